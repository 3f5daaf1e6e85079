"""The vLLM scheduler adapter, and the public home of the engine-facing value types.

Owns: ``PrefixCacheSchedulerAdapter``, which builds the immutable events and the
step's write layout from a vLLM ``SchedulerOutput`` and a block-table view
(``omni_cache.integration``, or the reference's view protocol) without
importing vLLM. The value types themselves (``PrefixCacheEventKind``,
``PrefixCacheRequestOwner``, ``PrefixCacheRequestEvent``, ``PrefixCacheStep``,
``PrefixCacheWrite``, ``PrefixCacheWriteLayout``) live in ``omni_cache.events``
and are re-exported here: ``omni_cache.adapter`` is their public import path
(DESIGN section 6).

Upholds the adapter half of I12 (request identity: events carry their
admission's owner, terminal events the owner they end, a reused id is REPLACED
before the new admission's first event, a preempted id that comes back among
the new requests is RESUMED) and I13 (a replayed step, same ``sequence``,
translates to no events and changes no adapter state); events carry block ids
as tuples (the input half of I5, ``omni_cache.events``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from omni_cache.events import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheRequestOwner,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
    freeze_block_ids,
)
from omni_cache.interface import ReqId

__all__ = [
    "PrefixCacheEventKind",
    "PrefixCacheRequestEvent",
    "PrefixCacheRequestOwner",
    "PrefixCacheSchedulerAdapter",
    "PrefixCacheStep",
    "PrefixCacheWrite",
    "PrefixCacheWriteLayout",
]


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


def _nth(values: list[Any], i: int, default: Any) -> Any:
    """``values[i]``, or ``default`` when the scheduler's per-request list is short (as the reference)."""
    return values[i] if i < len(values) else default


def _is_older(owner: PrefixCacheRequestOwner | None, than: PrefixCacheRequestOwner | None) -> bool:
    return owner is not None and than is not None and owner < than


class PrefixCacheSchedulerAdapter:
    """Turns one vLLM ``SchedulerOutput`` into immutable prefix-cache events.

    Duck-typed over vLLM's ``SchedulerOutput`` field names (V1 and Model Runner V2):

    * ``prefix_cache_replacements`` (optional): REPLACED controls, each with an
      owner; emitted first, unless older than the id's current owner.
    * ``scheduled_new_reqs`` (``NewRequestData``: ``req_id`` -- or
      ``request_id`` -- ``num_computed_tokens``, ``block_ids`` flat or one list
      per KV group, every group kept: the manager reads the hit from
      ``block_ids[output_group_id]``), each with the hit ``[0, num_computed_tokens)``: STARTED for
      an id not live (or live under an older owner, after a REPLACED control);
      RESUMED for a live id that ``preempted_req_ids`` reported preempted (Model
      Runner V2 re-delivers resumed requests here); EXTENDED otherwise.
    * ``scheduled_cached_reqs`` (``CachedRequestData``: ``req_ids``,
      ``resumed_req_ids`` -- or the older ``resumed_from_preemption`` flags --
      ``num_computed_tokens``, ``new_block_ids``, ``num_output_tokens``):
      resumed (or preempted) ids first, sorted, as RESUMED with the hit
      ``[0, num_computed_tokens)`` on their replacement blocks; the rest in order
      as EXTENDED. A per-request list shorter than ``req_ids`` reads as 0 / no
      blocks for the missing entries.
    * ``finished_req_ids`` and the optional ``aborted_req_ids``: FINISHED /
      ABORTED, last, sorted, each with the owner it ends. An abort is never
      inferred when ``aborted_req_ids`` is absent (vLLM 0.32 reports aborts only
      in ``finished_req_ids``): they arrive as FINISHED, which ends a request the
      same way.
    * ``prefix_cache_owners`` / ``prefix_cache_terminal_owners`` (optional
      ``{req_id: PrefixCacheRequestOwner}``): the owner of this step's events /
      the owner a terminal event ends (default: the owner last seen).
    * ``preempted_req_ids`` (optional): ids preempted in this step.
    * ``num_scheduled_tokens[req_id]``: each event's ``scheduled_tokens``.
    * ``prefix_cache_step_sequence`` (optional, ``translate_step`` only): a
      step whose sequence is not above the last translated one is a replay and
      yields no events (I13).

    An event older than the id's current owner is dropped. State: the live ids
    with their owners, the preempted ids, the last sequence; engine thread only.
    """

    def __init__(self) -> None:
        self._owners: dict[ReqId, PrefixCacheRequestOwner | None] = {}
        self._preempted: set[ReqId] = set()
        self._last_sequence: int | None = None

    @property
    def live_req_ids(self) -> frozenset[ReqId]:
        """Ids seen in a step and not terminal since."""
        return frozenset(self._owners)

    @property
    def preempted_req_ids(self) -> frozenset[ReqId]:
        """Live ids reported preempted and not scheduled since."""
        return frozenset(self._preempted)

    def translate_scheduler_output(self, so: Any) -> tuple[PrefixCacheRequestEvent, ...]:
        """The step's events: controls, new requests, cached ones, then terminal ones."""
        scheduled: dict[ReqId, int] = dict(getattr(so, "num_scheduled_tokens", None) or {})
        owners = dict(getattr(so, "prefix_cache_owners", None) or {})
        declared_terminal = dict(getattr(so, "prefix_cache_terminal_owners", None) or {})
        finished = set(getattr(so, "finished_req_ids", None) or ())
        aborted = set(getattr(so, "aborted_req_ids", None) or ())

        # Terminal owners are captured before this step's admissions move them; a
        # terminal of an older owner leaves the newer admission live.
        ending: dict[ReqId, PrefixCacheRequestOwner | None] = {}
        for req_id in finished | aborted:
            current = self._owners.get(req_id)
            ending[req_id] = declared_terminal.get(req_id, current)
            if not _is_older(ending[req_id], current):
                self._owners.pop(req_id, None)
                self._preempted.discard(req_id)

        events: list[PrefixCacheRequestEvent] = []
        for control in getattr(so, "prefix_cache_replacements", None) or ():
            if control.kind is not PrefixCacheEventKind.REPLACED or control.owner is None:
                raise ValueError(
                    f"PrefixCacheSchedulerAdapter: prefix_cache_replacements entry {control!r} must be a "
                    "REPLACED event with an owner"
                )
            if _is_older(control.owner, self._owners.get(control.req_id)):
                continue
            self._owners[control.req_id] = control.owner
            self._preempted.discard(control.req_id)
            events.append(control)

        for new_req in getattr(so, "scheduled_new_reqs", None) or ():
            req_id = _new_request_id(new_req)
            live = req_id in self._owners
            current = self._owners.get(req_id)
            owner = owners.get(req_id, current)
            if _is_older(owner, current):
                continue  # a stale admission's lookup
            hit = dict(hit_start=0, hit_end=int(getattr(new_req, "num_computed_tokens", 0) or 0),
                       block_ids=freeze_block_ids(getattr(new_req, "block_ids", None)),
                       scheduled_tokens=int(scheduled.get(req_id, 0)), owner=owner)
            if not live or owner != current:
                if live:  # the id is reused by a new owner while the old admission is live
                    events.append(PrefixCacheRequestEvent(
                        req_id, PrefixCacheEventKind.REPLACED, owner=owner, lookup_complete=False))
                kind = PrefixCacheEventKind.STARTED
            elif req_id in self._preempted:
                kind = PrefixCacheEventKind.RESUMED  # Model Runner V2: resumed among the new requests
            else:
                kind = PrefixCacheEventKind.EXTENDED
            events.append(PrefixCacheRequestEvent(req_id, kind, **hit))
            self._owners[req_id] = owner
            self._preempted.discard(req_id)

        cached = getattr(so, "scheduled_cached_reqs", None)
        if cached is not None:
            events.extend(self._translate_cached(cached, scheduled, owners))

        for req_id in getattr(so, "preempted_req_ids", None) or ():
            if req_id in self._owners and req_id not in ending:
                self._preempted.add(req_id)

        for req_id in sorted(ending, key=str):
            kind = PrefixCacheEventKind.ABORTED if req_id in aborted else PrefixCacheEventKind.FINISHED
            events.append(PrefixCacheRequestEvent(req_id, kind, owner=ending[req_id]))
        return tuple(events)

    def _translate_cached(
        self, cached: Any, scheduled: dict[ReqId, int], owners: dict[ReqId, Any]
    ) -> list[PrefixCacheRequestEvent]:
        req_ids = list(getattr(cached, "req_ids", None) or ())
        resumed_field = getattr(cached, "resumed_req_ids", None)
        if resumed_field is not None:
            resumed = set(resumed_field)
        else:  # older vLLM: one flag per row
            flags = list(getattr(cached, "resumed_from_preemption", None) or ())
            resumed = {rid for rid, flag in zip(req_ids, flags, strict=False) if flag}
        resumed |= self._preempted & set(req_ids)
        computed = list(getattr(cached, "num_computed_tokens", None) or ())
        new_blocks = list(getattr(cached, "new_block_ids", None) or ())
        out_tokens = list(getattr(cached, "num_output_tokens", None) or ())
        row = {rid: i for i, rid in enumerate(req_ids)}
        order = [*sorted(resumed, key=str), *(rid for rid in req_ids if rid not in resumed)]
        events: list[PrefixCacheRequestEvent] = []
        for req_id in order:
            current = self._owners.get(req_id)
            owner = owners.get(req_id, current)
            if _is_older(owner, current):
                continue
            i = row.get(req_id, len(req_ids))
            kind = PrefixCacheEventKind.RESUMED if req_id in resumed else PrefixCacheEventKind.EXTENDED
            events.append(
                PrefixCacheRequestEvent(
                    req_id,
                    kind,
                    hit_start=0,
                    hit_end=int(_nth(computed, i, 0)),
                    block_ids=freeze_block_ids(_nth(new_blocks, i, None)),
                    scheduled_tokens=int(scheduled.get(req_id, 0)),
                    num_output_tokens=int(_nth(out_tokens, i, 0)),
                    owner=owner,
                )
            )
            self._owners[req_id] = owner
            self._preempted.discard(req_id)
        return events

    def translate_step(self, so: Any) -> PrefixCacheStep:
        """The step's events, a private copy of ``num_scheduled_tokens`` and its sequence.

        A replayed step (``prefix_cache_step_sequence`` not above the last one
        translated) yields an empty step with that sequence and changes nothing (I13).
        """
        sequence = getattr(so, "prefix_cache_step_sequence", None)
        if sequence is not None and self._last_sequence is not None and sequence <= self._last_sequence:
            return PrefixCacheStep((), {}, sequence)
        events = self.translate_scheduler_output(so)
        scheduled = {rid: int(n) for rid, n in (getattr(so, "num_scheduled_tokens", None) or {}).items()}
        if sequence is not None:
            self._last_sequence = sequence
        return PrefixCacheStep(events, scheduled, sequence)

    def build_write_layout(self, view: Any, *, num_scheduled_tokens: Any) -> PrefixCacheWriteLayout:
        """Pack this step's rows in the batch order of ``view``; every request of the batch
        gets a write, a request with 0 scheduled tokens a zero-row one (rows do not advance).

        ``view`` is either of two protocols (one packing routine serves both):

        * the reference's: ``batch_req_ids()``, ``token_range(req_id, n) ->
          (start, end)`` and ``step_slots_cpu(req_ids, counts) -> slots``;
        * omni-cache's block-table view (``omni_cache.integration.block_table``):
          ``req_ids`` in batch order, ``num_computed_tokens`` per row and
          ``slots_for_spans(spans)``.

        ``num_scheduled_tokens`` is vLLM's ``{req_id: n}`` mapping or a per-row
        sequence in batch order. A request scheduled here but absent from the
        view raises (stale view).
        """
        view = _as_reference_view(view)
        req_ids = tuple(view.batch_req_ids())
        if isinstance(num_scheduled_tokens, Mapping):
            counts = {rid: int(n) for rid, n in num_scheduled_tokens.items()}
            batch = set(req_ids)
            missing = sorted((rid for rid, n in counts.items() if n > 0 and rid not in batch), key=str)
            if missing:
                raise ValueError(
                    f"PrefixCacheSchedulerAdapter.build_write_layout: requests {missing} are scheduled "
                    f"but not in the block-table view (batch {list(req_ids)}); build the view after the "
                    "runner has updated its input batch for this step"
                )
        else:
            per_row = [int(n) for n in num_scheduled_tokens]
            if len(per_row) > len(req_ids):
                raise ValueError(
                    f"PrefixCacheSchedulerAdapter.build_write_layout: {len(per_row)} per-row counts "
                    f"for a batch of {len(req_ids)} requests"
                )
            counts = dict(zip(req_ids, per_row, strict=False))
        writes: list[PrefixCacheWrite] = []
        row = 0
        for req_id in req_ids:
            n = counts.get(req_id, 0)
            if n < 0:
                raise ValueError(f"build_write_layout: negative token count {n} for {req_id!r}")
            start, end = (int(v) for v in view.token_range(req_id, n))
            writes.append(PrefixCacheWrite(req_id, row, row + n, start, end))
            row += n
        # The caller's mapping itself, as the reference passes it; per-row counts as a mapping.
        given = num_scheduled_tokens if isinstance(num_scheduled_tokens, Mapping) else counts
        return PrefixCacheWriteLayout(tuple(writes), row, view.step_slots_cpu(list(req_ids), given))


class _SpanViewAsReference:
    """omni-cache's block-table view seen through the reference's view protocol."""

    def __init__(self, view: Any) -> None:
        self._view = view
        self._computed = dict(zip(view.req_ids, (int(c) for c in view.num_computed_tokens), strict=False))

    def batch_req_ids(self) -> list[ReqId]:
        return list(self._view.req_ids)

    def token_range(self, req_id: ReqId, n: int) -> tuple[int, int]:
        start = self._computed.get(req_id, 0)
        return start, start + n

    def step_slots_cpu(self, req_ids: list[ReqId], counts: Mapping[ReqId, int]) -> torch.Tensor:
        spans = [(rid, *self.token_range(rid, int(counts.get(rid, 0)))) for rid in req_ids if counts.get(rid, 0)]
        return self._view.slots_for_spans(spans)


def _as_reference_view(view: Any) -> Any:
    if callable(getattr(view, "batch_req_ids", None)):
        return view
    if hasattr(view, "req_ids") and hasattr(view, "slots_for_spans"):
        return _SpanViewAsReference(view)
    raise TypeError(
        f"build_write_layout: {type(view).__name__} is neither a reference group view (batch_req_ids, "
        "token_range, step_slots_cpu) nor a block-table view (req_ids, num_computed_tokens, slots_for_spans)"
    )
