"""The copy path: device->host copies and the committer that lands pool writes.

Owns: the CUDA copy stream and events (when CUDA is used), the committer thread
(async mode), and ``process``: the one routine that takes a queued write through
start_copy -> finish_copy -> commit (``states.WRITE_TABLE``), landing its rows
through ``SlotTenancy.land`` and releasing its hold on the staging page.

Modes:
  eager   the thread that enqueued a write drains the queue inline (``drain``);
          copies are synchronous. This is what CI runs.
  async   a committer thread pops the queue; with CUDA the device->host copies
          run on a side stream ordered by events and land when the event fires.

Upholds:
  I3  a write unholds its staging page only after its rows have landed.
  I8  any exception while processing a write fails it, records the sticky
      failure, fails every queued write and releases every staging waiter.
  I9  nothing is dropped: the committer drains the queue before it stops.
  I11 ``process`` runs with no manager state lock held (it takes only the
      write book's lock for transitions and the pool's leaf lock for scatters).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.locks import LockWrap
from omni_cache.runtime.staging import StagingPool
from omni_cache.runtime.tenancy import SlotTenancy
from omni_cache.runtime.writes import PoolWrite, WriteBook

log = logging.getLogger(__name__)


class CopyEngine:
    """Device->host copies: inline on CPU, on a side stream with CUDA."""

    def __init__(self, *, use_cuda: bool, chunk_bytes: int) -> None:
        self.use_cuda = use_cuda
        self.chunk_bytes = chunk_bytes
        self.stream: Any = torch.cuda.Stream() if use_cuda else None

    def record_compute_event(self) -> Any:
        """An event on the compute stream after the forward (CUDA only)."""
        if not self.use_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    def device_clone(self, rows: torch.Tensor) -> torch.Tensor:
        """A private copy of ``rows`` on their own device (the compute stream)."""
        return rows.clone()

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Any:
        """Copy ``src`` into host ``dst``; return an event to wait on (or None)."""
        if not self.use_cuda or not src.is_cuda:
            self._chunked(dst, src)
            return None
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def copy_all(self, dsts: dict[str, torch.Tensor], srcs: dict[str, torch.Tensor], after: Any = None) -> Any:
        """``copy_into`` of every key of ``srcs`` into ``dsts[key]``; the last event (or None)."""
        event = None
        chunk = self.chunk_bytes
        for key, src in srcs.items():
            if not self.use_cuda and src.nbytes <= chunk:  # a host copy in one piece (as ``_chunked``)
                dsts[key].copy_(src)
                continue
            event = self.copy_into(dsts[key], src, after) or event
        return event

    def to_host(self, src: torch.Tensor, after: Any = None) -> tuple[torch.Tensor, Any]:
        """A host copy of ``src`` (pinned with CUDA) and its completion event."""
        if not src.is_cuda:
            dst = torch.empty_like(src, device="cpu")
            self._chunked(dst, src)
            return dst, None
        dst = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
        return dst, self.copy_into(dst, src, after)

    def _chunked(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Synchronous copy in slices of at most ``chunk_bytes``."""
        nbytes = src.nbytes
        if nbytes <= self.chunk_bytes or src.dim() == 0 or src.shape[0] <= 1:
            dst.copy_(src)
            return
        rows_per_chunk = max(1, self.chunk_bytes // (nbytes // src.shape[0]))
        for start in range(0, src.shape[0], rows_per_chunk):
            dst[start : start + rows_per_chunk].copy_(src[start : start + rows_per_chunk])

    @staticmethod
    def wait(event: Any) -> None:
        if event is not None:
            event.synchronize()


class Committer:
    """Takes queued writes to ``written``: inline (eager) or on a thread (async)."""

    def __init__(
        self,
        book: WriteBook,
        tenancy: SlotTenancy,
        staging: StagingPool,
        copies: CopyEngine,
        faults: FaultHooks,
        *,
        threaded: bool,
    ) -> None:
        self.book = book
        self.tenancy = tenancy
        self.staging = staging
        self.copies = copies
        self.faults = faults
        self.threaded = threaded
        self._thread: threading.Thread | None = None
        # Held by the one thread draining the queue inline (eager mode).
        self._drain_lock = threading.Lock()
        # Set once by stop(); the committer thread exits when it is set and the queue is empty.
        self._closing = False
        if threaded:
            self._thread = threading.Thread(target=self._run, name="omni-cache-committer", daemon=True)
            self._thread.start()

    def wrap_lock(self, wrap: LockWrap) -> Callable[[], None]:
        """Instrumentation seam (``locks.LockWrap``): the drain lock becomes ``wrap(lock)`` until the
        returned undo runs. Only while nothing drains."""
        inner = self._drain_lock
        self._drain_lock = wrap(inner)

        def undo() -> None:
            self._drain_lock = inner

        return undo

    def kick(self) -> None:
        """Make progress on the queue: drain it inline in eager mode.

        In eager mode a write that fails here raises to the caller that queued
        it (after recording the sticky failure), so the failure is never silent.
        """
        if not self.threaded:
            self.drain()
            self.book.check_failed("land the queued pool writes")

    def drain(self) -> None:
        """Process queued writes inline, one thread at a time, in queue order.

        Eager mode lets the engine and a builder thread both kick the queue; the
        drain lock keeps landing in queue order (a newer tenant never lands before
        an older one it was queued behind). A thread that finds another draining
        returns at once: the drainer re-checks the queue after releasing the lock,
        so nothing is stranded, and callers that need a write wait on its state.
        """
        while True:
            if not self._drain_lock.acquire(blocking=False):
                return
            try:
                while (write := self.book.start_next(block=False)) is not None:
                    self.process(write)
            finally:
                self._drain_lock.release()
            if self.book.queue_length() == 0:
                return

    def process(self, write: PoolWrite) -> None:
        """Copy to host (if needed), land and commit one write ``WriteBook.start_next`` started."""
        try:
            self.faults.before_device_to_host(write)
            self.faults.on_blocking(f"device->host copy of write tid {write.tid}")
            # ``copy_event`` orders this copy after the producer: the staging-page copy
            # issued at save (immediate) or the device clone (deferred).
            host: dict[str, torch.Tensor] = {}
            events = [write.copy_event]
            for key, src in write.source.items():
                if src.is_cuda:
                    host[key], event = self.copies.to_host(src, write.copy_event)
                    events.append(event)
                else:  # already host memory: the staging page, or a CPU clone
                    host[key] = src
            for event in events:
                self.copies.wait(event)
            write.host = host
            self.book.fire(write, "finish_copy")
            for key in write.host:
                self.faults.before_pool_write(write, key)
            self.tenancy.land_all(write.host, write.slots, write.tid, slots_np=write.slots_np, sigs=write.sigs)
            write.source = {}
            self.book.fire(write, "commit")
            write.host = None
        except BaseException as exc:  # any failure of the copy path is sticky (I8)
            message = self.book.fail(write, exc, where="the committer")
            self.staging.set_failed(message)
            log.error("omni-cache: %s", message)
            if not isinstance(exc, Exception):
                raise  # an interrupt or an exit goes on up, the write failed first (never left copying)
        finally:
            if write.staging_slot is not None and write.state in ("written", "failed"):
                slot, write.staging_slot = write.staging_slot, None
                self.staging.unhold(slot)

    def _run(self) -> None:
        try:
            while True:
                self.faults.committer_tick()
                write = self.book.start_next(block=True, timeout_s=0.5)
                if write is None:
                    if self.book.failure is not None:
                        return
                    if self._closing and self.book.queue_length() == 0:
                        return
                    continue
                self.process(write)
        except BaseException as exc:  # the committer died: release every waiter (I8, I11)
            message = self.book.fail(None, exc, where="the committer thread, which died")
            self.staging.set_failed(message)
            log.error("omni-cache: %s", message)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Drain what is queued, then stop the thread (I9)."""
        self._closing = True
        self.book.close()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("omni-cache: committer did not stop within %.1fs", timeout_s)
        else:
            self.drain()

    @property
    def alive(self) -> bool:
        return self._thread is None or self._thread.is_alive()
