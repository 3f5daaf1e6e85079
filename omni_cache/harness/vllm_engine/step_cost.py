"""What the cache adds to one real engine step, part by part, on a real vLLM CPU engine.

Owns: ``StepCostProbe`` (timers around the bridge's per-step calls, installed as instance
attributes and removed again), ``run_step_cost`` (one engine with the cache, decode steps
of 1 to 32 requests and one-request prefill steps of 32 to 512 tokens, each configuration
measured in alternating passes), ``StepCostResult`` and ``fit_cost`` (least squares:
cost = fixed + per_request x requests + per_row x rows).

The parts of a step (µs): ``begin_step`` (the bridge's, at the top of ``execute_model``:
the adapter's ``translate_step`` and the manager's ``new_step_starts`` inside it),
``after_forward`` (the bridge's ``after_forward_v1``: the block-table ``view``, the
adapter's write ``layout``, the manager's ``save`` and the model's per-token outputs inside
it), ``materialize`` (the consumer's call). ``bridge`` is what is left of ``begin_step``
and ``after_forward`` outside the parts named. The model's per-token outputs are the
model's work (here the simulation's stand-in, ``truth.derive_mm``), never the cache's:
they are timed and subtracted. The cache's cost of a step is
``begin_step + after_forward - model outputs + materialize``.

Two kinds of pass alternate, each running every configuration of both stages: ``totals``
(timers on the three calls above and the model outputs only) and ``parts`` (every part's timer
too, each adding its own call overhead); the cache's cost is read from the totals passes, the parts from the
parts passes. Two stages are measured: ``hidden`` (a thinker whose only per-token output is
its hidden rows) and ``hidden+mm`` (as ``omni-cache pipeline``'s thinker: two per-token mm
keys beside them, one written on finish).

**Fixed cost** is the cache's cost of a decode step of one request and one token (median
over its steps): what every step pays whatever the batch. The fit's intercept is printed
beside it. vLLM is imported only inside functions.

Upholds nothing itself; every saved step id is materialized exactly once (a second materialize is the bridge's refusal)
and the run fails when one is left unconsumed.
"""

from __future__ import annotations

import queue
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["FIXED_TARGET_US", "PARTS", "STAGES", "StepCostProbe", "StepCostResult", "StepSample", "fit_cost",
           "run_step_cost"]

FIXED_TARGET_US = 250.0
"""The fixed cost the cache may add to a step: a one-request, one-token decode step."""
PARTS = ("begin_step", "translate", "new_step_starts", "after_forward", "view", "layout", "save",
         "model_outputs", "materialize")
OUTER = ("begin_step", "after_forward", "model_outputs", "materialize")
STAGES = ("hidden", "hidden+mm")
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
PREFILL_TOKENS = (32, 128, 512)
PROMPT_TOKENS = 32  # the decode configurations' prompts


@dataclass
class StepSample:
    """One engine step: its requests and rows, each timed part (ns) and the engine's own times."""

    requests: int
    rows: int
    ns: dict[str, int]
    step_ns: int = 0
    forward_ns: int = 0

    @property
    def cache_ns(self) -> int:
        ns = self.ns
        return ns.get("begin_step", 0) + ns.get("after_forward", 0) - ns.get("model_outputs", 0) \
            + ns.get("materialize", 0)


class StepCostProbe:
    """Timers on one in-process engine's bridge (its manager must exist: install after a first real
    step). ``parts``: also time the inner parts. ``remove`` restores every wrapped method."""

    def __init__(self, bridge: Any, runner: Any, *, parts: bool) -> None:
        manager = bridge.hooks.manager
        if manager is None:
            raise RuntimeError("StepCostProbe: the engine ran no real step yet (no cache to time)")
        self._current: dict[str, int] = defaultdict(int)  # the step's ns per part; the wrappers add to it
        self._wrapped: list[tuple[Any, str, Any]] = []  # (object, attribute, its own instance value or None)
        self._step: dict[str, int] = {}
        self._wrap(bridge, "begin_step", "begin_step", on_call=self._note_step)
        self._wrap(bridge, "after_forward_v1", "after_forward")
        self._wrap(bridge.hooks, "materialize", "materialize")
        self._wrap(runner, "_model_forward", "forward_and_after")
        if bridge.mm_outputs_fn is not None:
            self._wrap(bridge, "mm_outputs_fn", "model_outputs")
        if parts:
            self._wrap(bridge.hooks.adapter, "translate_step", "translate")
            self._wrap(manager, "new_step_starts", "new_step_starts")
            if hasattr(bridge, "view_v1"):
                self._wrap(bridge, "view_v1", "view")
            self._wrap(bridge.hooks.adapter, "build_write_layout", "layout")
            self._wrap(manager, "save_outputs", "save")

    def _note_step(self, so: Any, *_: Any) -> None:
        self._step = {"requests": len(so.num_scheduled_tokens), "rows": int(so.total_num_scheduled_tokens)}

    def _wrap(self, obj: Any, name: str, part: str, on_call: Callable[..., None] | None = None) -> None:
        real = getattr(obj, name)
        current = self._current
        clock = time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            if on_call is not None:
                on_call(*args)
            start = clock()
            try:
                return real(*args, **kwargs)
            finally:
                current[part] += clock() - start

        self._wrapped.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, timed)

    def take(self, step_ns: int) -> StepSample | None:
        """The step just run (with its materialize), or None when it ran no forward."""
        ns = dict(self._current)
        self._current.clear()  # in place: the wrappers hold this dict
        step, self._step = self._step, {}
        if not step or "after_forward" not in ns:
            return None
        forward = ns.pop("forward_and_after", 0) - ns["after_forward"]
        return StepSample(step["requests"], step["rows"], ns, step_ns, forward)

    def remove(self) -> None:
        for obj, name, own in reversed(self._wrapped):
            if own is None:  # a method: the class's again
                del obj.__dict__[name]
            else:  # an instance attribute (e.g. mm_outputs_fn): its own value again
                setattr(obj, name, own)
        self._wrapped.clear()


@dataclass
class ConfigResult:
    """The medians of one configuration (a decode batch or a prefill length) of one stage."""

    stage: str
    kind: str  # "decode" or "prefill"
    requests: int
    rows: int
    steps: int  # steps in the totals passes
    cache_us: float
    step_us: float
    forward_us: float
    parts_us: dict[str, float] = field(default_factory=dict)

    @property
    def bridge_us(self) -> float:
        p = self.parts_us
        inner = sum(p.get(k, 0.0) for k in ("translate", "new_step_starts", "view", "layout", "save"))
        return p.get("begin_step", 0.0) + p.get("after_forward", 0.0) - p.get("model_outputs", 0.0) - inner

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "kind": self.kind, "requests": self.requests, "rows": self.rows,
                "steps": self.steps, "cache_us": round(self.cache_us, 2), "engine_step_us": round(self.step_us, 2),
                "forward_us": round(self.forward_us, 2), "bridge_us": round(self.bridge_us, 2),
                "parts_us": {k: round(v, 2) for k, v in self.parts_us.items()}}


def fit_cost(configs: list[ConfigResult]) -> dict[str, float]:
    """Least squares over the configurations: cache µs = fixed + per_request x requests + per_row x rows."""
    a = np.array([[1.0, c.requests, c.rows] for c in configs])
    y = np.array([c.cache_us for c in configs])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return {"intercept_us": float(coef[0]), "per_request_us": float(coef[1]), "per_row_us": float(coef[2])}


@dataclass
class StepCostResult:
    model: str
    repeats: int
    configs: list[ConfigResult]
    unconsumed: int = 0
    wall_s: float = 0.0
    target_us: float = FIXED_TARGET_US
    stages: tuple[str, ...] = STAGES

    def one_token(self, stage: str) -> ConfigResult:
        return next(c for c in self.configs if c.stage == stage and c.kind == "decode" and c.requests == 1)

    def fit(self, stage: str) -> dict[str, float]:
        return fit_cost([c for c in self.configs if c.stage == stage])

    @property
    def passed(self) -> bool:
        return self.unconsumed == 0 and all(self.one_token(s).cache_us <= self.target_us for s in self.stages)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "repeats": self.repeats, "target_fixed_us": self.target_us,
                "fixed_us": {s: round(self.one_token(s).cache_us, 2) for s in self.stages},
                "fit": {s: {k: round(v, 3) for k, v in self.fit(s).items()} for s in self.stages},
                "share_of_engine_step": {s: round(self.one_token(s).cache_us / self.one_token(s).step_us, 4)
                                         for s in self.stages},
                "unconsumed_step_ids": self.unconsumed, "pass": self.passed, "wall_s": round(self.wall_s, 1),
                "configs": [c.to_json() for c in self.configs]}


class _Driver:
    """One engine with the cache, driven step by step; every saved step id materialized at once."""

    def __init__(self, llm: Any) -> None:
        from omni_cache.integration.vllm_bridge import bridge_of, runner_of

        self.llm, self.bridge, self.runner = llm, bridge_of(llm), runner_of(llm)
        self._next_token = 0  # prompts made
        self._names = 0

    def prompt(self, n: int) -> list[int]:
        """``n`` tokens no earlier prompt shares a block with (no prefix hit between configurations)."""
        self._next_token += 1  # the first two tokens number the prompt: its every block hash is new
        k = self._next_token
        return [3 + k // 500 % 500, 3 + k % 500] + [3 + (k + i) * 7919 % 500 for i in range(n - 2)]

    def add(self, n_prompt: int, max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
        self._names += 1
        self.llm.llm_engine.add_request(f"cost{self._names}", TokensPrompt(prompt_token_ids=self.prompt(n_prompt)), sp)

    def step(self, probe: StepCostProbe | None) -> StepSample | None:
        clock = time.perf_counter_ns
        start = clock()
        self.llm.llm_engine.step()
        step_ns = clock() - start
        while True:
            try:
                published = self.bridge.step_ids.get_nowait()
            except queue.Empty:
                break
            self.bridge.hooks.materialize(published.step_id)
            self.bridge.step_ids.task_done()
        return probe.take(step_ns) if probe is not None else None

    def run_all(self, probe: StepCostProbe | None) -> list[StepSample]:
        samples = []
        while self.llm.llm_engine.has_unfinished_requests():
            sample = self.step(probe)
            if sample is not None:
                samples.append(sample)
        return samples


def _config_samples(driver: _Driver, kind: str, size: int, probe: StepCostProbe, decode_steps: int) -> list[StepSample]:
    if kind == "decode":
        for _ in range(size):
            driver.add(PROMPT_TOKENS, decode_steps + 1)
        return [s for s in driver.run_all(probe) if s.requests == size and s.rows == size]
    samples = []
    for _ in range(4):
        driver.add(size, 1)
        samples += [s for s in driver.run_all(probe) if s.requests == 1 and s.rows == size]
    return samples


def run_step_cost(llm: Any, *, model: str, repeats: int = 3, decode_steps: int = 16,
                  decode_batches: tuple[int, ...] = DECODE_BATCHES, prefill_tokens: tuple[int, ...] = PREFILL_TOKENS,
                  stages: tuple[str, ...] = STAGES, progress: Callable[[str], None] | None = None) -> StepCostResult:
    """Measure every configuration of both stages on ``llm`` (built with the cache), ``repeats``
    totals passes alternating with as many parts passes; medians per configuration."""
    import gc

    from omni_cache.harness.vllm_engine.truth import derive_mm

    t0 = time.perf_counter()
    driver = _Driver(llm)
    for stage in stages:  # warm-up: builds the manager, first touches, every stage's keys
        driver.bridge.mm_outputs_fn = derive_mm if stage == "hidden+mm" else None
        for _ in range(2):
            driver.add(PROMPT_TOKENS, decode_steps)
        driver.run_all(None)
    plan = [(stage, kind, size) for stage in stages
            for kind, size in [("decode", b) for b in decode_batches] + [("prefill", t) for t in prefill_tokens]]
    got: dict[tuple[str, str, int], dict[bool, list[StepSample]]] = {c: {False: [], True: []} for c in plan}
    # NOTE: every pass runs the whole plan, so a slow spell of the machine (these are small boxes shared
    # with other work) falls on every configuration alike instead of on the few measured during it.
    for r in range(2 * repeats):
        parts = r % 2 == 1
        if progress is not None:
            progress(f"pass {r + 1} of {2 * repeats} ({'parts' if parts else 'totals'})")
        for stage, kind, size in plan:
            driver.bridge.mm_outputs_fn = derive_mm if stage == "hidden+mm" else None
            probe = StepCostProbe(driver.bridge, driver.runner, parts=parts)
            gc.collect()
            gc.disable()
            try:
                got[stage, kind, size][parts] += _config_samples(driver, kind, size, probe, decode_steps)
            finally:
                gc.enable()
                probe.remove()
    configs = [_summarize(stage, kind, size, got[stage, kind, size][False], got[stage, kind, size][True])
               for stage, kind, size in plan]
    driver.bridge.mm_outputs_fn = None
    unconsumed = len(driver.bridge.hooks.manager.staging.unconsumed())
    return StepCostResult(model, repeats, configs, unconsumed, time.perf_counter() - t0, stages=stages)


def _summarize(stage: str, kind: str, size: int, totals: list[StepSample], parts: list[StepSample]) -> ConfigResult:
    if not totals or not parts:
        raise RuntimeError(f"step cost: no {kind} step of size {size} was measured ({stage})")
    med = statistics.median
    requests, rows = (size, size) if kind == "decode" else (1, size)
    return ConfigResult(
        stage, kind, requests, rows, len(totals), cache_us=med(s.cache_ns for s in totals) / 1e3,
        step_us=med(s.step_ns for s in totals) / 1e3, forward_us=med(s.forward_ns for s in totals) / 1e3,
        parts_us={p: med(s.ns.get(p, 0) for s in parts) / 1e3 for p in PARTS})
