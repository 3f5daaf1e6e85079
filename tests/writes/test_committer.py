"""The committer takes the queue's front write and starts its copy atomically (I8, I9).

A write taken off the queue is already ``copying``: a finished request that pushes its deferred
write to the front in between cannot put a copy start behind the queue's front (TLC's
WritesTrace: ``start_copy`` needs ``First(queue) = i``), and ``fail`` (which ends the queued and
pending writes, I8) never misses a write that is between the queue and its copy. The stateful
tenancy-trace test once saw that window under load. Here the window is forced open: the copy path's first fault hook (it
runs after the take) pushes a write to the front, as a finish on another thread would.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from omni_cache.runtime.copier import Committer, CopyEngine
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.interface import WriteSchedule
from omni_cache.runtime.writes import PoolWrite, WriteBook
from omni_cache.verify.testing import require_tlc
from omni_cache.verify.traces import TraceRecorder, check_writes_trace_tlc


class _Tenancy:  # the committer only lands rows through it
    def land_all(self, rows: Any, slots: Any, tid: int, **carried: Any) -> None:
        pass


class _Staging:  # no write here holds a staging page
    def set_failed(self, message: str) -> None:
        raise AssertionError(message)

    def unhold(self, slot: Any) -> None:
        raise AssertionError("no staging page was held")


class _FinishDuringCopy(FaultHooks):
    """The first copy's hook pushes ``late`` to the queue's front (a request finishing)."""

    def __init__(self, book: WriteBook, late: PoolWrite) -> None:
        self.book, self.late, self.seen = book, late, []

    def before_device_to_host(self, write: Any) -> None:
        self.seen.append((write.tid, write.state))
        if self.late.state == "pending":
            self.book.enqueue([self.late], front=True)


def _run(threaded: bool) -> tuple[list[Any], TraceRecorder, WriteBook]:
    rec = TraceRecorder()
    book = WriteBook(5.0, rec)
    slots = torch.arange(2)
    first = book.register(WriteSchedule.JOIN_NEXT_STEP, 1, slots, {"hidden": torch.ones(2, 3)})
    late = book.register(WriteSchedule.JOIN_ON_FINISH, 1, slots, {"mm.a": torch.ones(2, 3)})
    hooks = _FinishDuringCopy(book, late)
    committer = Committer(book, _Tenancy(), _Staging(), CopyEngine(use_cuda=False, chunk_bytes=1 << 20),  # type: ignore[arg-type]
                          hooks, threaded=threaded)
    book.enqueue([first])
    committer.kick()
    book.wait(late, ("written",), why="the test waits for the late write")
    committer.stop()
    assert first.state == late.state == "written"
    return hooks.seen, rec, book


def test_a_write_is_copying_when_it_leaves_the_queue() -> None:
    for threaded in (False, True):
        seen, _, _ = _run(threaded)
        assert seen[0] == (1, "copying"), f"threaded={threaded}: the committer took a write without starting it: {seen}"


def test_a_front_push_during_a_copy_passes_trace_validation() -> None:
    require_tlc()
    _, rec, _ = _run(threaded=False)
    verdict = check_writes_trace_tlc(rec)
    assert verdict.accepted, verdict.explain() + verdict.output


# ---- I11: a queued write wakes a committer that waits for one ------------------------------
def test_enqueue_wakes_a_committer_waiting_for_work() -> None:
    """Enqueueing a write wakes a committer waiting for work at once (I9, I11).

    Kills the mutant: ``writes:WriteBook.enqueue:negate_cond:6d8245e3`` (no notify while a thread waits:
    the committer slept out its whole wait before it saw the write).

    Enqueueing a write wakes a committer waiting for work at once (I9, I11)."""
    book = WriteBook(30.0)
    write = book.register(WriteSchedule.JOIN_NEXT_STEP, 1, torch.arange(2), {"hidden": torch.zeros(2, 2)})
    taken: list[object] = []
    waiter = threading.Thread(target=lambda: taken.append(book.start_next(block=True, timeout_s=30.0)))
    waiter.start()
    for _ in range(500):  # until the committer is inside its wait
        if book._num_waiting:
            break
        threading.Event().wait(0.01)
    assert book._num_waiting == 1, "the committer never started waiting"
    book.enqueue([write])
    waiter.join(5.0)
    assert not waiter.is_alive(), "enqueue did not wake the waiting committer (it sleeps out its 30 s wait)"
    assert taken == [write] and write.state == "copying"
