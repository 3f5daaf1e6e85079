"""The thinker of ``omni-cache pipeline --tp N --pp M``: the model on ``tp x pp`` worker processes.

Owns: ``ParallelThinkerStage`` (``stages.ThinkerStage`` driven from this
process while the model runs in vLLM's ``mp`` workers, each with the project's
worker class when prefix caching is on) and ``make_thinker_stage`` (the
in-process stage for one worker, this one otherwise).

The engine core and the scheduler stay in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the thinker's outputs
(``num_cached_tokens``, the answers) are read as in the one-process run. The
cache lives on the output rank only (TP rank 0 of the last stage,
``integration.ranks``): after every engine step ``vllm_sim.worker_probe.settle``
waits until that worker's consumer materialized every step id the step
published and brings back what it was served and the forward records; check
(a) of ``vllm_sim.truth`` runs here on every served row, the prompt rows the
talker gets are assembled from them, and ``finish`` runs check (c) (each step id
consumed exactly once, a second materialize refused, nothing unconsumed). With
prefix caching off the ground truth is ``stages.ForwardTap`` on the output
rank's runner (``pipeline.worker_stage``): rows read from the forward itself.
The stage timers (forward, save, materialize) are the output rank's; the
thinker's time includes gathering the rows from the workers.
Upholds nothing itself: checks I1, I4, I6 and I7 from outside.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from omni_cache.harness.pipeline import worker_stage
from omni_cache.harness.pipeline.stages import StageOptions, ThinkerStage
from omni_cache.harness.sim_engine.checker import Mismatch
from omni_cache.harness.vllm_engine import worker_probe
from omni_cache.harness.vllm_engine.consumer import absorb_worker_replies
from omni_cache.harness.vllm_engine.engine import BLOCK_SIZE
from omni_cache.harness.vllm_engine.truth import ForwardCapture
from omni_cache.integration.ranks import output_rank_index

__all__ = ["ParallelThinkerStage", "make_thinker_stage"]

_TIMED = ("forward_s", "begin_s", "save_s", "model_outputs_s", "materialize_s", "steps")  # the output rank's timers the report reads


def make_thinker_stage(llm: Any, opts: StageOptions, *, cached: bool, tier_truth: Any = None) -> ThinkerStage:
    if opts.workers > 1:
        if tier_truth is not None:
            raise ValueError("a KV connector runs with the thinker in this process: not with --tp/--pp")
        return ParallelThinkerStage(llm, cached=cached, tp=opts.tp, pp=opts.pp)
    return ThinkerStage(llm, cached=cached, tier_truth=tier_truth)


class ParallelThinkerStage(ThinkerStage):
    """One thinker engine on worker processes (see the module docstring)."""

    def __init__(self, llm: Any, *, cached: bool, tp: int, pp: int) -> None:
        self._init_state(llm, cached)
        self.output_rank = output_rank_index(tp, pp)
        self.tap_rows: dict[str, dict[int, torch.Tensor]] = {}  # prefix caching off: rows read from the forward
        if not cached:
            self.ranks = llm.collective_rpc(worker_stage.install_tap)
            return
        if not llm.llm_engine.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache refused: the engine is not idle")
        info = llm.collective_rpc(worker_stage.attach)[self.output_rank]
        self.kv_groups, self.kv_blocks_engine = int(info["kv_groups"]), int(info["num_blocks"])
        self.capture = ForwardCapture(BLOCK_SIZE)

    # ------------------------------------------------------------------ per step
    def _handoff(self) -> None:
        self._absorb(self.llm.collective_rpc(worker_probe.settle))

    def _absorb(self, replies: list[dict[str, Any]]) -> None:
        """The workers' drained reports (``consumer.absorb_worker_replies``): the output rank's forwards
        count prefill tokens, its served rows are what the talker gets."""
        self.published += len(replies[self.output_rank]["errors"])  # a refused step id was published too
        c0, cpu = time.perf_counter(), time.process_time()

        def record(rec: Any) -> None:
            for rid, start, end in rec.spans:
                self.prefill_tokens += max(0, min(end, self.prompt_len.get(rid, 0)) - start)

        def served(rank: int, engine_step: int, step_id: int, spans: Any, out: Any) -> None:
            if rank != self.output_rank:
                return
            self.published += 1
            self.materialized += 1
            if self._first_step_id is None:
                self._first_step_id = step_id
            self._keep_served(spans, out)

        absorb_worker_replies(replies, self.output_rank, self.capture, self.mismatches, record=record, served=served)
        self.timers.checker_s += time.perf_counter() - c0
        self.timers.checker_cpu_s += time.process_time() - cpu

    def _count_tapped(self) -> None:
        self._take_tapped(self.llm.collective_rpc(worker_stage.drain_tap)[self.output_rank])

    def _take_tapped(self, reply: dict[str, Any]) -> None:
        for rid, rows in reply["rows"].items():
            self.tap_rows.setdefault(rid, {}).update(rows)
        self.prefill_tokens = int(reply["computed"])

    def _received(self, rid: str) -> dict[int, torch.Tensor]:
        return self.served.get(rid, {}) if self.cached else self.tap_rows.get(rid, {})

    # ------------------------------------------------------------------ end
    def finish(self) -> None:
        """Check (c) from the output rank's final report; the timers; the runners' own methods back
        (``worker_stage.detach``, ``remove_tap``)."""
        if not self.cached:
            final = self.llm.collective_rpc(worker_stage.remove_tap)[self.output_rank]
            self._take_tapped(final)
            self._merge_timers(final["timers"])
            return
        try:
            finals = self.llm.collective_rpc(worker_probe.finish)
            self._merge_timers(self.llm.collective_rpc(worker_stage.detach)[self.output_rank])
        except Exception as exc:  # the workers are gone: check (c) cannot be done, which is a finding
            self.mismatches.append(Mismatch(None, None, None, None, None,
                                            f"the workers' final report failed ({type(exc).__name__}: {exc})"))
            return
        self._absorb(finals)
        self.mismatches[:0] = self.capture.mismatches
        self.ranks = [f["rank"] for f in finals]
        holders = [i for i, rank in enumerate(self.ranks) if rank.get("holds_cache")]
        if self.published and holders != [self.output_rank]:
            self.mismatches.append(Mismatch(None, None, None, None, None,
                                            f"the cache must live on the output rank {self.output_rank} only; "
                                            f"ranks that held one: {holders}"))
        once = worker_probe.exactly_once(finals[self.output_rank])
        self.mismatches.extend(once.mismatches)
        if once.published != self.published:
            self.mismatches.append(Mismatch(None, None, None, None, None,
                                            f"the output rank published {once.published} step ids, "
                                            f"{self.published} were served here"))
        self.double_materialize_refused = once.double_consume_refused
        self.unconsumed = once.unconsumed

    def _merge_timers(self, worker: dict[str, Any]) -> None:
        for name in _TIMED:
            setattr(self.timers, name, worker.get(name, 0))
