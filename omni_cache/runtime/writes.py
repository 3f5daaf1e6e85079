"""Pool writes: the second state machine, the copy queue, and waits on writes.

Owns: every ``PoolWrite`` (by tid), the copy queue (FIFO; writes of finished and
aborted requests are pushed to its front), the write-state condition variable,
and the manager's sticky failure.

A write moves pending -> queued -> copying -> host_ready -> written, or to
failed from any live state (``states.WRITE_TABLE``); only ``WriteBook.fire``
moves it.

Upholds:
  I8  sticky failure: the first failed write records an error and fails every
      open write (queued or pending), so no copy starts after it; every later
      ``check_failed`` and every waiter raises "write failed".
  I9  ``push_front`` puts a finished/aborted request's open writes at the head
      of the queue; nothing drops a write.
  I11 waits release the lock (condition variable) and are bounded by a timeout;
      a stuck write raises naming its state.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from omni_cache.runtime.errors import PHRASE_WRITE_FAILED, OmniPrefixCacheUnmatchError
from omni_cache.runtime.interface import ReqId, StepId, TensorName, Tid, WriteSchedule
from omni_cache.runtime.locks import LockWrap
from omni_cache.runtime.states import WRITE_TABLE, TableMachine
from omni_cache.runtime.trace import TraceRecorder
from omni_cache.runtime.validation import RowSig


class PoolWrite:
    """Rows of one step for some keys, bound for the block pool at ``slots``.

    Fields are set at registration; ``state`` and ``error`` change only through
    ``WriteBook`` under its lock. ``source`` maps key -> rows (a staging-page
    view for immediate writes, a device clone for deferred ones); the copier
    replaces it with host rows at ``finish_copy`` and drops it at ``commit``.
    """

    __slots__ = (
        "copy_event",
        "error",
        "host",
        "nbytes",
        "req_ids",
        "schedule",
        "sigs",
        "slots",
        "slots_np",
        "source",
        "staging_slot",
        "state",
        "step_id",
        "tid",
    )

    def __init__(
        self,
        tid: Tid,
        schedule: WriteSchedule,
        step_id: StepId | None,
        slots: torch.Tensor,
        source: dict[TensorName, torch.Tensor],
        *,
        staging_slot: Any = None,
        req_ids: Iterable[ReqId] = (),
        slots_np: np.ndarray | None = None,
        sigs: dict[TensorName, RowSig] | None = None,
    ) -> None:
        self.tid = tid
        self.state = WRITE_TABLE.initial
        self.schedule = schedule
        self.step_id = step_id
        self.slots = slots
        # The numpy view of ``slots`` and each key's row signature, as the save read them (or None).
        self.slots_np = slots_np
        self.sigs = sigs
        self.source = source
        self.host: dict[TensorName, torch.Tensor] | None = None
        self.staging_slot = staging_slot
        self.req_ids = tuple(req_ids)  # a tuple passes through as itself (no per-request copy)
        self.nbytes = sum(t.nbytes for t in source.values())
        self.copy_event: Any = None
        self.error: BaseException | None = None

    @property
    def keys(self) -> tuple[TensorName, ...]:
        return tuple(self.source) if self.host is None else tuple(self.host)

    def describe(self) -> str:
        return (
            f"write tid {self.tid} ({self.schedule.name}, step id {self.step_id}, "
            f"keys {sorted(self.keys)}, {self.slots.numel()} rows, state {self.state!r})"
        )


class WriteBook:
    """Registry, queue and waits of pool writes; one lock, one condition."""

    def __init__(self, wait_timeout_s: float, recorder: TraceRecorder | None = None) -> None:
        self.machine = TableMachine(WRITE_TABLE, recorder, name_of=lambda w: f"write tid {w.tid}")
        self.wait_timeout_s = wait_timeout_s
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Live (not terminal) writes by tid, in registration order.
        self._live: dict[Tid, PoolWrite] = {}
        # The copy queue (queued writes); the committer pops from the left.
        self._queue: collections.deque[PoolWrite] = collections.deque()
        self._next_tid: Tid = 1
        # Sticky failure (I8); set once, with the exception that caused it (chained on re-raise).
        self._failure: str | None = None
        self._failure_cause: BaseException | None = None
        self._closed = False
        # Threads waiting on the condition: a transition notifies only when someone waits.
        self._num_waiting = 0
        self.num_written = 0
        self.num_failed = 0

    # ---- registration and transitions ---------------------------------------
    def register(
        self,
        schedule: WriteSchedule,
        step_id: StepId | None,
        slots: torch.Tensor,
        source: dict[TensorName, torch.Tensor],
        *,
        staging_slot: Any = None,
        req_ids: Iterable[ReqId] = (),
        slots_np: np.ndarray | None = None,
        sigs: dict[TensorName, RowSig] | None = None,
    ) -> PoolWrite:
        with self._lock:
            self._raise_if_failed_locked("register a write")
            write = PoolWrite(
                self._next_tid, schedule, step_id, slots, source,
                staging_slot=staging_slot, req_ids=req_ids, slots_np=slots_np, sigs=sigs,
            )
            self._next_tid += 1
            self._live[write.tid] = write
            if self.machine.recorder is not None:  # the note's arguments are built only for a trace
                self._note("register", f"write tid {write.tid}", write.state, step_id, tid=write.tid,
                           deferred=schedule is WriteSchedule.JOIN_ON_FINISH)
            return write

    def fire(self, write: PoolWrite, trigger: str) -> None:
        with self._lock:
            self._fire_locked(write, trigger)

    def _fire_locked(self, write: PoolWrite, trigger: str) -> None:
        self.machine.fire(write, trigger, step_id=write.step_id)
        if write.state in WRITE_TABLE.terminal:
            self._live.pop(write.tid, None)
            if write.state == "written":
                self.num_written += 1
        if self._num_waiting:
            self._cond.notify_all()

    def enqueue(self, writes: Iterable[PoolWrite], *, front: bool = False) -> list[PoolWrite]:
        """Move pending writes into the queue (at its front for finish/abort, I9)."""
        moved: list[PoolWrite] = []
        with self._cond:
            writes = list(writes)
            if self.machine.recorder is not None:
                self._note("enqueue_front" if front else "enqueue_back", "queue", "-", None,
                           tids=tuple(dict.fromkeys(w.tid for w in writes if w.state == "pending")))
            for write in writes:
                if write.state == "pending":
                    self._fire_locked(write, "enqueue")
                    moved.append(write)
            # No notify of its own: each ``enqueue`` fire above notified the waiters, and they
            # wake only once this hold of the lock, which extends the queue, ends.
            if front:
                self._queue.extendleft(reversed(moved))
            else:
                self._queue.extend(moved)
        return moved

    def start_next(self, *, block: bool, timeout_s: float | None = None) -> PoolWrite | None:
        """Take the queue's front write and fire its ``start_copy`` under one hold of the lock
        (committer side); None when closed, failed or nothing queued.

        Atomic on purpose: a write taken off the queue but not yet started would be neither in
        the queue nor copying, so a finish/abort pushing writes to the front in between would be
        recorded ahead of a copy that had in fact already begun (the trace then shows a copy
        starting behind the queue's front, I9), and a failure in between would not fail it
        (``fail`` ends the queued and pending writes, I8)."""
        with self._lock:
            write = self._pop_locked(block, timeout_s)
            if write is not None:
                self._fire_locked(write, "start_copy")
            return write

    def _pop_locked(self, block: bool, timeout_s: float | None) -> PoolWrite | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._queue:
            if not block or self._closed or self._failure is not None:
                return None
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            self._wait_locked(remaining)
        return self._queue.popleft()

    def fail(self, write: PoolWrite | None, error: BaseException, *, where: str) -> str:
        """Record the sticky failure (I8); fail ``write``, every queued and every pending write."""
        with self._cond:
            if self._failure is None:
                what = write.describe() if write is not None else "the copy path"
                self._failure = (
                    f"{PHRASE_WRITE_FAILED}: {what} in {where}: {type(error).__name__}: {error}; "
                    "the omni prefix cache is failed for good (I8): every later call raises"
                )
                self._failure_cause = error
            # The write, every queued write, then every write still pending (a deferred write
            # whose request can no longer finish: every later entry raises): all end failed,
            # so nothing is left open and nothing is queued for a copy after the failure (I8).
            pending = [w for w in self._live.values() if w.state == "pending"]
            for w in ([write] if write is not None else []) + list(self._queue) + pending:
                if w.state not in WRITE_TABLE.terminal:
                    w.error = error
                    self._fire_locked(w, "fail")
                    self.num_failed += 1
            self._queue.clear()
            self._cond.notify_all()
            return self._failure

    def _note(self, what: str, obj: str, state: str, step_id: StepId | None, **data: object) -> None:
        """Log bookkeeping for trace validation (registrations, queue pushes); lock held."""
        recorder = self.machine.recorder
        if recorder is not None:
            recorder.note(WRITE_TABLE.name, obj, what, state, step_id, **data)

    # ---- waits --------------------------------------------------------------
    def wait(self, write: PoolWrite, states: tuple[str, ...], *, why: str) -> None:
        """Block until ``write`` reaches one of ``states``; failure or timeout raise."""
        deadline = time.monotonic() + self.wait_timeout_s
        with self._lock:
            while write.state not in states:
                if write.state == "failed" or self._failure is not None:
                    self._raise_if_failed_locked(why)
                    raise OmniPrefixCacheUnmatchError(
                        f"{PHRASE_WRITE_FAILED}: {write.describe()} failed while {why}"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise OmniPrefixCacheUnmatchError(
                        f"timed out after {self.wait_timeout_s:.3f}s while {why}: {write.describe()} "
                        f"is stuck in state {write.state!r} (waiting for {states})"
                    )
                self._wait_locked(remaining)

    def _wait_locked(self, timeout_s: float | None) -> None:
        """Wait on the condition (lock released meanwhile), counted so transitions know to notify."""
        self._num_waiting += 1
        try:
            self._cond.wait(timeout_s)
        finally:
            self._num_waiting -= 1

    # ---- failure and introspection -----------------------------------------
    def check_failed(self, what: str) -> None:
        """Raise the sticky failure (I8). No lock: ``_failure`` is set once, never cleared."""
        if self._failure is not None:
            raise OmniPrefixCacheUnmatchError(f"cannot {what}: {self._failure}") from self._failure_cause

    def _raise_if_failed_locked(self, what: str) -> None:
        if self._failure is not None:
            raise OmniPrefixCacheUnmatchError(f"cannot {what}: {self._failure}") from self._failure_cause

    @property
    def failure(self) -> str | None:
        with self._lock:
            return self._failure

    def wrap_lock(self, wrap: LockWrap) -> Callable[[], None]:
        """Instrumentation seam (``locks.LockWrap``): guard the book with ``wrap(lock)`` until the
        returned undo runs; the condition is rebuilt on it. Only while no call is in flight."""
        inner = self._lock
        self._lock = wrap(inner)
        self._cond = threading.Condition(self._lock)

        def undo() -> None:
            self._lock = inner
            self._cond = threading.Condition(inner)

        return undo

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._cond.notify_all()

    def get(self, tid: Tid) -> PoolWrite | None:
        with self._lock:
            return self._live.get(tid)

    def live(self) -> list[PoolWrite]:
        with self._lock:
            return list(self._live.values())

    def describe_in_flight(self) -> str:
        live = self.live()
        if not live:
            return "none"
        return "; ".join(w.describe() for w in live[:16]) + (
            f"; ... {len(live) - 16} more" if len(live) > 16 else ""
        )

    def queue_length(self) -> int:
        with self._lock:
            return len(self._queue)
