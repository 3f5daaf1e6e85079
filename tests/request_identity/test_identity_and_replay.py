"""Request identity (I12) and replayed steps (I13), manager and adapter sides; zero-row requests.

I12: a reused request id is a new admission -- the old admission's rows still land
(I9) and a later real hit reads them, the new admission never inherits the old
pending hit, a late terminal of the old owner never ends the new one, a delayed
lookup is installed once. I13: a replayed step (same ``PrefixCacheStep.sequence``)
changes nothing, in the manager and in the adapter. Plus the adapter's Model
Runner V2 rule: a preempted request re-delivered among the new
requests is RESUMED with its hit and gets the full prefix.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cache_helpers import WIDTH, event, manager, save, settle, slots, truth

from omni_cache import (
    OmniPrefixCacheUnmatchError,
    PrefixCacheEventKind,
    PrefixCacheSchedulerAdapter,
    PrefixCacheStep,
)
from omni_cache.runtime.events import PrefixCacheRequestOwner
from omni_cache.runtime.events import PrefixCacheRequestOwner as Owner

K = PrefixCacheEventKind
MODES = [True, False]
EMBEDS = "audio.embeds"


@pytest.mark.parametrize("eager", MODES)
def test_I12_reused_id_is_a_new_admission_old_rows_land_and_no_inherited_hit(eager: bool) -> None:
    from omni_cache import ModelCachePolicy

    m = manager(eager)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({EMBEDS})))
    try:
        # "x" fills blocks 0,1; admission 1 of "a" writes blocks 2,3 with a deferred key (open write).
        m.new_step_starts([event("x", K.STARTED, Owner(1)), event("a", K.STARTED, Owner(2))])
        rows_x = truth("x", range(8))
        rows_a = truth("a1", range(8))
        from omni_cache import PrefixCacheWriteLayout

        layout = PrefixCacheWriteLayout.packed([("x", 0, 8), ("a", 0, 8)],
                                               torch.cat([slots([0, 1], 0, 8), slots([2, 3], 0, 8)]))
        both = torch.cat([rows_x, rows_a])
        step = m.save_outputs(both, {EMBEDS: both * 2}, num_tokens_unpadded=16, num_tokens_padded=16,
                              write_layout=layout)
        m.discard_step(step)
        # Admission 2 of "a" (same id) arrives with a hit on x's blocks; before its first save the
        # scheduler replaces it (admission 3, lookup pending). The admission-2 hit must not be served
        # to admission 3, and admission 1's deferred rows must still land (I9).
        assert m.stats()["deferred_open"] == 1
        m.new_step_starts([event("a", K.STARTED, Owner(3), hit=8, blocks=[0, 1])])
        assert m.stats()["deferred_open"] == 0, "the replaced admission's open write was not pushed (I9)"
        m.new_step_starts([event("a", K.REPLACED, Owner(4), hit=None)])  # its lookup is still pending
        step, rows = save(m, [("a", [5], 0, 4)], tag_of={"a": "a4"}, mm={EMBEDS: truth("a4", range(4)) * 2})
        out = m.materialize(step, ["a"])
        assert torch.equal(out.hidden_states["a"], rows), "the new admission inherited an old pending hit"
        # A real hit on admission 1's blocks reads its rows, deferred key included: they landed.
        m.new_step_starts([event("b", K.STARTED, Owner(5), hit=8, blocks=[2, 3], n=1)])
        step, new = save(m, [("b", [2, 3, 6], 8, 9)], mm={EMBEDS: truth("b", range(8, 9)) * 2})
        settle(m)
        out = m.materialize(step, ["b"])
        assert torch.equal(out.hidden_states["b"], torch.cat([rows_a, new]))
        assert torch.equal(out.mm_outputs[EMBEDS]["b"], torch.cat([rows_a, new]) * 2)
        assert m.stats()["live_requests"] == 3
    finally:
        m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_I12_late_terminal_of_the_old_owner_never_ends_the_new_admission(eager: bool) -> None:
    m = manager(eager)
    try:
        m.new_step_starts([event("x", K.STARTED, Owner(1))])
        step, rows_x = save(m, [("x", [0, 1], 0, 8)])
        m.discard_step(step)
        m.new_step_starts([event("a", K.STARTED, Owner(2))])
        m.discard_step(save(m, [("a", [4], 0, 2)])[0])
        # The id is reused by admission 3 (with a hit on x's blocks) before admission 2's FINISHED,
        # which arrives one step late, carrying the owner it ends.
        m.new_step_starts([event("a", K.STARTED, Owner(3), hit=8, blocks=[0, 1], n=2)])
        m.new_step_starts([event("a", K.FINISHED, Owner(2)), event("a", K.EXTENDED, Owner(3), hit=8, blocks=[0, 1])])
        step, new = save(m, [("a", [0, 1, 7], 8, 10)])
        out = m.materialize(step, ["a"])
        assert torch.equal(out.hidden_states["a"], torch.cat([rows_x, new])), "the late terminal ended the new admission"
        assert m.stats()["stale_events"] == 1
        m.new_step_starts([event("a", K.FINISHED, Owner(3))])
        assert m.stats()["live_requests"] == 1  # only x
    finally:
        m.shutdown()


def test_I12_identity_errors_change_nothing() -> None:
    m = manager()
    try:
        m.new_step_starts([event("a", K.REPLACED, Owner(1, 2), hit=0)])
        bad = [
            ([event("a", K.REPLACED, None)], "carries no owner"),
            ([event("a", K.STARTED, Owner(1, 3))], "needs a REPLACED control"),
            ([event("a", K.EXTENDED, Owner(2))], "only STARTED or REPLACED may change"),
            ([event("a", K.REPLACED, Owner(1, 2), hit=4, blocks=[0])], "conflicting initial lookup"),
            ([event("b", K.STARTED), event("b2", K.STARTED, hit=3, blocks=[0])], "not block aligned"),
        ]
        for events, phrase in bad:
            before = m.stats()
            with pytest.raises(OmniPrefixCacheUnmatchError, match=phrase):
                m.new_step_starts(events)
            assert m.stats() == before, phrase
        m.new_step_starts([event("b", K.STARTED)])
        with pytest.raises(OmniPrefixCacheUnmatchError, match="still live"):
            m.new_step_starts([event("b", K.STARTED)])
    finally:
        m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_I13_replayed_step_changes_nothing(eager: bool) -> None:
    m = manager(eager)
    try:
        m.new_step_starts(PrefixCacheStep([event("x", K.STARTED)], {"x": 8}, sequence=1))
        step, rows_x = save(m, [("x", [0, 1], 0, 8)])
        m.discard_step(step)
        first = PrefixCacheStep([event("a", K.STARTED, hit=8, blocks=[0, 1]), event("x", K.FINISHED)], {"a": 2}, sequence=2)
        m.new_step_starts(first)
        step, new = save(m, [("a", [0, 1, 2], 8, 10)])
        assert torch.equal(m.materialize(step, ["a"]).hidden_states["a"], torch.cat([rows_x, new]))
        m.new_step_starts(PrefixCacheStep([event("a", K.FINISHED)], {}, sequence=3))
        before = m.stats()
        m.new_step_starts(first)  # replayed: a must not come back live with its hit
        m.new_step_starts(PrefixCacheStep([event("y", K.STARTED)], {}, sequence=3))
        after = m.stats()
        assert after["replayed_steps"] == 2 and after["live_requests"] == 0
        assert {k: after[k] for k in ("hits", "misses", "hit_tokens")} == {k: before[k] for k in ("hits", "misses", "hit_tokens")}
        # A new step (higher sequence) is applied again; a sequence-less step always is.
        m.new_step_starts(PrefixCacheStep([event("y", K.STARTED)], {}, sequence=4))
        m.new_step_starts([event("z", K.STARTED)])
        assert m.stats()["live_requests"] == 2
    finally:
        m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_zero_row_request_gets_empty_rows_not_an_error(eager: bool) -> None:
    from omni_cache import PrefixCacheWrite, PrefixCacheWriteLayout

    m = manager(eager)
    try:
        m.new_step_starts([event("a", K.STARTED), event("idle", K.STARTED)])
        rows = truth("a", range(4))
        layout = PrefixCacheWriteLayout((PrefixCacheWrite("idle", 0, 0, 5, 5), PrefixCacheWrite("a", 0, 4, 0, 4)),
                                        4, slots([1], 0, 4))
        step = m.save_outputs(rows, {"codes": -rows[:, :2], "meta": [1]}, num_tokens_unpadded=4,
                              num_tokens_padded=4, write_layout=layout)
        out = m.materialize(step, ["idle", "a"])
        assert out.hidden_states["idle"].shape == (0, WIDTH) and out.mm_outputs["codes"]["idle"].shape == (0, 2)
        assert torch.equal(out.hidden_states["a"], rows) and out.mm_outputs["meta"]["idle"] == [1]
    finally:
        m.shutdown()


# ----------------------------------------------------------------------------- adapter side


def _so(new=(), cached=None, finished=(), scheduled=None, **extra):
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                           num_scheduled_tokens=dict(scheduled or {}), finished_req_ids=set(finished), **extra)


def _new(req, computed=0, blocks=()):
    return SimpleNamespace(req_id=req, num_computed_tokens=computed, block_ids=(list(blocks),))


def test_adapter_preempted_request_back_among_new_ones_is_resumed_with_its_hit() -> None:
    a = PrefixCacheSchedulerAdapter()
    a.translate_step(_so(new=[_new("v")], scheduled={"v": 8}))
    a.translate_step(_so(new=[_new("w")], scheduled={"w": 8}, preempted_req_ids={"v"}))
    assert a.preempted_req_ids == {"v"}
    (event,) = a.translate_step(_so(new=[_new("v", 16, [3, 4, 5, 6, 7])], scheduled={"v": 4})).events
    assert (event.kind, event.hit_end, event.block_ids) == (K.RESUMED, 16, ((3, 4, 5, 6, 7),))
    (event,) = a.translate_step(_so(new=[_new("v", 20, [3, 4, 5, 6, 7])], scheduled={"v": 1})).events
    assert event.kind is K.EXTENDED  # resumed once
    # A preempted request that finishes while preempted is gone; its id starts afresh.
    a.translate_step(_so(preempted_req_ids={"v"}))
    a.translate_step(_so(finished={"v"}))
    (event,) = a.translate_step(_so(new=[_new("v", 8, [3, 4])], scheduled={"v": 1})).events
    assert event.kind is K.STARTED and not a.preempted_req_ids


def test_adapter_zero_token_step_still_passes_finished_ids() -> None:
    a = PrefixCacheSchedulerAdapter()
    a.translate_step(_so(new=[_new("r")], scheduled={"r": 4}))
    step = a.translate_step(_so(finished={"r"}, scheduled={}))  # vLLM 0.32: aborts arrive here too
    assert [(e.req_id, e.kind) for e in step] == [("r", K.FINISHED)] and step.scheduled_tokens == {}
    assert "r" not in a.live_req_ids


def test_adapter_reused_live_id_gets_a_replaced_control_first() -> None:
    a = PrefixCacheSchedulerAdapter()
    a.translate_step(_so(new=[_new("r")], scheduled={"r": 4}, prefix_cache_owners={"r": Owner(1)}))
    events = a.translate_step(_so(new=[_new("r", 8, [1, 2])], scheduled={"r": 4},
                                  prefix_cache_owners={"r": Owner(2)})).events
    assert [(e.kind, e.owner, e.lookup_complete) for e in events] == [
        (K.REPLACED, Owner(2), False), (K.STARTED, Owner(2), True)]
    assert events[1].hit_end == 8
    # The old owner's late terminal names the owner it ends; the new admission stays live.
    (event,) = a.translate_step(_so(finished={"r"}, prefix_cache_terminal_owners={"r": Owner(1)})).events
    assert (event.kind, event.owner) == (K.FINISHED, Owner(1)) and "r" in a.live_req_ids


def test_adapter_replayed_step_yields_nothing_and_changes_nothing() -> None:
    a = PrefixCacheSchedulerAdapter()
    first = _so(new=[_new("r")], scheduled={"r": 4}, prefix_cache_step_sequence=5)
    assert a.translate_step(first).events
    a.translate_step(_so(finished={"r"}, prefix_cache_step_sequence=6))
    replay = a.translate_step(first)
    assert (replay.events, replay.scheduled_tokens, replay.sequence) == ((), {}, 5)
    assert "r" not in a.live_req_ids


@pytest.mark.parametrize("field", ["admission_id", "generation"])
@pytest.mark.parametrize("bad", [-1, True, 1.0, "1", None])
def test_a_malformed_owner_is_refused_where_it_is_built(field: str, bad: object) -> None:
    """A malformed request owner is refused where it is built, never compared later (I12).

    An owner's
    fields order admissions (I12): a negative, bool, float, string or missing one is refused at
    construction with its name, never compared later.

    Kills the mutant: ``events:PrefixCacheRequestOwner.__post_init__:del_raise:3a5afb80``.

    A malformed request owner is refused where it is built, never compared later (I12)."""
    kwargs: dict[str, object] = {"admission_id": 3, "generation": 0, field: bad}
    with pytest.raises(ValueError, match=rf"PrefixCacheRequestOwner\.{field} must be an int >= 0, got {bad!r}"):
        PrefixCacheRequestOwner(**kwargs)  # type: ignore[arg-type]
    assert PrefixCacheRequestOwner(0, 0) < PrefixCacheRequestOwner(0, 1) < PrefixCacheRequestOwner(1, 0)


# ---- I12: a first admission is generation 0 ----------------------------------------------
def test_a_first_admission_is_older_than_its_first_replacement() -> None:
    """A request's first admission (generation 0 by default) is older than its first replacement (I12).

    Kills the mutant: ``events:PrefixCacheRequestOwner:int_off:ee162ae5`` (``generation`` default 0 -> 1).

    A request's first admission (generation 0 by default) is older than its first replacement (I12)."""
    first = PrefixCacheRequestOwner(5)
    replaced = PrefixCacheRequestOwner(5, 1)
    assert first.generation == 0, "a first admission must start at generation 0"
    assert first < replaced, "the first replacement of an admission must compare newer than it (I12)"
