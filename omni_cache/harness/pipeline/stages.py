"""The thinker stage of ``omni-cache pipeline`` and how its engines are built.

Owns: the thinker engines' ``LLM(...)`` arguments (``thinker_kwargs``: every engine option
is set there from ``StageOptions``: the thinker's model, its ``tp x pp`` grid, its KV
connector; with or without prefix caching, with or without the cache), the stage timers
(``StageTimers``, ``install_stage_timers``) and the thinker stage (``ThinkerStage``: a
dummy-weight model of ``vllm_sim.models`` as ``simulate --engine vllm`` builds it; with
prefix caching on, the omni cache is installed through ``worker_cls`` and every saved step
id is materialized right after the step that saved it, check (a) of ``vllm_sim.truth`` runs
on every served row, and each request's full-prompt rows are assembled from the served rows;
without the cache (prefix caching off, or on without the cache: the upper bound) the rows
are read from the forward itself by ``ForwardTap``; with a KV connector, ``TierTruth``
checks the tier's rows and one ``TIER_FLUSH`` request ends the stage). The talker is
``pipeline.talker``.

Timers (seconds, written by the engine thread; in a worker process the probe's
consumer thread writes materialize): begin (the bridge's ``begin_step``), forward (the runner's
``_model_forward`` without the bridge's ``after_forward_v1`` inside it), save
(``after_forward_v1``: block-table view, stand-in per-token outputs, the
cache's save; without the checker's ``observe_forward`` inside it), materialize, and the checker's
own time (check (a), the forward capture, the ground truth's tap), kept apart
so the measured stage times exclude it.
vLLM is imported only inside functions. Checks I1 (every saved step id
materialized exactly once, a second refused), I4, I6 and I7 from outside.

Upholds nothing itself: it checks I1, I4, I6 and I7 from outside.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from omni_cache.harness.sim_engine.checker import Mismatch
from omni_cache.harness.vllm_engine.consumer import StepConsumer, second_materialize_refused
from omni_cache.harness.vllm_engine.engine import (
    BLOCK_SIZE,
    VllmSimConfig,
    VllmSimulation,
    engine_kwargs,
)
from omni_cache.harness.vllm_engine.models import DEFAULT_MODEL, sim_model
from omni_cache.harness.vllm_engine.parallel import worker_kv_bytes
from omni_cache.harness.vllm_engine.spec_run import speculative_options
from omni_cache.harness.vllm_engine.tier_truth import TierTruth
from omni_cache.harness.vllm_engine.truth import ForwardCapture, derive_mm
from omni_cache.harness.vllm_engine.truth_spec import SpecCapture
from omni_cache.harness.vllm_engine.workload import FIRST_TOKEN
from omni_cache.integration.block_table import BlockTableView
from omni_cache.integration.vllm_bridge import bridge_of, runner_of
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError

__all__ = ["ForwardTap", "StageOptions", "StageTimers", "ThinkerStage", "install_stage_timers", "thinker_kwargs"]

TIER_FLUSH = "tier-flush"  # the request that carries a stage's last tier stores (ThinkerStage._flush_tier_stores)


@dataclass(frozen=True)
class StageOptions:
    """Engine sizing shared by the stages; ``extra`` goes to every ``LLM(...)``. ``model``, ``tp``
    and ``pp`` are the thinker's (``vllm_sim.models``; tensor- and pipeline-parallel workers);
    the talker is always the one-process tiny Llama."""

    kv_blocks: int
    max_batched_tokens: int
    max_model_len: int
    seed: int = 0
    extra: tuple[tuple[str, Any], ...] = ()
    model: str = DEFAULT_MODEL
    tp: int = 1
    pp: int = 1
    kv_transfer_config: dict[str, Any] | None = None  # the thinker's KV connector (prefix caching on only)
    speculative: str | None = None  # the thinker's speculative decoding (prefix caching on only)

    @property
    def workers(self) -> int:
        return self.tp * self.pp


def thinker_kwargs(model_dir: str, opts: StageOptions, *, prefix_caching: bool, cache: bool = True) -> dict[str, Any]:
    """The thinker: with prefix caching, the cache via ``worker_cls`` (as ``simulate --engine vllm``);
    without, vLLM's own worker and no cache; ``cache=False`` with prefix caching: vLLM's own worker
    with prefix caching and no cache (the upper bound, which serves the next stage wrong rows). With
    ``tp x pp`` workers: vLLM's ``mp`` executor and each worker's KV bytes for ``kv_blocks`` blocks
    of its own layers (``vllm_sim.parallel``)."""
    model = sim_model(opts.model)
    kwargs = engine_kwargs(model_dir, kv_blocks=opts.kv_blocks, max_batched_tokens=opts.max_batched_tokens,
                           max_model_len=opts.max_model_len, eager=True, **model.engine_options)
    kwargs["kv_cache_memory_bytes"] = model.kv_cache_memory_bytes(opts.kv_blocks)
    if opts.workers > 1:
        kwargs.update(tensor_parallel_size=opts.tp, pipeline_parallel_size=opts.pp, distributed_executor_backend="mp",
                      kv_cache_memory_bytes=worker_kv_bytes(opts.kv_blocks, opts.pp))
    if not prefix_caching or not cache:
        kwargs.update(enable_prefix_caching=prefix_caching, worker_cls="auto", additional_config={})
    elif opts.kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = opts.kv_transfer_config
    if prefix_caching and opts.speculative is not None:
        kwargs.update(speculative_options(opts.speculative, opts.kv_blocks))
    kwargs.update(dict(opts.extra))
    return kwargs


@dataclass
class StageTimers:
    forward_s: float = 0.0
    begin_s: float = 0.0  # the bridge's begin_step (top of execute_model: the adapter and new_step_starts)
    save_s: float = 0.0
    model_outputs_s: float = 0.0  # the model's per-token mm outputs (the stand-in ``derive_mm``): not the cache's
    materialize_s: float = 0.0
    checker_s: float = 0.0  # check (a), the forward capture and the tap's bookkeeping: excluded from stage times
    step_s: float = 0.0  # engine step() calls, handoff included
    checker_cpu_s: float = 0.0  # the same two in process CPU time (all threads): less moved by other processes
    step_cpu_s: float = 0.0
    steps: int = 0  # engine steps that ran a forward
    saved_steps: int = 0


def install_stage_timers(runner: Any, bridge: Any, t: StageTimers, observe: Any) -> None:
    """begin = the bridge's ``begin_step``; forward = the runner's ``_model_forward`` minus the
    bridge's ``after_forward_v1`` inside it;
    save = ``after_forward_v1`` minus the bridge's ``observe_forward`` inside it (the checker: the
    ``ForwardRecord`` built for ``observe``, installed as the bridge's observer, and ``observe``) and
    minus the model's per-token outputs (``mm_outputs_fn``, timed as ``model_outputs_s``). Instance attributes: ``ThinkerStage.finish`` pops ``_model_forward`` again."""
    real_forward, real_after, real_begin = runner._model_forward, bridge.after_forward_v1, bridge.begin_step
    real_mm = bridge.mm_outputs_fn
    inner = {"after": 0.0, "observer": 0.0, "mm": 0.0}

    def mm_outputs_fn(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real_mm(*args, **kwargs)
        finally:
            dt = time.perf_counter() - start
            inner["mm"] += dt
            t.model_outputs_s += dt

    def begin_step(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real_begin(*args, **kwargs)
        finally:
            t.begin_s += time.perf_counter() - start

    def model_forward(*args: Any, **kwargs: Any) -> Any:
        start, after0 = time.perf_counter(), inner["after"]
        try:
            return real_forward(*args, **kwargs)
        finally:
            t.forward_s += time.perf_counter() - start - (inner["after"] - after0)

    def after_forward_v1(*args: Any, **kwargs: Any) -> Any:
        start, obs0, mm0 = time.perf_counter(), inner["observer"], inner["mm"]
        try:
            return real_after(*args, **kwargs)
        finally:
            total = time.perf_counter() - start
            inner["after"] += total
            t.save_s += total - (inner["observer"] - obs0) - (inner["mm"] - mm0)

    real_observe_forward = bridge.observe_forward

    def observe_forward(*args: Any, **kwargs: Any) -> None:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            real_observe_forward(*args, **kwargs)  # builds the ForwardRecord, then calls ``observe``
        finally:
            dt = time.perf_counter() - start
            inner["observer"] += dt
            t.checker_s += dt
            t.checker_cpu_s += time.process_time() - cpu

    runner._model_forward, bridge.after_forward_v1, bridge.begin_step = model_forward, after_forward_v1, begin_step
    bridge.observer, bridge.observe_forward = observe, observe_forward
    if real_mm is not None:
        bridge.mm_outputs_fn = mm_outputs_fn


class PromptLengths(Protocol):
    """Request -> prompt length, as ``ForwardTap`` reads it (a dict, or the runner's request states)."""

    def get(self, rid: str, default: int, /) -> int: ...


class ForwardTap:
    """Prefix caching off: each request's prompt rows read straight from the forward (batch order and
    computed counts from the runner's input batch, like the cache's own view)."""

    def __init__(self, runner: Any, prompt_len: PromptLengths, timers: StageTimers) -> None:
        self.rows: dict[str, dict[int, torch.Tensor]] = {}  # written by the engine thread (this process)
        self.computed = 0  # prompt positions the forward computed, recomputations included
        self._prompt_len = prompt_len
        self._timers = timers
        self._so: Any = None
        real_execute, real_forward = runner.execute_model, runner._model_forward

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._so = scheduler_output
            try:
                return real_execute(scheduler_output, *args, **kwargs)
            finally:
                self._so = None

        def model_forward(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = real_forward(*args, **kwargs)
            t1, c1 = time.perf_counter(), time.process_time()
            timers.forward_s += t1 - t
            if self._so is not None:
                timers.steps += 1
                self._take(runner, out)
                timers.checker_s += time.perf_counter() - t1
                timers.checker_cpu_s += time.process_time() - c1
            return out

        runner.execute_model, runner._model_forward = execute_model, model_forward
        self._runner = runner

    def remove(self) -> None:
        """Back to the runner's own methods (the wrappers are instance attributes)."""
        for attr in ("execute_model", "_model_forward"):
            self._runner.__dict__.pop(attr, None)

    def _take(self, runner: Any, hidden: torch.Tensor) -> None:
        so, self._so = self._so, None
        view = BlockTableView.from_input_batch(runner.input_batch, block_size=BLOCK_SIZE)
        row = 0
        for rid, start in zip(view.req_ids, view.num_computed_tokens, strict=True):
            n = int(so.num_scheduled_tokens.get(rid, 0))
            start = int(start)
            end = min(start + n, self._prompt_len.get(rid, 0))
            self.computed += max(0, end - start)
            for p in range(start, end):
                self.rows.setdefault(rid, {})[p] = hidden[row + p - start].detach().clone()
            row += n


class ThinkerStage:
    """One thinker engine, driven step by step; ``cached``: prefix caching on with the omni cache."""

    timers: StageTimers  # set by ``_init_state``, which both stages' constructors call first

    def __init__(self, llm: Any, *, cached: bool, tier_truth: TierTruth | None = None, partial: bool = False) -> None:
        """``cached``: ``llm`` runs the omni cache (a fresh one is attached: its prefix cache is emptied).
        ``partial`` (not ``cached``; ``llm`` runs prefix caching without the cache): the next stage gets
        the rows the forward computed and zeros for the cached prefix -- wrong rows of the right shape,
        so its work is the same; the upper bound of what prefix caching buys, never a talker check.
        ``tier_truth``: ``llm`` runs ``OmniKVConnector``; the tier's ground truth, kept across the
        stages on one engine (what an earlier run stored comes back in a later one), checks every
        row the tier restores as check (a) checks local hits."""
        self._init_state(llm, cached)
        self.partial = partial and not cached
        runner = runner_of(llm)
        if not cached:
            if self.partial and not llm.llm_engine.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache refused: the engine is not idle")
            self.tap = ForwardTap(runner, self.prompt_len, self.timers)
            return
        bridge_of(llm)  # refuses an engine without the cache
        self.bridge = VllmSimulation(VllmSimConfig()).attach(llm)
        self.kv_groups = len(runner.kv_cache_config.kv_cache_groups)
        self.kv_blocks_engine = int(runner.kv_cache_config.num_blocks)
        # Speculative decoding: tokens past a forward's start stay tentative; rows checked against the answers.
        self.capture = SpecCapture(BLOCK_SIZE) if self.bridge.speculative else ForwardCapture(BLOCK_SIZE)
        self.bridge.mm_outputs_fn = derive_mm
        self.tier_truth = tier_truth
        self.consumer = StepConsumer(self.bridge, served=self._serve, failed=self._fail,
                                     catch=(OmniPrefixCacheUnmatchError,), timed=self._time_materialize)
        if tier_truth is not None:
            bridge = self.bridge
            tier_truth.capture, tier_truth.engine_step = self.capture, lambda: bridge.engine_step
            bridge.step_observer = tier_truth.on_step
        self._install_timers(runner)

    def _init_state(self, llm: Any, cached: bool) -> None:
        """The stage's bookkeeping (engine thread only), shared with ``pipeline.parallel``'s stage."""
        self.llm, self.cached = llm, cached
        self.partial = False  # the upper bound (prefix caching without the cache): zeros for cached rows
        self.ranks: list[dict[str, Any]] = []  # each worker's place and host bytes (workers only)
        self.kv_groups = 0  # the engine's KV-cache groups (above 1: a hybrid layout); prefix caching on
        self.kv_blocks_engine = 0  # the KV blocks the engine got (the output rank's); prefix caching on
        self.timers = StageTimers()
        self.mismatches: list[Mismatch] = []
        self.internal: dict[str, str] = {}  # name -> engine request id
        self.prompt_len: dict[str, int] = {}  # engine request id -> prompt length
        self.served: dict[str, dict[int, torch.Tensor]] = {}  # engine id -> position -> row the next stage got
        self.cached_tokens: dict[str, int] = {}  # name -> the engine's num_cached_tokens
        self.prefill_tokens = 0  # prompt positions the forward computed (recomputation included)
        self.published = self.materialized = 0
        self.double_materialize_refused = False
        self.unconsumed: dict[int, str] = {}
        self._first_step_id: int | None = None
        self.final: dict[str, list[int]] = {}  # engine id -> prompt and answer tokens of a finished request
        self.spec_counts: dict[str, int] = {}  # speculative decoding: the bridge's draft counts (at finish)

    def _install_timers(self, runner: Any) -> None:
        install_stage_timers(runner, self.bridge, self.timers, self._observe)

    def _observe(self, rec: Any) -> None:
        self.timers.steps += 1
        for rid, start, end in rec.spans:
            self.prefill_tokens += max(0, min(end, self.prompt_len.get(rid, 0)) - start)
        self.capture.observe(rec)

    # ------------------------------------------------------------------ driving
    def add(self, name: str, prompt: tuple[int, ...], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
        internal = self.llm.llm_engine.add_request(name, TokensPrompt(prompt_token_ids=list(prompt)), sp)
        self.internal[name] = internal
        self.prompt_len[internal] = len(prompt)
        if self.cached:
            self.capture.register_prompt(internal, prompt)

    def busy(self) -> bool:
        return bool(self.llm.llm_engine.has_unfinished_requests())

    def step(self) -> list[tuple[str, tuple[int, ...]]]:
        """One engine step, then the handoff of every step id it saved; the requests it finished."""
        t, cpu = time.perf_counter(), time.process_time()
        outs = self.llm.llm_engine.step()
        if self.cached:
            self._handoff()
        else:
            self._count_tapped()
        self.timers.step_s += time.perf_counter() - t
        self.timers.step_cpu_s += time.process_time() - cpu
        done = []
        for out in outs:
            if out.finished:
                self.cached_tokens[out.request_id] = int(out.num_cached_tokens or 0)
                done.append((out.request_id, tuple(out.outputs[0].token_ids)))
                internal = self.internal.get(out.request_id, out.request_id)
                self.final[internal] = [*out.prompt_token_ids, *out.outputs[0].token_ids]
        return done

    def _count_tapped(self) -> None:
        self.prefill_tokens = self.tap.computed

    def _handoff(self) -> None:
        """Materialize every step id the step published (``consumer.StepConsumer``, inline)."""
        self.consumer.take_waiting()
        self.published, self._first_step_id = self.consumer.taken, self.consumer.first_step_id

    def _serve(self, ps: Any, out: Any) -> None:
        t = self.timers
        self.materialized += 1
        t.saved_steps += 1
        self._keep_served(ps.spans, out)
        c0, cpu = time.perf_counter(), time.process_time()
        self.capture.check_step(ps.engine_step, ps.step_id, ps.spans, out)
        t.checker_s += time.perf_counter() - c0
        t.checker_cpu_s += time.process_time() - cpu

    def _fail(self, ps: Any, exc: Exception) -> None:
        self.mismatches.append(Mismatch(ps.engine_step, ps.step_id, None, None, None,
                                        f"materialize raised {type(exc).__name__}: {exc}"))

    def _time_materialize(self, seconds: float) -> None:
        self.timers.materialize_s += seconds

    def _flush_tier_stores(self) -> None:
        """The connector sends a finished request's stores with the next scheduled step; a serving
        engine keeps stepping, this stage ends idle and the next one attaches a fresh cache. One
        one-token request (no full block: it stores nothing itself) carries the last finishes'
        stores to the tier while this stage's cache still holds their rows; it is served and
        checked like any request, and handed to no talker."""
        kept = dataclasses.asdict(self.timers)  # the run's costs, measured without this request
        self.add(TIER_FLUSH, (FIRST_TOKEN,), 1)
        while self.busy():
            self.step()
        self.timers.__dict__.update(kept)  # in place: the run's stats hold this object

    def _keep_served(self, spans: Any, out: Any) -> None:
        """Keep the prompt positions of each request's served rows (``[0, end)`` when a hit was merged)."""
        for rid, _, end in spans:
            rows = (out.hidden_states or {}).get(rid)
            if rows is None:
                continue
            first = end - rows.shape[0]
            keep = self.served.setdefault(rid, {})
            for p in range(first, min(end, self.prompt_len.get(rid, 0))):
                keep[p] = rows[p - first]

    # ------------------------------------------------------------------ rows
    def _received(self, rid: str) -> dict[int, torch.Tensor]:
        """Position -> row of ``rid``'s prompt: served by the cache, or read from the forward."""
        return self.served.get(rid, {}) if self.cached else self.tap.rows.get(rid, {})

    def prompt_rows(self, name: str) -> torch.Tensor:
        """The full-prompt rows the next stage receives, ``[prompt_len, hidden]``."""
        rid = self.internal[name]
        got = self._received(rid)
        n = self.prompt_len[rid]
        missing = [p for p in range(n) if p not in got]
        if missing and self.partial and got:  # the upper bound: zeros for the cached prefix
            zero = torch.zeros_like(next(iter(got.values())))
            return torch.stack([got.get(p, zero) for p in range(n)])
        if missing:
            raise OmniPrefixCacheUnmatchError(
                f"request {name!r} ({rid}) finished but the next stage never received prompt rows "
                f"{missing[:4]}{'...' if len(missing) > 4 else ''} of {n}")
        return torch.stack([got[p] for p in range(n)])

    def computed_rows(self, name: str) -> torch.Tensor:
        """Only the prompt rows this request's own forward computed (negative control: no cached prefix)."""
        rows = self.capture.forward_rows.get(self.internal[name], {})
        return torch.stack([rows[p] for p in sorted(rows)])

    def finish(self) -> None:
        """Exactly-once accounting (nothing left unconsumed, a second materialize refused); the runner's
        own methods back, so a later stage on the same engine times only itself."""
        runner = runner_of(self.llm)
        if not self.cached:
            self.tap.remove()
            return
        if self.tier_truth is not None:
            self._flush_tier_stores()
        runner.__dict__.pop("_model_forward", None)
        if isinstance(self.capture, SpecCapture):  # I14 from outside: rows of the requests' tokens only, all of them
            self.capture.check_tokens(self.final, set(self.final))
            self.spec_counts = dict(self.bridge.verify_steps.counters)
        self.mismatches[:0] = self.capture.mismatches
        if self.published != self.materialized:
            self.mismatches.append(Mismatch(None, None, None, None, None,
                                            f"{self.published - self.materialized} saved step ids not materialized"))
        first = self._first_step_id
        manager = self.bridge.hooks.manager
        if manager is not None and self.capture.rows_verified and first is not None:
            self.double_materialize_refused = second_materialize_refused(manager, first)
            if not self.double_materialize_refused:
                self.mismatches.append(Mismatch(None, first, None, None, None,
                                                "a second materialize of a consumed step id was not refused"))
        self.unconsumed = {int(k): v for k, v in self.bridge.shutdown().items()}
        if self.unconsumed:
            self.mismatches.append(Mismatch(None, None, None, None, None,
                                            f"unconsumed step ids at shutdown: {self.unconsumed}"))


def build_llm(kwargs: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(**kwargs)



