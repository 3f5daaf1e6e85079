"""What the manager's doors refuse, and that a refusal changes nothing: typed input and scheduled counts.

Each bad input below is refused with ``OmniPrefixCacheUnmatchError`` (or, for a value type, a
``TypeError`` at construction that names the argument), never a bare ``TypeError`` /
``AttributeError`` from deep inside; after the refusal ``stats()`` is unchanged and the next valid
call works (a refused call changes no state):

* scheduled counts (contract 4.3, "slot mapping covers"): each request's rows equal its scheduled
  count, zero included -- a count of 0 for a request with rows, rows for a request with no count, a
  count with no rows;
* an unhashable request id; ``materialize`` with an unhashable request id; a sparse ``slots_cpu``;
  a hit bound that is not an int; ``new_step_starts`` given something that is not an event.

Invariants touched: I4 (a refused materialize consumes nothing), I5 (hits are ints), I13's
"a refused call changes no state".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from cache_helpers import MODES, manager, save, settle, slots, started, truth

from omni_cache import (
    OmniPrefixCacheUnmatchError,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.errors import PHRASE_OUTSIDE_SNAPSHOT, PHRASE_SLOT_MAPPING
from omni_cache.runtime.events import PrefixCacheEventKind as E

# ---- scheduled counts: rows equal counts, zero included --------------------------------------


@pytest.mark.parametrize("eager", MODES)
@pytest.mark.parametrize(("counts", "named"), [
    ({"A": 4, "B": 0}, "request 'B' was scheduled 0 tokens but the slot mapping covers 4 rows"),
    ({"A": 4}, r"request 'B' was not scheduled \(no count: 0 tokens\) but the slot mapping covers 4 rows"),
    ({"A": 4, "B": 4, "C": 2}, "request 'C' was scheduled 2 tokens but the slot mapping covers 0 rows"),
])
def test_each_requests_rows_equal_its_scheduled_count_zero_included(eager: bool, counts: dict[str, int],
                                                                    named: str) -> None:
    m = manager(eager)
    try:
        m.new_step_starts(PrefixCacheStep((started("A"), started("B"), started("C")), counts))
        before = m.stats()
        with pytest.raises(OmniPrefixCacheUnmatchError, match=named):
            save(m, [("A", [0], 0, 4), ("B", [1], 0, 4)])
        assert PHRASE_SLOT_MAPPING in named
        assert m.stats() == before, "a refused save changed state"
        # The counts are kept for the retry: the layout the counts describe is accepted.
        spans = [(r, [i], 0, n) for i, (r, n) in enumerate(counts.items()) if n]
        step, rows = save(m, spans)
        out = m.materialize(step, [r for r, *_ in spans])
        assert torch.equal(torch.cat([out.hidden_states[r] for r, *_ in spans]), rows)
    finally:
        m.shutdown()


def test_a_zero_row_request_with_a_zero_count_is_accepted() -> None:
    m = manager()
    try:
        m.new_step_starts(PrefixCacheStep((started("A"), started("idle")), {"A": 2, "idle": 0}))
        layout = PrefixCacheWriteLayout((PrefixCacheWrite("A", 0, 2, 0, 2), PrefixCacheWrite("idle", 2, 2, 0, 0)),
                                        2, slots([0], 0, 2))
        step = m.save_outputs(truth("A", range(2)), {}, num_tokens_unpadded=2, num_tokens_padded=2,
                              write_layout=layout)
        assert m.materialize(step, ["idle"]).hidden_states["idle"].shape[0] == 0
    finally:
        m.shutdown()


# ---- typed input: refused at the door, naming what is wrong; nothing changes -------------------


def _unchanged(m: Any, before: dict[str, Any]) -> None:
    after = m.stats()
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}


@pytest.mark.parametrize("kwargs", [
    dict(req_id=["A"]), dict(req_id={"A": 1}),
    dict(hit_end="8"), dict(hit_end=8.0), dict(hit_end=True), dict(hit_start=None),
    dict(scheduled_tokens="2"), dict(num_output_tokens=1.5),
    dict(block_ids=["x"]), dict(block_ids=[[0, "1"]]),
])
def test_a_malformed_event_is_refused_at_construction_naming_the_argument(kwargs: dict[str, Any]) -> None:
    name = next(iter(kwargs))
    fields = {"req_id": "A", "kind": E.STARTED, **kwargs}
    with pytest.raises(TypeError, match=rf"PrefixCacheRequestEvent .*{name}"):
        PrefixCacheRequestEvent(**fields)


def test_integer_likes_are_ints_in_every_value_type() -> None:
    event = PrefixCacheRequestEvent("A", E.STARTED, np.int64(0), np.int32(8), (np.array([0, 1]),), np.int64(2))
    assert (event.hit_end, event.scheduled_tokens, event.block_ids) == (8, 2, ((0, 1),))
    assert type(event.hit_end) is int and type(event.scheduled_tokens) is int
    step = PrefixCacheStep((event,), {"A": np.int64(2)}, np.int64(3))
    assert step.sequence == 3 and type(step.sequence) is int and step.scheduled_tokens == {"A": 2}
    for bad in (True, 3.0, "3"):
        with pytest.raises(TypeError, match=r"PrefixCacheStep\.sequence must be an int"):
            PrefixCacheStep((), {}, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"PrefixCacheWrite .*req_id must be hashable"):
        PrefixCacheWrite(["A"], 0, 1, 0, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("eager", MODES)
@pytest.mark.parametrize(("events", "kw", "named"), [
    (["B"], None, r"events\[0\] must be a PrefixCacheRequestEvent, got str 'B'"),
    ([started("B"), 5], None, r"events\[1\] must be a PrefixCacheRequestEvent, got int"),
    (5, None, "events must be an iterable"),
    ([started("B")], {"B": "x"}, r"num_scheduled_tokens\['B'\] must be an int, got 'x'"),
    ([started("B")], {"B": 2.5}, r"num_scheduled_tokens\['B'\] must be an int"),
    ([started("B")], [1], "num_scheduled_tokens must be a"),
])
def test_new_step_starts_refuses_what_is_not_an_event_or_a_count(eager: bool, events: Any, kw: Any,
                                                                 named: str) -> None:
    m = manager(eager)
    try:
        m.new_step_starts(PrefixCacheStep((started("A"),), {"A": 4}, sequence=1))
        before = m.stats()
        with pytest.raises(OmniPrefixCacheUnmatchError, match=named):
            m.new_step_starts(events, num_scheduled_tokens=kw)
        _unchanged(m, before)
        step, rows = save(m, [("A", [0], 0, 4)])  # the last applied step's counts still hold
        assert torch.equal(m.materialize(step, ["A"]).hidden_states["A"], rows)
        m.new_step_starts([started("B")], num_scheduled_tokens={"B": np.int64(2)})
        assert m.stats()["live_requests"] == 2
    finally:
        m.shutdown()


@pytest.mark.parametrize("eager", MODES)
@pytest.mark.parametrize("req_ids", [[["A"]], ["A", {"B"}], 5, None])
def test_materialize_refuses_unhashable_or_missing_request_ids_and_consumes_nothing(eager: bool, req_ids: Any) -> None:
    m = manager(eager)
    try:
        m.new_step_starts([started("A"), started("B")])
        step, rows = save(m, [("A", [0], 0, 2), ("B", [1], 0, 1)])
        # An async save lands on the writer thread; snapshot after it has, so the comparison sees
        # only what the refused materialize could have changed.
        settle(m)
        before = m.stats()
        phrase = PHRASE_OUTSIDE_SNAPSHOT if isinstance(req_ids, list) else "req_ids must be a sequence"
        with pytest.raises(OmniPrefixCacheUnmatchError, match=phrase):
            m.materialize(step, req_ids)
        _unchanged(m, before)
        assert torch.equal(m.materialize(step, ["A"]).hidden_states["A"], rows[:2])  # still unconsumed (I4)
    finally:
        m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_a_sparse_slot_mapping_is_refused_before_anything_is_claimed(eager: bool) -> None:
    m = manager(eager)
    try:
        m.new_step_starts(PrefixCacheStep((started("A"),), {"A": 2}))
        sparse = slots([3], 0, 2).to_sparse()
        layout = PrefixCacheWriteLayout.packed([("A", 0, 2)], sparse)
        assert layout.slots_cpu.layout is torch.sparse_coo  # kept as given, never coerced
        before = m.stats()
        with pytest.raises(OmniPrefixCacheUnmatchError, match=f"{PHRASE_SLOT_MAPPING}.*layout torch.sparse_coo"):
            m.save_outputs(truth("A", range(2)), {}, num_tokens_unpadded=2, num_tokens_padded=2,
                           write_layout=layout)
        _unchanged(m, before)
        step, rows = save(m, [("A", [3], 0, 2)])
        assert torch.equal(m.materialize(step, ["A"]).hidden_states["A"], rows)
    finally:
        m.shutdown()


@dataclass(frozen=True)
class _Loose:  # not a PrefixCacheWrite: the save checks it and keeps a PrefixCacheWrite of it
    req_id: Any
    row_start: int
    row_end: int
    token_start: int
    token_end: int


@pytest.mark.parametrize(("write", "says"), [
    (_Loose(["A"], 0, 2, 0, 2), f"unhashable request id: the {PHRASE_SLOT_MAPPING}"),
    # checked as a PrefixCacheWrite is: rows and positions of one length, no negative position
    (_Loose("A", 0, 2, -10, 90), "of the layout is refused: PrefixCacheWrite 'A': rows"),
    (_Loose("A", 0, 2, -2, 0), "of the layout is refused: PrefixCacheWrite 'A': rows"),
])
def test_a_duck_typed_write_that_is_no_valid_write_is_refused(write: Any, says: str) -> None:
    m = manager()
    try:
        m.new_step_starts([started("A")])
        layout = PrefixCacheWriteLayout((write,), 2, slots([0], 0, 2))
        before = m.stats()
        with pytest.raises(OmniPrefixCacheUnmatchError, match=re.escape(says)):
            m.save_outputs(truth("A", range(2)), {}, num_tokens_unpadded=2, num_tokens_padded=2, write_layout=layout)
        _unchanged(m, before)
        step, rows = save(m, [("A", [0], 0, 2)])
        assert torch.equal(m.materialize(step, ["A"]).hidden_states["A"], rows)
    finally:
        m.shutdown()


def test_a_layout_without_a_slot_mapping_is_refused_naming_it_missing() -> None:
    """A layout without a slot mapping is refused at the door, naming what it got; nothing is claimed.

    A layout built without ``slots_cpu`` (or whose mapping was replaced by
    another object) is refused at the door, naming what it got, and nothing is claimed.

    Kills the mutant: ``validation:check_slot_mapping:del_assign:35af84af`` (no problem noted for a
    mapping that is not a tensor).

    A layout without a slot mapping is refused at the door, naming what it got; nothing is claimed."""
    m = manager()
    try:
        m.new_step_starts(PrefixCacheStep((started("A"),), {"A": 2}))
        before = m.stats()
        for mapping, says in ((None, "slots_cpu is missing"), ([0, 1], "slots_cpu is a list, not a tensor")):
            layout = PrefixCacheWriteLayout.packed([("A", 0, 2)], slots([0], 0, 2))
            object.__setattr__(layout, "slots_cpu", mapping)  # past the constructor's conversion
            with pytest.raises(OmniPrefixCacheUnmatchError, match=f"{PHRASE_SLOT_MAPPING}.*{says}"):
                m.save_outputs(truth("A", range(2)), {}, num_tokens_unpadded=2, num_tokens_padded=2,
                               write_layout=layout)
            _unchanged(m, before)
    finally:
        m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_a_request_outside_a_step_of_ids_of_mixed_types_is_refused_by_name(eager: bool) -> None:
    """Request ids need only be hashable: a step of a str and an int id names them in the refusal
    of a request outside it (not a TypeError from ordering them) and consumes nothing (I4)."""
    m = manager(eager)
    try:
        m.new_step_starts([started("a"), started(7)])
        step, rows = save(m, [("a", [0], 0, 2), (7, [1], 0, 1)], tag_of={7: "b"})
        with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"{PHRASE_OUTSIDE_SNAPSHOT}.*\['a', 7\]"):
            m.materialize(step, ["zzz"])
        assert torch.equal(m.materialize(step, ["a"]).hidden_states["a"], rows[:2])  # still unconsumed (I4)
    finally:
        m.shutdown()


class _MutableWrite:
    """A write-like object the engine keeps and may change after the save (duck-typed writes are accepted)."""

    def __init__(self, req_id: str, row_start: int, row_end: int, token_start: int, token_end: int) -> None:
        self.req_id, self.row_start, self.row_end = req_id, row_start, row_end
        self.token_start, self.token_end = token_start, token_end


@pytest.mark.parametrize("eager", MODES)
def test_a_duck_typed_write_changed_after_the_save_changes_nothing_served(eager: bool) -> None:
    """I4: materialize reads the rows the save snapshotted. A duck-typed write the caller changes
    after the save must not widen a request's rows into a reused staging page (another step's
    stale rows) nor swap two requests' rows."""
    m = manager(eager=eager, staging_depth=1)  # one staging page: step 2 reuses step 1's
    try:
        m.new_step_starts([started("X")])
        step, _ = save(m, [("X", [1, 2], 0, 8)])
        m.materialize(step, ["X"])
        m.new_step_starts([started("A"), started("B")])
        wa, wb = _MutableWrite("A", 0, 2, 0, 2), _MutableWrite("B", 2, 4, 0, 2)
        layout = PrefixCacheWriteLayout((wa, wb), 4, torch.cat([slots([3], 0, 2), slots([4], 0, 2)]))  # type: ignore[arg-type]
        hidden = torch.cat([truth("A", range(2)), truth("B", range(2))])
        step = m.save_outputs(hidden, {}, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)
        wb.row_end, wb.token_end = 8, 6  # past the step's rows: step 1's rows in the reused page
        wa.row_start, wa.row_end = 2, 4  # B's rows
        out = m.materialize(step, ["B", "A"]).hidden_states
        assert torch.equal(out["B"], truth("B", range(2))) and torch.equal(out["A"], truth("A", range(2)))
    finally:
        m.shutdown()
