"""Simulated workloads: the three presets and their request streams.

Owns: ``Preset`` (a workload's shape and its default engine/cache sizing),
``PRESETS`` and ``Workload`` (deterministic arrivals from a seed). Presets:

- ``chat``: chat requests behind a few shared system prompts (one dominant):
  many hits on the system-prompt blocks, including same-step hits when two
  requests with the same prompt arrive together.
- ``multiturn``: conversations whose turn ``k+1`` prompt is turn ``k``'s prompt
  + its answer + a new user message, arriving a few steps after turn ``k``
  finished: hits span earlier answers' blocks (decoded, not prefilled, rows).
- ``audio``: long audio prompts with a wide deferred key (``audio.embeds``)
  and a small ``gpu_staging_bytes``, so the budget forces early flushes.

Every preset aborts a fraction of requests at a random later step. All
randomness comes from ``random.Random(seed)``; follow-up turns depend only on
the (deterministic) answers, so a run is a function of its seed.

Upholds nothing (input generation only); the presets are shaped to reach I2 (builder
lag), I7 (slot reuse under eviction and preemption) and the deferred-key
budget path (``audio``).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the CLI reads PRESETS before torch is loaded
    from omni_cache.harness.sim_engine.request import SimRequest


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    requests: int = 48
    max_batched_tokens: int = 256
    num_blocks: int = 160
    block_size: int = 16
    max_num_seqs: int = 24
    hidden_width: int = 64
    embeds_width: int = 32
    gpu_staging_bytes: int = 512 << 20
    arrivals_per_step: float = 0.8
    """Mean arrival rate of bursts (conversations for multiturn)."""
    burst: tuple[int, int] = (1, 3)
    """Requests per burst: a burst arrives in one step (same-step prefix hits)."""
    abort_rate: float = 0.06
    system_prompt_lens: tuple[int, ...] = (96, 64, 160)
    system_prompt_weights: tuple[float, ...] = (0.7, 0.2, 0.1)
    user_len: tuple[int, int] = (4, 48)
    max_tokens: tuple[int, int] = (4, 40)
    turns: tuple[int, int] = (1, 1)
    turn_gap_steps: tuple[int, int] = (0, 6)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "chat",
            "shared system prompt chat",
            requests=128,
            num_blocks=96,
            arrivals_per_step=0.5,
            burst=(1, 4),
            max_tokens=(8, 64),
        ),
        Preset(
            "multiturn",
            "multi-turn conversations (each turn extends the previous prompt + answer)",
            requests=96,
            num_blocks=160,
            system_prompt_lens=(48,),
            system_prompt_weights=(1.0,),
            user_len=(8, 40),
            max_tokens=(8, 48),
            turns=(2, 5),
            arrivals_per_step=0.3,
            burst=(1, 2),
        ),
        Preset(
            "audio",
            "audio-heavy: long audio prompts, wide deferred audio.embeds, small GPU staging budget",
            requests=64,
            max_batched_tokens=384,
            num_blocks=128,
            embeds_width=256,
            gpu_staging_bytes=96 << 10,
            system_prompt_lens=(32, 48),
            system_prompt_weights=(0.6, 0.4),
            user_len=(64, 320),
            max_tokens=(8, 48),
            arrivals_per_step=0.4,
            burst=(1, 3),
        ),
    )
}


class Workload:
    """The request stream of a preset: arrivals by step, follow-up turns on finish.

    Arrivals are generated lazily, in step order, as the engine asks for them, so
    a huge ``num_requests`` costs nothing up front. The first turns come from
    ``random.Random(seed)`` in the same order as before they were lazy (a run's
    first turns do not depend on when they are drawn); follow-up turns draw
    from their own generator. Requests that cannot run are counted, never hidden:
    ``dropped_too_long`` (prompt + output longer than ``max_model_len``) and
    ``skipped_after_abort`` (later turns of a conversation whose turn was aborted).
    """

    def __init__(
        self,
        preset: Preset,
        num_requests: int,
        *,
        seed: int,
        block_size: int,
        max_model_len: int,
        vocab_size: int = 32000,
    ) -> None:
        if num_requests < 0:
            raise ValueError("num_requests must be >= 0")
        self.preset = preset
        self.num_requests = num_requests
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)
        self._turn_rng = random.Random(f"{seed}/follow-up turns")
        rng = self._rng
        # Token ids 0..99 are never drawn for user/audio tokens, so prompts differ after the system prompt.
        self._system_prompts = [[rng.randrange(100, vocab_size) for _ in range(n)] for n in preset.system_prompt_lens]
        self._pending: dict[int, list[SimRequest]] = defaultdict(list)
        self._created = 0
        self.dropped_too_long = 0
        self.skipped_after_abort = 0
        self._conv_turns_left: dict[int, int] = {}
        self._planner = self._plan_first_turns()
        self._next_first: SimRequest | None = None
        self._planner_done = num_requests == 0
        self._advance_planner()

    @staticmethod
    def shortest_request_tokens(preset: Preset) -> int:
        """Prompt + output tokens of the shortest request the preset can draw."""
        return min(preset.system_prompt_lens) + preset.user_len[0] + preset.max_tokens[0]

    @property
    def created(self) -> int:
        return self._created

    def _plan_first_turns(self) -> Iterator[SimRequest | None]:
        """First turns in arrival order; None for one dropped as too long."""
        rng, preset = self._rng, self.preset
        step = 0.0
        conv = 0
        planned = 0
        while planned < self.num_requests:
            step += rng.expovariate(preset.arrivals_per_step)
            for _ in range(rng.randint(*preset.burst)):
                if planned >= self.num_requests:
                    break
                turns = min(rng.randint(*preset.turns), self.num_requests - planned)
                planned += turns
                system = rng.choices(self._system_prompts, weights=preset.system_prompt_weights)[0]
                req = self._make(system + self._user_tokens(rng), int(step), conv, 0, rng)
                if req is None:
                    self.dropped_too_long += turns
                else:
                    self._conv_turns_left[conv] = turns - 1
                yield req
                conv += 1

    def _advance_planner(self) -> None:
        """Hold the next first turn that will run (or none when the plan is exhausted)."""
        self._next_first = None
        while not self._planner_done:
            try:
                req = next(self._planner)
            except StopIteration:
                self._planner_done = True
                return
            if req is not None:
                self._next_first = req
                return

    def _user_tokens(self, rng: random.Random) -> list[int]:
        lo, hi = self.preset.user_len
        return [rng.randrange(100, self.vocab_size) for _ in range(rng.randint(lo, hi))]

    def _make(self, prompt: list[int], step: int, conv: int, turn: int, rng: random.Random) -> SimRequest | None:
        max_tokens = rng.randint(*self.preset.max_tokens)
        if len(prompt) + max_tokens > self.max_model_len:
            return None
        abort_at = None
        if rng.random() < self.preset.abort_rate:
            abort_at = step + rng.randint(1, 24)
        from omni_cache.harness.sim_engine.request import SimRequest

        req = SimRequest(
            req_id=f"req-{self._created}" if self.preset.turns == (1, 1) else f"req-{self._created}-c{conv}t{turn}",
            prompt=prompt,
            max_tokens=max_tokens,
            block_size=self.block_size,
            arrival_step=step,
            abort_at_step=abort_at,
            conversation=conv,
            turn=turn,
        )
        self._created += 1
        return req

    def arrivals(self, step: int) -> list[SimRequest]:
        """Requests arriving at ``step`` (and any earlier ones not yet taken)."""
        while self._next_first is not None and self._next_first.arrival_step <= step:
            self._pending[self._next_first.arrival_step].append(self._next_first)
            self._advance_planner()
        due = sorted(s for s in self._pending if s <= step)
        out: list[SimRequest] = []
        for s in due:
            out.extend(self._pending.pop(s))
        return out

    def next_arrival_step(self) -> int | None:
        steps = list(self._pending)
        if self._next_first is not None:
            steps.append(self._next_first.arrival_step)
        return min(steps) if steps else None

    def on_finished(self, req: SimRequest, step: int) -> None:
        """A finished turn may start the conversation's next turn (multiturn)."""
        conv = req.conversation
        if conv is None or self._conv_turns_left.get(conv, 0) <= 0:
            return
        self._conv_turns_left[conv] -= 1
        rng = self._turn_rng
        gap = rng.randint(*self.preset.turn_gap_steps)
        nxt = self._make(req.prompt + req.output + self._user_tokens(rng), step + 1 + gap, conv, req.turn + 1, rng)
        if nxt is None:
            self.dropped_too_long += 1 + self._conv_turns_left.pop(conv)
        else:
            self._pending[nxt.arrival_step].append(nxt)

    def on_aborted(self, req: SimRequest) -> None:
        """An aborted turn ends its conversation: its later turns are never asked."""
        if req.conversation is not None:
            self.skipped_after_abort += self._conv_turns_left.pop(req.conversation, 0)
