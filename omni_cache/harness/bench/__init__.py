"""Benchmarks of omni-cache: the manager against a raw-copy floor, and the state-machine cost.

Owns nothing at run time; ``omni-cache bench`` (``omni_cache.cli.bench``) drives it.

- ``workload``: the synthetic engine and its ground-truth checker
  (``check_outputs`` catches I4 snapshot, I6 zero-served hit and I7 stale-tenant
  violations in what materialize returns).
- ``floor``: the raw-copy floor (the same copies, no bookkeeping).
- ``runner``: interleaved timing, medians, ratios (I1/I2 checked at shutdown).
- ``machine``: the staging-slot machine's cost next to a dict-table baseline.
- ``profiling``: cProfile and section timers of the manager's hot path.
- ``report``: rich tables and the matplotlib plot.
- ``preset``: named workloads with their targets (``decode13``: the decode-heavy workload).
- ``breakdown``: exclusive µs per decode step by category (validation, state
  machine, locks, staging slots, tenancy, write book, copies, output assembly).
- ``sweep``: bookkeeping per decode step over requests x num_blocks, plotted.
- ``memory``: pool + staging + tenancy bytes vs the formula vs peak RSS.
- ``gpu``: ``--device cuda``: the save's engine-thread time, the side-stream copy against the
  pinned device-to-host bandwidth, its overlap with a stand-in forward (CUDA events).

Their command-line options (``--preset`` / ``--sweep`` / ``--memory``, and the breakdown
``--profile`` prints) are ``omni_cache.cli.bench_workloads``.

Upholds nothing itself: the runs check I1, I2, I4, I6 and I7 from outside.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_cache.runtime.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "MachineBenchResult": "omni_cache.harness.bench.machine",
    "run_machine_bench": "omni_cache.harness.bench.machine",
    "TARGET_RATIO": "omni_cache.harness.bench.runner",
    "BenchResult": "omni_cache.harness.bench.runner",
    "ImplResult": "omni_cache.harness.bench.runner",
    "run_bench": "omni_cache.harness.bench.runner",
    "GroundTruthError": "omni_cache.harness.bench.workload",
    "WorkloadSpec": "omni_cache.harness.bench.workload",
    "build_workload": "omni_cache.harness.bench.workload",
    "check_outputs": "omni_cache.harness.bench.workload",
}

__all__ = [
    "TARGET_RATIO",
    "BenchResult",
    "GroundTruthError",
    "ImplResult",
    "MachineBenchResult",
    "WorkloadSpec",
    "build_workload",
    "check_outputs",
    "run_bench",
    "run_machine_bench",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from omni_cache.harness.bench.machine import MachineBenchResult, run_machine_bench
    from omni_cache.harness.bench.runner import TARGET_RATIO, BenchResult, ImplResult, run_bench
    from omni_cache.harness.bench.workload import (
        GroundTruthError,
        WorkloadSpec,
        build_workload,
        check_outputs,
    )
