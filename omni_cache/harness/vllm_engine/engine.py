"""``omni-cache simulate --engine vllm``: a real vLLM engine as the thinker.

Owns: ``VllmSimConfig``, ``VllmSimulation`` (builds a tiny dummy-weight engine
-- the model of ``--model``, ``omni_cache.harness.vllm_engine.models`` -- in this process with ``OmniCPUWorker`` installed through vLLM's
``worker_cls``, drives the planned workload step by step, runs the consumer
thread that materializes every step id (``consumer.StepConsumer``), then the recomputation run) and
``VllmSimResult``. vLLM is imported only inside functions.

Checks, each counted: (a) every served row, bit for bit, against the forward's
own row (``truth.ForwardCapture``); (b) each finished request's full-prompt
hidden states (as the next stage received them) against the same prompt
recomputed alone after ``reset_prefix_cache`` (asserted: no token served from
the KV cache), within ``tolerance``; (c) every published step id consumed
exactly once, none left at shutdown, a second materialize refused, no contract
error. I1, I4, I6, I7, I9 are checked from outside.

Upholds nothing itself: it checks I1, I4, I6, I7 and I9 from outside.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from omni_cache.harness.sim_engine.checker import Mismatch
from omni_cache.harness.vllm_engine import promises
from omni_cache.harness.vllm_engine.consumer import StepConsumer, exactly_once, second_materialize_refused
from omni_cache.harness.vllm_engine.models import (
    BLOCK_SIZE,
    DEFAULT_MODEL,
    MODELS,
    TINY_LLAMA,
    model_dir,
    model_engine_kwargs,
    sim_model,
)
from omni_cache.harness.vllm_engine.truth import DEFERRED_KEY, ForwardCapture, derive_mm
from omni_cache.harness.vllm_engine.workload import PRESETS, PlannedRequest, plan_requests
from omni_cache.integration.vllm_bridge import runner_of

__all__ = ["DEFAULT_TOLERANCE", "TINY_LLAMA", "VllmSimConfig", "VllmSimResult", "VllmSimulation", "tiny_llama_dir"]

KV_BLOCK_BYTES = MODELS["llama"].kv_bytes_per_block
DEFAULT_TOLERANCE = 1e-5  # check (b): max |diff| / max |row|, per row; see docs/vllm-integration.md, "Tolerance of check (b)"
WORKER_CLS = "omni_cache.integration.vllm_worker.OmniCPUWorker"

def tiny_llama_dir(path: str | None = None) -> str:
    """A model directory holding only a ``config.json`` (weights: ``load_format="dummy"``)."""
    return model_dir("llama", path)


def engine_kwargs(model_dir: str, *, kv_blocks: int, max_batched_tokens: int, max_model_len: int,
                  eager: bool = True, **overrides: Any) -> dict[str, Any]:
    """``LLM(...)`` arguments of the simulated stage (overrides win)."""
    kwargs: dict[str, Any] = dict(
        model=model_dir, load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
        block_size=BLOCK_SIZE, dtype="float32", enforce_eager=True, seed=0,
        kv_cache_memory_bytes=kv_blocks * KV_BLOCK_BYTES, max_num_batched_tokens=max_batched_tokens,
        max_model_len=max_model_len, worker_cls=WORKER_CLS,
        additional_config={"omni_cache": {"deferred_keys": [DEFERRED_KEY], "eager": eager, "consumer": "queue"}},
    )
    kwargs.update(overrides)
    return kwargs


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Keep vLLM's (and its C++ libraries') prints off stdout, so ``--json`` stays parseable."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def prepare_vllm_env() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core, scheduler and runner in this process
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


@dataclass(frozen=True)
class VllmSimConfig:
    preset: str = "mixed"
    seed: int = 0
    requests: int | None = None
    kv_blocks: int | None = None
    max_batched_tokens: int | None = None
    eager: bool = True
    steps_limit: int = 2000
    tolerance: float = DEFAULT_TOLERANCE
    tp: int = 1  # tensor-parallel workers (> 1 or pp > 1: worker processes, vllm_sim.parallel)
    pp: int = 1  # pipeline-parallel stages
    check_ranks: bool = False  # a cache on every TP rank of the last stage, each compared bit for bit
    kv_connector: str | None = None  # "example": ExampleConnector under OmniKVConnector (vllm_sim.tier_run)
    model: str = DEFAULT_MODEL
    speculative: str | None = None  # "ngram", "draft", "eagle": speculative decoding (vllm_engine.spec_run)

    def __post_init__(self) -> None:
        sim_model(self.model)  # an unknown model: ValueError naming the choices
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r} (choose from {sorted(PRESETS)})")
        if self.kv_blocks is not None and self.kv_blocks < 17:
            raise ValueError(f"--num-blocks must be at least 17 (a 512-token request), got {self.kv_blocks}")
        if self.max_batched_tokens is not None and self.max_batched_tokens < 32:
            raise ValueError(f"--max-batched-tokens must be at least 32, got {self.max_batched_tokens}")
        if not self.tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0, got {self.tolerance}")
        from omni_cache.harness.vllm_engine.grid import check_kv_connector, check_parallel_config
        from omni_cache.harness.vllm_engine.speculative import check_speculative

        check_parallel_config(self)
        check_kv_connector(self)
        check_speculative(self)

    def as_dict(self) -> dict[str, Any]:
        preset = PRESETS[self.preset]
        return {**asdict(self), "kv_blocks": self.kv_blocks or preset.kv_blocks,
                "max_batched_tokens": self.max_batched_tokens or preset.max_batched_tokens,
                "requests": self.requests or preset.requests, "block_size": BLOCK_SIZE}


@dataclass
class VllmSimResult:
    config: VllmSimConfig
    vllm_version: str = ""
    requests_created: int = 0
    finished: int = 0
    aborted: int = 0
    failed_requests: list[str] = field(default_factory=list)  # ended by vLLM with an error (a failed KV load)
    preemptions: int = 0
    steps: int = 0
    saved: int = 0
    zero_token_steps: int = 0
    computed_tokens: int = 0
    hit_tokens: int = 0
    same_step_hits: int = 0
    chunked_prefills: int = 0
    served_from_cache: int = 0
    rows_verified: int = 0
    recompute_requests: int = 0
    recompute_rows: int = 0
    recompute_max_abs_diff: float = 0.0
    recompute_max_rel_diff: float = 0.0
    recompute_exact_rows: int = 0
    published: int = 0
    consumed: int = 0
    unconsumed: dict[int, str] = field(default_factory=dict)
    double_consume_refused: bool = False
    engine_start_s: float = 0.0
    wall_s: float = 0.0
    kv_groups: int = 0  # the engine's KV-cache groups (above 1: a hybrid layout)
    output_group_id: int = 0  # the group whose slots address the cache's rows
    mismatches: list[Mismatch] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # one per worker: place, host bytes
    rank_rows_compared: int = 0  # --check-ranks: rows compared between TP ranks
    kv_blocks_engine: int = 0  # the KV blocks the engine got (the run checks they are the asked ones)
    incomplete: list[str] = field(default_factory=list)  # ran clean but did less than the preset promises

    @property
    def ok(self) -> bool:
        return not self.mismatches


class VllmSimulation:
    def __init__(self, config: VllmSimConfig, plan: list[PlannedRequest] | None = None) -> None:
        self.config = config
        preset = PRESETS[config.preset]
        self.preset = preset
        self.preset_plan = plan is None  # the preset's own workload (its promises apply)
        self.plan: list[PlannedRequest] = plan if plan is not None else plan_requests(
            preset, seed=config.seed, requests=config.requests, block_size=BLOCK_SIZE)
        self.capture = ForwardCapture(BLOCK_SIZE)
        self.consumer: StepConsumer | None = None  # the next stage's side, built per run
        self._published: list[int] = []
        self._stop = threading.Event()

    # ------------------------------------------------------------------ engine
    def build_llm(self) -> Any:
        prepare_vllm_env()
        from vllm import LLM

        p = self.preset
        kv_blocks = self.config.kv_blocks or p.kv_blocks
        model = model_engine_kwargs(self.config.model, kv_blocks=kv_blocks)
        return LLM(**engine_kwargs(model.pop("model"), kv_blocks=kv_blocks,
                                   max_batched_tokens=self.config.max_batched_tokens or p.max_batched_tokens,
                                   max_model_len=p.max_model_len, eager=self.config.eager, **model))

    @staticmethod
    def runner_of(llm: Any) -> Any:
        return runner_of(llm)

    # ------------------------------------------------------------------ consumer
    def _consumer_for(self, bridge: Any, res: VllmSimResult) -> StepConsumer:
        """Check (a) on every served step; a materialize or check error is a finding with its step."""
        def failed(ps: Any, exc: Exception) -> None:
            res.mismatches.append(Mismatch(ps.engine_step, ps.step_id, None, None, None,
                                           f"materialize or its check raised {type(exc).__name__}: {exc}"))

        return StepConsumer(bridge, failed=failed,
                            served=lambda ps, out: self.capture.check_step(ps.engine_step, ps.step_id, ps.spans, out))

    def attach(self, llm: Any) -> Any:
        """A fresh cache for ``llm``'s runner (on an idle engine with an emptied KV prefix cache)."""
        from omni_cache.integration.bridge_settings import CONFIG_KEY
        from omni_cache.integration.vllm_bridge import VllmRunnerBridge

        if not llm.llm_engine.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache refused: the engine is not idle")
        runner = self.runner_of(llm)
        old = getattr(runner, "omni_cache", None)
        if old is not None and old.active:
            old.shutdown()
        settings = dict((getattr(runner.vllm_config, "additional_config", None) or {}).get(CONFIG_KEY) or {})
        bridge = VllmRunnerBridge({**settings, "eager": self.config.eager})
        bridge.on_model_loaded(runner.get_model())
        bridge.on_kv_cache_initialized(runner.vllm_config, runner.kv_cache_config)
        runner.omni_cache = bridge
        return bridge

    def run(self, llm: Any = None) -> VllmSimResult:
        """Build an engine (or reuse ``llm``, given a fresh cache) and run the workload and the checks."""
        if self.config.tp * self.config.pp > 1:
            raise ValueError("VllmSimulation runs one worker in this process; use vllm_sim.parallel.make_simulation")
        res = VllmSimResult(self.config)
        t0 = time.perf_counter()
        owned = llm is None
        with stdout_to_stderr():
            import vllm

            res.vllm_version = vllm.__version__
            if owned:
                llm = self.build_llm()
                bridge = self.runner_of(llm).omni_cache
            else:
                bridge = self.attach(llm)
            res.engine_start_s = time.perf_counter() - t0
            res.kv_blocks_engine = int(self.runner_of(llm).kv_cache_config.num_blocks)
            res.kv_groups = len(self.runner_of(llm).kv_cache_config.kv_cache_groups)
            res.output_group_id = bridge.hooks.config.output_group_id if bridge.hooks.config is not None else 0
            bridge.mm_outputs_fn = derive_mm
            bridge.observer = self._observe_with(bridge)
            self.bridge = bridge
            self.consumer = self._consumer_for(bridge, res)
            consumer = threading.Thread(target=self.consumer.run, args=(self._stop,), name="omni-consumer", daemon=True)
            consumer.start()
            try:
                if promises.kv_block_problem(self.config, res.kv_blocks_engine, res, getattr(self, "kv_blocks", None)):
                    raise promises.NotRun
                self._drive(llm, res)
                bridge.step_ids.join()
                if res.ok:
                    self._recompute(llm, res)
                    bridge.step_ids.join()
            except promises.NotRun:
                pass
            except Exception as exc:
                res.mismatches.append(Mismatch(bridge.engine_step, None, None, None, None,
                                               f"the engine raised {type(exc).__name__}: {exc}"))
            finally:
                self._stop.set()
                consumer.join(timeout=60)
            res.ranks = [{**bridge.hooks.rank_stats(), "engine_steps": bridge.engine_step,
                          "zero_token_steps": bridge.zero_token_steps}]
            self._check_exactly_once(bridge, res)
            res.preemptions = bridge.preemptions
            res.steps = bridge.engine_step
            if owned:
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

    def _after_step(self, llm: Any, res: VllmSimResult) -> None:
        """After each engine step (worker-process runs gather the workers' records here)."""

    def _on_output(self, out: Any) -> None:
        """Each ``RequestOutput`` of the workload's engine steps (speculative runs keep the tokens)."""

    def _observe_with(self, bridge: Any) -> Any:
        def observe(rec: Any) -> None:
            if rec.step_id is not None:
                self._published.append(rec.step_id)
            self.capture.observe(rec)
        return observe

    def _drive(self, llm: Any, res: VllmSimResult) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        le = llm.llm_engine
        arrivals = sorted(self.plan, key=lambda r: r.arrive_step)
        aborts = {r.name: r.abort_step for r in self.plan if r.abort_step is not None}
        aborted: set[str] = set()
        self._internal: dict[str, str] = {}
        self._finished: list[PlannedRequest] = []
        by_name = {r.name: r for r in self.plan}
        step = 0
        i = 0
        while i < len(arrivals) or le.has_unfinished_requests():
            while i < len(arrivals) and arrivals[i].arrive_step <= step:
                r = arrivals[i]
                sp = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
                internal = le.add_request(r.name, TokensPrompt(prompt_token_ids=list(r.prompt)), sp)
                self._internal[r.name] = internal
                self.capture.register_prompt(internal, r.prompt)
                res.requests_created += 1
                i += 1
            for name, at in list(aborts.items()):
                if at <= step and name in self._internal:
                    le.abort_request([name])
                    del aborts[name]
                    aborted.add(name)
                    res.aborted += 1
            for out in le.step():
                self._on_output(out)
                if out.finished and out.request_id in by_name and out.request_id not in aborted:
                    if any(getattr(o, "finish_reason", None) == "error" for o in out.outputs):
                        res.failed_requests.append(out.request_id)  # no row of it is owed to the next stage
                    else:
                        self._finished.append(by_name[out.request_id])
            self._after_step(llm, res)
            step += 1
            if step >= self.config.steps_limit and (i < len(arrivals) or le.has_unfinished_requests()):
                self._cut(le, res, step, aborted, len(arrivals) - i)
                break
        res.finished = len({r.name for r in self._finished})

    def _cut(self, le: Any, res: VllmSimResult, step: int, aborted: set[str], not_arrived: int) -> None:
        """``--steps-limit`` reached: abort what is still running (the engine ends idle, so the checks of
        the finished requests run as usual) and record the cut as the run doing less than asked."""
        ended = aborted | {r.name for r in self._finished} | set(res.failed_requests)
        running = [name for name in self._internal if name not in ended]
        if running:
            le.abort_request(running)
        while le.has_unfinished_requests():  # the aborts take effect in the next step
            for out in le.step():
                self._on_output(out)
        res.incomplete.append(f"--steps-limit {self.config.steps_limit} stopped the run after {step} engine steps "
                              f"with {len(running)} request(s) unfinished and {not_arrived} not yet arrived")

    def _recompute(self, llm: Any, res: VllmSimResult) -> None:
        """Check (b): each finished prompt alone on an empty prefix cache."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        le = llm.llm_engine
        sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True,
                            skip_reading_prefix_cache=True)  # no local nor KV-connector hit
        tol = self.config.tolerance
        for r in self._finished:
            if not le.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache refused with the engine idle")
            name = f"recompute-{r.name}"
            internal = le.add_request(name, TokensPrompt(prompt_token_ids=list(r.prompt)), sp)
            self.capture.register_prompt(internal, r.prompt)
            cached = None
            while le.has_unfinished_requests():
                for out in le.step():
                    if out.finished:
                        cached = out.num_cached_tokens
                self._after_step(llm, res)
            if cached:
                res.mismatches.append(Mismatch(None, None, name, None, None,
                                               f"the recomputation was served {cached} tokens from the KV cache"))
                continue
            res.recompute_requests += 1
            self._compare_prompt(self._internal[r.name], internal, r, res, tol)

    def _compare_prompt(self, served_id: str, truth_id: str, r: PlannedRequest, res: VllmSimResult, tol: float) -> None:
        served = self.capture.prompt_rows.get(served_id, {})
        truth = self.capture.forward_rows.get(truth_id, {})
        for p in range(len(r.prompt)):
            if p not in served:
                res.mismatches.append(Mismatch(None, None, served_id, "hidden", p,
                                               "the next stage never received this prompt row"))
                return
            diff = (served[p] - truth[p]).abs().max().item()
            scale = truth[p].abs().max().item()
            rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
            res.recompute_rows += 1
            res.recompute_exact_rows += int(diff == 0.0)
            res.recompute_max_abs_diff = max(res.recompute_max_abs_diff, diff)
            res.recompute_max_rel_diff = max(res.recompute_max_rel_diff, rel)
            if rel > tol:
                res.mismatches.append(Mismatch(None, None, served_id, "hidden", p,
                                               f"full-prompt row differs from the recomputation by {diff:.3g} "
                                               f"({rel:.3g} of the row's max |value| {scale:.3g}; tolerance {tol:g})"))
                return

    def _check_exactly_once(self, bridge: Any, res: VllmSimResult) -> None:
        consumed = self.consumer.consumed if self.consumer is not None else Counter()
        manager = bridge.hooks.manager
        refused = manager is not None and bool(self._published) and second_materialize_refused(
            manager, self._published[0])
        once = exactly_once(self._published, consumed, refused, {int(k): v for k, v in bridge.shutdown().items()})
        res.published, res.consumed, res.saved = once.published, once.consumed, once.published
        res.double_consume_refused, res.unconsumed = once.double_consume_refused, once.unconsumed
        res.mismatches.extend(once.mismatches)
