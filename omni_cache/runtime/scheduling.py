"""Write scheduling: registering a step's pool writes and deciding when each is queued to land.

Owns: ``WriteScheduler``, the manager's half that turns a step's rows into pool writes (the
write book entry, the hold on the staging page, the pool's fixed row signatures of the write's
keys, the slots' new versions in the tenancy) and
orders their landing: an older tenant's unlanded write and every write a planned read needs go to
the front of the copy queue, a save's immediate write joins the queue after them, and a deferred
write (``JOIN_ON_FINISH``) stays open until its requests end (the manager pushes it then) or the
open deferred writes outgrow ``gpu_staging_bytes`` (the oldest are flushed). It keeps the open
deferred writes (and, per request, the ones holding its rows) and their device bytes,
guarded by the manager's state lock, which it shares (``OwnedLock``); the manager's ``count``
counts budget flushes and tier restores, its ``issue_step_id`` names a restore. It implements
the write half of the manager's door for the hidden-state tier (``TierPort``): a restored block
registered as one write, and a vacated block's new tenant.

Upholds: I7 (an older tenant's unlanded write on the new tenant's slots is found at registration
and lands first, then is skipped there), I9 (``flush`` pushes writes to the queue's front and
kicks the committer), I11 (the state lock covers the bookkeeping only, never a flush or the
committer's progress; the ``on_blocking`` fault hook sees each flush).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from omni_cache.runtime.copier import Committer
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.interface import ReqId, StepId, WriteSchedule
from omni_cache.runtime.locks import OwnedLock
from omni_cache.runtime.staging import StagingPool
from omni_cache.runtime.tenancy import PlannedRead, SlotTenancy
from omni_cache.runtime.validation import RowSig
from omni_cache.runtime.writes import PoolWrite, WriteBook


class WriteScheduler:
    """Registers pool writes and queues them in landing order; one per manager."""

    def __init__(self, *, book: WriteBook, tenancy: SlotTenancy, staging: StagingPool, committer: Committer,
                 faults: FaultHooks, lock: OwnedLock, count: Callable[[str], None],
                 issue_step_id: Callable[[], StepId], gpu_staging_bytes: int) -> None:
        self.book = book
        self.tenancy = tenancy
        self.staging = staging
        self.committer = committer
        self.faults = faults
        self.gpu_staging_bytes = gpu_staging_bytes
        # The manager's state lock (I11: bookkeeping only under it), its counters and step ids.
        self._lock = lock
        self._count = count
        self._issue_step_id = issue_step_id
        # ---- guarded by _lock ----
        self._deferred_open: dict[int, PoolWrite] = {}
        self._deferred_bytes = 0
        # req -> {tid: write}: the open deferred writes holding each request's rows, the ones its
        # end pushes to the queue's front (I9). A write leaves every request's entry when it is
        # queued, so a long generation's entry never grows past its open writes.
        self._open_of: dict[ReqId, dict[int, PoolWrite]] = {}

    def open_deferred_locked(self, write: PoolWrite) -> None:
        """Keep a save's registered deferred ``write`` open until flushed. Caller holds the state lock."""
        self._deferred_open[write.tid] = write
        self._deferred_bytes += write.nbytes
        for req_id in write.req_ids:
            self._open_of.setdefault(req_id, {})[write.tid] = write

    def take_open_of_locked(self, req_id: ReqId) -> list[PoolWrite]:
        """The open deferred writes holding ``req_id``'s rows, in registration order; the request's
        entry is forgotten (it ended: the caller flushes them to the queue's front, I9). Caller
        holds the state lock."""
        return list(self._open_of.pop(req_id, {}).values())

    def num_open_of(self, req_id: ReqId) -> int:
        """How many open deferred writes hold ``req_id``'s rows (takes the state lock)."""
        with self._lock:
            return len(self._open_of.get(req_id, ()))

    def deferred_stats_locked(self) -> tuple[int, int]:
        """(open deferred writes, their device bytes). Caller holds the state lock."""
        return len(self._deferred_open), self._deferred_bytes

    def register(self, schedule: WriteSchedule, step_id: StepId, slots: torch.Tensor, slots_np: np.ndarray,
                 source: dict[str, torch.Tensor], staging_slot: Any,
                 req_ids: tuple[ReqId, ...], registered: list[PoolWrite],
                 sigs: dict[str, RowSig], *, scan_older: bool | None = None) -> tuple[PoolWrite | None, set[int]]:
        """Register one write for ``source``'s keys; also return older unlanded tids on its slots
        (scanned for deferred writes, or when ``scan_older`` says so).

        The write is appended to ``registered`` as soon as the write book holds it, so a
        failure later in registration fails it (sticky, I8) instead of leaking it in flight.
        """
        if not source:
            return None, set()
        write = self.book.register(schedule, step_id, slots, source, staging_slot=staging_slot, req_ids=req_ids,
                                   slots_np=slots_np, sigs=sigs)
        registered.append(write)
        # NOTE: once the write is recorded (a failure from here on fails it for good, I8) and before
        # it is queued: its keys' row shapes are fixed from now on (a later save or tier entry of
        # another shape is refused before it claims anything), though its rows land later. The
        # caller checked them against the pool's already.
        self.tenancy.pool.fix_sigs(source.keys(), sigs)
        if staging_slot is not None:
            self.staging.hold(staging_slot)
        # Immediate writes of saves land in order (each save waits for the previous one), so only
        # deferred writes (and tier restores, which no save waits for) can leave an older tenant
        # unlanded behind them.
        if scan_older is None:
            scan_older = schedule is WriteSchedule.JOIN_ON_FINISH
        return write, self.tenancy.register(list(source), slots_np, write.tid, step_id=step_id,
                                            scan_older=scan_older)

    def fail_registered(self, registered: list[PoolWrite], exc: BaseException, *, where: str) -> None:
        """A save or restore failed after registering ``registered`` (published versions, not
        undoable): record the sticky failure (I8) on each of them and on the staging pool, so every
        later call raises instead of waiting on a write nobody will queue."""
        message = self.book.fail(registered[0], exc, where=where)
        for write in registered[1:]:
            self.book.fail(write, exc, where=where)
        self.staging.set_failed(message)

    def after_save(self, imm: PoolWrite | None, older: set[int], plans: list[PlannedRead]) -> None:
        """Queue what must land: older tenants first, writes a planned read needs, this step, budget."""
        if older or plans:
            needed = set(older)
            for plan in plans:
                for versions in plan.expected.values():
                    needed.update(np.unique(versions).tolist())
            front = [w for t in sorted(needed) if (w := self.book.get(t)) is not None and w.state == "pending"]
            if front:
                self.flush(front, front=True, why="writes a planned read or a new tenant needs first")
        if imm is not None:
            self.book.enqueue([imm])
            self.committer.kick()
        if not self._deferred_open:  # only this (engine) thread adds to it: nothing over budget
            return
        with self._lock:
            over = self._deferred_bytes - self.gpu_staging_bytes
            oldest: list[PoolWrite] = []
            for write in self._deferred_open.values():
                if over <= 0:
                    break
                oldest.append(write)
                over -= write.nbytes
        if oldest:
            self._count("budget_flushes")  # takes the state lock for the count, then lets it go
            self.flush(oldest, front=False, why="gpu_staging_bytes budget")

    def register_restored(self, slots: torch.Tensor, slots_np: np.ndarray, source: dict[str, torch.Tensor],
                          sigs: dict[str, RowSig]) -> StepId:
        """``TierPort.register_restored_write``: ``source`` (host rows, checked against the pool's
        signatures by the caller) as one immediate write on ``slots``, queued like a save's."""
        self.tenancy.prepare_keys(sigs)
        step_id = self._issue_step_id()
        self._count("tier_restores")
        # an older tenant's open (deferred) write on these slots lands first, then is skipped there (I7)
        registered: list[PoolWrite] = []
        try:
            write, older = self.register(WriteSchedule.JOIN_NEXT_STEP, step_id, slots, slots_np, source,
                                         None, (), registered, sigs, scan_older=True)
            self.after_save(write, older, [])
        except BaseException as exc:
            if registered:  # its versions may be published: fail for good (I8)
                self.fail_registered(registered, exc, where=f"the tier restore of step {step_id}")
            raise
        return step_id

    def vacate(self, slots_np: np.ndarray) -> StepId:
        """``TierPort.vacate``: a new tenant that wrote nothing on ``slots``."""
        step_id = self._issue_step_id()
        self.tenancy.take_slots(slots_np, step_id=step_id)
        return step_id

    def flush(self, writes: list[PoolWrite], *, front: bool, why: str) -> None:
        """Queue pending writes (no state lock held: I11) and make progress."""
        self.faults.on_blocking(f"flush: {why}")
        moved = self.book.enqueue(writes, front=front)
        with self._lock:
            for write in moved:
                if self._deferred_open.pop(write.tid, None) is not None:
                    self._deferred_bytes -= write.nbytes
                    for req_id in write.req_ids:
                        held = self._open_of.get(req_id)
                        if held is not None and held.pop(write.tid, None) is not None and not held:
                            del self._open_of[req_id]
        self.committer.kick()
