"""The run of ``omni-cache pipeline``: both pipelines, the controls and the measurements.

Owns: ``PipelineConfig``, ``PipelineResult``, ``drive`` (one pipeline: the
planned turns arrive at their steps, the thinker steps, each request it
finishes goes onto the handoff queue, the talker takes it in the same pipeline
step and steps too -- both engines' steps interleaved, the talker never waits
for the whole thinker batch) and ``Pipeline.run`` (build the talker checkpoint
and the three engines, run the pipeline with prefix caching and the cache,
then with prefix caching off on the thinker (ground truth), then the two
negative controls on the talker, and compare).

Measured in the same run: thinker prefill tokens computed and thinker time
(its engine steps, the handoff included, the checker's own time excluded) and
end-to-end time (first arrival to last talker output, checker excluded) with
and without prefix caching, and the cache's cost (save and materialize per
step against the forward). Upholds nothing itself: it checks I1, I4, I6, I7 from
outside (see ``stages``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import shutil
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
from omni_cache.harness.pipeline.parallel import make_thinker_stage
from omni_cache.harness.pipeline.stages import (
    StageOptions,
    StageTimers,
    TalkerStage,
    ThinkerStage,
    talker_checkpoint,
    talker_kwargs,
    thinker_kwargs,
)
from omni_cache.harness.pipeline.workload import (
    PRESETS,
    PlannedTurn,
    max_prompt_len,
    plan_turns,
    resolve_prompt,
)
from omni_cache.harness.sim_engine.checker import Mismatch
from omni_cache.harness.vllm_engine.engine import BLOCK_SIZE
from omni_cache.harness.vllm_engine.grid import check_kv_connector, check_parallel_config
from omni_cache.harness.vllm_engine.models import DEFAULT_MODEL, sim_model
from omni_cache.harness.vllm_engine.tier_run import tier_findings
from omni_cache.harness.vllm_engine.tier_truth import TierTruth
from omni_cache.harness.vllm_engine.truth import ForwardCapture

__all__ = ["Drive", "PipelineConfig", "PipelineResult", "RunStats", "drive", "run_pipeline"]


@dataclass(frozen=True)
class PipelineConfig:
    preset: str = "mix"
    seed: int = 0
    requests: int | None = None
    talker_tokens: int | None = None
    tolerance: float = DEFAULT_LOGPROB_TOLERANCE
    repeats: int = 2  # each pipeline runs this often, alternating (on, off, off, on, ...); times: the fastest
    steps_limit: int = 5000
    extra_engine_args: tuple[tuple[str, Any], ...] = ()  # every engine
    model: str = DEFAULT_MODEL  # the thinker's (vllm_sim.models)
    tp: int = 1  # the thinker's tensor-parallel workers (pipeline.parallel when tp x pp > 1)
    pp: int = 1  # the thinker's pipeline-parallel stages
    kv_connector: str | None = None  # "example": the thinker with prefix caching runs ExampleConnector under
    # OmniKVConnector; from the second repeat on its prefixes come back through it (pipeline.kv_scope)

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

    def as_dict(self) -> dict[str, Any]:
        preset = PRESETS[self.preset]
        return {**asdict(self), "requests": self.requests or preset.requests,
                "talker_tokens": self.talker_tokens or preset.talker_tokens, "kv_blocks": preset.kv_blocks,
                "max_batched_tokens": preset.max_batched_tokens, "max_model_len": preset.max_model_len}


@dataclass
class RunStats:
    """One pipeline run (with or without prefix caching on the thinker)."""

    finished: int = 0
    talker_finished: int = 0
    pipeline_steps: int = 0
    prefill_tokens: int = 0
    hit_tokens: int = 0  # the engine's num_cached_tokens, summed over requests
    hit_requests: int = 0
    thinker_s: float = 0.0
    end_to_end_s: float = 0.0
    talker_s: float = 0.0
    thinker_cpu_s: float = 0.0  # process CPU time, all threads
    end_to_end_cpu_s: float = 0.0
    overlap_steps: int = 0  # pipeline steps in which both engines stepped
    timers: StageTimers = field(default_factory=StageTimers)


@dataclass
class PipelineResult:
    config: PipelineConfig
    vllm_version: str = ""
    requests: int = 0
    with_apc: RunStats = field(default_factory=RunStats)
    without_apc: RunStats = field(default_factory=RunStats)
    identity: Verdict = field(default_factory=Verdict)
    thinker_answers_equal: int = 0
    row_max_rel_diff: float = 0.0
    control_computed: Verdict = field(default_factory=Verdict)
    control_perturbed: Verdict = field(default_factory=Verdict)
    perturbed: str = ""  # "request, position" of control (ii)
    repeats_with_apc: list[dict[str, float]] = field(default_factory=list)
    repeats_without_apc: list[dict[str, float]] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # the thinker's workers (tp x pp > 1)
    kv_groups: int = 0  # the thinker's KV-cache groups (above 1: a hybrid layout)
    tier: dict[str, Any] = field(default_factory=dict)  # --kv-connector: the tier's counters and external tokens
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
        """Ran clean but proved less than asked (exit 3): no request hit the prefix cache."""
        return self.with_apc.hit_tokens == 0

    @property
    def ok(self) -> bool:
        return not self.failed and not self.incomplete


@dataclass
class Drive:
    """What one pipeline run produced: stats, each turn's prompt and answer, the talker's request names."""

    stats: RunStats
    prompts: dict[str, tuple[int, ...]]
    answers: dict[str, tuple[int, ...]]
    sent: list[str]


def drive(thinker: ThinkerStage, talker: TalkerStage, plan: list[PlannedTurn], *, turn_gap: int,
          steps_limit: int, prefix: str = "") -> Drive:
    """One pipeline run; the talker's requests are named ``prefix`` + turn."""
    stats = RunStats()
    children: dict[str, list[PlannedTurn]] = collections.defaultdict(list)
    due: list[tuple[int, PlannedTurn]] = []
    for turn in plan:
        if turn.parent is None:
            due.append((turn.arrive_step, turn))
        else:
            children[turn.parent].append(turn)
    prompts: dict[str, tuple[int, ...]] = {}
    answers: dict[str, tuple[int, ...]] = {}
    handoff: collections.deque[str] = collections.deque()  # finished by the thinker, not yet taken by the talker
    sent: list[str] = []
    step = 0
    talker0 = talker.step_s
    t0, cpu0 = time.perf_counter(), time.process_time()
    while True:
        due.sort(key=lambda d: d[0])
        while due and due[0][0] <= step:
            turn = due.pop(0)[1]
            prompts[turn.name] = resolve_prompt(turn, prompts, answers)
            thinker.add(turn.name, prompts[turn.name], turn.max_tokens)
        stepped = False
        if thinker.busy():
            stepped = True
            for name, answer in thinker.step():
                answers[name] = answer
                handoff.append(name)
                due.extend((step + turn_gap, child) for child in children.pop(name, ()))
        while handoff:
            name = handoff.popleft()
            talker.add(prefix + name, thinker.prompt_rows(name))
            sent.append(prefix + name)
        if talker.busy():
            stats.overlap_steps += int(stepped)
            talker.step()
        if not due and not thinker.busy() and not talker.busy():
            break
        step += 1
        if not thinker.busy() and not talker.busy() and due:
            step = max(step, min(d[0] for d in due))
        if step >= steps_limit:
            raise RuntimeError(f"the pipeline did not finish within {steps_limit} steps")
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    t = thinker.timers
    stats.pipeline_steps = step + 1
    stats.finished = len(answers)
    stats.talker_finished = sum(1 for n in sent if n in talker.outputs)
    stats.prefill_tokens = thinker.prefill_tokens
    stats.hit_tokens = sum(thinker.cached_tokens.values())
    stats.hit_requests = sum(1 for v in thinker.cached_tokens.values() if v > 0)
    stats.thinker_s = t.step_s - t.checker_s
    stats.end_to_end_s = wall - t.checker_s
    stats.thinker_cpu_s = t.step_cpu_s - t.checker_cpu_s
    stats.end_to_end_cpu_s = cpu - t.checker_cpu_s
    stats.talker_s = talker.step_s - talker0
    stats.timers = t
    return Drive(stats, prompts, answers, sent)


class Pipeline:
    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.preset = PRESETS[config.preset]
        self.plan = plan_turns(self.preset, seed=config.seed, requests=config.requests)
        p = self.preset
        self.opts = StageOptions(kv_blocks=p.kv_blocks, max_batched_tokens=p.max_batched_tokens,
                                 max_model_len=p.max_model_len, seed=config.seed, extra=config.extra_engine_args,
                                 model=config.model, tp=config.tp, pp=config.pp)
        self.talker_tokens = config.talker_tokens or p.talker_tokens
        # The engine reports pool blocks: a hybrid layout's groups share one pool (vllm_sim.models).
        self.asked_kv_blocks = p.kv_blocks * sim_model(config.model).pool_blocks_per_block

    def run(self, engines: dict[str, Any] | None = None) -> PipelineResult:
        """Build the engines (or use ``engines``: ``thinker_apc``, ``thinker_truth``, ``talker``) and run."""
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
        ckpt = stack.enter_context(talker_checkpoint(self.config.seed))
        thinker_dir = model_dir(self.config.model, tempfile.mkdtemp(prefix="omni-cache-thinker-"))
        stack.callback(shutil.rmtree, thinker_dir, True)
        talker = build_llm(talker_kwargs(ckpt, self.opts))
        stack.callback(_shutdown, talker)
        engines = {"talker": talker, "thinker_truth": build_llm(thinker_kwargs(thinker_dir, self.opts,
                                                                               prefix_caching=False))}
        stack.callback(_shutdown, engines["thinker_truth"])
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
        talker = TalkerStage(engines["talker"], self.talker_tokens)
        self._warm_up(talker)
        runs: dict[bool, list[tuple[ThinkerStage, Drive]]] = {True: [], False: []}
        tier_truth = TierTruth(ForwardCapture(BLOCK_SIZE), lambda: 0) if self.config.kv_connector else None
        for r in range(self.config.repeats):  # on, off, off, on, ...: drift and warm-up fall on both
            for cached in ((True, False) if r % 2 == 0 else (False, True)):
                stage = make_thinker_stage(engines["thinker_apc" if cached else "thinker_truth"], self.opts,
                                           cached=cached, tier_truth=tier_truth if cached else None)
                if cached and stage.kv_blocks_engine != self.asked_kv_blocks:
                    res.mismatches.append(Mismatch(None, None, None, None, None, (
                        f"the thinker's engine got {stage.kv_blocks_engine} KV blocks, the preset asks for "
                        f"{self.asked_kv_blocks}: its prefix hits are not the preset's (something changed "
                        "kv_cache_memory_bytes)")))
                gc.collect()
                gc.disable()  # no collector pauses inside the timed runs (the checker's many small tensors)
                try:
                    out = drive(stage, talker, self.plan, turn_gap=self.preset.turn_gap_steps,
                                steps_limit=self.config.steps_limit, prefix=f"{'apc' if cached else 'truth'}{r}:")
                finally:
                    gc.enable()
                stage.finish()
                res.mismatches.extend(stage.mismatches)
                runs[cached].append((stage, out))
        res.repeats_with_apc = [_times(d.stats) for _, d in runs[True]]
        res.repeats_without_apc = [_times(d.stats) for _, d in runs[False]]
        res.with_apc = _fastest([d.stats for _, d in runs[True]])
        res.without_apc = _fastest([d.stats for _, d in runs[False]])
        names = [t.name for t in self.plan]
        truth, truth_run = runs[False][0]
        truth_out = {n: talker.outputs[f"truth0:{n}"] for n in names if f"truth0:{n}" in talker.outputs}
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
        self._controls(apc, talker, truth_out, res)

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
        """The talker is shared by both runs: warm it (prompt lengths like the workload's, batched and alone)
        so that neither run's end-to-end time carries its first steps."""
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


def _fastest(stats: list[RunStats]) -> RunStats:
    """The counts of the first repeat, the smallest time of each kind over the repeats."""
    first = stats[0]
    for attr in ("thinker_s", "end_to_end_s", "talker_s", "thinker_cpu_s", "end_to_end_cpu_s"):
        setattr(first, attr, min(getattr(s, attr) for s in stats))
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
