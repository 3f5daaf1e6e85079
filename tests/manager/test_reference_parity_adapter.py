"""Reference parity, the scheduler adapter: the reference's ``tests/core/test_prefix_cache_adapter.py``.

The vLLM-Omni prefix cache's public-API adapter tests, rewritten, run against omni-cache's
``PrefixCacheSchedulerAdapter`` through the renaming shim (tests/manager/reference_parity_shim.py;
the port, its shim and what is not ported: tests/manager/test_reference_parity.py). Events are
explicit frozen values, resume and abort come only from their own fields, a resumed event copies
(snapshots) its row of the cached payload, an id terminal and new in one step is started then
extended, and a write layout follows the view's batch order and slots, keeping zero-token
requests without advancing rows. Owners: a replacement control comes before the delayed lookup, a cached extension carries
its owner, a terminal names the old admission of a reused id, a stale lookup or terminal leaves
the current owner, and a replayed step changes nothing the adapter saw. Where omni-cache
deliberately differs (the layout's ``slots_cpu`` is a private copy; ``spec/contract.md``
section 13) the reference's expectation is a strict xfail.

Invariants touched: I12, I13 (as the reference's tests do).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from reference_parity_shim import K, new_req
from vllm_omni.core.prefix_cache.adapter import (
    PrefixCacheRequestEvent,
    PrefixCacheRequestOwner,
    PrefixCacheSchedulerAdapter,
)


class OrderView:
    """A reference-protocol view over a fixed batch ``b`` (from position 12), ``a`` (from 7)."""

    def __init__(self, slots: torch.Tensor | None = None) -> None:
        self.slots = torch.tensor([20, 21, 7], dtype=torch.long) if slots is None else slots
        self.calls: list[tuple[list[str], object]] = []

    def batch_req_ids(self):
        return ["b", "a"]

    def token_range(self, req_id, n):
        start = {"b": 12, "a": 7}[req_id]
        return start, start + n

    def step_slots_cpu(self, req_ids, counts):
        self.calls.append((list(req_ids), counts))
        return self.slots


def sched(*, new=(), resumed=(), finished=(), aborted=(), cached=None, **extra):
    """A scheduler output shaped as the reference's tests build it."""
    cached = cached or {}
    out = SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            resumed_req_ids=set(resumed),
            req_ids=list(cached.get("req_ids", resumed)),
            num_computed_tokens=list(cached.get("num_computed_tokens", ())),
            new_block_ids=list(cached.get("new_block_ids", ())),
            num_output_tokens=list(cached.get("num_output_tokens", ())),
        ),
        finished_req_ids=set(finished),
        aborted_req_ids=set(aborted),
    )
    for key, value in extra.items():
        setattr(out, key, value)
    return out


def test_events_are_explicit_frozen_values_and_a_live_new_id_extends() -> None:
    adapter = PrefixCacheSchedulerAdapter()
    (first,) = adapter.translate_scheduler_output(sched(new=[new_req("a", 4, [[2]])]))
    assert first == PrefixCacheRequestEvent("a", K.STARTED, 0, 4, ((2,),))
    with pytest.raises(AttributeError):
        first.req_id = "b"  # type: ignore[misc]
    (second,) = adapter.translate_scheduler_output(sched(new=[new_req("a")]))
    assert second.kind is K.EXTENDED


def test_resume_and_abort_come_only_from_their_fields() -> None:
    adapter = PrefixCacheSchedulerAdapter()
    events = adapter.translate_scheduler_output(sched(resumed={"r"}, finished={"f"}, aborted={"a"}))
    assert [(e.req_id, e.kind) for e in events] == [("r", K.RESUMED), ("a", K.ABORTED), ("f", K.FINISHED)]
    (event,) = adapter.translate_scheduler_output(sched(finished={"x"}))
    assert event.kind is K.FINISHED


def test_without_the_abort_field_a_finish_is_never_an_abort() -> None:
    out = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=None, finished_req_ids={"done"},
                          num_scheduled_tokens={})
    events = PrefixCacheSchedulerAdapter().translate_scheduler_output(out)
    assert [(e.req_id, e.kind) for e in events] == [("done", K.FINISHED)]


def test_resumed_event_copies_its_row_of_the_cached_payload() -> None:
    events = PrefixCacheSchedulerAdapter().translate_scheduler_output(sched(
        resumed={"r"},
        cached={"req_ids": ["other", "r"], "num_computed_tokens": [3, 8], "new_block_ids": [[[1]], [[4, 5]]],
                "num_output_tokens": [1, 6]},
    ))
    event = events[0]
    assert (event.kind, event.req_id, event.hit_start, event.hit_end) == (K.RESUMED, "r", 0, 8)
    assert (event.block_ids, event.scheduled_tokens, event.num_output_tokens) == (((4, 5),), 0, 6)


def test_resumed_blocks_are_a_snapshot() -> None:
    blocks = [[7, 8]]
    (event,) = PrefixCacheSchedulerAdapter().translate_scheduler_output(
        sched(resumed={"r"}, cached={"req_ids": ["r"], "new_block_ids": [blocks], "num_computed_tokens": [8]}))
    blocks[0][0] = 99
    assert event.block_ids == ((7, 8),)


def test_an_id_terminal_and_new_in_one_step_is_started_then_extended() -> None:
    adapter = PrefixCacheSchedulerAdapter()
    adapter.translate_scheduler_output(sched(new=[new_req("r")]))
    events = adapter.translate_scheduler_output(sched(new=[new_req("r")], finished={"r"}))
    assert [e.kind for e in events] == [K.STARTED, K.FINISHED]
    assert [e.kind for e in adapter.translate_scheduler_output(sched(new=[new_req("r")]))] == [K.EXTENDED]
    (event,) = adapter.translate_scheduler_output(sched(new=[new_req("r", 8)]))
    assert event.kind is K.EXTENDED


def test_layout_follows_the_views_batch_order_and_slots() -> None:
    layout = PrefixCacheSchedulerAdapter().build_write_layout(OrderView(), num_scheduled_tokens={"b": 2, "a": 1})
    assert layout.total_rows == 3
    assert [(w.req_id, w.row_start, w.row_end, w.token_start, w.token_end) for w in layout.writes] == [
        ("b", 0, 2, 12, 14), ("a", 2, 3, 7, 8)]
    assert torch.equal(layout.slots_cpu, torch.tensor([20, 21, 7]))
    with pytest.raises(AttributeError):
        layout.writes = ()  # type: ignore[misc]


@pytest.mark.parametrize("scheduled", [{}, {"a": 1}])
def test_layout_keeps_zero_token_requests_without_advancing_rows(scheduled) -> None:
    view = OrderView(torch.arange(sum(scheduled.values())))
    layout = PrefixCacheSchedulerAdapter().build_write_layout(view, num_scheduled_tokens=scheduled)
    n = len(view.slots)
    assert layout.total_rows == n and torch.equal(layout.slots_cpu, view.slots)
    assert [(w.req_id, w.row_start, w.row_end, w.token_start, w.token_end) for w in layout.writes] == [
        ("b", 0, 0, 12, 12), ("a", 0, n, 7, 7 + n)]
    assert view.calls == [(["b", "a"], scheduled)]


@pytest.mark.xfail(strict=True, reason="difference (contract section 13): slots_cpu is a private copy")
def test_reference_layout_shares_the_views_slot_tensor() -> None:
    view = OrderView(torch.arange(1))
    assert PrefixCacheSchedulerAdapter().build_write_layout(view, num_scheduled_tokens={"a": 1}).slots_cpu is view.slots


def test_a_replacement_control_comes_before_the_delayed_lookup() -> None:
    adapter = PrefixCacheSchedulerAdapter()
    owner = PrefixCacheRequestOwner(1, 2)
    control = PrefixCacheRequestEvent("a", K.REPLACED, owner=owner, lookup_complete=False)
    step = adapter.translate_step(sched(prefix_cache_replacements=(control,), prefix_cache_step_sequence=1))
    assert step.sequence == 1 and step.events == (control,) and not step.scheduled_tokens
    (event,) = adapter.translate_scheduler_output(
        sched(new=[new_req("a", 0, [[2]])], prefix_cache_owners={"a": owner}))
    assert event.kind is K.EXTENDED and event.owner == owner
    assert event.lookup_complete and event.hit_end == 0


def test_a_cached_extension_carries_its_owner_and_the_delayed_lookup() -> None:
    owner = PrefixCacheRequestOwner(1, 1)
    (event,) = PrefixCacheSchedulerAdapter().translate_scheduler_output(sched(
        cached={"req_ids": ["a"], "num_computed_tokens": [8], "new_block_ids": [[[3, 4]]]},
        prefix_cache_owners={"a": owner}))
    assert (event.kind, event.owner, event.hit_end, event.block_ids) == (K.EXTENDED, owner, 8, ((3, 4),))


def test_a_terminal_names_the_old_admission_when_the_id_is_reused() -> None:
    adapter = PrefixCacheSchedulerAdapter()
    adapter.translate_step(sched(new=[new_req("a")], prefix_cache_owners={"a": PrefixCacheRequestOwner(1)}))
    events = adapter.translate_step(sched(new=[new_req("a")], finished=["a"],
                                          prefix_cache_owners={"a": PrefixCacheRequestOwner(2)})).events
    assert events[0].owner == PrefixCacheRequestOwner(2) and events[-1].owner == PrefixCacheRequestOwner(1)


def test_a_replayed_step_does_not_change_what_the_adapter_saw() -> None:
    adapter = PrefixCacheSchedulerAdapter()
    first = sched(new=[new_req("a")], prefix_cache_step_sequence=1,
                  prefix_cache_owners={"a": PrefixCacheRequestOwner(1)})
    adapter.translate_step(first)
    adapter.translate_step(sched(finished=["a"], prefix_cache_step_sequence=2))
    assert adapter.translate_step(first).events == ()
    assert adapter.translate_scheduler_output(first)[0].kind is K.STARTED


def test_a_stale_lookup_and_terminal_leave_the_current_owner() -> None:
    adapter = PrefixCacheSchedulerAdapter()
    admitted = sched(new=[new_req("a")], prefix_cache_owners={"a": PrefixCacheRequestOwner(2, 1)})
    adapter.translate_step(admitted)
    stale = sched(new=[new_req("a")], finished=["a"], prefix_cache_owners={"a": PrefixCacheRequestOwner(1)},
                  prefix_cache_terminal_owners={"a": PrefixCacheRequestOwner(1)})
    assert all(e.kind is K.FINISHED for e in adapter.translate_step(stale).events)
    assert adapter.translate_step(admitted).events[0].kind is K.EXTENDED  # still the current owner


@pytest.mark.parametrize("owner", [None, PrefixCacheRequestOwner(1)])
def test_an_ownerless_cached_step_keeps_the_admission_until_its_terminal(owner) -> None:
    adapter = PrefixCacheSchedulerAdapter()
    admitted = sched(new=[SimpleNamespace(req_id="a", num_computed_tokens=0, block_ids=())],
                     prefix_cache_owners={"a": owner} if owner is not None else {})
    assert adapter.translate_step(admitted).events[0].kind is K.STARTED
    assert adapter.translate_step(sched(cached={"req_ids": ["a"], "num_computed_tokens": [4]})).events[0].kind \
        is K.EXTENDED
    assert adapter.translate_step(admitted).events[0].kind is K.EXTENDED
    terminal = adapter.translate_step(sched(finished=["a"])).events[0]
    assert terminal.kind is K.FINISHED and terminal.owner == owner
    assert adapter.translate_step(admitted).events[0].kind is K.STARTED
