"""The staging pool: ``staging_depth`` reusable host pages per tensor name.

Owns: the page storage (``_pages``; no other module may touch it -- a test scans
the package for that), the staging slots, the map of unconsumed step ids, the
claim-wait history (a fixed-size ``WaitHistogram``: bounded however long the
run), every claim's wait since the last ``take_claim_waits`` (a bounded ``ObservationLog``, for
metrics), and the pool lock with its condition variable. ``abort`` drops the pages
its claimed slot allocated for new keys, so a refused save fixes no row shape.

The staging-slot machine (``states.STAGING_TABLE``) is the only door: a page is
written only through a ``claimed`` slot, read only through a ``saved`` or
``materialized`` one, and claimed only from ``free``.

Upholds:
  I1  a step id is consumed once; a second consume, an unknown id or a non-int
      (a bool or float equal to an id) raises "already consumed or never saved"
      and changes nothing.
  I2  at most ``staging_depth`` unconsumed step ids; a claim that finds no free
      slot waits ``staging_claim_timeout_s`` on the condition variable, then
      raises ``OmniPrefixCacheStagingTimeoutError`` naming every unconsumed step
      id with where it was saved, and the in-flight writes.
  I3  a page is not freed while its consumer or a pool write still reads it.
  I10 a step larger than a page raises "staging capacity is".
  I11 the pool lock covers only bookkeeping: the wait releases it, and page
      allocation and row copies run outside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from omni_cache.runtime.errors import (
    PHRASE_NOT_SAVED,
    PHRASE_SHUT_DOWN,
    PHRASE_UNCONSUMED,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
)
from omni_cache.runtime.histogram import ObservationLog, WaitHistogram
from omni_cache.runtime.interface import StepId, TensorName
from omni_cache.runtime.locks import LockWrap
from omni_cache.runtime.states import STAGING_TABLE, TableMachine
from omni_cache.runtime.trace import TraceRecorder
from omni_cache.runtime.validation import (
    RowSig,
    allocate_rows,
    check_capacity,
    check_held_sigs,
    check_sig,
    row_sig,
)

# Claim waits kept for a reader between two ``take_claim_waits`` (older ones are dropped and counted).
CLAIM_WAIT_LOG = 4096
# Slot states through which a page may be read (the step's consumer, or its pool write).
_READABLE = ("saved", "materialized")


class StagingSlot:
    """One page index of the pool and its lifecycle state.

    Mutated only by ``StagingPool`` under its lock (``state`` via the machine).
    """

    __slots__ = ("index", "new_keys", "num_rows", "num_write_holds", "reading", "saved_at", "state", "step_id")

    def __init__(self, index: int) -> None:
        self.index = index
        self.state = STAGING_TABLE.initial
        self.step_id: StepId | None = None
        self.saved_at: str | None = None
        self.num_rows = 0
        # Pool writes that still read this page (I3).
        self.num_write_holds = 0
        # True between consume and done_reading: the consumer reads the page.
        self.reading = False
        # Keys whose pages this slot's claim allocated: dropped again if the save aborts.
        self.new_keys: list[TensorName] = []

    def describe(self) -> str:
        return f"staging slot {self.index} (state {self.state!r}, step id {self.step_id})"


class StagingPool:
    """``depth`` pages of ``capacity`` rows per key, behind the slot machine."""

    def __init__(
        self,
        depth: int,
        capacity_tokens: int,
        claim_timeout_s: float,
        *,
        pin_memory: bool = False,
        recorder: TraceRecorder | None = None,
        describe_in_flight: Callable[[], str] | None = None,
        library_triggers: bool | None = None,
    ) -> None:
        self.depth = depth
        self.capacity_tokens = capacity_tokens
        self.claim_timeout_s = claim_timeout_s
        self.pin_memory = pin_memory
        self.machine = TableMachine(STAGING_TABLE, recorder, library_triggers=library_triggers,
                                    name_of=lambda s: f"staging slot {s.index}")
        self._describe_in_flight = describe_in_flight or (lambda: "none")
        # Protects every field below and every slot's fields.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._slots = [StagingSlot(i) for i in range(depth)]
        # Saved, unconsumed step ids -> their slot (I1, I2).
        self._by_step: dict[StepId, StagingSlot] = {}
        # key -> tensor [depth, capacity, *row_shape]; the page storage itself.
        self._pages: dict[TensorName, torch.Tensor] = {}
        # key -> per staging slot, the view of its page (one slice per access instead of two indexings).
        self._slot_pages: dict[TensorName, list[torch.Tensor]] = {}
        # key -> (dtype, row shape) of its pages: row checks compare tuples, not tensors.
        self._sigs: dict[TensorName, RowSig] = {}
        # Per staging slot: key -> (n, the view of its page's rows [0, n)), the last one made. A
        # decode step stages and reads the same n rows step after step: one view, not one slice
        # per access. Views never leave the runtime (writes land from them, materialize clones them).
        # A slot's dict is touched by the slot's current holder only (the save while claimed, the
        # reader while saved or materialized), and by ``abort`` under the lock for dropped keys.
        self._head_views: list[dict[TensorName, tuple[int, torch.Tensor]]] = [{} for _ in range(depth)]
        # Claims waiting on the condition: a release notifies only when one waits.
        self._num_waiting = 0
        # Set once when the manager fails (I8): claims and waiters raise it.
        self._failure: str | None = None
        # Set once by ``close`` (shutdown began, contract 4.6): a claim not yet made, waiting or
        # not, is refused; claims already made are untouched.
        self._closed = False
        self.num_claims = 0
        # Claims that had to wait, and how long: a fixed-size histogram (bounded however long the run).
        self._waits = WaitHistogram()
        # Every claim's wait (0.0 when a slot was free), until a reader takes them (metrics).
        self._claim_log = ObservationLog(CLAIM_WAIT_LOG)
        self._note(None, "open", None)  # trace validation reads the configured depth here

    # ---- lifecycle (the machine's triggers) ---------------------------------
    def claim(self, num_rows: int, *, timeout_s: float | None = None) -> StagingSlot:
        """Find a free slot and claim it, atomically; wait for one if none is free."""
        self.check_capacity(num_rows)
        timeout_s = self.claim_timeout_s if timeout_s is None else timeout_s
        start: float | None = None  # set when the first look finds no free slot
        with self._lock:
            while True:
                if self._failure is not None:
                    raise OmniPrefixCacheUnmatchError(self._failure)
                if self._closed:
                    raise OmniPrefixCacheUnmatchError(self._shutdown_refusal_locked(start is not None))
                slot = next((s for s in self._slots if s.state == "free"), None)
                if slot is not None:
                    self.machine.fire(slot, "claim")
                    slot.num_rows = num_rows
                    self.num_claims += 1
                    if start is not None:
                        waited = time.perf_counter() - start
                        self._waits.record(waited)
                        self._claim_log.record(waited)
                    else:
                        self._claim_log.record(0.0)
                    return slot
                if start is None:
                    start = time.perf_counter()
                remaining = timeout_s - (time.perf_counter() - start)
                if remaining <= 0 or not self._wait_locked(remaining):
                    if any(s.state == "free" for s in self._slots):
                        continue
                    unconsumed = self._describe_unconsumed_locked()
                    break
        raise OmniPrefixCacheStagingTimeoutError(
            f"save waited {timeout_s:.3f}s for a free staging slot and timed out "
            f"(staging_depth={self.depth}, I2); {PHRASE_UNCONSUMED}: {unconsumed}; "
            f"in-flight writes: {self._describe_in_flight()}. Every step id must be "
            "materialized or discarded exactly once."
        )

    def check_capacity(self, num_rows: int) -> None:
        """A step larger than a page raises; the cache never clamps (I10)."""
        check_capacity(num_rows, self.capacity_tokens)

    def abort(self, slot: StagingSlot) -> None:
        """The save failed after claiming: give the page back unused."""
        with self._lock:
            if slot.num_write_holds:
                raise OmniPrefixCacheUnmatchError(
                    f"cannot abort {slot.describe()}: {slot.num_write_holds} pool write(s) still read "
                    "its page (I3); a save that registered writes cannot be aborted"
                )
            self.machine.fire(slot, "abort")
            slot.num_rows = 0
            # A refused save fixes no key's row shape: only a saved step's keys keep their pages.
            for key in slot.new_keys:
                del self._pages[key]
                del self._slot_pages[key]
                del self._sigs[key]
                for heads in self._head_views:
                    heads.pop(key, None)
            slot.new_keys = []
            if self._num_waiting:
                self._cond.notify_all()

    def save(self, slot: StagingSlot, step_id: StepId, saved_at: str) -> None:
        """Issue ``step_id`` for the claimed slot."""
        with self._lock:
            if step_id in self._by_step:
                raise AssertionError(f"step id {step_id} issued twice: a bug in the manager's counter")
            self.machine.fire(slot, "save", step_id=step_id)
            slot.step_id = step_id
            slot.saved_at = saved_at
            slot.new_keys = []
            self._by_step[step_id] = slot

    def consume(self, step_id: StepId, *, caller: str) -> StagingSlot:
        """Take ``step_id`` exactly once (I1); the caller then reads the page."""
        with self._lock:
            # Only a real int is an id (True == 1 and 1.0 == 1 would find step 1's slot).
            issued = isinstance(step_id, int) and not isinstance(step_id, bool)
            slot = self._by_step.get(step_id) if issued else None
            if slot is None:
                self._note(None, "reject", step_id)
                raise OmniPrefixCacheUnmatchError(
                    f"{caller}: step id {step_id} was {PHRASE_NOT_SAVED} (I1); "
                    f"unconsumed step ids: {sorted(self._by_step)}"
                )
            self.machine.fire(slot, "consume", step_id=step_id)
            del self._by_step[step_id]
            slot.reading = True
            return slot

    def done_reading(self, slot: StagingSlot) -> None:
        """The consumer is done with the page; release it if no write reads it."""
        with self._lock:
            assert slot.reading, f"done_reading on {slot.describe()} without a consume: manager bug"
            slot.reading = False
            if self.machine.recorder is not None:
                self._note(slot, "done_reading", slot.step_id)
            self._release_if_idle_locked(slot)

    def hold(self, slot: StagingSlot) -> None:
        """A pool write will read this page (I3)."""
        with self._lock:
            slot.num_write_holds += 1
            if self.machine.recorder is not None:
                self._note(slot, "hold", slot.step_id)

    def unhold(self, slot: StagingSlot) -> None:
        """A pool write no longer reads this page."""
        with self._lock:
            assert slot.num_write_holds > 0, f"unhold without hold on {slot.describe()}: manager bug"
            slot.num_write_holds -= 1
            if self.machine.recorder is not None:
                self._note(slot, "unhold", slot.step_id)
            self._release_if_idle_locked(slot)

    def _release_if_idle_locked(self, slot: StagingSlot) -> None:
        if slot.state == "materialized" and not slot.reading and slot.num_write_holds == 0:
            step_id = slot.step_id
            self.machine.fire(slot, "release", step_id=step_id)
            slot.step_id = None
            slot.saved_at = None
            slot.num_rows = 0
            if self._num_waiting:
                self._cond.notify_all()

    def _wait_locked(self, timeout_s: float) -> bool:
        """Wait on the condition (lock released meanwhile), counted so releases know to notify."""
        self._num_waiting += 1
        try:
            return self._cond.wait(timeout_s)
        finally:
            self._num_waiting -= 1

    def _note(self, slot: StagingSlot | None, what: str, step_id: StepId | None) -> None:
        """Log bookkeeping for trace validation (holds, reader, rejects); lock held."""
        recorder = self.machine.recorder
        if recorder is not None:
            recorder.note(
                STAGING_TABLE.name, "pool" if slot is None else f"staging slot {slot.index}", what,
                "-" if slot is None else slot.state, step_id,
                depth=self.depth,
                holds=0 if slot is None else slot.num_write_holds,
                reading=False if slot is None else slot.reading,
            )

    # ---- page access: only through a slot in the right state ----------------
    def claimed_pages(
        self, slot: StagingSlot, rows_by_key: dict[TensorName, torch.Tensor], sigs: dict[TensorName, RowSig] | None = None
    ) -> dict[TensorName, torch.Tensor]:
        """``claimed_page`` for every key of a step, with one state check (``sigs``: each key's
        ``row_sig``, when the caller already read it)."""
        with self._lock:
            if slot.state != "claimed":
                raise self._refusal(slot, ("claimed",), f"stage rows of {sorted(rows_by_key)}")
        views = {}
        for key, like in rows_by_key.items():
            num_rows = like.shape[0]
            if num_rows > slot.num_rows:
                raise AssertionError(f"staging {num_rows} rows into {slot.describe()}: manager bug")
            sig = sigs[key] if sigs is not None else row_sig(like)
            views[key] = self._head_view(key, self._page(key, like, slot, sig), slot.index, num_rows)
        return views

    def _head_view(self, key: TensorName, pages: list[torch.Tensor], index: int, num_rows: int) -> torch.Tensor:
        """Rows ``[0, num_rows)`` of ``key``'s page of staging slot ``index`` (the last such view, if
        of the same rows). The caller checked the slot's state under the lock."""
        heads = self._head_views[index]
        cached = heads.get(key)
        if cached is not None and cached[0] == num_rows:
            return cached[1]
        view = pages[index][:num_rows]
        heads[key] = (num_rows, view)
        return view

    def claimed_page(self, slot: StagingSlot, key: TensorName, like: torch.Tensor) -> torch.Tensor:
        """The writable page rows ``[0, len(like))`` of ``key`` for a ``claimed`` slot.

        The page of ``key`` is allocated on first use (outside the lock) with
        ``like``'s row shape and dtype; the caller copies the step's rows in.
        """
        return self.claimed_pages(slot, {key: like})[key]

    def pages_rows(self, slot: StagingSlot, keys: tuple[TensorName, ...], start: int, end: int) -> dict[TensorName, torch.Tensor]:
        """``page_rows`` of several keys with one state check."""
        with self._lock:
            if slot.state not in _READABLE:
                raise self._refusal(slot, _READABLE, f"read rows of {keys}")
            pages = [(key, self._slot_pages[key]) for key in keys]
        if start == 0:
            return {key: self._head_view(key, per_slot, slot.index, end) for key, per_slot in pages}
        return {key: per_slot[slot.index][start:end] for key, per_slot in pages}

    def page_rows(self, slot: StagingSlot, key: TensorName, start: int, end: int) -> torch.Tensor:
        """A view of rows [start, end) of ``slot``'s page; slot saved or materialized."""
        with self._lock:
            if slot.state not in _READABLE:
                raise self._refusal(slot, _READABLE, f"read rows of {key!r}")
            page = self._slot_pages[key][slot.index]
        return page[start:end]

    def _refusal(self, slot: StagingSlot, states: tuple[str, ...], action: str) -> OmniPrefixCacheUnmatchError:
        """The error for a page access through a slot in the wrong state (I3)."""
        return OmniPrefixCacheUnmatchError(
            f"cannot {action} through {slot.describe()}: the staging-slot machine allows it "
            f"only in states {states} (I3)"
        )

    def check_sigs(self, keys: Iterable[TensorName], sigs: dict[TensorName, RowSig]) -> None:
        """Raise unless each of ``keys``, of row signature ``sigs[key]``, matches the row shape
        and dtype of its pages (a key without pages matches)."""
        check_held_sigs("staging page of", self._sigs, sigs, keys)  # no lock: pages are only ever added

    def _page(self, key: TensorName, like: torch.Tensor, slot: StagingSlot, sig: RowSig) -> list[torch.Tensor]:
        """The per-slot page views of ``key`` (allocated on first use), checked against ``sig``."""
        page = self._pages.get(key)
        if page is None:
            fresh = allocate_rows(
                (self.depth, self.capacity_tokens, *like.shape[1:]), like.dtype, pin_memory=self.pin_memory,
                zeroed=False, what=f"save_outputs: cannot allocate the staging pages of {key!r}: staging_depth "
                f"{self.depth} x staging_capacity_tokens {self.capacity_tokens} rows of shape {tuple(like.shape[1:])} "
                f"{like.dtype}")
            with self._lock:
                page = self._pages.setdefault(key, fresh)
                if page is fresh:
                    slot.new_keys.append(key)
                    self._slot_pages[key] = list(fresh.unbind(0))
                    self._sigs[key] = row_sig(fresh[0])
        if self._sigs[key] != sig:
            check_sig(f"staging page of {key!r}", self._sigs[key], sig)
        return self._slot_pages[key]

    # ---- introspection ------------------------------------------------------
    def _describe_unconsumed_locked(self) -> str:
        if not self._by_step:
            return "none (every slot is held by a consumer or a pool write)"
        return ", ".join(
            f"step {sid} saved at {slot.saved_at} in staging slot {slot.index}"
            for sid, slot in sorted(self._by_step.items())
        )

    def unconsumed(self) -> dict[StepId, str]:
        """Unconsumed step ids -> where they were saved."""
        with self._lock:
            return {sid: slot.saved_at or "?" for sid, slot in sorted(self._by_step.items())}

    def slot_states(self) -> list[str]:
        with self._lock:
            return [s.state for s in self._slots]

    def page_bytes(self) -> dict[TensorName, int]:
        with self._lock:
            return {k: p.numel() * p.element_size() for k, p in self._pages.items()}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            num_waits, max_wait = self._waits.count, self._waits.max_s
            dropped = self._claim_log.dropped(self.num_claims)
            states = [s.state for s in self._slots]
        return {
            "depth": self.depth,
            "capacity_tokens": self.capacity_tokens,
            "slots": {st: states.count(st) for st in STAGING_TABLE.states},
            "claims": self.num_claims,
            "claim_waits": num_waits,
            "claim_wait_s_max": max_wait,
            "claim_waits_dropped": dropped,
            "page_bytes": self.page_bytes(),
        }

    @property
    def num_claim_waits(self) -> int:
        with self._lock:
            return self._waits.count

    def record_claim_wait(self, seconds: float) -> None:
        """Add one claim wait to the history (``claim`` records each of its waits here)."""
        with self._lock:
            self._waits.record(seconds)

    def wait_percentiles(self, qs: tuple[float, ...]) -> list[float]:
        """Claim-wait percentiles from the histogram: constant cost, whatever the run's length."""
        with self._lock:
            return self._waits.percentiles(qs)

    def take_claim_waits(self) -> tuple[float, ...]:
        """Each claim's wait in seconds (0.0: a slot was free) since the last call, oldest first;
        at most the log's capacity (older ones are dropped and counted in ``claim_waits_dropped``)."""
        with self._lock:
            return self._claim_log.take()

    def wait_history_footprint(self) -> int:
        with self._lock:
            return self._waits.footprint()

    def wrap_lock(self, wrap: LockWrap) -> Callable[[], None]:
        """Instrumentation seam (``locks.LockWrap``): guard the pool with ``wrap(lock)`` until the
        returned undo runs; the condition is rebuilt on it. Only while no call is in flight."""
        inner = self._lock
        self._lock = wrap(inner)
        self._cond = threading.Condition(self._lock)

        def undo() -> None:
            self._lock = inner
            self._cond = threading.Condition(inner)

        return undo

    def close(self) -> None:
        """Shutdown began (contract 4.6): refuse every claim not yet made, and wake the waiting ones."""
        with self._lock:
            self._closed = True
            self._cond.notify_all()

    def _shutdown_refusal_locked(self, waited: bool) -> str:
        states = ", ".join(s.describe() for s in self._slots)
        return (
            f"save_outputs refused: {PHRASE_SHUT_DOWN} -- shutdown() began before this save claimed "
            f"a staging slot ({'it was waiting for one' if waited else 'it had not asked for one yet'}; "
            f"staging_depth={self.depth}: {states}; {PHRASE_UNCONSUMED}: "
            f"{self._describe_unconsumed_locked()}); no step id was issued and nothing was saved "
            "(contract 4.6)"
        )

    def set_failed(self, message: str) -> None:
        """The manager failed (I8): every claim, waiting or not, raises ``message``."""
        with self._lock:
            if self._failure is None:
                self._failure = message
            self._cond.notify_all()
