"""A simulated engine request: its tokens, progress, block table and truth hashes.

Owns: ``SimRequest`` and ``RequestStatus``. The scheduler mutates a request
(``num_computed_tokens``, ``block_ids``, ``status``); only ``append_output``
adds tokens, and it keeps the chained block hashes (allocator side) and the
rolling prefix hashes (ground-truth side) in step with the token ids. Token ids
are never removed, so rows of any position ``< num_tokens`` are fixed for the
request's lifetime -- the property every cache check relies on (I6, I7).

Upholds nothing (a simulated request).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from omni_cache.harness.sim_engine.truth import extend_prefix_hashes


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


def chain_block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """vLLM-style chained hash of one full block: (parent hash, block token ids)."""
    return hash((parent, tokens))


@dataclass(eq=False)
class SimRequest:
    """One request of the simulated workload."""

    req_id: str
    prompt: list[int]
    max_tokens: int
    block_size: int
    arrival_step: int = 0
    abort_at_step: int | None = None
    conversation: int | None = None
    turn: int = 0
    output: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of every full block of prompt+output (allocator side).
    block_hashes: list[int] = field(default_factory=list)
    # How many leading blocks of ``block_ids`` are published in the allocator.
    num_cached_blocks: int = 0
    # Rolling hash of every prefix (truth side), one per position.
    truth_hashes: list[int] = field(default_factory=list)
    # Has the manager seen this request (STARTED)?
    started: bool = False
    num_preemptions: int = 0
    # Hit (in tokens) of the last STARTED/RESUMED; its first step returns [0, end).
    pending_hit: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.req_id}: empty prompt")
        self._update_hashes()

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    @property
    def max_num_tokens(self) -> int:
        """Upper bound of tokens this request will ever hold."""
        return len(self.prompt) + self.max_tokens

    def append_output(self, token: int) -> None:
        self.output.append(int(token))
        self._update_hashes()

    def _update_hashes(self) -> None:
        tokens = self.all_tokens
        extend_prefix_hashes(self.truth_hashes, tokens)
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(tokens):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(chain_block_hash(parent, tuple(tokens[i * bs:(i + 1) * bs])))

    def slot_of(self, pos: int) -> int:
        """The KV slot of position ``pos`` (its block must be allocated)."""
        return self.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size
