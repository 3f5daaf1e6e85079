"""PrefixCacheSchedulerAdapter over fakes that mirror vLLM's SchedulerOutput.

Checks the event translation rules, in the reference's order (controls, new, resumed then other cached requests, terminal last;
STARTED / EXTENDED / RESUMED / FINISHED / ABORTED, never an inferred abort,
re-STARTED after a terminal in the same step), that events and layouts are
immutable snapshots (I4's input; I5's block ids are copied), and that the write
layout packs rows in batch order with the view's slots, zero-row writes for
idle requests.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fakes_vllm import CachedRequestData, NewRequestData, OmniSchedulerOutput, SchedulerOutput

from omni_cache import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheSchedulerAdapter,
    PrefixCacheStep,
)
from omni_cache.integration import BlockTableView

K = PrefixCacheEventKind


def _so(new=(), cached=None, scheduled=None, finished=(), aborted=None) -> SchedulerOutput:
    scheduled = dict(scheduled or {})
    common = dict(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=set(finished),
    )
    if aborted is None:
        return SchedulerOutput(**common)
    return OmniSchedulerOutput(**common, aborted_req_ids=set(aborted))


def _cached(rows, resumed=()) -> CachedRequestData:
    """rows: (req_id, num_computed_tokens, new_block_ids, num_output_tokens)."""
    return CachedRequestData(
        req_ids=[r[0] for r in rows],
        resumed_req_ids=set(resumed),
        new_token_ids=[[] for _ in rows],
        all_token_ids={},
        new_block_ids=[r[2] for r in rows],
        num_computed_tokens=[r[1] for r in rows],
        num_output_tokens=[r[3] for r in rows],
    )


def _kinds(events) -> list[tuple[str, PrefixCacheEventKind]]:
    return [(e.req_id, e.kind) for e in events]


def test_new_request_is_started_with_its_hit_and_blocks() -> None:
    a = PrefixCacheSchedulerAdapter()
    so = _so(new=[NewRequestData("r1", [1] * 40, ([3, 4, 5],), 32)], scheduled={"r1": 8})
    (ev,) = a.translate_scheduler_output(so)
    assert ev == PrefixCacheRequestEvent("r1", K.STARTED, 0, 32, ((3, 4, 5),), scheduled_tokens=8)


def test_request_id_field_and_flat_block_ids_are_accepted() -> None:
    class OlderNewRequest:  # request_id instead of req_id, flat block ids
        def __init__(self) -> None:
            self.request_id = "r9"
            self.num_computed_tokens = 16
            self.block_ids = np.array([7, 8], dtype=np.int64)

    (ev,) = PrefixCacheSchedulerAdapter().translate_scheduler_output(
        _so(new=[OlderNewRequest()], scheduled={"r9": 4})
    )
    assert (ev.req_id, ev.kind, ev.hit_end, ev.block_ids) == ("r9", K.STARTED, 16, ((7, 8),))
    assert all(type(b) is int for b in ev.block_ids[0])


def test_per_group_block_ids_keep_every_group() -> None:
    (ev,) = PrefixCacheSchedulerAdapter().translate_scheduler_output(
        _so(new=[NewRequestData("r", [1], ([1, 2], [9]), 0)], scheduled={"r": 1})
    )
    assert ev.block_ids == ((1, 2), (9,))
    assert ev.group0_block_ids == (1, 2)


def test_new_request_without_an_id_raises() -> None:
    class NoId:
        num_computed_tokens = 0
        block_ids = ()

    with pytest.raises(ValueError, match="neither req_id nor request_id"):
        PrefixCacheSchedulerAdapter().translate_scheduler_output(_so(new=[NoId()]))


def test_a_live_id_sent_as_new_again_is_extended() -> None:
    # As the reference: EXTENDED carries num_computed_tokens as hit_end; the manager reads it only
    # as the delayed first lookup of a new owner (I12), never as a hit of a live admission.
    a = PrefixCacheSchedulerAdapter()
    a.translate_scheduler_output(_so(new=[NewRequestData("r", [1] * 20, ([1],), 0)], scheduled={"r": 16}))
    (ev,) = a.translate_scheduler_output(_so(new=[NewRequestData("r", [1] * 20, ([1, 2],), 16)], scheduled={"r": 4}))
    assert (ev.kind, ev.hit_start, ev.hit_end, ev.scheduled_tokens) == (K.EXTENDED, 0, 16, 4)


def test_cached_requests_are_extended_or_resumed() -> None:
    a = PrefixCacheSchedulerAdapter()
    a.translate_scheduler_output(
        _so(new=[NewRequestData("x", [1], ([1],), 0), NewRequestData("y", [1], ([2],), 0)], scheduled={"x": 1, "y": 1})
    )
    so = _so(
        cached=_cached([("x", 17, ([5],), 1), ("y", 32, ([6, 7, 8],), 3)], resumed={"y"}),
        scheduled={"x": 1, "y": 2},
    )
    ry, ex = a.translate_scheduler_output(so)  # resumed first, as the reference
    assert ex == PrefixCacheRequestEvent("x", K.EXTENDED, 0, 17, ((5,),), 1, 1)
    assert ry == PrefixCacheRequestEvent("y", K.RESUMED, 0, 32, ((6, 7, 8),), 2, 3)


def test_cached_rows_given_as_arrays_are_read_as_lists_are() -> None:
    """A producer that hands numpy arrays for the per-row fields (an array has no truth value) gets
    the same events as one that hands lists."""
    def step(as_array: bool) -> tuple[PrefixCacheRequestEvent, ...]:
        a = PrefixCacheSchedulerAdapter()
        a.translate_scheduler_output(_so(new=[NewRequestData("x", [1], ([1],), 0), NewRequestData("y", [1], ([2],), 0)],
                                         scheduled={"x": 1, "y": 1}))
        cached = _cached([("x", 17, None, 1), ("y", 32, ([6],), 3)])
        if as_array:
            cached.req_ids = np.array(cached.req_ids)
            cached.num_computed_tokens = np.array(cached.num_computed_tokens)
            cached.num_output_tokens = np.array(cached.num_output_tokens)
        return a.translate_scheduler_output(_so(cached=cached, scheduled={"x": 1, "y": 1}))

    assert step(as_array=True) == step(as_array=False)
    assert [e.hit_end for e in step(as_array=True)] == [17, 32]


def test_older_resumed_from_preemption_flags_are_read() -> None:
    class OlderCached:
        def __init__(self) -> None:
            self.req_ids = ["a", "b"]
            self.resumed_from_preemption = [False, True]
            self.num_computed_tokens = [5, 16]
            self.new_block_ids = [None, ([4, 9],)]

    eb, ea = PrefixCacheSchedulerAdapter().translate_scheduler_output(
        _so(cached=OlderCached(), scheduled={"a": 1, "b": 3})
    )
    assert (ea.kind, ea.block_ids, ea.num_output_tokens, ea.hit_end) == (K.EXTENDED, (), 0, 5)
    assert (eb.kind, eb.hit_end, eb.block_ids) == (K.RESUMED, 16, ((4, 9),))


def test_cached_rows_shorter_than_their_ids_read_as_a_miss() -> None:
    # The reference reads missing per-request entries as 0 / no blocks.
    short = _cached([("a", 1, None, 0), ("r", 8, ([4, 5],), 2)], resumed={"r"})
    short.num_computed_tokens = [1]
    short.new_block_ids = [None]
    short.num_output_tokens = []
    er, ea = PrefixCacheSchedulerAdapter().translate_scheduler_output(_so(cached=short))
    assert (er.req_id, er.kind, er.hit_end, er.block_ids, er.num_output_tokens) == ("r", K.RESUMED, 0, (), 0)
    assert (ea.req_id, ea.kind, ea.hit_end) == ("a", K.EXTENDED, 1)


def test_terminal_events_come_last_and_abort_is_reported_once() -> None:
    a = PrefixCacheSchedulerAdapter()
    so = _so(
        new=[NewRequestData("n", [1], ([1],), 0)],
        scheduled={"n": 1},
        finished={"f", "ab"},
        aborted={"ab", "only_aborted"},
    )
    assert _kinds(a.translate_scheduler_output(so)) == [
        ("n", K.STARTED),
        ("ab", K.ABORTED),
        ("f", K.FINISHED),
        ("only_aborted", K.ABORTED),
    ]


def test_abort_is_never_inferred_without_the_field() -> None:
    a = PrefixCacheSchedulerAdapter()
    so = _so(finished={"r"})
    assert not hasattr(so, "aborted_req_ids")
    assert _kinds(a.translate_scheduler_output(so)) == [("r", K.FINISHED)]


def test_terminal_and_new_in_one_step_is_started_again() -> None:
    a = PrefixCacheSchedulerAdapter()
    a.translate_scheduler_output(_so(new=[NewRequestData("r", [1] * 9, ([1],), 0)], scheduled={"r": 9}))
    assert "r" in a.live_req_ids
    events = a.translate_scheduler_output(
        _so(new=[NewRequestData("r", [2] * 9, ([2],), 0)], scheduled={"r": 9}, finished={"r"})
    )
    assert _kinds(events) == [("r", K.STARTED), ("r", K.FINISHED)]  # the manager applies terminals first
    # after a plain finish the id is terminal: the next new request with it starts again
    a.translate_scheduler_output(_so(finished={"r"}))
    assert "r" not in a.live_req_ids
    (ev,) = a.translate_scheduler_output(_so(new=[NewRequestData("r", [2] * 9, ([2],), 0)], scheduled={"r": 9}))
    assert ev.kind is K.STARTED


def test_events_are_snapshots_of_the_scheduler_objects() -> None:
    a = PrefixCacheSchedulerAdapter()
    blocks = [3, 4]
    new = NewRequestData("r", [1] * 40, (blocks,), 32)
    so = _so(new=[new], scheduled={"r": 8})
    step = a.translate_step(so)
    blocks.append(99)
    new.num_computed_tokens = 0
    so.num_scheduled_tokens["r"] = 1000
    (ev,) = step.events
    assert ev.block_ids == ((3, 4),) and ev.hit_end == 32
    assert step.scheduled_tokens == {"r": 8}
    assert isinstance(step, PrefixCacheStep) and list(step) == [ev]
    with pytest.raises(AttributeError):
        ev.hit_end = 0  # type: ignore[misc]


def _view(req_ids, computed, table, block_size=4) -> BlockTableView:
    return BlockTableView(req_ids, computed, torch.tensor(table, dtype=torch.int32), block_size=block_size)


def test_layout_packs_rows_in_batch_order_with_view_slots() -> None:
    a = PrefixCacheSchedulerAdapter()
    view = _view(["b", "a", "idle"], [6, 0, 3], [[7, 2, 6], [5, 0, 0], [9, 0, 0]])
    layout = a.build_write_layout(view, num_scheduled_tokens={"a": 3, "b": 3})
    assert [(w.req_id, w.row_start, w.row_end, w.token_start, w.token_end) for w in layout.writes] == [
        ("b", 0, 3, 6, 9),
        ("a", 3, 6, 0, 3),
        ("idle", 6, 6, 3, 3),  # a zero-row write: rows do not advance
    ]
    assert layout.total_rows == 6
    # b: p6, p7 in its 2nd block (2) -> 10, 11; p8 in its 3rd block (6) -> 24; a: block 5 -> 20..22
    assert layout.slots_cpu.tolist() == [10, 11, 24, 20, 21, 22]
    assert layout.slots_cpu.dtype == torch.int64


def test_layout_accepts_per_row_counts_and_keeps_idle_rows_as_zero_row_writes() -> None:
    a = PrefixCacheSchedulerAdapter()
    view = _view(["x", "y"], [0, 4], [[1, 0], [2, 3]])
    layout = a.build_write_layout(view, num_scheduled_tokens=np.array([0, 2]))
    assert layout.req_ids == ("x", "y") and layout.writes[0].num_rows == 0
    assert layout.slots_cpu.tolist() == [12, 13]
    with pytest.raises(ValueError, match="3 per-row counts for a batch of 2"):
        a.build_write_layout(view, num_scheduled_tokens=[1, 1, 1])
    with pytest.raises(ValueError, match="negative token count"):
        a.build_write_layout(view, num_scheduled_tokens=[-1, 0])


def test_layout_refuses_a_scheduled_request_missing_from_the_view() -> None:
    view = _view(["x"], [0], [[1]])
    with pytest.raises(ValueError, match=r"requests \['ghost'\] are scheduled but not in the block-table view"):
        PrefixCacheSchedulerAdapter().build_write_layout(view, num_scheduled_tokens={"x": 1, "ghost": 2})


def test_layout_is_a_snapshot_of_the_view() -> None:
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    computed = np.array([0], dtype=np.int32)
    view = BlockTableView(["x"], computed, table, block_size=4)
    layout = PrefixCacheSchedulerAdapter().build_write_layout(view, num_scheduled_tokens={"x": 5})
    table.fill_(7)
    computed[0] = 3
    assert layout.slots_cpu.tolist() == [4, 5, 6, 7, 8]


# ---- the adapter: a new request without num_computed_tokens is a miss --------------------
def test_a_new_request_without_num_computed_tokens_is_a_miss() -> None:
    """A new request that carries no ``num_computed_tokens`` is a miss: the adapter reads the default 0,
    never a hit.

    Kills the mutant: ``getattr(new_req, "num_computed_tokens", 0)`` -> default 1.

    A new request that carries no ``num_computed_tokens`` is a miss: the adapter reads the default 0,
    never a hit."""

    bare = SimpleNamespace(req_id="r", block_ids=([3, 4],))  # no num_computed_tokens at all
    output = SimpleNamespace(scheduled_new_reqs=[bare], scheduled_cached_reqs=None,
                             num_scheduled_tokens={"r": 8}, finished_req_ids=set())
    (event,) = PrefixCacheSchedulerAdapter().translate_scheduler_output(output)
    assert (event.kind, event.hit_start, event.hit_end) == (PrefixCacheEventKind.STARTED, 0, 0)
    assert event.group0_block_ids == (3, 4)


# ---- the adapter forgets a preempted id when it ends -------------------------------------
def _namespace_so(new=(), finished=(), scheduled=None, **extra):  # type: ignore[no-untyped-def]
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=None,
                           num_scheduled_tokens=dict(scheduled or {}), finished_req_ids=set(finished), **extra)


def _namespace_new(req: str) -> SimpleNamespace:
    return SimpleNamespace(req_id=req, num_computed_tokens=0, block_ids=([],))


@pytest.mark.parametrize("how", ["finished", "aborted"])
def test_a_preempted_request_that_ends_is_no_longer_preempted(how: str) -> None:
    """A preempted request that finishes or aborts leaves the adapter's preempted set: its id is never
    resumed afterwards.

    Kills the mutant: ``adapter:...translate_scheduler_output:del_call:7c1a06ae`` (the terminal
    ``self._preempted.discard(req_id)`` deleted: the ended id stays "preempted" forever).

    A preempted request that finishes or aborts leaves the adapter's preempted set: its id is never
    resumed afterwards."""
    a = PrefixCacheSchedulerAdapter()
    a.translate_step(_namespace_so(new=[_namespace_new("v"), _namespace_new("w")], scheduled={"v": 4, "w": 4}))
    a.translate_step(_namespace_so(preempted_req_ids={"v", "w"}))
    assert a.preempted_req_ids == {"v", "w"}
    a.translate_step(_namespace_so(finished={"v"}) if how == "finished" else _namespace_so(aborted_req_ids={"v"}))
    assert "v" not in a.live_req_ids
    assert a.preempted_req_ids == {"w"}, "an ended request is still reported preempted (not live)"
