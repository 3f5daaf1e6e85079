"""Tests that kill survivors of the fresh sample ``tools/ast_mutants.py --seed 14``.

Each was checked by applying its mutant to a copy
(``tools/ast_mutants.py [--modules events] --only ID --tests FILE``) and seeing it fail.

Invariants touched: I12 (request identity: a first admission is generation 0, so a
replacement is newer), the layout types' refusal of malformed spans and their int64 slot
mapping, the adapter's set of preempted ids (live ids only), and the CUDA compute event the
copy stream waits on (the device->host copy must not start before the forward's writes).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cache_helpers import manager, save, slots, started

from omni_cache import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheSchedulerAdapter,
    PrefixCacheWriteLayout,
)
from omni_cache.block_pool import PrefixBlockPool
from omni_cache.copier import CopyEngine
from omni_cache.events import PrefixCacheRequestOwner, PrefixCacheWrite
from omni_cache.tenancy import SlotTenancy


# ---- I12: a first admission is generation 0 ----------------------------------------------
def test_a_first_admission_is_older_than_its_first_replacement() -> None:
    """Mutant: ``events:PrefixCacheRequestOwner:int_off:ee162ae5`` (``generation`` default 0 -> 1)."""
    first = PrefixCacheRequestOwner(5)
    replaced = PrefixCacheRequestOwner(5, 1)
    assert first.generation == 0, "a first admission must start at generation 0"
    assert first < replaced, "the first replacement of an admission must compare newer than it (I12)"


# ---- a span with a negative row start is refused at construction ------------------------
def test_a_write_span_starting_before_row_zero_is_refused() -> None:
    """Mutant: ``events:PrefixCacheWrite.__post_init__:int_off:39e2da9e`` (``0 <=`` -> ``-1 <=``)."""
    with pytest.raises(ValueError, match="bad rows"):
        PrefixCacheWrite("a", -1, 3, 0, 4)
    PrefixCacheWrite("a", 0, 4, 0, 4)  # row 0 itself is fine


# ---- an empty list of slots becomes an int64 mapping -------------------------------------
def test_an_empty_slot_list_becomes_an_int64_mapping() -> None:
    """Mutant: ``events:PrefixCacheWriteLayout.__post_init__:int_off:ee162ae5`` (``numel() == 0`` -> ``== 1``).

    ``torch.as_tensor([])`` is float32; without the cast a zero-token step's empty
    mapping would be kept as floats and refused as malformed by ``save_outputs``.
    """
    layout = PrefixCacheWriteLayout((), 0, [])
    assert layout.slots_cpu is not None and layout.slots_cpu.dtype == torch.int64
    assert layout.slots_cpu.numel() == 0
    one = PrefixCacheWriteLayout((PrefixCacheWrite("a", 0, 1, 0, 1),), 1, [7])
    assert one.slots_cpu.dtype == torch.int64 and one.slots_cpu.tolist() == [7]


# ---- the adapter forgets a preempted id when it ends -------------------------------------
def _so(new=(), finished=(), scheduled=None, **extra):  # type: ignore[no-untyped-def]
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=None,
                           num_scheduled_tokens=dict(scheduled or {}), finished_req_ids=set(finished), **extra)


def _new(req: str) -> SimpleNamespace:
    return SimpleNamespace(req_id=req, num_computed_tokens=0, block_ids=([],))


@pytest.mark.parametrize("how", ["finished", "aborted"])
def test_a_preempted_request_that_ends_is_no_longer_preempted(how: str) -> None:
    """Mutant: ``adapter:...translate_scheduler_output:del_call:7c1a06ae`` (the terminal
    ``self._preempted.discard(req_id)`` deleted: the ended id stays "preempted" forever)."""
    a = PrefixCacheSchedulerAdapter()
    a.translate_step(_so(new=[_new("v"), _new("w")], scheduled={"v": 4, "w": 4}))
    a.translate_step(_so(preempted_req_ids={"v", "w"}))
    assert a.preempted_req_ids == {"v", "w"}
    a.translate_step(_so(finished={"v"}) if how == "finished" else _so(aborted_req_ids={"v"}))
    assert "v" not in a.live_req_ids
    assert a.preempted_req_ids == {"w"}, "an ended request is still reported preempted (not live)"


# ---- CUDA: the compute event is recorded on the compute stream --------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_the_compute_event_covers_work_queued_before_it() -> None:
    """Mutant: ``copier:CopyEngine.record_compute_event:del_call:42299636`` (``event.record`` deleted).

    An event never recorded reports complete at once; one recorded behind a long kernel
    does not, so the copy stream waiting on it would not wait for the forward.
    """
    engine = CopyEngine(use_cuda=True, chunk_bytes=1 << 20)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning on the compute stream
    event = engine.record_compute_event()
    assert not event.query(), "the compute event completed before the work queued ahead of it"
    event.synchronize()
    assert event.query()


# ---- I9: shutdown stops the committer once the queue is drained ---------------------------
def test_shutdown_stops_the_committer_thread_after_draining() -> None:
    """Mutant: ``copier:Committer._run:cmp_flip:419aef94`` (``queue_length() == 0`` -> ``!= 0``:
    the closed committer spins on an empty queue forever and ``stop`` gives up after its timeout)."""
    m = manager(False)
    assert m.committer.alive
    m.new_step_starts([started("a")])
    step, rows = save(m, [("a", [0], 0, 4)])
    m.discard_step(step)
    t0 = time.monotonic()
    m.shutdown()
    assert not m.committer.alive, "the committer thread is still running after shutdown (I9)"
    assert time.monotonic() - t0 < 5.0, "shutdown waited out the committer's stop timeout"
    (key,) = m.pool.keys()
    assert torch.equal(m.pool.rows(key, slots([0], 0, 4)), rows), "the queued write did not land"


# ---- I5/I12: an ended request's untaken hit is dropped ------------------------------------
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_an_ended_requests_untaken_hit_is_never_served(eager: bool) -> None:
    """Mutant: ``manager:OmniPrefixCacheManager.new_step_starts:del_call:a9b43551`` (the ``end``
    op's ``self._hits.drop(req_id)`` deleted: the hit stays pending after FINISHED)."""
    m = manager(eager)
    try:
        m.new_step_starts([started("x")])
        step, _ = save(m, [("x", [0, 1], 0, 8)])
        m.discard_step(step)
        m.new_step_starts([started("a", 8, [0, 1], 4)])  # a hit of 8, never taken by a save
        m.new_step_starts([PrefixCacheRequestEvent("a", PrefixCacheEventKind.FINISHED)])
        # The id's next rows start afresh at 0: no hit of the ended request continues into them.
        step, rows = save(m, [("a", [2], 0, 4)])
        out = m.materialize(step, ["a"])
        assert torch.equal(out.hidden_states["a"], rows), "an ended request's pending hit was served"
    finally:
        m.shutdown()


# ---- I7: the preserved-rows counter counts rows --------------------------------------------
def test_the_preserved_rows_total_counts_each_row_kept_for_a_pin() -> None:
    """Mutant: ``tenancy:SlotTenancy._preserve_locked:int_off:d559aa41`` (the total grows by 2 a row)."""
    ten = SlotTenancy(PrefixBlockPool(8))
    slots_np = np.array([2, 3], dtype=np.int64)
    ten.register(["k"], slots_np, 1, step_id=11)
    ten.land_all({"k": torch.full((2, 3), 1.0)}, torch.from_numpy(slots_np), 1)
    plan = ten.plan(["k"], torch.from_numpy(slots_np))  # pins version 1 of both slots
    ten.register(["k"], slots_np, 2, step_id=12)
    ten.land_all({"k": torch.full((2, 3), 2.0)}, torch.from_numpy(slots_np), 2)  # overwrites the pinned rows
    assert ten.num_preserved_total == 2, "two pinned rows were preserved before the overwrite"
    assert torch.equal(ten.read("k", plan, what="r"), torch.full((2, 3), 1.0))
    ten.unplan(plan)
