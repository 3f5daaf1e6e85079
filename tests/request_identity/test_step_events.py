"""One step's events, end to end through the adapter and the manager (I12, I13).

* Each event applies to the admission it names, whatever its position in the step:
  ``[STARTED A (owner 1), ABORTED A (owner 1)]`` leaves nothing live, in either order, and so does
  ``[REPLACED A -> owner 2, ABORTED A (owner 2)]`` (owner 1 ends by the REPLACED, its open write
  still lands: I9); the adapter agrees. A terminal of a newer owner proves the id's older
  admissions over: an older owner's control of the same step leaves nothing live.
* The first new request of a REPLACED control's owner carries its hit ``[0, num_computed_tokens)``:
  a control of the same step built with the default ``lookup_complete=True`` gives way to it (the
  next stage gets 9 rows, not 1); a complete lookup an earlier control installed must agree with it,
  else the step is refused ("conflicting initial lookup") and nothing changes.
* A refused ``translate_step`` changes no adapter state, so its retry is translated afresh, never
  taken for a replay; ``prefix_cache_step_sequence`` may be a numpy int.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from cache_helpers import MODES, manager, save, truth

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheRequestOwner,
    PrefixCacheSchedulerAdapter,
    PrefixCacheStep,
)

K = PrefixCacheEventKind
O1, O2 = PrefixCacheRequestOwner(1), PrefixCacheRequestOwner(2)
EMBEDS = "audio.embeds"


def _so(new: Any = (), finished: Any = (), aborted: Any = (), scheduled: Any = None, **extra: Any) -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=None,
                           num_scheduled_tokens=dict(scheduled or {}), finished_req_ids=set(finished),
                           aborted_req_ids=set(aborted), **extra)


def _new(req: str, computed: int = 0, blocks: Any = ()) -> SimpleNamespace:
    return SimpleNamespace(req_id=req, num_computed_tokens=computed, block_ids=(list(blocks),))


def _state(a: PrefixCacheSchedulerAdapter) -> tuple[Any, ...]:
    return a.live_req_ids, a.preempted_req_ids, dict(a._owners), dict(a._controls), a._last_sequence


# ---- each event applies to the admission it names ------------------------------------------


@pytest.mark.parametrize("eager", MODES)
@pytest.mark.parametrize("terminal_first", [False, True])
def test_a_request_started_and_aborted_in_one_step_ends(eager: bool, terminal_first: bool) -> None:
    m = manager(eager)
    try:
        m.new_step_starts([PrefixCacheRequestEvent("x", K.STARTED, owner=O1)])
        m.discard_step(save(m, [("x", [0, 1], 0, 8)])[0])
        events = [PrefixCacheRequestEvent("A", K.STARTED, 0, 8, ((0, 1, 2),), owner=O2),
                  PrefixCacheRequestEvent("A", K.ABORTED, owner=O2)]
        m.new_step_starts(events[::-1] if terminal_first else events)
        assert m.stats()["live_requests"] == 1, "A was left live forever"  # only x
        # A's id starts afresh, without the dead admission's hit.
        m.new_step_starts([PrefixCacheRequestEvent("A", K.STARTED, owner=PrefixCacheRequestOwner(3))])
        step, rows = save(m, [("A", [5], 0, 2)])
        assert torch.equal(m.materialize(step, ["A"]).hidden_states["A"], rows)
    finally:
        m.shutdown()


@pytest.mark.parametrize("eager", MODES)
@pytest.mark.parametrize("terminal_first", [False, True])
def test_a_replacement_and_an_abort_of_the_new_owner_in_one_step_end_both(eager: bool, terminal_first: bool) -> None:
    m = manager(eager)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({EMBEDS})))
    try:
        m.new_step_starts([PrefixCacheRequestEvent("A", K.STARTED, owner=O1)])
        step, rows = save(m, [("A", [0, 1], 0, 8)], mm={EMBEDS: truth("A", range(8)) * 2})
        m.discard_step(step)
        assert m.stats()["deferred_open"] == 1
        events = [PrefixCacheRequestEvent("A", K.REPLACED, owner=O2, lookup_complete=False),
                  PrefixCacheRequestEvent("A", K.ABORTED, owner=O2)]
        m.new_step_starts(events[::-1] if terminal_first else events)
        stats = m.stats()
        assert stats["live_requests"] == 0, "owner 2 was left live"
        assert stats["deferred_open"] == 0, "owner 1's open write was not pushed (I9)"
        # Owner 1's rows landed: a real hit on its blocks reads them, deferred key included.
        m.new_step_starts([PrefixCacheRequestEvent("b", K.STARTED, 0, 8, ((0, 1, 2),))])
        step, new = save(m, [("b", [0, 1, 2], 8, 9)], mm={EMBEDS: truth("b", range(8, 9)) * 2})
        out = m.materialize(step, ["b"])
        assert torch.equal(out.mm_outputs[EMBEDS]["b"], torch.cat([rows, new]) * 2)
    finally:
        m.shutdown()


def test_a_terminal_of_the_live_owner_still_ends_it_before_a_new_admission() -> None:
    """The other half of the rule: a terminal of the owner live before the step ends it first, so
    the id starts again in the same step (ownerless too, as the reference)."""
    m = manager()
    try:
        m.new_step_starts([PrefixCacheRequestEvent("A", K.STARTED, owner=O1), PrefixCacheRequestEvent("B", K.STARTED)])
        m.new_step_starts([PrefixCacheRequestEvent("A", K.STARTED, owner=O2), PrefixCacheRequestEvent("A", K.FINISHED, owner=O1),
                           PrefixCacheRequestEvent("B", K.STARTED), PrefixCacheRequestEvent("B", K.FINISHED)])
        assert m.stats()["live_requests"] == 2 and m.stats()["stale_events"] == 0
    finally:
        m.shutdown()


def test_the_adapter_ends_an_admission_started_or_replaced_to_in_the_step_of_its_terminal() -> None:
    a = PrefixCacheSchedulerAdapter()
    step = a.translate_step(_so(new=[_new("A")], aborted={"A"}, scheduled={"A": 0},
                                prefix_cache_owners={"A": O1}, prefix_cache_terminal_owners={"A": O1}))
    assert [(e.kind, e.owner) for e in step] == [(K.STARTED, O1), (K.ABORTED, O1)]
    assert not a.live_req_ids, "the adapter kept A live"
    a.translate_step(_so(new=[_new("B")], scheduled={"B": 4}, prefix_cache_owners={"B": O1}))
    control = PrefixCacheRequestEvent("B", K.REPLACED, owner=O2, lookup_complete=False)
    step = a.translate_step(_so(aborted={"B"}, prefix_cache_replacements=[control],
                                prefix_cache_terminal_owners={"B": O2}))
    assert [(e.kind, e.owner) for e in step] == [(K.REPLACED, O2), (K.ABORTED, O2)]
    assert not a.live_req_ids
    m = manager()  # and the manager agrees, fed the adapter's events
    try:
        m.new_step_starts([PrefixCacheRequestEvent("B", K.STARTED, owner=O1)])
        m.new_step_starts(step)
        assert m.stats()["live_requests"] == 0
    finally:
        m.shutdown()


O3, O4 = PrefixCacheRequestOwner(3), PrefixCacheRequestOwner(4)


def test_a_terminal_of_a_newer_owner_ends_an_older_owners_control_of_the_same_step() -> None:
    """A (owner 2) is live; before the next step it is replaced to owner 3 (a pending control), owner 3
    is aborted, A is admitted again as owner 4 and aborted too. vLLM's scheduler output holds one
    terminal per id (``finished_req_ids`` is a set): A with owner 4. That terminal proves owner 3
    over as well: the adapter drops owner 3's control and nothing of A stays live; fed the events
    themselves (both terminals, or only owner 4's), the manager agrees. Found by
    TestAdapterAsync (the adapter kept owner 3 live forever, a leak of I12)."""
    a = PrefixCacheSchedulerAdapter()
    a.translate_step(_so(new=[_new("A")], scheduled={"A": 4}, prefix_cache_owners={"A": O2}))
    control = PrefixCacheRequestEvent("A", K.REPLACED, owner=O3, lookup_complete=False)
    step = a.translate_step(_so(aborted={"A"}, finished={"A"}, prefix_cache_replacements=[control],
                                prefix_cache_terminal_owners={"A": O4}))
    assert [(e.kind, e.owner) for e in step] == [(K.ABORTED, O4)], "owner 3's control was kept"
    assert not a.live_req_ids, "the adapter kept A live"
    for events in ([control, PrefixCacheRequestEvent("A", K.ABORTED, owner=O3),
                    PrefixCacheRequestEvent("A", K.ABORTED, owner=O4)],
                   [control, PrefixCacheRequestEvent("A", K.ABORTED, owner=O4)],
                   list(step)):
        m = manager()
        try:
            m.new_step_starts([PrefixCacheRequestEvent("A", K.STARTED, owner=O2)])
            m.new_step_starts(events)
            assert m.stats()["live_requests"] == 0, [(e.kind.name, e.owner) for e in events]
            m.new_step_starts([PrefixCacheRequestEvent("A", K.STARTED, owner=PrefixCacheRequestOwner(5))])
            assert m.stats()["live_requests"] == 1  # the id is free for its next admission
        finally:
            m.shutdown()


# ---- the first new request of a replaced owner carries its hit -------------------------------


def _replaced_run(eager: bool, steps: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """x fills blocks 0, 1; A (owner 1) runs on block 5; then ``steps`` (scheduler outputs' fields);
    the last schedules A's position 8 on blocks 0, 1, 2. Returns (A's materialized rows, x's rows)."""
    a, m = PrefixCacheSchedulerAdapter(), manager(eager)
    try:
        m.new_step_starts(a.translate_step(_so(new=[_new("x"), _new("A")], scheduled={"x": 8, "A": 2},
                                               prefix_cache_owners={"x": O1, "A": O1})))
        step, rows = save(m, [("x", [0, 1], 0, 8), ("A", [5], 0, 2)])
        m.discard_step(step)
        for fields in steps:
            m.new_step_starts(a.translate_step(_so(**fields)))
        step, _ = save(m, [("A", [0, 1, 2], 8, 9)], tag_of={"A": "x"})
        return m.materialize(step, ["A"]).hidden_states["A"], rows[:8]
    finally:
        m.shutdown()


NEW_A = dict(new=[_new("A", 8, [0, 1, 2])], scheduled={"A": 1})


@pytest.mark.parametrize("eager", MODES)
@pytest.mark.parametrize("control", [
    PrefixCacheRequestEvent("A", K.REPLACED, owner=O2),  # the default: lookup_complete=True, a miss
    PrefixCacheRequestEvent("A", K.REPLACED, owner=O2, lookup_complete=False),
    PrefixCacheRequestEvent("A", K.REPLACED, 0, 8, ((0, 1, 2),), owner=O2),  # a complete lookup that agrees
])
def test_a_control_and_the_new_request_in_one_step_serve_the_full_prefix(eager: bool, control: Any) -> None:
    got, x_rows = _replaced_run(eager, [dict(prefix_cache_replacements=[control], **NEW_A)])
    assert got.shape[0] == 9, f"the next stage got {got.shape[0]} rows instead of 9"
    assert torch.equal(got, torch.cat([x_rows, truth("x", range(8, 9))]))


@pytest.mark.parametrize("eager", MODES)
@pytest.mark.parametrize("control", [
    PrefixCacheRequestEvent("A", K.REPLACED, owner=O2, lookup_complete=False),
    PrefixCacheRequestEvent("A", K.REPLACED, 0, 8, ((0, 1, 2),), owner=O2),
])
def test_a_control_of_an_earlier_step_and_the_new_request_serve_the_full_prefix(eager: bool, control: Any) -> None:
    got, x_rows = _replaced_run(eager, [dict(prefix_cache_replacements=[control]), NEW_A])
    assert torch.equal(got, torch.cat([x_rows, truth("x", range(8, 9))]))


def test_a_new_request_whose_hit_an_earlier_control_contradicts_is_refused_and_changes_nothing() -> None:
    a, m = PrefixCacheSchedulerAdapter(), manager()
    try:
        m.new_step_starts(a.translate_step(_so(new=[_new("A")], prefix_cache_owners={"A": O1},
                                               prefix_cache_step_sequence=1)))
        control = PrefixCacheRequestEvent("A", K.REPLACED, owner=O2)  # complete: a miss
        m.new_step_starts(a.translate_step(_so(prefix_cache_replacements=[control], prefix_cache_step_sequence=2)))
        before, stats = _state(a), m.stats()
        bad = _so(prefix_cache_step_sequence=3, **NEW_A)
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"conflicting initial lookup .*'A'.*\[0, 0\).*8 tokens"):
            a.translate_step(bad)
        assert _state(a) == before and m.stats() == stats
        # The scheduler's corrected step (the miss the control announced) goes through.
        step = a.translate_step(_so(new=[_new("A", 0, [3])], scheduled={"A": 2}, prefix_cache_step_sequence=3))
        assert [(e.kind, e.owner, e.hit_end) for e in step] == [(K.EXTENDED, O2, 0)]
    finally:
        m.shutdown()


# ---- a refused translate_step changes nothing; numpy sequences ----------------------------


@pytest.mark.parametrize("eager", MODES)
def test_a_numpy_sequence_is_translated_and_a_refused_step_is_retried_afresh(eager: bool) -> None:
    a, m = PrefixCacheSchedulerAdapter(), manager(eager)
    try:
        m.new_step_starts(a.translate_step(_so(new=[_new("x")], scheduled={"x": 8}, prefix_cache_step_sequence=1)))
        m.discard_step(save(m, [("x", [0, 1], 0, 8)])[0])
        step = a.translate_step(_so(new=[_new("B")], prefix_cache_step_sequence=np.int64(2)))
        assert step.sequence == 2 and type(step.sequence) is int and [e.kind for e in step] == [K.STARTED]
        m.new_step_starts(step)
        fields: dict[str, Any] = dict(new=[_new("A", 8, [0, 1, 2])], scheduled={"A": 1})
        for bad in (dict(prefix_cache_step_sequence=3.0), dict(prefix_cache_step_sequence="3"),
                    dict(prefix_cache_step_sequence=3, num_scheduled_tokens={"A": "1"}),
                    dict(prefix_cache_step_sequence=3, scheduled_new_reqs=[_new("A", 8, [0, 1, 2]), object()])):
            so = _so(**fields)
            for name, value in bad.items():
                setattr(so, name, value)
            before = _state(a)
            with pytest.raises((TypeError, ValueError)):
                a.translate_step(so)
            assert _state(a) == before, f"a refused step changed the adapter: {bad}"
        step = a.translate_step(_so(prefix_cache_step_sequence=np.int64(3), **fields))  # the retry
        assert [(e.kind, e.hit_end) for e in step] == [(K.STARTED, 8)], "the retry was taken for a replay"
        m.new_step_starts(step)
        step_id, _ = save(m, [("A", [0, 1, 2], 8, 9)], tag_of={"A": "x"})
        got = m.materialize(step_id, ["A"]).hidden_states["A"]
        assert torch.equal(got, truth("x", range(9))), "A's prefix was dropped"
        assert a.translate_step(_so(prefix_cache_step_sequence=np.int32(3), **fields)).events == ()  # a replay
    finally:
        m.shutdown()


def test_a_step_refused_midway_leaves_the_adapter_as_it_was() -> None:
    a = PrefixCacheSchedulerAdapter()
    a.translate_step(_so(new=[_new("A")], prefix_cache_owners={"A": O1}))
    control = PrefixCacheRequestEvent("A", K.REPLACED, owner=O2)
    before = _state(a)
    with pytest.raises(ValueError, match="neither req_id nor request_id"):  # after the control was accepted
        a.translate_scheduler_output(_so(new=[SimpleNamespace(num_computed_tokens=0)], finished={"B"},
                                         prefix_cache_replacements=[control]))
    assert _state(a) == before
    assert isinstance(a.translate_step(_so(prefix_cache_replacements=[control])), PrefixCacheStep)
    assert a._owners == {"A": O2}
