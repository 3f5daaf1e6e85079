"""The vLLM scheduler adapter, and the public home of the engine-facing value types.

Owns: ``PrefixCacheSchedulerAdapter``, which builds the immutable events and the
step's write layout from a vLLM ``SchedulerOutput`` and a block-table view
(``omni_cache.integration``, or the reference's view protocol) without
importing vLLM. The value types themselves (``PrefixCacheEventKind``,
``PrefixCacheRequestOwner``, ``PrefixCacheRequestEvent``, ``PrefixCacheStep``,
``PrefixCacheWrite``, ``PrefixCacheWriteLayout``) live in ``omni_cache.runtime.events``
and are re-exported here: ``omni_cache.integration.adapter`` is their public import path
(spec/contract.md section 10).

Upholds the adapter half of I12 (request identity: events carry their
admission's owner, terminal events the owner they end, a reused id is REPLACED
before the new admission's first event, whose first new request carries its hit,
a preempted id that comes back among the new requests is RESUMED, a terminal
ends the admission it names, also one started or replaced-to in its step, and
proves every older admission of its id over: an older owner's control or request of
the same step is dropped) and
I13 (a replayed step, same ``sequence``, translates to no events and changes no
adapter state; a step that raises changes none either); events carry block ids
as tuples (the input half of I5, ``omni_cache.runtime.events``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from omni_cache.integration.block_table import BlockTableView
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.events import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheRequestOwner,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
    as_index,
    freeze_block_ids,
    scheduled_counts,
)
from omni_cache.runtime.interface import ReqId

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


def _per_row(cached: Any, name: str) -> list[Any]:
    """``cached.<name>`` as a list, one entry per row (``[]`` when absent): a list, a tuple or an
    array alike (an array has no truth value, so ``value or ()`` is no test for "absent")."""
    value = getattr(cached, name, None)
    return [] if value is None else list(value)


def _nth(values: list[Any], i: int, default: Any) -> Any:
    """``values[i]``, or ``default`` when the scheduler's per-request list is short (as the reference)."""
    return values[i] if i < len(values) else default


_State = tuple[dict[ReqId, "PrefixCacheRequestOwner | None"], set[ReqId], dict[ReqId, PrefixCacheRequestEvent]]
"""The adapter's state after a step: live ids and owners, preempted ids, pending controls."""


def _is_older(owner: PrefixCacheRequestOwner | None, than: PrefixCacheRequestOwner | None) -> bool:
    return owner is not None and than is not None and owner < than


class PrefixCacheSchedulerAdapter:
    """Turns one vLLM ``SchedulerOutput`` into immutable prefix-cache events.

    Duck-typed over vLLM's ``SchedulerOutput`` field names (V1 and Model Runner V2):

    * ``prefix_cache_replacements`` (optional): REPLACED controls, each with an
      owner; emitted first, unless older than the id's current owner. The first
      new request of a control's owner carries the lookup: a control of the same
      step is emitted with ``lookup_complete=False``; an earlier control's complete
      lookup must have its ``hit_end``, else the step is refused.
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
      same way. A terminal of an owner that this step's controls or
      ``prefix_cache_owners`` name ends that admission after the step's other events.
    * ``prefix_cache_owners`` / ``prefix_cache_terminal_owners`` (optional
      ``{req_id: PrefixCacheRequestOwner}``): the owner of this step's events /
      the owner a terminal event ends (default: the owner last seen).
    * ``preempted_req_ids`` (optional): ids preempted in this step.
    * ``num_scheduled_tokens[req_id]``: each event's ``scheduled_tokens``.
    * ``prefix_cache_step_sequence`` (optional, ``translate_step`` only): a
      step whose sequence is not above the last translated one is a replay and
      yields no events (I13).

    An event older than the id's current owner, or than the owner a terminal of this
    step ends (that terminal proves its id's older admissions over), is dropped. State: the live ids
    with their owners, the preempted ids, the controls whose owner's first new
    request is still due, the last sequence; engine thread only, computed on
    copies and replaced only by a translation that succeeds.
    """

    def __init__(self) -> None:
        # ---- engine thread only; replaced as a whole by a translation that succeeds ----
        self._owners: dict[ReqId, PrefixCacheRequestOwner | None] = {}
        self._preempted: set[ReqId] = set()
        # id -> the REPLACED control that admitted its live owner, until that owner's first new
        # request arrives (it must carry the lookup: contract section 10).
        self._controls: dict[ReqId, PrefixCacheRequestEvent] = {}
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
        """The step's events: controls, new requests, cached ones, then terminal ones.

        A step that raises changes no adapter state (I13's "a refused call changes nothing")."""
        events, state = self._translate(so)
        self._owners, self._preempted, self._controls = state
        return events

    def _translate(self, so: Any) -> tuple[tuple[PrefixCacheRequestEvent, ...], _State]:
        """The step's events and the adapter state after them, computed on copies."""
        scheduled: dict[ReqId, int] = dict(getattr(so, "num_scheduled_tokens", None) or {})
        owners = dict(getattr(so, "prefix_cache_owners", None) or {})
        declared_terminal = dict(getattr(so, "prefix_cache_terminal_owners", None) or {})
        finished = set(getattr(so, "finished_req_ids", None) or ())
        aborted = set(getattr(so, "aborted_req_ids", None) or ())
        controls_in = list(getattr(so, "prefix_cache_replacements", None) or ())
        new_reqs = [(_new_request_id(r), r) for r in getattr(so, "scheduled_new_reqs", None) or ()]
        cached = getattr(so, "scheduled_cached_reqs", None)
        live, preempted, admitted_by = dict(self._owners), set(self._preempted), dict(self._controls)

        # (id, owner) pairs this step's other events name: a terminal of such an owner applies to
        # that admission after them (it may be started or replaced-to in this very step).
        named = {(c.req_id, c.owner) for c in controls_in if getattr(c, "owner", None) is not None}
        for req_id in (*(rid for rid, _ in new_reqs), *_per_row(cached, "req_ids")):
            if owners.get(req_id) is not None:
                named.add((req_id, owners[req_id]))
        # The others end the admission live before the step (captured before this step's
        # admissions move it, so an id may end and start again); one of an older owner ends nothing.
        ending: dict[ReqId, PrefixCacheRequestOwner | None] = {}
        after: dict[ReqId, PrefixCacheRequestOwner] = {}
        for req_id in finished | aborted:
            current = live.get(req_id)
            ended = ending[req_id] = declared_terminal.get(req_id, current)
            if ended is not None and (req_id, ended) in named:
                after[req_id] = ended
            elif not _is_older(ended, current):
                live.pop(req_id, None)
                preempted.discard(req_id)
                admitted_by.pop(req_id, None)

        events: list[PrefixCacheRequestEvent] = []
        control_at: dict[ReqId, int] = {}  # id -> index in ``events`` of its control of this step
        for control in controls_in:
            if getattr(control, "kind", None) is not PrefixCacheEventKind.REPLACED or control.owner is None:
                raise ValueError(
                    f"PrefixCacheSchedulerAdapter: prefix_cache_replacements entry {control!r} must be a "
                    "REPLACED event with an owner"
                )
            if _is_older(control.owner, live.get(control.req_id)) or _is_older(control.owner, ending.get(control.req_id)):
                continue  # stale, or its admission ended before this step's terminal of a newer owner
            live[control.req_id] = control.owner
            preempted.discard(control.req_id)
            admitted_by[control.req_id] = control
            control_at[control.req_id] = len(events)
            events.append(control)

        for req_id, new_req in new_reqs:
            is_live = req_id in live
            current = live.get(req_id)
            owner = owners.get(req_id, current)
            if _is_older(owner, current) or _is_older(owner, ending.get(req_id)):
                continue  # a stale admission's lookup
            hit_end = int(getattr(new_req, "num_computed_tokens", 0) or 0)
            control = admitted_by.pop(req_id, None)
            if not is_live or owner != current:
                if is_live:  # the id is reused by a new owner while the old admission is live
                    events.append(PrefixCacheRequestEvent(
                        req_id, PrefixCacheEventKind.REPLACED, owner=owner, lookup_complete=False))
                kind = PrefixCacheEventKind.STARTED
            elif req_id in preempted:
                kind = PrefixCacheEventKind.RESUMED  # Model Runner V2: resumed among the new requests
            else:
                kind = PrefixCacheEventKind.EXTENDED
                if control is not None and control.owner == owner:  # the first new request of a control's owner
                    self._carry_lookup(events, control_at.get(req_id), control, hit_end)
            events.append(PrefixCacheRequestEvent(
                req_id, kind, hit_start=0, hit_end=hit_end, block_ids=freeze_block_ids(getattr(new_req, "block_ids", None)),
                scheduled_tokens=int(scheduled.get(req_id, 0)), owner=owner))
            live[req_id] = owner
            preempted.discard(req_id)

        if cached is not None:
            events.extend(self._translate_cached(cached, scheduled, owners, live, preempted, admitted_by, ending))

        for req_id in getattr(so, "preempted_req_ids", None) or ():
            if req_id in live and req_id not in ending:
                preempted.add(req_id)

        for req_id, owner in after.items():  # a terminal of an owner this step names ends it now
            if req_id in live and not _is_older(owner, live[req_id]):
                live.pop(req_id)
                preempted.discard(req_id)
                admitted_by.pop(req_id, None)

        for req_id in sorted(ending, key=str):
            kind = PrefixCacheEventKind.ABORTED if req_id in aborted else PrefixCacheEventKind.FINISHED
            events.append(PrefixCacheRequestEvent(req_id, kind, owner=ending[req_id]))
        return tuple(events), (live, preempted, admitted_by)

    @staticmethod
    def _carry_lookup(events: list[PrefixCacheRequestEvent], at: int | None,
                      control: PrefixCacheRequestEvent, hit_end: int) -> None:
        """The first new request of a REPLACED control's owner carries that admission's lookup
        ``[0, num_computed_tokens)``. A control of this step gives way to it (its lookup becomes
        pending, so the manager installs the new request's); a complete lookup that an earlier
        step's control already installed must agree with it, else the step is refused (I12)."""
        if not control.lookup_complete:
            return
        if at is not None:
            events[at] = dataclasses.replace(control, lookup_complete=False)
            return
        if control.hit_end != hit_end:
            raise OmniPrefixCacheUnmatchError(
                f"PrefixCacheSchedulerAdapter: conflicting initial lookup for request {control.req_id!r} "
                f"owner {control.owner}: its REPLACED control of an earlier step carried a complete lookup "
                f"[0, {control.hit_end}), its first new request computed {hit_end} tokens; build the control "
                "with lookup_complete=False (the new request carries the lookup) (I12)"
            )

    def _translate_cached(
        self, cached: Any, scheduled: dict[ReqId, int], owners: dict[ReqId, Any],
        live: dict[ReqId, PrefixCacheRequestOwner | None], preempted: set[ReqId],
        admitted_by: dict[ReqId, PrefixCacheRequestEvent], ending: dict[ReqId, PrefixCacheRequestOwner | None],
    ) -> list[PrefixCacheRequestEvent]:
        req_ids = _per_row(cached, "req_ids")
        resumed_field = getattr(cached, "resumed_req_ids", None)
        if resumed_field is not None:
            resumed = set(resumed_field)
        else:  # older vLLM: one flag per row
            flags = _per_row(cached, "resumed_from_preemption")
            resumed = {rid for rid, flag in zip(req_ids, flags, strict=False) if flag}
        resumed |= preempted & set(req_ids)
        computed = _per_row(cached, "num_computed_tokens")
        new_blocks = _per_row(cached, "new_block_ids")
        out_tokens = _per_row(cached, "num_output_tokens")
        row = {rid: i for i, rid in enumerate(req_ids)}
        order = [*sorted(resumed, key=str), *(rid for rid in req_ids if rid not in resumed)]
        events: list[PrefixCacheRequestEvent] = []
        for req_id in order:
            current = live.get(req_id)
            owner = owners.get(req_id, current)
            if _is_older(owner, current) or _is_older(owner, ending.get(req_id)):
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
            live[req_id] = owner
            preempted.discard(req_id)
            admitted_by.pop(req_id, None)  # a cached event of the owner: its lookup is served or installed
        return events

    def translate_step(self, so: Any) -> PrefixCacheStep:
        """The step's events, a private copy of ``num_scheduled_tokens`` and its sequence.

        A replayed step (``prefix_cache_step_sequence`` not above the last one
        translated) yields an empty step with that sequence and changes nothing (I13).
        The sequence and the counts are checked before anything else (integer-likes
        become ints): a step that raises changes no adapter state, so a retry is
        translated afresh, never taken for a replay.
        """
        sequence = getattr(so, "prefix_cache_step_sequence", None)
        if sequence is not None:
            sequence = as_index("PrefixCacheSchedulerAdapter.translate_step: prefix_cache_step_sequence", sequence)
        if sequence is not None and self._last_sequence is not None and sequence <= self._last_sequence:
            return PrefixCacheStep((), {}, sequence)
        scheduled = scheduled_counts("num_scheduled_tokens", getattr(so, "num_scheduled_tokens", None) or {})
        events, state = self._translate(so)
        step = PrefixCacheStep(events, scheduled, sequence)
        self._owners, self._preempted, self._controls = state
        if sequence is not None:
            self._last_sequence = sequence
        return step

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
        if _is_block_table_view(view):
            return _layout_of_block_table_view(view, num_scheduled_tokens)
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


def _is_block_table_view(view: Any) -> bool:
    """omni-cache's ``BlockTableView``: rows in batch order with their computed tokens, and every
    row's slots in one vectorized call that makes a fresh tensor (taken by the layout as is)."""
    return isinstance(view, BlockTableView)


def _scheduled_per_row(req_ids: tuple[ReqId, ...], num_scheduled_tokens: Any) -> list[int]:
    """This step's count of every row of the batch (0 for a row not scheduled); a mapping that
    schedules a request outside the batch raises (stale view), as does a negative count."""
    if isinstance(num_scheduled_tokens, Mapping):
        counts = num_scheduled_tokens
        per_row = [int(counts.get(rid, 0)) for rid in req_ids]
        outside = counts.keys() - req_ids  # one set difference in C
        if outside:
            missing = sorted((rid for rid in outside if int(counts[rid]) > 0), key=str)
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
        per_row += [0] * (len(req_ids) - len(per_row))
    if per_row and min(per_row) < 0:
        i = next(i for i, n in enumerate(per_row) if n < 0)
        raise ValueError(f"build_write_layout: negative token count {per_row[i]} for {req_ids[i]!r}")
    return per_row


def _layout_of_block_table_view(view: Any, num_scheduled_tokens: Any) -> PrefixCacheWriteLayout:
    """``build_write_layout`` over a block-table view: the same writes, every row's slots from one
    vectorized ``slots_for_counts`` (no per-request tensor work)."""
    req_ids = tuple(view.req_ids)
    per_row = _scheduled_per_row(req_ids, num_scheduled_tokens)
    writes: list[PrefixCacheWrite] = []
    row = 0
    for req_id, n, start in zip(req_ids, per_row, view.num_computed_tokens, strict=True):
        start = int(start)
        writes.append(PrefixCacheWrite(req_id, row, row + n, start, start + n))
        row += n
    # NOTE: the view computes a fresh slot tensor for this layout alone: taken, not copied again.
    return PrefixCacheWriteLayout.taking(tuple(writes), row, view.slots_for_counts(per_row))


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
