"""Driving the synthetic engine through the manager and through the raw-copy floor.

Owns: the timing loop of ``omni-cache bench`` and its results
(``ImplResult`` per implementation and batch size, ``BenchResult`` for a whole
run, with the omni_cache/floor ratios and the pass/fail against the target).

Method: one manager and one floor per batch size, each warmed up by one
discarded pass (first-touch allocation of the pool and the staging pages is
start-up cost, not per-step cost), then ``repeats`` measured passes. Within a
pass the two run *step by step* (manager step k, floor step k, alternating who
goes first), so a burst of machine noise hits both. Only the cache calls are
timed (``perf_counter_ns`` around each ``new_step_starts`` / ``save_outputs`` /
``materialize``); building the forward's outputs and checking every
materialized row against the ground truth happen outside the timers. The
garbage collector is collected before and disabled during each pass. The
reported time of a step and op is its median over the repeats; totals (and
tokens/s) are sums of those medians, which keeps one noisy step of one repeat
from moving the result on these shared 2-core machines.

Checks (every repeat, warm-up included): every materialized step equals the
ground truth (I4, I6, I7 through ``check_outputs``), each step id is consumed
exactly once by materialize (I1), and ``shutdown`` reports no unconsumed step
ids (I2).

Upholds nothing itself: it checks the invariants above from outside.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from omni_cache.harness.bench.floor import RawCopyFloor
from omni_cache.harness.bench.workload import (
    MM_KEY,
    GroundTruthError,
    Step,
    Workload,
    WorkloadSpec,
    build_workload,
    check_outputs,
)
from omni_cache.runtime.interface import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig

OPS: tuple[str, ...] = ("new_step_starts", "save", "materialize")
OMNI, FLOOR = "omni_cache", "floor"
TARGET_RATIO = 0.5

ManagerFactory = Callable[[PrefixCacheConfig, bool], Any]


def default_manager_factory(config: PrefixCacheConfig, eager: bool) -> Any:
    from omni_cache.runtime.manager import OmniPrefixCacheManager

    return OmniPrefixCacheManager(config, eager=eager)


@dataclass
class RepeatTimes:
    """One timed pass of one implementation: ns per (step, op), plus the closing call."""

    step_ns: list[list[int]]  # [step][op index in OPS]
    finish_ns: int
    rows_checked: int

    @property
    def total_ns(self) -> int:
        return sum(map(sum, self.step_ns)) + self.finish_ns


@dataclass
class ImplResult:
    """Medians over the repeats of one implementation at one batch size."""

    impl: str
    batch_size: int
    tokens: int
    steps: int
    decode_tokens: int
    tokens_per_s: float
    us_per_step: float
    decode_tokens_per_s: float
    decode_us_per_step: float
    # Mean µs per call of each op (median over repeats); None where the impl has no such call.
    us_per_call: dict[str, float | None]
    repeats_tokens_per_s: list[float]
    rows_checked: int


@dataclass
class BenchResult:
    """A whole ``omni-cache bench`` run."""

    config: dict[str, Any]
    results: list[ImplResult]
    target_ratio: float = TARGET_RATIO
    ground_truth: str = "ok"
    manager_stats: dict[int, dict[str, Any]] = field(default_factory=dict)

    def get(self, impl: str, batch_size: int) -> ImplResult:
        return next(r for r in self.results if r.impl == impl and r.batch_size == batch_size)

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({r.batch_size for r in self.results})

    def ratio(self, batch_size: int, *, decode: bool = False) -> float:
        field_name = "decode_tokens_per_s" if decode else "tokens_per_s"
        floor = getattr(self.get(FLOOR, batch_size), field_name)
        return getattr(self.get(OMNI, batch_size), field_name) / floor if floor else float("nan")

    def overhead_us_per_step(self, batch_size: int) -> float:
        """Decode µs/step of omni_cache minus the floor's (a difference of two timings that can be
        negative: the floor clones per request and key; ``bench.narrow`` measures the bookkeeping)."""
        return self.get(OMNI, batch_size).decode_us_per_step - self.get(FLOOR, batch_size).decode_us_per_step

    def overhead_growth_us_per_request(self) -> float:
        """How ``overhead_us_per_step`` changes per extra request, smallest -> largest batch."""
        lo, hi = self.batch_sizes[0], self.batch_sizes[-1]
        if hi == lo:
            return 0.0
        return (self.overhead_us_per_step(hi) - self.overhead_us_per_step(lo)) / (hi - lo)

    @property
    def passed(self) -> bool:
        return all(self.ratio(b) >= self.target_ratio for b in self.batch_sizes)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "results": [asdict(r) for r in self.results],
            "ratios": {str(b): self.ratio(b) for b in self.batch_sizes},
            "decode_ratios": {str(b): self.ratio(b, decode=True) for b in self.batch_sizes},
            "decode_overhead_us_per_step": {str(b): self.overhead_us_per_step(b) for b in self.batch_sizes},
            "decode_overhead_growth_us_per_request": self.overhead_growth_us_per_request(),
            "target_ratio": self.target_ratio,
            "pass": None if self.config.get("quick") else self.passed,  # --quick: no verdict
            "ground_truth": self.ground_truth,
            "manager_stats": {str(b): s for b, s in self.manager_stats.items()},
        }


def manager_step(manager: Any, step: Step) -> tuple[list[int], Any]:
    clock = time.perf_counter_ns
    n = step.num_tokens
    t0 = clock()
    manager.new_step_starts(step.events)
    t1 = clock()
    step_id = manager.save_outputs(
        step.outputs[HIDDEN_KEY], {MM_KEY: step.outputs[MM_KEY]},
        num_tokens_unpadded=n, num_tokens_padded=n, write_layout=step.layout)
    t2 = clock()
    out = manager.materialize(step_id, step.req_ids)
    t3 = clock()
    return [t1 - t0, t2 - t1, t3 - t2], out


def floor_step(floor: RawCopyFloor, step: Step) -> tuple[list[int], Any]:
    clock = time.perf_counter_ns
    t1 = clock()
    floor.save(step)
    t2 = clock()
    out = floor.materialize(step)
    t3 = clock()
    return [0, t2 - t1, t3 - t2], out


def finish_workload(manager: Any, workload: Workload) -> int:
    t0 = time.perf_counter_ns()
    manager.new_step_starts(workload.finish)
    return time.perf_counter_ns() - t0


def run_manager_once(manager: Any, workload: Workload, *, check: bool = True) -> RepeatTimes:
    """One pass of the workload through the manager's public API (checked unless told)."""
    step_ns, rows = [], 0
    for step in workload.steps:
        ns, out = manager_step(manager, step)
        step_ns.append(ns)
        if check:
            rows += check_outputs(workload, step, out, who=OMNI)
    return RepeatTimes(step_ns, finish_workload(manager, workload), rows)


def run_interleaved(
    manager: Any, floor: RawCopyFloor, workload: Workload, *, omni_first: bool, check: bool = True
) -> tuple[RepeatTimes, RepeatTimes]:
    """One pass of both, step by step (a noise burst hits both), alternating who goes first.

    The garbage collector is collected before and disabled during the pass.
    """
    omni_ns: list[list[int]] = []
    floor_ns: list[list[int]] = []
    omni_rows = floor_rows = 0
    gc.collect()
    gc.disable()
    try:
        for step in workload.steps:
            for impl in ((OMNI, FLOOR) if omni_first else (FLOOR, OMNI)):
                if impl == OMNI:
                    ns, out = manager_step(manager, step)
                    omni_ns.append(ns)
                    if check:
                        omni_rows += check_outputs(workload, step, out, who=OMNI)
                else:
                    ns, out = floor_step(floor, step)
                    floor_ns.append(ns)
                    if check:
                        floor_rows += check_outputs(workload, step, out, who=FLOOR)
            omni_first = not omni_first
        finish_ns = finish_workload(manager, workload)
    finally:
        gc.enable()
    return RepeatTimes(omni_ns, finish_ns, omni_rows), RepeatTimes(floor_ns, 0, floor_rows)


def summarize(impl: str, workload: Workload, repeats: list[RepeatTimes]) -> ImplResult:
    """Per step and op, the median over repeats; totals are sums of those medians."""
    spec = workload.spec
    steps = len(workload.steps)
    med = statistics.median
    step_med = [[med(r.step_ns[i][j] for r in repeats) for j in range(len(OPS))] for i in range(steps)]
    finish = med(r.finish_ns for r in repeats)
    total_ns = sum(map(sum, step_med)) + finish
    decode = [i for i, s in enumerate(workload.steps) if s.phase == "decode"]
    decode_ns = sum(sum(step_med[i]) for i in decode)
    decode_tokens = sum(workload.steps[i].num_tokens for i in decode)
    per_call: dict[str, float | None] = {}
    for j, op in enumerate(OPS):
        if impl == FLOOR and op == "new_step_starts":
            per_call[op] = None
            continue
        extra = finish if op == "new_step_starts" else 0
        calls = steps + (1 if op == "new_step_starts" else 0)
        per_call[op] = (sum(row[j] for row in step_med) + extra) / calls / 1e3
    return ImplResult(
        impl=impl,
        batch_size=spec.batch_size,
        tokens=workload.num_tokens,
        steps=steps,
        decode_tokens=decode_tokens,
        tokens_per_s=workload.num_tokens / (total_ns / 1e9),
        us_per_step=total_ns / steps / 1e3,
        decode_tokens_per_s=decode_tokens / (decode_ns / 1e9) if decode else 0.0,
        decode_us_per_step=decode_ns / len(decode) / 1e3 if decode else 0.0,
        us_per_call=per_call,
        repeats_tokens_per_s=[workload.num_tokens / (r.total_ns / 1e9) for r in repeats],
        rows_checked=sum(r.rows_checked for r in repeats),
    )


def bench_batch(
    spec: WorkloadSpec,
    *,
    repeats: int,
    eager: bool,
    check: bool = True,
    manager_factory: ManagerFactory | None = None,
) -> tuple[ImplResult, ImplResult, dict[str, Any]]:
    """Warm up, then ``repeats`` interleaved timed repeats of the floor and the manager."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    workload = build_workload(spec)
    floor = RawCopyFloor(spec)
    manager = (manager_factory or default_manager_factory)(spec.cache_config(), eager)
    try:
        manager.register_policy(ModelCachePolicy())
        run_interleaved(manager, floor, workload, omni_first=True, check=check)  # warm-up: first touch
        omni_times: list[RepeatTimes] = []
        floor_times: list[RepeatTimes] = []
        for r in range(repeats):
            omni, fl = run_interleaved(manager, floor, workload, omni_first=r % 2 == 1, check=check)
            omni_times.append(omni)
            floor_times.append(fl)
        stats = manager.stats()
    finally:
        unconsumed = manager.shutdown()
    if unconsumed:
        raise GroundTruthError(f"omni_cache: shutdown reported unconsumed step ids {unconsumed} (I1/I2)")
    return summarize(OMNI, workload, omni_times), summarize(FLOOR, workload, floor_times), _json_safe(stats)


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def run_bench(
    batch_sizes: list[int],
    *,
    repeats: int = 5,
    eager: bool = True,
    check: bool = True,
    manager_factory: ManagerFactory | None = None,
    progress: Callable[[str], None] | None = None,
    **spec_kwargs: Any,
) -> BenchResult:
    """The whole bench: every batch size, omni_cache next to the floor."""
    results: list[ImplResult] = []
    stats: dict[int, dict[str, Any]] = {}
    spec0 = WorkloadSpec(batch_size=max(batch_sizes), **spec_kwargs)
    for b in batch_sizes:
        spec = WorkloadSpec(batch_size=b, **spec_kwargs)
        if progress is not None:
            progress(f"batch size {b}: {spec.total_tokens} tokens in {len(build_steps_hint(spec))} steps x "
                     f"{repeats} repeats (+1 warm-up)")
        omni, floor, stats[b] = bench_batch(spec, repeats=repeats, eager=eager, check=check,
                                            manager_factory=manager_factory)
        results += [omni, floor]
    config = {
        "batch_sizes": list(batch_sizes),
        "repeats": repeats,
        "mode": "eager" if eager else "async",
        "checked": check,
        "hidden_width": spec0.hidden_width,
        "mm_key": MM_KEY,
        "mm_width": spec0.mm_width,
        "dtype": str(spec0.dtype).replace("torch.", ""),
        "block_size": spec0.block_size,
        "num_blocks": spec0.num_blocks,
        "prompt_tokens": spec0.prompt_tokens,
        "hit_tokens": spec0.hit_tokens,
        "decode_steps": spec0.decode_steps,
        "seed": spec0.seed,
        "timer": "perf_counter_ns around each cache call; median over repeats",
    }
    return BenchResult(config, results, manager_stats=stats)


def build_steps_hint(spec: WorkloadSpec) -> range:
    """The steps of a run: prefill of the misses, prefill of the hits (or one per request), decodes."""
    if spec.staggered:
        return range(spec.batch_size + spec.decode_steps)
    return range(1 + (1 if spec.num_hits else 0) + spec.decode_steps)
