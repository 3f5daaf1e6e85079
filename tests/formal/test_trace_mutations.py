"""Trace validation can fail: runtime mutations that TLC's trace specs reject.

Each test applies one small mutation to the runtime (monkeypatched, undone at
the end), drives it, and checks that the recorded trace is REJECTED by TLC
against the real specs (tla/staging/StagingTrace.tla extends Staging.tla,
tla/writes/WritesTrace.tla extends Writes.tla, tla/tenancy/TenancyTrace.tla
extends Tenancy.tla), while the same run without the mutation is accepted.
Guards I3 (a page is never released under its reader), I9 (writes land in
queue order, an ended request's first) and I7 (no stale tenant).
"""

from __future__ import annotations

import pytest
import torch

from omni_cache.runtime.block_pool import PrefixBlockPool
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.interface import WriteSchedule
from omni_cache.runtime.staging import StagingPool, StagingSlot
from omni_cache.runtime.tenancy import NotLandedYet, PlannedRead, SlotTenancy
from omni_cache.runtime.trace import TraceEvent, TraceRecorder
from omni_cache.runtime.writes import PoolWrite, WriteBook
from omni_cache.verify import check_trace_tlc
from omni_cache.verify.tenancy_trace import check_tenancy_trace_tlc, split_writes, tenancy_trace_data
from omni_cache.verify.testing import require_tlc
from omni_cache.verify.traces import check_writes_trace_tlc, writes_trace_data

pytestmark = pytest.mark.tlc


def _reader_outlives_write() -> list[TraceEvent]:
    """A save whose pool write lands while its consumer still reads the page."""
    rec = TraceRecorder()
    pool = StagingPool(2, 8, 1.0, recorder=rec)
    rows = torch.ones(4, 3)
    slot = pool.claim(4)
    pool.claimed_page(slot, "hidden", rows).copy_(rows)
    pool.hold(slot)
    pool.save(slot, 1, "test:1")
    read = pool.consume(1, caller="materialize")
    pool.unhold(slot)  # the write lands while the consumer reads
    pool.done_reading(read)
    pool.save(pool.claim(2), 2, "test:2")
    pool.done_reading(pool.consume(2, caller="discard_step"))
    return rec.events(notes=True)


def _release_ignoring_reader(self: StagingPool, slot: StagingSlot) -> None:
    """Mutant of StagingPool._release_if_idle_locked: forgets ``not slot.reading``."""
    if slot.state == "materialized" and slot.num_write_holds == 0:
        step_id = slot.step_id
        self.machine.fire(slot, "release", what=f"staging slot {slot.index}", step_id=step_id)
        slot.step_id = None
        slot.num_rows = 0
        self._cond.notify_all()


def test_release_under_a_reader_fails_trace_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    require_tlc()
    good = check_trace_tlc(_reader_outlives_write())
    assert good.accepted, good.explain() + good.output
    monkeypatch.setattr(StagingPool, "_release_if_idle_locked", _release_ignoring_reader)
    events = _reader_outlives_write()
    bad = check_trace_tlc(events)
    assert not bad.accepted, "TLC accepted a trace whose page was released under its reader (I3)"
    assert bad.stuck_at is not None and events[bad.stuck_at].trigger == "release", bad.explain()


def _writes_run() -> list[TraceEvent]:
    """An immediate write queued, then a finished request's two deferred writes pushed to the
    front; the committer lands all three (I9: the finished request's writes first)."""
    rec = TraceRecorder()
    book = WriteBook(1.0, rec)
    slots = torch.arange(2)
    imm = book.register(WriteSchedule.JOIN_NEXT_STEP, 1, slots, {"hidden": torch.ones(2, 3)})
    d1 = book.register(WriteSchedule.JOIN_ON_FINISH, 1, slots, {"mm.a": torch.ones(2, 3)})
    d2 = book.register(WriteSchedule.JOIN_ON_FINISH, 2, slots, {"mm.a": torch.ones(2, 3)})
    book.enqueue([imm])
    book.enqueue([d1, d2], front=True)
    while (write := book.start_next(block=False)) is not None:  # the committer's own take
        for trigger in ("finish_copy", "commit"):
            book.fire(write, trigger)
    return rec.events(notes=True)


def _pop_newest(self: WriteBook, block: bool, timeout_s: float | None) -> PoolWrite | None:
    """Mutant of WriteBook._pop_locked (the committer's take): the newest queued write (lands
    writes out of order)."""
    return self._queue.pop() if self._queue else None


def test_writes_landing_out_of_order_fail_trace_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    require_tlc()
    good = check_writes_trace_tlc(_writes_run())
    assert good.accepted, good.explain() + good.output
    monkeypatch.setattr(WriteBook, "_pop_locked", _pop_newest)
    events = _writes_run()
    bad = check_writes_trace_tlc(events)
    assert not bad.accepted, "TLC accepted a trace whose committer landed the queue's tail first"
    records = [ln for ln in writes_trace_data(events)[0].splitlines() if ln.strip().startswith("[ev")]
    assert bad.result == "deadlock" and bad.stuck_at is not None, bad.explain()
    assert records[bad.stuck_at].strip().startswith('[ev |-> "start_copy", tid |-> 1,'), records[bad.stuck_at]


def _tenancy_run() -> list[TraceEvent]:
    """Step 1 writes KV slots 0 and 1; a hit plans them; step 2 takes slot 1 (reuse) and lands
    before the delayed read, which must serve step 1's rows of slot 1 from the preserved copy."""
    rec = TraceRecorder()
    tenancy = SlotTenancy(PrefixBlockPool(4), rec)
    both, one = torch.tensor([0, 1]), torch.tensor([1])
    tenancy.register(["hidden"], both.numpy(), 1, step_id=1)
    tenancy.land_all({"hidden": torch.full((2, 3), 1.0)}, both, 1)
    hit = tenancy.plan(["hidden"], both)
    tenancy.register(["hidden"], one.numpy(), 2, step_id=2)
    tenancy.land_all({"hidden": torch.full((1, 3), 2.0)}, one, 2)
    rows = tenancy.read("hidden", hit, what="test read")
    tenancy.unplan(hit)
    assert rows.shape == (2, 3)
    return rec.events(notes=True)


def _read_landed(self: SlotTenancy, key: str, read: PlannedRead, *, what: str,
                 settled: object = frozenset()) -> torch.Tensor:
    """Mutant of SlotTenancy.read: serves the landed (newest) rows, ignoring the pinned version
    and the preserved copy -- a stale tenant (I7). It logs what it really served."""
    with self.pool.lock:
        v = self._versions_locked(key)
        current = v.landed[read.slots_np]
        if (current < read.expected[key]).any():
            raise NotLandedYet([])
        tensor = self.pool.tensor_locked(key)
        assert tensor is not None
        if self.recorder is not None:
            self._note("read", None, plan=read.plan_id, key=key, served=tuple(current.tolist()))
        return tensor.index_select(0, read.slots)


def test_serving_a_stale_tenant_fails_trace_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    require_tlc()
    good = check_tenancy_trace_tlc(_tenancy_run())
    assert good.accepted, good.explain() + good.output
    monkeypatch.setattr(SlotTenancy, "read", _read_landed)
    events = _tenancy_run()
    bad = check_tenancy_trace_tlc(events)
    assert not bad.accepted, "TLC accepted a trace whose read served the newer tenant's rows (I7)"
    records = [ln.strip() for ln in tenancy_trace_data(events)[0].splitlines() if ln.strip().startswith("[ev")]
    assert bad.stuck_at is not None and records[bad.stuck_at].startswith('[ev |-> "read", slot |-> 2,'), (
        bad.explain(), records)


def test_a_read_of_an_absent_key_is_traced_as_raised() -> None:
    """A key the slot's tenant did not write raises "is not readable"; the trace says Raised and TLC
    accepts it (NeverSilentMiss along the trace)."""
    require_tlc()
    rec = TraceRecorder()
    tenancy = SlotTenancy(PrefixBlockPool(2), rec)
    slot = torch.tensor([0])
    tenancy.register(["hidden", "mm.a"], slot.numpy(), 1, step_id=1)
    tenancy.land_all({"hidden": torch.ones(1, 2), "mm.a": torch.ones(1, 2)}, slot, 1)
    tenancy.register(["hidden"], slot.numpy(), 2, step_id=2)  # a new tenant without mm.a
    tenancy.land_all({"hidden": torch.ones(1, 2)}, slot, 2)
    hit = tenancy.plan(["mm.a"], slot)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="is not readable"):
        tenancy.read("mm.a", hit, what="test read")
    events = rec.events(notes=True)
    assert any(e.trigger == "read" and e.get("raised") for e in events)
    verdict = check_tenancy_trace_tlc(events)
    assert verdict.accepted, verdict.explain() + verdict.output


def _split_writes_run() -> list[TraceEvent]:
    """Two steps take KV slot 0, each with an immediate (hidden) and a deferred (mm.a) write: one
    tenant, two writes. A hit planned after step 2's save reads mm.a once only step 2's immediate
    write landed: it must wait for the deferred write (NotLandedYet), then serve step 2's rows."""
    rec = TraceRecorder()
    tenancy = SlotTenancy(PrefixBlockPool(2), rec)
    slot = torch.tensor([0])
    for step, tid in ((1, 1), (2, 3)):
        tenancy.register(["hidden"], slot.numpy(), tid, step_id=step)
        tenancy.register(["mm.a"], slot.numpy(), tid + 1, step_id=step)
        if step == 1:
            tenancy.land_all({"hidden": torch.full((1, 2), 1.0)}, slot, 1)
            tenancy.land_all({"mm.a": torch.full((1, 2), 1.0)}, slot, 2)
    hit = tenancy.plan(["hidden", "mm.a"], slot)
    tenancy.land_all({"hidden": torch.full((1, 2), 3.0)}, slot, 3)
    try:
        rows = tenancy.read("mm.a", hit, what="test read")
    except NotLandedYet:
        tenancy.land_all({"mm.a": torch.full((1, 2), 4.0)}, slot, 4)
        rows = tenancy.read("mm.a", hit, what="test read")
    assert torch.equal(tenancy.read("hidden", hit, what="test read"), torch.full((1, 2), 3.0))
    tenancy.unplan(hit)
    assert rows.shape == (1, 2)
    return rec.events(notes=True)


def _read_without_waiting(self: SlotTenancy, key: str, read: PlannedRead, *, what: str,
                          settled: object = frozenset()) -> torch.Tensor:
    """Mutant of SlotTenancy.read: never waits for a planned write still in flight; serves the
    pool rows as they are (for a deferred key: the previous tenant's). Logs what it served."""
    with self.pool.lock:
        v = self._versions_locked(key)
        current = v.landed[read.slots_np]
        tensor = self.pool.tensor_locked(key)
        assert tensor is not None
        if self.recorder is not None:
            self._note("read", None, plan=read.plan_id, key=key, served=tuple(current.tolist()))
        return tensor.index_select(0, read.slots)


def test_a_read_that_does_not_wait_for_the_deferred_write_fails_trace_validation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Trace validation covers steps with an immediate and a deferred write on one KV slot: the
    correct run is accepted; a read that serves a deferred key before the tenant's deferred write
    landed (the previous tenant's rows, I7) is rejected at that read."""
    require_tlc()
    events = _split_writes_run()
    assert split_writes(events) == 2  # both steps: (step 1, slot 0) and (step 2, slot 0)
    good = check_tenancy_trace_tlc(events)
    assert good.accepted and good.split_writes == 2, good.explain() + good.output
    monkeypatch.setattr(SlotTenancy, "read", _read_without_waiting)
    events = _split_writes_run()
    bad = check_tenancy_trace_tlc(events)
    assert not bad.accepted, "TLC accepted a read of a deferred key served before its write landed"
    records = [ln.strip() for ln in tenancy_trace_data(events)[0].splitlines() if ln.strip().startswith("[ev")]
    assert bad.result == "deadlock" and bad.stuck_at is not None, bad.explain()
    assert records[bad.stuck_at].startswith('[ev |-> "read", slot |-> 1,') and "got |-> 1]" in records[bad.stuck_at], (
        bad.explain(), records)
