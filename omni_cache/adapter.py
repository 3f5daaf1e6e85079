"""Engine-facing value types: request events and the step's write layout.

Owns: ``PrefixCacheEventKind``, ``PrefixCacheRequestEvent``, ``PrefixCacheStep``,
``PrefixCacheWrite`` and ``PrefixCacheWriteLayout`` -- immutable snapshots the
engine hands to the manager -- and ``PrefixCacheSchedulerAdapter`` (bottom of
this file), which builds them from a vLLM ``SchedulerOutput`` and a block-table
view (``omni_cache.integration``) without importing vLLM.

Upholds the input half of I5: events carry block ids as tuples (one per KV
group, group 0 used), so later changes to scheduler objects cannot change them.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterable, Iterator, Mapping
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
    """Snapshot vLLM block ids as plain ints, one tuple per KV group.

    Accepts a flat sequence (one group), a sequence of per-group sequences
    (vLLM's ``tuple[list[int], ...]``), numpy arrays or ``None``. Integer-likes
    (numpy ints, 0-d tensors) become ``int`` so that later changes to the
    scheduler's lists cannot reach the event.
    """
    if block_ids is None:
        return ()
    groups = list(block_ids)
    if not groups:
        return ()

    def _is_scalar(b: Any) -> bool:
        try:
            operator.index(b)
        except TypeError:
            return False
        return True

    if all(_is_scalar(b) for b in groups):
        return (tuple(operator.index(b) for b in groups),)
    return tuple(tuple(operator.index(b) for b in (() if group is None else group)) for group in groups)


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
        for name in ("row_start", "row_end", "token_start", "token_end"):
            value = getattr(self, name)
            # Integer-likes (numpy ints, 0-d integer tensors) become ``int``; floats, bools,
            # strings and None are refused here, never at materialize after an id is consumed.
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                raise TypeError(f"PrefixCacheWrite {self.req_id!r}: {name} must be an int, got {value!r}")
            try:
                object.__setattr__(self, name, operator.index(value))
            except TypeError as exc:  # e.g. a floating tensor
                raise TypeError(f"PrefixCacheWrite {self.req_id!r}: {name} must be an int, got {value!r}") from exc
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
            slots = self.slots_cpu
            if not isinstance(slots, torch.Tensor):  # a list or numpy array of slot ids
                slots = torch.as_tensor(slots)
                if slots.numel() == 0:
                    slots = slots.to(torch.int64)
            slots = slots.detach()
            if slots.device.type == "cpu" and not (
                slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool
            ):
                slots = slots.to(torch.int64)
            # A malformed mapping (not integer, not CPU, not 1-D) is kept as given, never
            # coerced: ``save_outputs`` refuses it before anything is claimed ("slot mapping
            # covers"). Own a private copy: the engine reuses its slot-mapping buffers.
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


# --------------------------------------------------------------------------- #
# The vLLM scheduler adapter (duck-typed; vLLM is never imported here).
# --------------------------------------------------------------------------- #


def _new_request_id(new_req: Any) -> ReqId:
    req_id = getattr(new_req, "req_id", None)
    if req_id is None:
        req_id = getattr(new_req, "request_id", None)
    if req_id is None:
        raise ValueError(
            f"PrefixCacheSchedulerAdapter: scheduled_new_reqs entry {new_req!r} has neither "
            "req_id nor request_id"
        )
    return req_id


class PrefixCacheSchedulerAdapter:
    """Turns one vLLM ``SchedulerOutput`` into immutable prefix-cache events.

    Duck-typed over vLLM v1's ``SchedulerOutput`` field names:

    * ``scheduled_new_reqs`` (``NewRequestData``: ``req_id`` -- or
      ``request_id`` -- ``num_computed_tokens``, ``block_ids`` flat or one list
      per KV group): STARTED for an id not seen before or terminal, with the
      hit ``[0, num_computed_tokens)``; EXTENDED for a live id.
    * ``scheduled_cached_reqs`` (``CachedRequestData``: ``req_ids``,
      ``resumed_req_ids`` -- or the older ``resumed_from_preemption`` flags --
      ``num_computed_tokens``, ``new_block_ids``, ``num_output_tokens``):
      RESUMED for a resumed id, with the hit ``[0, num_computed_tokens)`` on its
      (replacement) blocks; EXTENDED otherwise (no hit; the new blocks only).
    * ``finished_req_ids`` and the optional ``aborted_req_ids``: FINISHED /
      ABORTED. An abort is never inferred when ``aborted_req_ids`` is absent.
    * ``num_scheduled_tokens[req_id]``: each event's ``scheduled_tokens``.

    Terminal events come first (sorted by id), so an id that is terminal and new
    in the same step is STARTED again after its FINISHED/ABORTED. The adapter's
    only state is the set of live ids; it is used on the engine thread only.
    """

    def __init__(self) -> None:
        self._live: set[ReqId] = set()

    @property
    def live_req_ids(self) -> frozenset[ReqId]:
        """Ids seen in a step and not terminal since."""
        return frozenset(self._live)

    def translate_scheduler_output(self, so: Any) -> tuple[PrefixCacheRequestEvent, ...]:
        """The step's events: terminal first, then new requests, then cached ones."""
        scheduled: dict[ReqId, int] = dict(getattr(so, "num_scheduled_tokens", None) or {})
        events: list[PrefixCacheRequestEvent] = []

        # Terminal events. vLLM's finished_req_ids includes aborted requests;
        # an id in aborted_req_ids is reported once, as ABORTED.
        finished = set(getattr(so, "finished_req_ids", None) or ())
        aborted_field = getattr(so, "aborted_req_ids", None)
        aborted = set(aborted_field) if aborted_field is not None else set()
        for req_id in sorted(finished | aborted, key=str):
            kind = PrefixCacheEventKind.ABORTED if req_id in aborted else PrefixCacheEventKind.FINISHED
            events.append(PrefixCacheRequestEvent(req_id, kind))
            self._live.discard(req_id)

        for new_req in getattr(so, "scheduled_new_reqs", None) or ():
            req_id = _new_request_id(new_req)
            n_tokens = int(scheduled.get(req_id, 0))
            block_ids = _freeze_block_ids(getattr(new_req, "block_ids", None))
            if req_id in self._live:
                events.append(
                    PrefixCacheRequestEvent(
                        req_id, PrefixCacheEventKind.EXTENDED, block_ids=block_ids, scheduled_tokens=n_tokens
                    )
                )
            else:
                computed = int(getattr(new_req, "num_computed_tokens", 0) or 0)
                events.append(
                    PrefixCacheRequestEvent(
                        req_id,
                        PrefixCacheEventKind.STARTED,
                        hit_start=0,
                        hit_end=computed,
                        block_ids=block_ids,
                        scheduled_tokens=n_tokens,
                    )
                )
                self._live.add(req_id)

        cached = getattr(so, "scheduled_cached_reqs", None)
        if cached is not None:
            events.extend(self._translate_cached(cached, scheduled))
        return tuple(events)

    def _translate_cached(self, cached: Any, scheduled: dict[ReqId, int]) -> list[PrefixCacheRequestEvent]:
        req_ids = list(getattr(cached, "req_ids", None) or ())
        resumed_field = getattr(cached, "resumed_req_ids", None)
        if resumed_field is not None:
            resumed = set(resumed_field)
        else:  # older vLLM: one flag per row
            flags = list(getattr(cached, "resumed_from_preemption", None) or ())
            resumed = {rid for rid, flag in zip(req_ids, flags, strict=False) if flag}
        computed = list(getattr(cached, "num_computed_tokens", None) or ())
        new_blocks = list(getattr(cached, "new_block_ids", None) or ())
        out_tokens = list(getattr(cached, "num_output_tokens", None) or ())
        if len(computed) != len(req_ids):
            raise ValueError(
                f"PrefixCacheSchedulerAdapter: scheduled_cached_reqs has {len(req_ids)} req_ids "
                f"but {len(computed)} num_computed_tokens"
            )
        events: list[PrefixCacheRequestEvent] = []
        for i, req_id in enumerate(req_ids):
            block_ids = _freeze_block_ids(new_blocks[i] if i < len(new_blocks) else None)
            n_out = int(out_tokens[i]) if i < len(out_tokens) else 0
            n_tokens = int(scheduled.get(req_id, 0))
            if req_id in resumed:
                events.append(
                    PrefixCacheRequestEvent(
                        req_id,
                        PrefixCacheEventKind.RESUMED,
                        hit_start=0,
                        hit_end=int(computed[i]),
                        block_ids=block_ids,
                        scheduled_tokens=n_tokens,
                        num_output_tokens=n_out,
                    )
                )
            else:
                events.append(
                    PrefixCacheRequestEvent(
                        req_id,
                        PrefixCacheEventKind.EXTENDED,
                        block_ids=block_ids,
                        scheduled_tokens=n_tokens,
                        num_output_tokens=n_out,
                    )
                )
            self._live.add(req_id)
        return events

    def translate_step(self, so: Any) -> PrefixCacheStep:
        """The step's events plus a private copy of ``num_scheduled_tokens``."""
        events = self.translate_scheduler_output(so)
        scheduled = {rid: int(n) for rid, n in (getattr(so, "num_scheduled_tokens", None) or {}).items()}
        return PrefixCacheStep(events, scheduled)

    def build_write_layout(self, view: Any, *, num_scheduled_tokens: Any) -> PrefixCacheWriteLayout:
        """Pack this step's rows in the batch order of ``view``.

        ``view`` is a block-table view (``omni_cache.integration.block_table``):
        ``req_ids`` in batch order, ``num_computed_tokens`` per row and
        ``slots_for_spans(spans)``. ``num_scheduled_tokens`` is vLLM's
        ``{req_id: n}`` mapping or a per-row sequence in batch order. A
        request scheduled here but absent from the view raises (stale view).
        """
        req_ids = tuple(view.req_ids)
        computed = view.num_computed_tokens
        if isinstance(num_scheduled_tokens, Mapping):
            counts = {rid: int(n) for rid, n in num_scheduled_tokens.items()}
            missing = sorted((rid for rid, n in counts.items() if n > 0 and rid not in set(req_ids)), key=str)
            if missing:
                raise ValueError(
                    f"PrefixCacheSchedulerAdapter.build_write_layout: requests {missing} are scheduled "
                    f"but not in the block-table view (batch {list(req_ids)}); build the view after the "
                    "runner has updated its input batch for this step"
                )
            per_row = [counts.get(rid, 0) for rid in req_ids]
        else:
            per_row = [int(n) for n in num_scheduled_tokens]
            if len(per_row) > len(req_ids):
                raise ValueError(
                    f"PrefixCacheSchedulerAdapter.build_write_layout: {len(per_row)} per-row counts "
                    f"for a batch of {len(req_ids)} requests"
                )
        spans: list[tuple[ReqId, int, int]] = []
        for row, n in enumerate(per_row):
            if n < 0:
                raise ValueError(f"build_write_layout: negative token count {n} for {req_ids[row]!r}")
            if n:
                start = int(computed[row])
                spans.append((req_ids[row], start, start + n))
        slots = view.slots_for_spans(spans)
        return PrefixCacheWriteLayout.packed(spans, slots)
