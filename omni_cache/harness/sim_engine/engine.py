"""The simulated two-stage engine: the per-step protocol, end to end.

Owns: the engine loop (``Simulation.run``) and the run's raw counters
(``SimResult``). Per scheduler step, on the calling (engine) thread:

1. arrivals join the scheduler; ``schedule`` picks chunks within the budget;
2. events -- FINISHED/ABORTED first, then STARTED/RESUMED with the hit the
   allocator found (block ids = the request's block table), EXTENDED for
   running requests -- go to ``manager.new_step_starts``;
3. the thinker's forward; ``save_outputs`` with its write layout -> step id;
4. the step id and what its materialize must return go to the builder thread
   (``builder.OutputBuilder``), which verifies while the engine moves on.

A step with no scheduled tokens feeds no forward to the cache (only its
terminal events). At the end, the last terminal events are delivered (their
deferred writes land, I9), the builder drains, and ``shutdown`` must report no
unconsumed step id (I1). Any contract error from the manager becomes a
``Mismatch`` naming the step; the run stops at the first failure.

Upholds nothing itself: it checks I1 and I9 from outside.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from omni_cache.harness.sim_engine.allocator import AllocatorStats, BlockAllocator
from omni_cache.harness.sim_engine.builder import OutputBuilder
from omni_cache.harness.sim_engine.checker import (
    Mismatch,
    OutputChecker,
    ReqExpectation,
    StepExpectation,
    Talker,
)
from omni_cache.harness.sim_engine.config import SimConfig
from omni_cache.harness.sim_engine.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from omni_cache.harness.sim_engine.thinker import Thinker, policy_for
from omni_cache.harness.sim_engine.workload import Workload
from omni_cache.runtime.events import PrefixCacheEventKind, PrefixCacheRequestEvent, PrefixCacheStep
from omni_cache.runtime.interface import PrefixCacheConfig

ManagerFactory = Callable[[PrefixCacheConfig, bool], Any]


def default_manager(config: PrefixCacheConfig, eager: bool) -> Any:
    """The real cache: ``OmniPrefixCacheManager`` (eager, or with its committer thread)."""
    from omni_cache.runtime.manager import OmniPrefixCacheManager

    return OmniPrefixCacheManager(config, eager=eager)


@contextlib.contextmanager
def _warnings_off() -> Iterator[None]:
    """Warnings and below logged by nobody for the block (errors still are); the process's own
    ``logging.disable`` level is back after it."""
    previous = logging.root.manager.disable
    logging.disable(max(previous, logging.WARNING))
    try:
        yield
    finally:
        logging.disable(previous)


@dataclass
class SimResult:
    config: SimConfig
    wall_s: float = 0.0
    steps: int = 0
    saves: int = 0
    computed_tokens: int = 0
    requests_created: int = 0
    requests_dropped_too_long: int = 0
    """Asked for, but longer than the model length this KV cache allows: never run."""
    requests_skipped_after_abort: int = 0
    """Later turns of a conversation whose turn the workload aborted: never asked of the engine."""
    mismatches: list[Mismatch] = field(default_factory=list)
    stopped_by_steps_limit: bool = False
    allocator: AllocatorStats = field(default_factory=AllocatorStats)
    scheduler: SchedulerStats = field(default_factory=SchedulerStats)
    rows_checked: int = 0
    rows_from_cache: int = 0
    talker_completed: int = 0
    save_s: list[float] = field(default_factory=list)
    builder_lag_s: list[float] = field(default_factory=list)
    materialize_s: list[float] = field(default_factory=list)
    manager_stats: dict[str, Any] = field(default_factory=dict)
    unconsumed: dict[Any, str] = field(default_factory=dict)
    padded_steps: int = 0

    @property
    def ok(self) -> bool:
        """No mismatch and no contract error in what ran (see ``complete`` for what did not run)."""
        return not self.mismatches

    @property
    def requests_asked(self) -> int:
        return self.config.requests

    @property
    def requests_not_reached(self) -> int:
        """Asked for, but never created because the steps limit stopped the run first."""
        return max(0, self.requests_asked - self.requests_created - self.requests_dropped_too_long
                   - self.requests_skipped_after_abort)

    @property
    def complete(self) -> bool:
        """Every request asked for ran to its end (none dropped, no step cut by the steps limit) and
        at least one of them was finished and verified whole."""
        return (not self.requests_dropped_too_long and not self.stopped_by_steps_limit and not self.requests_not_reached
                and self.talker_completed > 0)

    def incomplete_reasons(self) -> list[str]:
        """One line per way the run did less than asked (empty when ``complete``)."""
        reasons = []
        if self.requests_dropped_too_long:
            cfg = self.config
            reasons.append(
                f"{self.requests_dropped_too_long} of {self.requests_asked} requests were dropped: longer than the "
                f"{cfg.model_len}-token model length that --num-blocks {cfg.num_blocks} x --block-size "
                f"{cfg.block_size} allows (half the KV cache); raise --num-blocks")
        if self.stopped_by_steps_limit or self.requests_not_reached:
            reasons.append(
                f"--steps-limit {self.config.steps_limit} stopped the run with requests unfinished "
                f"({self.requests_not_reached} of {self.requests_asked} never started)")
        if not self.talker_completed and not reasons:
            reasons.append(
                f"no request was finished and verified whole: the workload aborted the {self.requests_created} "
                f"that ran" + (f" and skipped {self.requests_skipped_after_abort} later turns"
                               if self.requests_skipped_after_abort else "")
                + " (more --requests or another --seed runs some to their end)")
        return reasons


def build_events(out: SchedulerOutput) -> list[PrefixCacheRequestEvent]:
    """The step's events: terminal first, then (re)starts with their hits, then running."""
    events = [PrefixCacheRequestEvent(req.req_id, kind) for req, kind in out.terminal]
    scheduled = {c.req.req_id: c.num_tokens for c in out.chunks}
    for req, kind, hit in out.started:
        events.append(PrefixCacheRequestEvent(
            req.req_id, kind, hit_start=0, hit_end=hit, block_ids=(tuple(req.block_ids),),
            scheduled_tokens=scheduled[req.req_id], num_output_tokens=len(req.output),
        ))
    for chunk in out.chunks:
        if chunk.hit is None:
            events.append(PrefixCacheRequestEvent(
                chunk.req.req_id, PrefixCacheEventKind.EXTENDED, block_ids=(tuple(chunk.req.block_ids),),
                scheduled_tokens=chunk.num_tokens, num_output_tokens=len(chunk.req.output),
            ))
    return events


class Simulation:
    """One deterministic run of the simulated engine against a cache manager."""

    def __init__(
        self,
        config: SimConfig,
        *,
        manager_factory: ManagerFactory | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.config = config
        self.spec = config.truth_spec()
        self.allocator = BlockAllocator(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.allocator, max_num_batched_tokens=config.max_batched_tokens,
            max_num_seqs=config.max_num_seqs, vocab_size=self.spec.vocab_size, publish=config.publish,
        )
        self.workload = Workload(
            config.preset_obj, config.requests, seed=config.seed, block_size=config.block_size,
            max_model_len=config.model_len, vocab_size=self.spec.vocab_size,
        )
        self.scheduler.on_abort = self.workload.on_aborted
        self.thinker = Thinker(
            self.spec, config.capacity_tokens, pad_multiple=config.pad_multiple,
            pad_probability=config.pad_probability, seed=config.seed, device=config.device,
        )
        self.manager = (manager_factory or default_manager)(config.cache_config(), config.eager)
        self.manager.register_policy(policy_for(self.spec))
        self.checker = OutputChecker(self.spec)
        self.builder = OutputBuilder(self.manager, self.checker, Talker(self.spec), delay_s=config.builder_delay_s)
        self.on_progress = on_progress

    def _fail(self, step: int | None, where: str, exc: BaseException) -> None:
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" if frame else ""
        self.checker.record(Mismatch(step, None, None, None, None, f"{where} raised {type(exc).__name__}{at}: {exc}"))

    def run(self) -> SimResult:
        res = SimResult(self.config)
        t0 = time.perf_counter()
        self.builder.start()
        step = 0
        interrupted = False
        try:
            step = self._loop(res)
        except Exception as exc:
            self._fail(step, "the engine loop", exc)
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            if interrupted:  # the user stopped the run: stop the threads, report nothing
                self.builder.close()
                with _warnings_off():  # the steps an interrupt leaves unconsumed are not news
                    self.manager.shutdown()
            else:
                self._finish(res, step)
        res.wall_s = time.perf_counter() - t0
        return res

    def _loop(self, res: SimResult) -> int:
        cfg, sched, mgr = self.config, self.scheduler, self.manager
        step = 0
        while not self.builder.failed.is_set():
            if res.steps >= cfg.steps_limit:
                res.stopped_by_steps_limit = sched.has_unfinished or self.workload.next_arrival_step() is not None
                break
            for req in self.workload.arrivals(step):
                sched.add_request(req)
            if not sched.has_unfinished and not sched.pending_terminal:
                nxt = self.workload.next_arrival_step()
                if nxt is None:
                    break
                step = max(step + 1, nxt)
                continue
            out = sched.schedule(step)
            exp = StepExpectation(step, None, aborted=[r.req_id for r, k in out.terminal if k == PrefixCacheEventKind.ABORTED])
            events = build_events(out)
            if out.chunks:
                try:
                    mgr.new_step_starts(PrefixCacheStep(events, {c.req.req_id: c.num_tokens for c in out.chunks}))
                except Exception as exc:
                    self._fail(step, "new_step_starts", exc)
                    break
                fwd = self.thinker.forward(step, out.chunks)
                res.padded_steps += fwd.num_tokens_padded > fwd.num_tokens_unpadded
                t = time.perf_counter()
                try:
                    exp.step_id = mgr.save_outputs(
                        fwd.hidden, fwd.mm, num_tokens_unpadded=fwd.num_tokens_unpadded,
                        num_tokens_padded=fwd.num_tokens_padded, write_layout=fwd.layout,
                    )
                except Exception as exc:
                    self._fail(step, "save_outputs", exc)
                    break
                res.save_s.append(time.perf_counter() - t)
                res.saves += 1
                res.computed_tokens += fwd.num_tokens_unpadded
                exp.leftovers = fwd.leftovers
                exp.reqs = [
                    ReqExpectation(c.req.req_id, c.req.truth_hashes, c.token_start, c.token_end,
                                   0 if c.hit is not None else c.token_start)
                    for c in out.chunks
                ]
            elif events:
                try:
                    mgr.new_step_starts(PrefixCacheStep(events, {}))
                except Exception as exc:
                    self._fail(step, "new_step_starts", exc)
                    break
            for req in sched.update_from_output(out):
                self.workload.on_finished(req, step)
                exp.finished.append((req.req_id, req.truth_hashes, req.num_tokens - 1))
            if exp.step_id is not None or exp.aborted or exp.finished:
                self.builder.submit(exp)
            res.steps += 1
            if self.on_progress is not None:
                self.on_progress(sched.stats.finished + sched.stats.aborted, self.workload.created)
            step += 1
        return step

    def _finish(self, res: SimResult, step: int) -> None:
        """Deliver the last terminal events, drain the builder, shut the cache down."""
        terminal = self.scheduler.take_terminal()
        if terminal and not self.checker.mismatches:
            events = [PrefixCacheRequestEvent(req.req_id, kind) for req, kind in terminal]
            try:
                self.manager.new_step_starts(PrefixCacheStep(events, {}))
            except Exception as exc:
                self._fail(step, "new_step_starts (final terminal events)", exc)
        self.builder.close()
        try:
            res.manager_stats = dict(self.manager.stats())
        except Exception as exc:
            self._fail(step, "stats", exc)
        try:
            res.unconsumed = dict(self.manager.shutdown() or {})
        except Exception as exc:
            self._fail(step, "shutdown", exc)
        if res.unconsumed and not self.checker.mismatches:
            first = sorted(res.unconsumed.items())[0]
            self.checker.record(Mismatch(
                step, first[0], None, None, None,
                f"shutdown reports {len(res.unconsumed)} unconsumed step id(s), first saved at {first[1]}",
            ))
        res.mismatches = list(self.checker.mismatches)
        res.allocator = self.allocator.stats
        res.scheduler = self.scheduler.stats
        res.rows_checked = self.checker.rows_checked
        res.rows_from_cache = self.checker.rows_from_cache
        res.talker_completed = self.builder.talker.completed
        res.builder_lag_s = list(self.builder.lags_s)
        res.materialize_s = list(self.builder.materialize_s)
        res.requests_created = self.workload.created
        res.requests_dropped_too_long = self.workload.dropped_too_long
        res.requests_skipped_after_abort = self.workload.skipped_after_abort
