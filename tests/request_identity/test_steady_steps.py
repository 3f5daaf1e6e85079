"""A steady step (every event EXTENDs its live admission) is applied without planning (I12).

``plans_nothing`` is the manager's shortcut for the steps a real engine sends most: every
running request's EXTENDED event. It must never say "nothing to plan" for events that
``plan_events`` would plan (an admission, an ended one, an installed lookup, an owner
change to refuse) or count as stale: the property below checks it against ``plan_events``
itself over arbitrary events and live admissions, and the manager test checks that a
step the shortcut takes leaves the manager as the full path would (the events a decode
step carries, then a refused owner change that must still be refused).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from cache_helpers import manager
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_cache import (
    OmniPrefixCacheUnmatchError,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheRequestOwner,
)
from omni_cache.runtime.admissions import Admission, plan_events, plans_nothing

K = PrefixCacheEventKind
REQS = ("a", "b", "c")
owners = st.none() | st.builds(PrefixCacheRequestOwner, st.integers(0, 2), st.integers(0, 1))
lookups = st.none() | st.just((0, ())) | st.just((16, (3,)))


@st.composite
def events(draw: st.DrawFn) -> PrefixCacheRequestEvent:
    kind = draw(st.sampled_from([K.EXTENDED, K.EXTENDED, K.EXTENDED, K.STARTED, K.RESUMED, K.FINISHED, K.REPLACED]))
    owner = draw(owners)
    if kind is K.REPLACED and owner is None:
        owner = PrefixCacheRequestOwner(2)
    hit = draw(st.sampled_from([0, 16]))
    return PrefixCacheRequestEvent(draw(st.sampled_from(REQS)), kind, hit_start=0, hit_end=hit,
                                   block_ids=(3,) if hit else (), owner=owner,
                                   lookup_complete=draw(st.booleans()))


@settings(max_examples=400, deadline=None)
@given(st.lists(events(), max_size=4),
       st.dictionaries(st.sampled_from(REQS), st.builds(Admission, owners, lookups), max_size=3))
def test_plans_nothing_only_where_plan_events_plans_nothing(evs: list[PrefixCacheRequestEvent],
                                                            live: dict[str, Admission]) -> None:
    requests = {rid: SimpleNamespace(admission=a) for rid, a in live.items()}
    if not plans_nothing(evs, requests):
        return
    assert all(e.kind is K.EXTENDED for e in evs)
    plan = plan_events(evs, live, block_size=16)  # raises for an owner change: then the shortcut was wrong
    assert plan.changes == [] and plan.stale == 0, (evs, live, plan)


def test_the_shortcut_is_taken_by_a_steady_step_and_by_nothing_else() -> None:
    o1, o2 = PrefixCacheRequestOwner(1), PrefixCacheRequestOwner(2)
    live = {"a": SimpleNamespace(admission=Admission(o1, (16, (3,)))),
            "b": SimpleNamespace(admission=Admission(None, (0, ())))}
    steady = [PrefixCacheRequestEvent("a", K.EXTENDED, owner=o1), PrefixCacheRequestEvent("b", K.EXTENDED)]
    assert plans_nothing(steady, live) and plans_nothing([], live)
    assert not plans_nothing([PrefixCacheRequestEvent("c", K.EXTENDED)], live)  # not live: admitted
    assert not plans_nothing([PrefixCacheRequestEvent("a", K.EXTENDED, owner=o2)], live)  # owner change: refused
    assert not plans_nothing([PrefixCacheRequestEvent("a", K.FINISHED, owner=o1)], live)
    waiting = {"a": SimpleNamespace(admission=Admission(o1, None))}  # its lookup is still to come
    assert not plans_nothing([PrefixCacheRequestEvent("a", K.EXTENDED, owner=o1, hit_end=16, block_ids=(3,))],
                             waiting)


def test_a_manager_refuses_an_owner_change_among_steady_events() -> None:
    """The full path still runs when one event of a steady-looking step is not: the step is refused
    and nothing changes (the other requests stay live, the next steady step applies)."""
    o1, o2 = PrefixCacheRequestOwner(1), PrefixCacheRequestOwner(2)
    m = manager(eager=True)
    try:
        m.new_step_starts([PrefixCacheRequestEvent("a", K.STARTED, owner=o1),
                           PrefixCacheRequestEvent("b", K.STARTED, owner=o1)])
        m.new_step_starts([PrefixCacheRequestEvent("a", K.EXTENDED, owner=o1),
                           PrefixCacheRequestEvent("b", K.EXTENDED, owner=o1)])
        with pytest.raises(OmniPrefixCacheUnmatchError, match="only STARTED or REPLACED may change"):
            m.new_step_starts([PrefixCacheRequestEvent("a", K.EXTENDED, owner=o1),
                               PrefixCacheRequestEvent("b", K.EXTENDED, owner=o2)])
        assert m.stats()["live_requests"] == 2
        m.new_step_starts([PrefixCacheRequestEvent("c", K.EXTENDED)])  # never announced: admitted
        assert m.stats()["live_requests"] == 3
    finally:
        m.shutdown()
