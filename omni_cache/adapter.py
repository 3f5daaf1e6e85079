"""Engine-facing value types: request events and the step's write layout.

Owns: ``PrefixCacheEventKind``, ``PrefixCacheRequestEvent``, ``PrefixCacheStep``,
``PrefixCacheWrite`` and ``PrefixCacheWriteLayout`` -- immutable snapshots the
engine hands to the manager. (The vLLM scheduler adapter that builds them lives
in ``omni_cache.integration``.)

Upholds the input half of I5: events carry block ids as tuples (one per KV
group, group 0 used), so later changes to scheduler objects cannot change them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache.interface import ReqId


class PrefixCacheEventKind(enum.Enum):
    """What happened to a request at the start of this step."""

    STARTED = "started"
    EXTENDED = "extended"
    RESUMED = "resumed"
    FINISHED = "finished"
    ABORTED = "aborted"


def _freeze_block_ids(block_ids: Any) -> tuple[tuple[int, ...], ...]:
    """One tuple per KV group; a flat sequence of ints is one group."""
    groups = tuple(block_ids or ())
    if groups and all(isinstance(b, int) for b in groups):
        return (tuple(int(b) for b in groups),)
    return tuple(tuple(int(b) for b in group) for group in groups)


@dataclass(frozen=True)
class PrefixCacheRequestEvent:
    """One request's event: a hit span ``[hit_start, hit_end)`` on ``block_ids``."""

    req_id: ReqId
    kind: PrefixCacheEventKind
    hit_start: int = 0
    hit_end: int = 0
    block_ids: tuple[tuple[int, ...], ...] = ()
    scheduled_tokens: int = 0
    num_output_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", _freeze_block_ids(self.block_ids))
        if not isinstance(self.kind, PrefixCacheEventKind):
            object.__setattr__(self, "kind", PrefixCacheEventKind(self.kind))

    @property
    def group0_block_ids(self) -> tuple[int, ...]:
        return self.block_ids[0] if self.block_ids else ()


@dataclass(frozen=True)
class PrefixCacheStep:
    """The events of one scheduler step and its scheduled tokens per request."""

    events: tuple[PrefixCacheRequestEvent, ...]
    scheduled_tokens: dict[ReqId, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        object.__setattr__(self, "scheduled_tokens", dict(self.scheduled_tokens))

    def __iter__(self) -> Iterator[PrefixCacheRequestEvent]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)


@dataclass(frozen=True)
class PrefixCacheWrite:
    """Rows ``[row_start, row_end)`` of the packed batch are the request's
    positions ``[token_start, token_end)``."""

    req_id: ReqId
    row_start: int
    row_end: int
    token_start: int
    token_end: int

    def __post_init__(self) -> None:
        if not (0 <= self.row_start <= self.row_end):
            raise ValueError(f"PrefixCacheWrite {self.req_id!r}: bad rows [{self.row_start}, {self.row_end})")
        if self.token_end - self.token_start != self.row_end - self.row_start or self.token_start < 0:
            raise ValueError(
                f"PrefixCacheWrite {self.req_id!r}: rows [{self.row_start}, {self.row_end}) and "
                f"positions [{self.token_start}, {self.token_end}) differ in length"
            )

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


@dataclass(frozen=True)
class PrefixCacheWriteLayout:
    """Where this step's packed rows go: per-request spans and every row's KV slot.

    ``slots_cpu`` is an int64 CPU tensor of the KV slot of every row (at least
    ``total_rows`` long). The manager refuses a layout that does not cover the
    step ("slot mapping covers").
    """

    writes: tuple[PrefixCacheWrite, ...]
    total_rows: int
    slots_cpu: torch.Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "writes", tuple(self.writes))
        if self.slots_cpu is not None:
            slots = torch.as_tensor(self.slots_cpu, dtype=torch.int64, device="cpu")
            # Own a private copy: the engine reuses its slot-mapping buffers.
            object.__setattr__(self, "slots_cpu", slots.clone())

    @property
    def req_ids(self) -> tuple[ReqId, ...]:
        return tuple(w.req_id for w in self.writes)

    @classmethod
    def packed(cls, spans: Iterable[tuple[ReqId, int, int]], slots_cpu: torch.Tensor | None) -> PrefixCacheWriteLayout:
        """Pack ``(req_id, token_start, token_end)`` spans in batch order."""
        writes: list[PrefixCacheWrite] = []
        row = 0
        for req_id, start, end in spans:
            writes.append(PrefixCacheWrite(req_id, row, row + end - start, start, end))
            row += end - start
        return cls(tuple(writes), row, slots_cpu)
