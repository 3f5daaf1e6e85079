"""Rows out of a served engine: each finished request's full-prompt hidden states as a file.

Owns: the plain data that crosses vLLM's scheduler/worker boundary for delivery
(``DeliveryTarget``: where a request's file goes, ``DeliveryPlan``: a step's new targets and
finished requests, ``DeliveryResult``: what became of one request's file) and
``RowDelivery``, the worker half (its settings: ``delivery_settings.DeliverySettings``): it
consumes every step id the runner bridge saves
(``materialize`` for the requests that still need rows, ``discard_step`` when none does),
keeps each request's rows by token position until its file is complete, hands the file to a
writer thread and waits for it, bounded, before the step ends, so the scheduler learns the
outcome in the same step (``take_results``). No vLLM import.

When a file is complete: by default when the request's prompt has been computed (its rows are
``[0, num_prompt_tokens)``: cached prefix rows and computed rows, in prompt order), written in
the step that computes the prompt's last token, before the step's output reaches the client.
With ``include_output_tokens`` (the request's ``kv_transfer_params``, or the setting) the file
also holds the rows of every output token but the last (which is never an input of a forward),
and is written in the step after the request finished, when its token ids are known; the
client, told the path at the finish, waits on the file's lock as vLLM's reader does.

Upholds, per request: the file's row count equals its token count and every row is one the
cache served (``materialize``, I4/I6/I7), never zeros: a position no saved step covered fails
the delivery, naming the positions. A fault fails that request's delivery, never the engine:
a step whose save failed has its requests' deliveries failed (and its slots vacated by the
bridge, so no later hit reads an older tenant's rows there); a failed materialize fails the
requests it was asked for; a write that fails (a full disk, a missing directory) or does not
finish within ``timeout_s`` fails its request with the reason (and is never published; one still
waiting for a writer is never written at all), and a backlog of more than
``max_pending`` unfinished writes fails new ones at once instead of stalling the engine; writes
given up on never hold a later file back (the writers outnumber the backlog allowed). Every
step id given to ``consume`` is consumed exactly once (I1), whatever happens to the rows.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache.integration.delivery_files import DeliveryDirInUse, DeliveryStore
from omni_cache.integration.delivery_settings import DeliverySettings
from omni_cache.runtime.errors import ErrorTally, OmniPrefixCacheUnmatchError
from omni_cache.runtime.histogram import ObservationLog
from omni_cache.runtime.interface import HIDDEN_KEY, StepId

__all__ = ["DeliveryPlan", "DeliveryResult", "DeliveryTarget", "RowDelivery"]

log = logging.getLogger(__name__)

FORMAT = "omni-cache hidden states v1"


# ---------------------------------------------------------------- plain data across processes
@dataclass(frozen=True)
class DeliveryTarget:
    """Where request ``req_id``'s file goes (``path``), or why it cannot go anywhere (``error``)."""

    req_id: str
    path: str | None
    error: str | None
    num_prompt_tokens: int
    include_output_tokens: bool


@dataclass(frozen=True)
class DeliveryPlan:
    """One step's delivery news from the scheduler: requests first scheduled now (``targets``),
    ``include_output_tokens`` requests that finished (their token ids, all but the last),
    requests that ended without needing a file any more (``dropped``: aborted, or finished
    before their prompt was computed) and prompt-only requests that ended (``told``: their
    outputs, which name the file, are out, so retention may count the file from now)."""

    targets: tuple[DeliveryTarget, ...] = ()
    finished: tuple[tuple[str, tuple[int, ...]], ...] = ()
    dropped: tuple[str, ...] = ()
    told: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.targets or self.finished or self.dropped or self.told)


@dataclass(frozen=True)
class DeliveryResult:
    """What became of one request's file: ``path`` written, or ``error``."""

    req_id: str
    path: str | None
    error: str | None = None
    num_tokens: int = 0
    cached_tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    def as_params(self) -> dict[str, Any]:
        """The request output's ``kv_transfer_params`` entries."""
        if self.error is not None:
            return {"hidden_states_error": self.error}
        return {"hidden_states_path": self.path, "hidden_states_num_tokens": self.num_tokens,
                "hidden_states_cached_tokens": self.cached_tokens}


# ---------------------------------------------------------------------------- the worker half
_WRITING_SLOTS = 2  # files serialized and written at a time


@dataclass
class _Job:
    """One file on its way to disk; ``published`` and ``cancelled`` change under ``lock``."""

    target: DeliveryTarget
    num_tokens: int
    cached_tokens: int
    started: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    published: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    future: cf.Future[int] | None = None
    nbytes: int = 0  # the file's size, set before it is written
    holds_slot: bool = False  # holds one of the writing slots (``RowDelivery._slots``)


@dataclass
class _Rows:
    """A request's rows so far, by token position (later steps win: a preempted request's
    recomputed rows replace its earlier ones)."""

    target: DeliveryTarget
    prompt_token_ids: tuple[int, ...] | None
    lock_fd: int | None
    chunks: list[tuple[int, dict[str, torch.Tensor]]] = field(default_factory=list)
    cached_tokens: int = 0
    done: bool = False  # its file has been handed to the writer (or its delivery failed)


class RowDelivery:
    """The worker half of delivery (see the module docstring). Engine thread, except the
    writer threads that run ``DeliveryStore.write``."""

    def __init__(self, settings: DeliverySettings, *, store: DeliveryStore | None = None, claim: bool = True,
                 replica: int = 0) -> None:
        """``claim``: this worker delivers (the output rank), so its store takes the directory (as
        data-parallel replica ``replica``); a directory another live server holds is refused here,
        naming the setting."""
        self.settings = settings
        if store is None:
            try:
                store = DeliveryStore(settings.delivery_dir, max_bytes=settings.delivery_max_bytes,
                                      max_age_s=settings.delivery_max_age_s, claim=claim, replica=replica)
            except DeliveryDirInUse as exc:
                raise DeliveryDirInUse(f"OmniKVConnector: omni_cache.delivery_dir: {exc}") from None
            except OSError as exc:  # cannot be created or written: refused at start, not at every request
                raise ValueError(f"OmniKVConnector: omni_cache.delivery_dir {settings.delivery_dir!r} cannot hold "
                                 f"the delivered files: {exc}") from exc
        self.store = store
        # NOTE: two files serialize and write at a time (``_slots``: a file's payload is built whole in
        # memory). A write given up on (timed out) gives its slot to the next file but keeps its thread
        # until the disk returns; up to ``delivery_max_pending`` of them may run (then new files fail at
        # once), so the threads outnumber them by the two slots: stuck writes never hold a later file
        # back. Threads start on demand.
        self._slots = threading.Semaphore(_WRITING_SLOTS)
        self._writers = cf.ThreadPoolExecutor(max_workers=settings.delivery_max_pending + _WRITING_SLOTS,
                                              thread_name_prefix="omni-cache-delivery")
        self._requests: dict[str, _Rows] = {}
        # Prompt-only files handed to a writer whose request still runs: held from retention until the
        # plan's ``told`` (the request's output, which names the file, is out). Engine thread only.
        self._held: dict[str, str] = {}
        self._step_jobs: list[_Job] = []  # submitted this step: waited for by finish_step
        self._abandoned: list[_Job] = []  # timed out, still running: count against max_pending
        self._results: list[DeliveryResult] = []
        self._failed_reason: str | None = None  # the whole cache failed: every delivery fails
        self.counters = {"files": 0, "bytes": 0, "failures": 0, "steps_materialized": 0, "steps_discarded": 0}
        # Seconds from hand-off to published, per file, until the metrics report takes them (bounded).
        self._latencies = ObservationLog()
        self.errors = ErrorTally()  # the contract errors a materialize raised (each failed its requests)

    # ----------------------------------------------------------------- per step
    def begin_step(self, plan: DeliveryPlan | None, prompt_token_ids: Mapping[str, Any]) -> None:
        """Top of the step: admit the plan's new targets (holding their lock files), hand over the
        files of finished ``include_output_tokens`` requests, forget dropped ones."""
        if not plan:
            return
        for target in plan.targets:
            self._admit(target, prompt_token_ids.get(target.req_id))
        for req_id, token_ids in plan.finished:
            rows = self._requests.get(req_id)
            if rows is not None and not rows.done:
                # NOTE: a prompt given as prompt_embeds has no token ids (vLLM counts it in placeholder
                # zeros): its file's token_ids stay empty, as with prompt rows only (vLLM's own connector)
                ids = None if rows.prompt_token_ids is None else tuple(token_ids)
                self._complete(req_id, rows, len(token_ids), ids)
        for req_id in plan.dropped:
            rows = self._requests.pop(req_id, None)
            if rows is not None and not rows.done and rows.target.path is not None:
                self.store.discard_lock(rows.target.path, rows.lock_fd)  # its client was told no path
        for req_id in plan.told:
            self._unhold(req_id)

    def consume(self, manager: Any, step_id: StepId, spans: Iterable[tuple[str, int, int]]) -> None:
        """Consume ``step_id`` (exactly once): materialize the rows the step's requests still
        need, discard it when none does; complete the files whose rows are all here."""
        needed = [(r, s, e) for r, s, e in spans if self._needs_rows(r, s)]
        if not needed:
            manager.discard_step(step_id)
            self.counters["steps_discarded"] += 1
            return
        try:
            out = manager.materialize(step_id, [r for r, _, _ in needed])
        except Exception as exc:  # the requests fail, the engine does not
            self.errors.record(exc)
            # NOTE: a materialize that failed before consuming would leave the step's staging slot
            # pinned (I1/I2): discard it; one that consumed it already refuses, which is fine.
            with contextlib.suppress(OmniPrefixCacheUnmatchError):
                manager.discard_step(step_id)
            self.fail_requests([r for r, _, _ in needed], f"materialize of step {step_id} failed: {exc}")
            return
        self.counters["steps_materialized"] += 1
        pool_keys = manager.pool.keys()  # every per-token key the cache holds
        keys = [k for k in pool_keys if k != HIDDEN_KEY]
        for req_id, start, end in needed:
            rows = self._requests[req_id]
            hidden = out.hidden_states[req_id] if out.hidden_states is not None else None
            tensors: dict[str, torch.Tensor] = {}
            if hidden is not None:
                tensors["hidden_states"] = hidden
            for key in keys:
                value = out.mm_outputs.get(key, {}).get(req_id)
                if isinstance(value, torch.Tensor):
                    tensors[key] = value
            if keys and {"hidden_states", "token_ids"} & set(keys):
                self._fail(req_id, rows, f"a per-token key is named like a file tensor: {sorted(keys)}")
                continue
            if not tensors:
                self._fail(req_id, rows, f"step {step_id} served no per-token rows for the request")
                continue
            count = {int(t.shape[0]) for t in tensors.values()}
            if len(count) != 1:
                self._fail(req_id, rows, f"step {step_id} served {sorted(count)} rows for one request's keys")
                continue
            (n,) = count
            if end == n:  # rows from position 0: the request (re)starts here, with a hit or without
                rows.cached_tokens = n - (end - start)  # (after a preemption, only the latest start's hit)
            rows.chunks.append((end - n, tensors))
            target = rows.target
            if not target.include_output_tokens and end >= target.num_prompt_tokens:
                self._complete(req_id, rows, target.num_prompt_tokens, rows.prompt_token_ids)

    def fail_requests(self, req_ids: Iterable[str], reason: str) -> None:
        """Fail the delivery of ``req_ids`` (e.g. the step that should have saved their rows failed)."""
        for req_id in req_ids:
            rows = self._requests.get(req_id)
            if rows is not None and not rows.done:
                self._fail(req_id, rows, reason)

    def fail_all(self, reason: str) -> None:
        """The cache failed for good: every open delivery fails now, every later one at admission."""
        self._failed_reason = reason
        self.fail_requests(list(self._requests), reason)

    def finish_step(self) -> None:
        """End of the step (``wait_for_save``): wait, bounded by ``delivery_timeout_s`` in all,
        for the files handed to the writer this step; a file not done by then fails its request."""
        deadline = time.monotonic() + self.settings.delivery_timeout_s
        jobs, self._step_jobs = self._step_jobs, []
        given_up: list[_Job] = []
        for job in jobs:
            assert job.future is not None
            try:
                nbytes = job.future.result(timeout=max(0.0, deadline - time.monotonic()))
            except cf.TimeoutError:
                with job.lock:
                    if not job.published:
                        job.cancelled.set()
                self._abandoned.append(job)  # still running: it counts against max_pending
                given_up.append(job)
                if job.cancelled.is_set():
                    self._unhold(job.target.req_id)  # its client is told an error, never this path
                    self._record_failure(job.target, f"the file was not written within delivery_timeout_s="
                                         f"{self.settings.delivery_timeout_s:g}s (a slow or stuck disk)")
                    continue
                # NOTE: published in time: the file is complete; what the writer does after the link
                # (its retention, on a slow disk) must not hold the engine thread. A reader still
                # waits on the lock, which the writer releases when it returns.
                nbytes = job.nbytes
            except Exception as exc:  # the request fails, the engine does not
                self._unhold(job.target.req_id)  # its client is told an error, never this path
                self._record_failure(job.target, f"writing the file failed: {type(exc).__name__}: {exc}")
                continue
            self._record_success(job, nbytes)
        # NOTE: only once every late file of the step is cancelled: a slot given earlier could start
        # a file of this step that is about to be given up on
        for job in given_up:
            self._give_slot(job)
        self._abandoned = [j for j in self._abandoned if j.future is not None and not j.future.done()]

    def take_latencies(self) -> tuple[float, ...]:
        """Each published file's latency (seconds from hand-off to the writer to published) since
        the last call: the observations behind the delivery-latency histogram."""
        return self._latencies.take()

    def take_results(self) -> tuple[DeliveryResult, ...]:
        results, self._results = tuple(self._results), []
        return results

    @property
    def num_open(self) -> int:
        """Requests whose delivery is open: rows gathered or a lock file held (bounded by the live
        requests: a delivery leaves when its file is handed to a writer, fails or is dropped)."""
        return len(self._requests)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Wait (bounded) for writes in flight, release every held lock file, stop the writers."""
        pending = [j.future for j in (*self._step_jobs, *self._abandoned) if j.future is not None]
        if pending:
            cf.wait(pending, timeout=timeout_s)
        running = sum(not f.done() for f in pending)
        for rows in self._requests.values():
            if not rows.done:
                self.store.release_lock(rows.lock_fd)
        self._requests.clear()
        self._writers.shutdown(wait=False, cancel_futures=True)
        if running:  # NOTE: a write still running keeps the directory claimed: the claim ends with the process
            log.warning("omni-cache: %d delivery write(s) still running after %.1fs; %s stays claimed until "
                        "this process exits", running, timeout_s, self.settings.delivery_dir)
        else:
            self.store.close()

    # ------------------------------------------------------------- internals
    def _admit(self, target: DeliveryTarget, prompt_token_ids: Any) -> None:
        if target.req_id in self._requests and not self._requests[target.req_id].done:
            return  # a resumed request keeps its rows and its lock
        # NOTE: a refused admission keeps nothing here: its outcome is reported once and the
        # scheduler drops nothing for it later (it never had rows or a lock to drop).
        if target.error is not None or target.path is None or self._failed_reason is not None:
            self._record_failure(target, target.error or self._failed_reason or "no path")
            return
        try:
            lock_fd = self.store.hold_lock(target.path)
        except OSError as exc:
            self._record_failure(target, f"cannot create the lock file: {exc}")
            return
        ids = tuple(int(t) for t in prompt_token_ids) if prompt_token_ids is not None else None
        self._requests[target.req_id] = _Rows(target, ids, lock_fd)

    def _needs_rows(self, req_id: str, start: int) -> bool:
        rows = self._requests.get(req_id)
        if rows is None or rows.done:
            return False
        return rows.target.include_output_tokens or start < rows.target.num_prompt_tokens

    def _complete(self, req_id: str, rows: _Rows, num_tokens: int, token_ids: tuple[int, ...] | None) -> None:
        """All ``num_tokens`` rows should be here: assemble them and hand the file to the writer."""
        rows.done = True
        try:
            tensors = _assemble(rows.chunks, num_tokens)
        except LookupError as exc:
            self._fail(req_id, rows, str(exc))
            return
        rows.chunks = []
        ids = torch.tensor(token_ids if token_ids is not None else (), dtype=torch.long)
        if token_ids is not None and len(ids) != num_tokens:
            self._fail(req_id, rows, f"{len(ids)} token ids for {num_tokens} rows")
            return
        tensors["token_ids"] = ids
        target = rows.target
        backlog = sum(1 for j in self._abandoned if j.future is not None and not j.future.done())
        if backlog >= self.settings.delivery_max_pending:
            self._fail(req_id, rows, f"{backlog} earlier files are still being written "
                       f"(delivery_max_pending={self.settings.delivery_max_pending}): the disk is behind")
            return
        if not target.include_output_tokens:  # written before its output names it: held until then
            assert target.path is not None
            self.store.hold(target.path)
            self._held[req_id] = target.path
        job = _Job(target, num_tokens, rows.cached_tokens, time.monotonic())
        metadata = {"format": FORMAT, "req_id": req_id, "num_tokens": str(num_tokens),
                    "cached_tokens": str(rows.cached_tokens)}
        try:
            job.future = self._writers.submit(self._write, job, tensors, metadata, rows.lock_fd)
        except RuntimeError as exc:  # the writers were shut down: no file, and no hold left behind
            self._unhold(req_id)
            self._fail(req_id, rows, f"no writer takes the file: {exc}")
            return
        rows.lock_fd = None  # the writer releases it
        self._step_jobs.append(job)
        del self._requests[req_id]

    def _write(self, job: _Job, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
               lock_fd: int | None) -> int:
        """Writer thread: serialize, write atomically (``DeliveryStore.write``), release the lock."""
        from safetensors.torch import save

        try:
            assert job.target.path is not None
            if not job.cancelled.is_set():
                self._slots.acquire()
                with job.lock:
                    job.holds_slot = True
            if job.cancelled.is_set():  # abandoned while queued behind a slow disk: its failure is out already
                raise TimeoutError("the delivery was abandoned before its file was written")
            payload = save({k: t.contiguous() for k, t in tensors.items()}, metadata=metadata)
            job.nbytes = len(payload)
            return self.store.write(job.target.path, payload, publish=job)
        except BaseException as exc:
            if job.target.path is not None:
                self.store.note_failure(job.target.path, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._give_slot(job)
            self.store.release_lock(lock_fd)

    def _give_slot(self, job: _Job) -> None:
        """The writing slot ``job`` holds goes to the next file (its writer is done, or given up on)."""
        with job.lock:
            held, job.holds_slot = job.holds_slot, False
        if held:
            self._slots.release()

    def _unhold(self, req_id: str) -> None:
        """End the hold of ``req_id``'s file, if it has one (``DeliveryStore.release``)."""
        path = self._held.pop(req_id, None)
        if path is not None:
            self.store.release(path)

    def _fail(self, req_id: str, rows: _Rows, reason: str) -> None:
        rows.done = True
        rows.chunks = []
        if rows.lock_fd is not None:
            if rows.target.path is not None:
                self.store.note_failure(rows.target.path, reason)
            self.store.release_lock(rows.lock_fd)
            rows.lock_fd = None
        self._requests.pop(req_id, None)
        self._record_failure(rows.target, reason)

    def _record_failure(self, target: DeliveryTarget, reason: str) -> None:
        message = f"request {target.req_id!r}: hidden states not delivered: {reason}"
        log.warning("omni-cache delivery: %s", message)
        self.counters["failures"] += 1
        self._results.append(DeliveryResult(target.req_id, None, message))

    def _record_success(self, job: _Job, nbytes: int) -> None:
        seconds = time.monotonic() - job.started
        self.counters["files"] += 1
        self.counters["bytes"] += nbytes
        self._latencies.record(seconds)
        self._results.append(DeliveryResult(job.target.req_id, job.target.path, None, job.num_tokens,
                                             job.cached_tokens, nbytes, seconds))


def _assemble(chunks: list[tuple[int, dict[str, torch.Tensor]]], num_tokens: int) -> dict[str, torch.Tensor]:
    """Rows ``[0, num_tokens)`` of every key from the chunks (a later chunk wins where two
    cover a position); ``LookupError`` names the positions no chunk covered."""
    if not chunks:
        raise LookupError(f"no rows were saved for positions [0, {num_tokens})")
    keys = set(chunks[0][1])
    for _, tensors in chunks:
        if set(tensors) != keys:
            raise LookupError(f"the request's steps served different keys: {sorted(keys)} and {sorted(tensors)}")
    covered = torch.zeros(num_tokens, dtype=torch.bool)
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        first = chunks[0][1][key]
        out[key] = torch.empty((num_tokens, *first.shape[1:]), dtype=first.dtype)
    for start, tensors in chunks:
        lo, hi = max(start, 0), min(start + int(next(iter(tensors.values())).shape[0]), num_tokens)
        if lo >= hi:
            continue
        for key, t in tensors.items():
            out[key][lo:hi].copy_(t[lo - start : hi - start])
        covered[lo:hi] = True
    if not bool(covered.all()):
        missing = (~covered).nonzero().flatten()
        raise LookupError(f"positions {int(missing[0])}..{int(missing[-1])} ({len(missing)} of {num_tokens}) "
                          "were never served by a saved step: no file, never zeros")
    return out
