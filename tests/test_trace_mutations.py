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

from omni_cache.interface import WriteSchedule
from omni_cache.staging import StagingPool, StagingSlot
from omni_cache.trace import TraceEvent, TraceRecorder
from omni_cache.verify import check_trace_tlc
from omni_cache.verify.testing import require_tlc
from omni_cache.verify.traces import check_writes_trace_tlc, writes_trace_data
from omni_cache.writes import PoolWrite, WriteBook

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
    while (write := book.pop(block=False)) is not None:
        for trigger in ("start_copy", "finish_copy", "commit"):
            book.fire(write, trigger)
    return rec.events(notes=True)


def _pop_newest(self: WriteBook, *, block: bool, timeout_s: float | None = None) -> PoolWrite | None:
    """Mutant of WriteBook.pop: takes the newest queued write (lands writes out of order)."""
    with self._cond:
        return self._queue.pop() if self._queue else None


def test_writes_landing_out_of_order_fail_trace_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    require_tlc()
    good = check_writes_trace_tlc(_writes_run())
    assert good.accepted, good.explain() + good.output
    monkeypatch.setattr(WriteBook, "pop", _pop_newest)
    events = _writes_run()
    bad = check_writes_trace_tlc(events)
    assert not bad.accepted, "TLC accepted a trace whose committer landed the queue's tail first"
    records = [ln for ln in writes_trace_data(events)[0].splitlines() if ln.strip().startswith("[ev")]
    assert bad.result == "deadlock" and bad.stuck_at is not None, bad.explain()
    assert records[bad.stuck_at].strip().startswith('[ev |-> "start_copy", tid |-> 1,'), records[bad.stuck_at]
