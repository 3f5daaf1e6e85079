"""OmniPrefixCacheManager: the per-step protocol of the omni prefix cache.

Owns: the live requests (their pending hits are a ``hits.PendingHits`` it guards
with its state lock), the step ids it took from the process-wide counter (another
manager's id is never one of ours), and the state lock over all of those. It composes
the staging pool (pages), the write book (write lifecycle and queue), the write scheduler
(``scheduling``: registration, landing order, the open deferred writes and their
GPU-byte budget, under the same state lock), the step consumption (``consumption``: the
unconsumed step contexts and their single consumers, under the same state lock), the
committer (copies and landing), the block pool and the slot tenancy (versions and
preserved rows). ``wrap_locks`` is the documented seam that lets a profiler time every
runtime lock. The hidden-state tier's pool side (``omni_cache.runtime.tier_rows``: restores
registered as writes, reads of a block's rows) reaches the manager through one door,
``tier_port`` (a ``TierPort``), and its public collaborators; nothing outside this module
touches the manager's private state.

Per real scheduler step (spec/protocol.md): ``new_step_starts`` ->
forward -> ``save_outputs`` -> (a verify step of speculative decoding: ``trim_step``) ->
exactly one of ``materialize`` / ``discard_step`` (possibly on another thread while the
engine saves the next steps); the consumer's calls are checked here (I8, shutdown) and
delegated to ``consumption``.

Upholds: I1 (the save puts a step's context in place before ``StagingPool.save`` makes its
id consumable; ``consumption`` and ``StagingPool.consume`` take it once), I8 for saves (a
failure inside ``save_outputs`` is undone before any write is registered, or sticky after),
I2/I3/I10 (staging), I4 (the step context), I5 (``new_step_starts`` validates hits), I12
(request identity: events are applied per admission, planned by ``admissions.plan_events``),
I13 (a step whose ``sequence`` is not above the last applied one changes nothing), I6/I7
(tenancy reads), I8 (every entry checks the sticky failure), I9 (finish/abort push open
writes to the queue's front), I11 (the state lock is held only for dictionary bookkeeping:
never across a wait, a copy or a budget flush; the ``on_blocking`` fault hook lets tests
assert it), I14 (``trim_step``, through ``consumption``: a verify step's cut rows are never
materialized, and their KV slots are vacated; ``step_trim.trim_rows``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache.runtime.admissions import Admission, lookup_of, plan_events, plans_nothing
from omni_cache.runtime.block_pool import PrefixBlockPool
from omni_cache.runtime.consumption import StepConsumption
from omni_cache.runtime.copier import Committer, CopyEngine
from omni_cache.runtime.errors import (
    PHRASE_SHUT_DOWN,
    OmniPrefixCacheUnmatchError,
)
from omni_cache.runtime.events import (
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
    scheduled_counts,
)
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.hits import PendingHits
from omni_cache.runtime.interface import (
    ModelCachePolicy,
    PrefixCacheConfig,
    ReqId,
    StageCacheOutputs,
    StepId,
    WriteSchedule,
)
from omni_cache.runtime.locks import LockWrap, OwnedLock, SaveGate, caller_location
from omni_cache.runtime.reader import StepReader
from omni_cache.runtime.scheduling import WriteScheduler
from omni_cache.runtime.staging import StagingPool
from omni_cache.runtime.step_outputs import StepContext, classify_outputs, copy_leftovers
from omni_cache.runtime.tenancy import PlannedRead, SlotTenancy
from omni_cache.runtime.tier_rows import TierPort
from omni_cache.runtime.trace import TraceRecorder
from omni_cache.runtime.validation import (
    check_scheduled,
    validate_hit,
    validate_save,
)
from omni_cache.runtime.writes import PoolWrite, WriteBook

log = logging.getLogger(__name__)

# Step ids come from one process-wide counter: an id issued by another manager instance is
# never one of this manager's, so it is "already consumed or never saved" here (I1).
_STEP_IDS = itertools.count(1)

@dataclass
class _Request:
    """A live request. Mutated only under the manager's state lock."""

    req_id: ReqId
    # Owner of this admission and its lookup (I12).
    admission: Admission = field(default_factory=Admission)


class OmniPrefixCacheManager:
    """Keeps per-token stage outputs in host memory, addressed by KV slots.

    Thread model: the engine thread calls ``new_step_starts`` and
    ``save_outputs``; any thread may call ``materialize`` / ``discard_step``;
    in async mode (``eager=False``) a committer thread lands pool writes.
    """

    def __init__(
        self,
        config: PrefixCacheConfig,
        *,
        eager: bool | None = None,
        recorder: TraceRecorder | None = None,
        faults: FaultHooks | None = None,
    ) -> None:
        if not isinstance(config, PrefixCacheConfig):
            raise TypeError(f"config must be a PrefixCacheConfig, got {type(config).__name__}")
        cuda = torch.cuda.is_available()
        self.config = config
        self.eager = (not cuda) if eager is None else bool(eager)
        self.use_cuda = cuda and not self.eager
        self.faults = faults or FaultHooks()
        self.recorder = recorder
        self.pool = PrefixBlockPool(config.num_slots, pin_memory=self.use_cuda)
        try:
            self.tenancy = SlotTenancy(self.pool, recorder)
        except MemoryError as exc:  # one int64 per KV slot at start: a sizing problem, named as one
            raise ValueError(
                f"PrefixCacheConfig.num_blocks x block_size = {config.num_blocks} x {config.block_size} = "
                f"{config.num_slots:,} KV slots: their per-slot bookkeeping ({8 * config.num_slots:,} bytes at "
                f"start, more per key) cannot be allocated ({exc})") from exc
        self.book = WriteBook(config.staging_claim_timeout_s, recorder)
        self.staging = StagingPool(
            config.staging_depth,
            config.staging_capacity_tokens,
            config.staging_claim_timeout_s,
            pin_memory=self.use_cuda,
            recorder=recorder,
            describe_in_flight=self.book.describe_in_flight,
        )
        self.copies = CopyEngine(use_cuda=self.use_cuda, chunk_bytes=config.copy_chunk_bytes)
        self.committer = Committer(
            self.book, self.tenancy, self.staging, self.copies, self.faults, threaded=not self.eager
        )
        # late-bound: an instrumented ``scheduling.flush`` (``omni-cache bench --profile``) is the one called
        self.reader = StepReader(self.staging, self.tenancy, self.book, self.copies, self.faults,
                                 lambda writes, why: self.scheduling.flush(writes, front=True, why=why))
        # ---- guarded by _lock (the state lock; I11: bookkeeping only) ----
        self._lock = OwnedLock()
        self.policy = ModelCachePolicy()
        self._num_saved = 0
        self._requests: dict[ReqId, _Request] = {}
        # req -> (hit_end, group-0 block ids) from STARTED/RESUMED, served by its next save; guarded
        # by the state lock like ``policy`` (a public attribute: a profiler may wrap its methods).
        self.hits = PendingHits(config.block_size, config.output_group_id)
        self._scheduled: dict[ReqId, int] = {}
        self._last_sequence: int | None = None  # of the last applied PrefixCacheStep (I13)
        self._ids_issued = 0  # step ids this manager took from _STEP_IDS (``_issue_step_id``)
        self._last_immediate: PoolWrite | None = None
        self._shut_down = False
        # The saves in progress (its own lock): shutdown closes it and waits for them (contract 4.6).
        self._saves = SaveGate()
        self.counters = {"hits": 0, "hit_tokens": 0, "misses": 0, "saved": 0, "saved_rows": 0,
                         "materialized": 0, "discarded": 0, "budget_flushes": 0,
                         "replayed_steps": 0, "stale_events": 0, "tier_restores": 0,
                         "trimmed_rows": 0}
        # Registration and landing order of the pool writes; shares the state lock.
        self.scheduling = WriteScheduler(book=self.book, tenancy=self.tenancy, staging=self.staging,
                                         committer=self.committer, faults=self.faults, lock=self._lock,
                                         count=self._count, issue_step_id=self._issue_step_id,
                                         gpu_staging_bytes=config.gpu_staging_bytes)
        # The saved steps' contexts and their single consumers; shares the state lock.
        self.consumption = StepConsumption(lock=self._lock, staging=self.staging, reader=self.reader,
                                           count_locked=self._count_locked, vacate=self.scheduling.vacate)
        self.tier_port = TierPort(self.check_usable, self.scheduling.register_restored, self.scheduling.vacate)

    # ------------------------------------------------------------------ API --
    def register_policy(self, policy: ModelCachePolicy) -> None:
        """Freeze the model's cache policy; only before the first save."""
        if not isinstance(policy, ModelCachePolicy):
            raise TypeError(f"policy must be a ModelCachePolicy, got {type(policy).__name__}")
        with self._lock:
            if self._num_saved and policy != self.policy:
                raise OmniPrefixCacheUnmatchError(
                    f"register_policy after {self._num_saved} saved steps would change which keys "
                    f"are cached ({self.policy} -> {policy}); register it before the first save"
                )
            self.policy = policy

    def new_step_starts(
        self,
        events: PrefixCacheStep | Iterable[PrefixCacheRequestEvent],
        *,
        num_scheduled_tokens: dict[ReqId, int] | None = None,
    ) -> None:
        """Apply one step's events per admission (I12): end admissions (finished, aborted,
        replaced) and push their open writes to the queue's front (I9), admit new ones,
        register lookups (hits of started/resumed requests, I5). A replayed step (same
        ``sequence``) changes nothing (I13); an error changes nothing."""
        self.check_usable("new_step_starts")
        try:  # typed input is refused at the door, with the contract error; nothing has changed yet
            step = events if isinstance(events, PrefixCacheStep) else PrefixCacheStep(events)
            extra = scheduled_counts("num_scheduled_tokens", num_scheduled_tokens) if num_scheduled_tokens else {}
        except TypeError as exc:
            raise OmniPrefixCacheUnmatchError(f"new_step_starts: {exc}; nothing was applied") from exc
        scheduled = {**step.scheduled_tokens, **extra} if extra else dict(step.scheduled_tokens)
        with self._lock:
            if step.sequence is not None and self._last_sequence is not None \
                    and step.sequence <= self._last_sequence:
                self.counters["replayed_steps"] += 1
                return
            # a decode step: no admission changes, nothing to validate (I12)
            if not step.events or plans_nothing(step.events, self._requests):
                self._scheduled = scheduled
                if step.sequence is not None:
                    self._last_sequence = step.sequence
                return
            # only the ids this step names: O(events), not O(live requests)
            live = {e.req_id: r.admission for e in step.events if (r := self._requests.get(e.req_id)) is not None}
        plan = plan_events(step.events, live, self.config.block_size, self.config.output_group_id)
        for _, _, arg in plan.changes:  # validate everything first: an error changes nothing
            if isinstance(arg, PrefixCacheRequestEvent) and (arg.hit_end or arg.hit_start):  # a lookup's event
                validate_hit(arg, self.config)
        to_flush: list[PoolWrite] = []
        with self._lock:
            for _, req_id, arg in plan.changes:  # the op is told by the argument's type
                if arg is None:  # "end"
                    self.hits.drop(req_id)
                    self._requests.pop(req_id, None)
                    to_flush.extend(self.scheduling.take_open_of_locked(req_id))
                elif isinstance(arg, Admission):  # "admit"
                    self.hits.drop(req_id)
                    self._requests[req_id] = _Request(req_id, arg)
                else:  # "lookup": the event
                    self._install_lookup(req_id, arg)
            self._scheduled = scheduled
            self.counters["stale_events"] += plan.stale
            if step.sequence is not None:
                self._last_sequence = step.sequence
        if to_flush:
            self.scheduling.flush(to_flush, front=True, why="finished/aborted/replaced requests' open writes (I9)")

    def _install_lookup(self, req_id: ReqId, event: PrefixCacheRequestEvent) -> None:
        """A lookup's hit (or miss) for the request's current admission. Caller holds the lock."""
        request = self._requests[req_id]
        request.admission = Admission(request.admission.owner, lookup_of(event, self.config.block_size, self.config.output_group_id))
        if self.hits.install(req_id, event):
            self.counters["hits"] += 1
            self.counters["hit_tokens"] += event.hit_end
        else:
            self.counters["misses"] += 1

    def save_outputs(
        self,
        hidden_states: torch.Tensor | None,
        mm_outputs: dict[str, Any] | None,
        *,
        num_tokens_unpadded: int,
        num_tokens_padded: int,
        write_layout: PrefixCacheWriteLayout,
    ) -> StepId:
        """Claim a staging slot, copy this step's rows, register writes; return the step id.

        A save that has not claimed its page when ``shutdown`` begins is refused (nothing
        changes); one that has claimed it finishes, and its write lands before ``shutdown``
        returns (contract 4.6)."""
        self.check_usable("save_outputs")
        if not self._saves.enter():
            raise OmniPrefixCacheUnmatchError(f"cannot save_outputs: {PHRASE_SHUT_DOWN}")
        try:
            return self._save(hidden_states, mm_outputs, num_tokens_unpadded, num_tokens_padded, write_layout)
        finally:
            self._saves.leave()

    def _save(self, hidden_states: torch.Tensor | None, mm_outputs: dict[str, Any] | None,
              num_tokens_unpadded: int, num_tokens_padded: int, write_layout: PrefixCacheWriteLayout) -> StepId:
        n = num_tokens_unpadded
        slots, step_rows = validate_save(self.config, self.policy, hidden_states, mm_outputs, n,
                                         num_tokens_padded, write_layout)
        slots_np = self.pool.check_slots(slots, where="save_outputs", distinct=True, describe_row=step_rows.describe_row)
        with self._lock:
            policy = self.policy
            scheduled = self._scheduled  # cleared only by a save that succeeds
            prev = self._last_immediate
        check_scheduled(scheduled, step_rows)
        split = classify_outputs(policy, hidden_states, mm_outputs or {}, n, num_tokens_padded)
        sigs = split.sigs  # each per-token key's (dtype, row shape), read once by classify_outputs
        self.staging.check_sigs(split.immediate, sigs)  # a key's row shape and dtype never change
        self.pool.check_sigs(sigs)  # also a key whose registered write has not landed yet
        leftover = copy_leftovers(split.leftover) if split.leftover else {}  # refused before a claim (I4)
        if prev is not None and prev.state != "written":
            self.faults.on_blocking("save waits for the previous step's pool writes")
            self.book.wait(prev, ("written",), why=f"save_outputs waits for {prev.describe()}")
        compute_event = self.copies.record_compute_event()
        saved_at = caller_location()
        hits = {}
        if self.hits:  # only the engine thread (this one) installs hits: no lock needed to see none
            with self._lock:
                hits = self.hits.take(step_rows, slots_np)  # raises (taking nothing) if one is not continued (I5)
        step_id: StepId | None = None
        plans: list[PlannedRead] = []
        registered: list[PoolWrite] = []
        reserved: list[str] = []  # new keys' pool tensors, given back if this save is refused
        slot = None
        ctx: StepContext | None = None
        try:
            # A new key's pool tensor and per-slot bookkeeping are allocated after every refusal that
            # reads the step and before anything is claimed (a refusal here has nothing to undo but
            # the hits), so neither registration nor landing below allocates.
            # NOTE: a claim refused after it (staging timeout, shutdown) keeps a new key's empty
            # columns: no version of it is registered, so its slots read as absent (I7).
            reserved = self.tenancy.prepare_keys(sigs)  # every per-token key, immediate and deferred
            self.faults.on_blocking("save claims a staging slot")
            slot = self.staging.claim(n)  # refused once shutdown began (contract 4.6)
            self.faults.after_claim(slot)
            step_id = self._issue_step_id()  # only once a page is held: a refused save burns no id
            views = self.staging.claimed_pages(slot, split.immediate, sigs)
            copy_event = self.copies.copy_all(views, split.immediate, compute_event)
            deferred_dev = {k: self.copies.device_clone(v) for k, v in split.deferred.items()}
            deferred_host, host_events = {}, []
            for key, rows in split.deferred.items():
                deferred_host[key], event = self.copies.to_host(rows, compute_event)
                host_events.append(event)
            hit_keys = self.hits.hit_keys(policy, (*split.immediate, *split.deferred))
            req_ids = step_rows.req_ids
            # Registration: from here on a failure cannot be rolled back (versions are
            # published), so it fails the manager for good (I8) instead.
            imm, older = self.scheduling.register(WriteSchedule.JOIN_NEXT_STEP, step_id, slots, slots_np, views, slot,
                                        req_ids, registered, sigs)
            if imm is not None:
                imm.copy_event = copy_event
            deferred, older_deferred = self.scheduling.register(
                WriteSchedule.JOIN_ON_FINISH, step_id, slots, slots_np, deferred_dev, None, req_ids, registered, sigs)
            if deferred is not None:
                deferred.copy_event = self.copies.record_compute_event()  # after the clones
            elif imm is None:  # no per-token key at all: still the slots' new tenant (I6/I7)
                self.tenancy.take_slots(slots_np, step_id=step_id)
            # Plan hit reads after this step's writes are registered: vLLM publishes block
            # hashes at allocation, so a request may hit blocks another request of this
            # very step computes; their planned version is then this step's write.
            planned: dict[ReqId, PlannedRead] = {}
            if hit_keys:
                for req_id, (_, blocks) in hits.items():
                    planned[req_id] = self.tenancy.plan(list(hit_keys), self.hits.slots_of(blocks),
                                                         block_size=self.config.block_size)
                    plans.append(planned[req_id])
            ctx = StepContext(step_id, slot, saved_at, step_rows, planned, tuple(split.immediate), imm, deferred_host,
                              leftover, hit_keys, policy.hidden_key is not None, host_events, slots_np)
            # NOTE: the context is in place before the staging save makes the id consumable, so a
            # consumer can never consume the step without its context (I1).
            with self._lock:
                self.consumption.put_locked(ctx)
            self.staging.save(slot, step_id, saved_at)
        except BaseException as exc:
            if ctx is not None:  # its step id was never handed out: no consumer may keep it
                with self._lock:
                    self.consumption.drop_locked(ctx.step_id)
            if registered:  # versions may be published: not undoable, so fail for good (I8)
                self.scheduling.fail_registered(registered, exc, where=f"save_outputs step {step_id}")
                raise  # the original exception itself; later entries chain it (I8)
            for plan in plans:
                self.tenancy.unplan(plan)
            self.pool.drop_reserved(reserved)
            with self._lock:
                self.hits.restore(hits)
            if slot is not None and slot.state == "claimed":
                self.staging.abort(slot)
            raise
        with self._lock:
            if self._scheduled is scheduled:
                self._scheduled = {}
            self._num_saved += 1
            self.counters["saved"] += 1
            self.counters["saved_rows"] += n
            if imm is not None:
                self._last_immediate = imm
            if deferred is not None:
                self.scheduling.open_deferred_locked(deferred)
                for req_id in req_ids:
                    if req_id not in self._requests:  # one the engine never announced is live from here
                        self._requests[req_id] = _Request(req_id)
        try:
            self.scheduling.after_save(imm, older | older_deferred, plans)
        except BaseException as exc:  # the step's versions are published: fail for good (I8)
            self.scheduling.fail_registered(registered, exc, where=f"save_outputs step {step_id}")
            raise
        return step_id

    def materialize(self, step_id: StepId, req_ids: Sequence[ReqId]) -> StageCacheOutputs:
        """Per request: cached prefix rows then this step's rows (consumes the step id once)."""
        self.check_usable("materialize")
        return self.consumption.materialize(step_id, req_ids)

    def trim_step(self, step_id: StepId, keep: Mapping[ReqId, int]) -> None:
        """A verify step's verdict (speculative decoding, contract 4.14), before its step id is handed on:
        request ``r`` keeps its first ``keep[r]`` rows of the step; materialize never returns the rest
        (rejected draft tokens' rows), and their KV slots are vacated (I14). A refusal changes nothing."""
        self.check_usable("trim_step")
        self.consumption.trim(step_id, keep)

    def discard_step(self, step_id: StepId) -> None:
        """Consume ``step_id`` without building outputs (payload built from live outputs, or error)."""
        self.check_usable("discard_step")
        self.consumption.discard(step_id)

    def shutdown(self) -> dict[StepId, str]:
        """Refuse saves that have not claimed a page, let the ones that have finish, drain the
        queue and stop the committer; report (log and return) every unconsumed step id and
        where it was saved (contract 4.6)."""
        with self._lock:
            already, self._shut_down = self._shut_down, True
        if not already:
            self.staging.close()  # a claim not yet made, waiting or not, is refused from now on
            timeout_s = max(10.0, self.config.staging_claim_timeout_s)
            if still := self._saves.close_and_wait(timeout_s):
                log.error("omni-cache shutdown: %d save(s) still running after %.1fs; their writes "
                          "may not land", still, timeout_s)
            self.committer.stop()
        unconsumed = self.staging.unconsumed()
        if unconsumed and not already:
            log.warning("omni-cache shutdown with %d unconsumed step ids: %s", len(unconsumed),
                        "; ".join(f"step {s} saved at {w}" for s, w in unconsumed.items()))
        return unconsumed

    def stats(self) -> dict[str, Any]:
        """Staging occupancy and waits, unconsumed ids, writes in flight, pool bytes, hits and misses."""
        with self._lock:
            counters = dict(self.counters)
            deferred_open, deferred_bytes = self.scheduling.deferred_stats_locked()
            live = len(self._requests)
        p50, p99 = self.staging.wait_percentiles((0.5, 0.99))  # a fixed-size histogram: O(1) in run length
        return {
            "staging": self.staging.stats(),
            "staging_wait_s_p50": p50,
            "staging_wait_s_p99": p99,
            "unconsumed_step_ids": self.staging.unconsumed(),
            "writes_in_flight": len(self.book.live()),
            "write_queue": self.book.queue_length(),
            "writes_written": self.book.num_written,
            "writes_failed": self.book.num_failed,
            "deferred_open": deferred_open,
            "deferred_bytes_on_device": deferred_bytes,
            "pool_bytes": self.pool.nbytes(),
            "preserved_rows": self.tenancy.num_preserved(),
            "live_requests": live,
            "failed": self.book.failure,
            **counters,
        }

    def wrap_locks(self, wrap: LockWrap) -> Callable[[], None]:
        """Instrumentation seam (``omni-cache bench --profile`` times lock waits with it): guard the
        state lock, the staging pool, the write book, the block pool's leaf lock and the committer's
        drain lock with ``wrap(lock)`` (a lock-like proxy) until the returned undo runs. Only on an
        idle manager: no call in flight and no committer thread (``eager=True``)."""
        undos = [self._lock.wrap_lock(wrap), self.staging.wrap_lock(wrap), self.book.wrap_lock(wrap)]
        inner_pool_lock = self.pool.lock
        self.pool.lock = wrap(inner_pool_lock)
        undos.append(lambda: setattr(self.pool, "lock", inner_pool_lock))
        undos.append(self.committer.wrap_lock(wrap))

        def undo() -> None:
            for step in reversed(undos):
                step()

        return undo

    def take_staging_waits(self) -> tuple[float, ...]:
        """Each save's wait for a staging slot, in seconds (0.0: a slot was free), since the last
        call: the observations behind a wait histogram (contract 4.13)."""
        return self.staging.take_claim_waits()

    def state_lock_held_by_current_thread(self) -> bool:
        """For I11 tests: does the calling thread hold the state lock?"""
        return self._lock.held_by_current_thread()

    # ------------------------------------------------------------- helpers --
    def check_usable(self, what: str) -> None:
        """Raise the contract error that every entry point raises for ``what`` once the manager
        cannot take it: a write failed (I8), ``shutdown`` began, or the committer thread died."""
        self.book.check_failed(what)  # I8
        if self._shut_down:
            raise OmniPrefixCacheUnmatchError(f"cannot {what}: {PHRASE_SHUT_DOWN}")
        if not self.committer.alive:
            raise OmniPrefixCacheUnmatchError(f"cannot {what}: the committer thread is not running")

    def _count(self, counter: str) -> None:
        with self._lock:
            self.counters[counter] += 1

    def _count_locked(self, counter: str, n: int) -> None:
        self.counters[counter] += n

    def _issue_step_id(self) -> StepId:
        with self._lock:
            self._ids_issued += 1
            return next(_STEP_IDS)
