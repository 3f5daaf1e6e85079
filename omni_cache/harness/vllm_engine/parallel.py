"""``simulate --engine vllm --tp N --pp M``: the thinker on tensor- and pipeline-parallel worker processes.

Owns: ``parallel_engine_kwargs`` (the engine's arguments: vLLM's ``mp``
executor, the per-worker KV-cache bytes of the preset's block count from
``worker_kv_bytes``, the all-TP-ranks setting), ``make_simulation`` and
``ParallelVllmSimulation``; what ``--tp``, ``--pp`` and ``--check-ranks`` allow
is ``vllm_sim.grid.check_parallel_config`` (re-exported here).

The engine core and scheduler stay in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the model runs in ``tp x pp`` spawned
worker processes, each with the project's worker class. The cache lives on the
output rank (TP rank 0 of the last stage) only, so its forward records and
served outputs are there: ``worker_probe`` collects them and this module pulls
them after every engine step through ``LLM.collective_rpc`` and runs the same
checks (a), (b) and (c) as the in-process run on every row. With
``check_ranks`` every TP rank of the last stage keeps a cache and each one's
served outputs are compared with the output rank's, bit for bit, per step,
request and key. Upholds nothing itself: it checks I1, I4, I6, I7 from outside.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Any

import torch

from omni_cache.harness.sim_engine.checker import Mismatch
from omni_cache.harness.vllm_engine import promises, worker_probe
from omni_cache.harness.vllm_engine.consumer import absorb_worker_replies
from omni_cache.harness.vllm_engine.engine import (
    KV_BLOCK_BYTES,
    TINY_LLAMA,
    VllmSimConfig,
    VllmSimResult,
    VllmSimulation,
    engine_kwargs,
    prepare_vllm_env,
    stdout_to_stderr,
    tiny_llama_dir,
)
from omni_cache.harness.vllm_engine.grid import check_parallel_config
from omni_cache.harness.vllm_engine.truth import PER_TOKEN_KEYS, mm_of
from omni_cache.integration.ranks import output_rank_index, prepare_parallel_env

__all__ = ["ParallelVllmSimulation", "check_parallel_config", "make_simulation", "parallel_engine_kwargs", "worker_kv_bytes"]



def parallel_engine_kwargs(cfg: VllmSimConfig, model_dir: str, *, kv_blocks: int, max_batched_tokens: int,
                           max_model_len: int) -> dict[str, Any]:
    """``LLM(...)`` arguments for ``tp x pp`` workers. ``kv_cache_memory_bytes``
    is per worker: a stage holds ``layers / pp`` layers (the KV heads, one here,
    are replicated over TP ranks), so each worker gets the bytes of ``kv_blocks``
    blocks of its own layers."""
    kwargs = engine_kwargs(model_dir, kv_blocks=kv_blocks, max_batched_tokens=max_batched_tokens,
                           max_model_len=max_model_len, eager=cfg.eager,
                           tensor_parallel_size=cfg.tp, pipeline_parallel_size=cfg.pp,
                           distributed_executor_backend="mp")
    kwargs["kv_cache_memory_bytes"] = worker_kv_bytes(kv_blocks, cfg.pp)
    settings = dict(kwargs["additional_config"]["omni_cache"])
    if cfg.check_ranks:
        settings["all_tp_ranks"] = True
    kwargs["additional_config"] = {"omni_cache": settings}
    return kwargs


def worker_kv_bytes(kv_blocks: int, pp: int) -> int:
    """One worker's KV-cache bytes for ``kv_blocks`` blocks of the tiny Llama: a stage holds
    ``layers / pp`` of its layers (its one KV head is replicated over TP ranks)."""
    per_layer = KV_BLOCK_BYTES // TINY_LLAMA["num_hidden_layers"]
    return kv_blocks * per_layer * -(-TINY_LLAMA["num_hidden_layers"] // pp)


def make_simulation(cfg: VllmSimConfig, plan: Any = None) -> VllmSimulation:
    """The in-process run for one worker, the worker-process run otherwise."""
    return ParallelVllmSimulation(cfg, plan) if cfg.tp * cfg.pp > 1 else VllmSimulation(cfg, plan)


class ParallelVllmSimulation(VllmSimulation):
    """The run on worker processes (see the module docstring); it owns its engine."""

    def __init__(self, config: VllmSimConfig, plan: Any = None) -> None:
        super().__init__(config, plan)
        self.output_rank = output_rank_index(config.tp, config.pp)
        # Engine thread only: outputs served per rank and engine step, until compared (--check-ranks).
        self._pending: dict[int, dict[int, tuple[tuple[tuple[str, int, int], ...], Any]]] = {}
        self._compared: Counter[int] = Counter()  # engine step -> TP ranks compared with the output rank

    def build_llm(self) -> Any:
        prepare_vllm_env()
        prepare_parallel_env(self.config.tp * self.config.pp)
        from vllm import LLM

        p = self.preset
        return LLM(**parallel_engine_kwargs(
            self.config, tiny_llama_dir(), kv_blocks=promises.asked_kv_blocks(self.config),
            max_batched_tokens=self.config.max_batched_tokens or p.max_batched_tokens, max_model_len=p.max_model_len))

    def run(self, llm: Any = None) -> VllmSimResult:
        if llm is not None:
            raise ValueError("ParallelVllmSimulation.run: the worker-process run builds its own engine")
        res = VllmSimResult(self.config)
        t0 = time.perf_counter()
        with stdout_to_stderr():
            import vllm

            res.vllm_version = vllm.__version__
            llm = self.build_llm()
            try:
                res.engine_start_s = time.perf_counter() - t0
                infos = llm.collective_rpc(worker_probe.install)
                res.kv_blocks_engine = min(int(i["num_blocks"]) for i in infos)
                self._run_workload(llm, res)
                self._finish(llm, res)
            finally:
                with contextlib.suppress(Exception):
                    llm.llm_engine.engine_core.shutdown()
        cap = self.capture
        res.mismatches[:0] = cap.mismatches
        res.hit_tokens, res.same_step_hits = cap.hit_tokens, cap.same_step_hits
        res.chunked_prefills, res.served_from_cache, res.rows_verified = (
            cap.chunked_prefills, cap.served_from_cache, cap.rows_verified)
        res.computed_tokens = cap.rows_captured
        promises.preemption_problem(self.config, res, preset_plan=self.preset_plan)
        res.wall_s = time.perf_counter() - t0
        return res

    def _finish(self, llm: Any, res: VllmSimResult) -> None:
        try:
            finals = llm.collective_rpc(worker_probe.finish)
        except Exception as exc:  # the workers are gone: check (c) cannot be done, which is a finding
            res.mismatches.append(Mismatch(None, None, None, None, None,
                                           f"the workers' final report failed ({type(exc).__name__}: {exc})"))
            return
        self._absorb(finals, res)
        self._close_ranks(res)
        self._exactly_once(finals[self.output_rank], res)
        res.ranks = [{**f["rank"], "engine_steps": f["engine_steps"], "zero_token_steps": f["zero_token_steps"]}
                     for f in finals]
        res.preemptions = int(finals[self.output_rank]["preemptions"])
        res.steps = int(finals[self.output_rank]["engine_steps"])

    def _run_workload(self, llm: Any, res: VllmSimResult) -> None:
        if promises.kv_block_problem(self.config, res.kv_blocks_engine, res):
            return
        try:
            self._drive(llm, res)
            self._settle(llm, res)
            if res.ok:
                self._recompute(llm, res)
        except Exception as exc:
            res.mismatches.append(Mismatch(None, None, None, None, None,
                                           f"the engine raised {type(exc).__name__}: {exc}"))

    # ------------------------------------------------------------ gathering
    def _after_step(self, llm: Any, res: VllmSimResult) -> None:
        self._absorb(llm.collective_rpc(worker_probe.drain), res)

    def _settle(self, llm: Any, res: VllmSimResult) -> None:
        """Every step id published so far consumed and checked (before check (b) reads the served rows)."""
        self._absorb(llm.collective_rpc(worker_probe.settle), res)

    def _absorb(self, replies: list[dict[str, Any]], res: VllmSimResult) -> None:
        """The workers' drained reports (``consumer.absorb_worker_replies``); with ``--check-ranks``
        every rank's served rows are kept for the comparison."""
        def keep(rank: int, engine_step: int, step_id: int, spans: Any, out: Any) -> None:
            self._pending.setdefault(rank, {})[engine_step] = (spans, out)

        absorb_worker_replies(replies, self.output_rank, self.capture, res.mismatches,
                              served=keep if self.config.check_ranks else None)
        if self.config.check_ranks:
            self._compare_ranks(res)

    # ------------------------------------------------------------ --check-ranks
    def _compare_ranks(self, res: VllmSimResult) -> None:
        """Compare every step both a TP rank and the output rank have served; the
        output rank's copy is dropped once every other TP rank compared it."""
        ref = self._pending.get(self.output_rank, {})
        for rank, steps in self._pending.items():
            if rank == self.output_rank:
                continue
            for engine_step in sorted(set(steps) & set(ref)):
                spans, served = steps.pop(engine_step)
                ref_spans, ref_served = ref[engine_step]
                self._compare_step(rank, engine_step, spans, served, ref_spans, ref_served, res)
                self._compared[engine_step] += 1
                if self._compared[engine_step] == self.config.tp - 1:
                    del ref[engine_step], self._compared[engine_step]

    def _compare_step(self, rank: int, step: int, spans: Any, served: Any, ref_spans: Any, ref_served: Any,
                      res: VllmSimResult) -> None:
        if tuple(spans) != tuple(ref_spans):
            res.mismatches.append(Mismatch(step, None, None, None, None,
                                           f"rank {rank} served spans {spans} where the output rank "
                                           f"{self.output_rank} served {ref_spans}"))
            return
        for rid, _, _ in spans:
            mine, theirs = (served.hidden_states or {}).get(rid), (ref_served.hidden_states or {}).get(rid)
            pairs = [("hidden", mine, theirs)] + [(k, mm_of(served, rid).get(k), mm_of(ref_served, rid).get(k))
                                                  for k in PER_TOKEN_KEYS]
            for key, a, b in pairs:
                if a is None or b is None or a.shape != b.shape or not torch.equal(a, b):
                    res.mismatches.append(Mismatch(
                        step, None, rid, key, None,
                        f"TP rank {rank} served other rows than the output rank {self.output_rank} "
                        f"({'missing' if a is None or b is None else f'shapes {tuple(a.shape)} / {tuple(b.shape)}'}"
                        f"{'' if a is None or b is None or a.shape != b.shape else ', values differ'})"))
                    continue
                res.rank_rows_compared += int(a.shape[0])

    def _close_ranks(self, res: VllmSimResult) -> None:
        """After the last gather: a step served on one rank and never on the other is a finding."""
        if not self.config.check_ranks:
            return
        self._compare_ranks(res)
        for rank, steps in self._pending.items():
            for step in steps:
                res.mismatches.append(Mismatch(step, None, None, None, None,
                                               f"rank {rank} served this step and not every other TP rank did"))
        if res.rank_rows_compared == 0:
            res.mismatches.append(Mismatch(None, None, None, None, None,
                                           "--check-ranks: no rank besides the output rank served a step"))

    # ------------------------------------------------------------ check (c)
    def _exactly_once(self, final: dict[str, Any], res: VllmSimResult) -> None:
        once = worker_probe.exactly_once(final)
        res.mismatches.extend(once.mismatches)
        res.published, res.consumed, res.saved = once.published, once.consumed, once.published
        res.double_consume_refused, res.unconsumed = once.double_consume_refused, once.unconsumed
