"""Host memory of the cache for a bench workload: measured bytes, the formula, peak RSS.

Owns: ``memory_report`` (``omni-cache bench --memory``). A fresh Python process
(so no earlier run's allocations blur the peak) builds the workload, resets
the kernel's peak-RSS mark (``/proc/self/clear_refs``), notes its RSS, then
creates one manager and runs the workload through it (every step materialized
and checked). It reports, per key, the host bytes the block pool and the
staging pages actually hold, the per-slot version vectors of the tenancy, the
documented formula for each, and the run's peak RSS above that baseline.

The formula (README "Configuration and what it costs"):

  block pool   num_blocks * block_size * width * itemsize          per key
  staging      staging_depth * staging_capacity_tokens * width * itemsize
                                                                   per immediate key
  tenancy      num_blocks * block_size * (3 * 8 + 4) bytes per key + 8 per slot

Upholds nothing; it measures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from omni_cache.harness.bench.workload import WorkloadSpec


@dataclass
class MemoryReport:
    spec: dict[str, Any]
    pool_bytes: int  # measured: the pool tensors' bytes
    staging_bytes: int  # measured: the staging pages' bytes
    tenancy_bytes: int  # measured: the version vectors' bytes
    formula_bytes: dict[str, int]  # pool, staging, tenancy
    baseline_rss: int  # after the workload was built, before the manager
    peak_rss: int  # the kernel's high-water mark after the run
    peak_reset: bool  # whether clear_refs reset the mark (else it may include the build)

    @property
    def measured_bytes(self) -> int:
        return self.pool_bytes + self.staging_bytes + self.tenancy_bytes

    @property
    def formula_total(self) -> int:
        return sum(self.formula_bytes.values())

    @property
    def rss_growth(self) -> int:
        return self.peak_rss - self.baseline_rss

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "measured_bytes": self.measured_bytes, "formula_total": self.formula_total,
                "rss_growth": self.rss_growth}


def formula(spec: WorkloadSpec) -> dict[str, int]:
    cfg = spec.cache_config()
    itemsize = spec.dtype.itemsize if hasattr(spec.dtype, "itemsize") else 2
    widths = sum(spec.widths().values())  # both keys are immediate in the bench
    slots = cfg.num_blocks * cfg.block_size
    return {
        "pool": slots * widths * itemsize,
        "staging": cfg.staging_depth * cfg.staging_capacity_tokens * widths * itemsize,
        "tenancy": slots * (3 * 8 + 4) * len(spec.widths()) + slots * 8,
    }


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _child(spec_json: str) -> None:
    """Runs in the fresh process: prints one JSON line."""
    import gc

    import torch

    from omni_cache.harness.bench.runner import default_manager_factory, run_manager_once
    from omni_cache.harness.bench.workload import build_workload
    from omni_cache.runtime.interface import ModelCachePolicy

    torch.set_num_threads(1)
    spec = WorkloadSpec(**json.loads(spec_json))
    workload = build_workload(spec)
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS mark (VmHWM) to the current RSS
        reset = True
    except OSError:
        reset = False
    baseline = _status_kib("VmRSS") * 1024
    manager = default_manager_factory(spec.cache_config(), True)
    manager.register_policy(ModelCachePolicy())
    run_manager_once(manager, workload)
    peak = _status_kib("VmHWM") * 1024
    pool = sum(manager.pool.nbytes().values())
    staging = sum(manager.staging.page_bytes().values())
    tenancy = manager.tenancy.nbytes()
    manager.shutdown()
    print(json.dumps({"pool": pool, "staging": staging, "tenancy": tenancy, "baseline": baseline, "peak": peak,
                      "reset": reset}))


def memory_report(spec: WorkloadSpec) -> MemoryReport:
    fields = {k: getattr(spec, k) for k in ("batch_size", "hidden_width", "mm_width", "block_size", "num_blocks",
                                             "prompt_tokens", "hit_tokens", "decode_steps", "seed", "staggered")}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_package_root(), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "omni_cache.harness.bench.memory", json.dumps(fields)],
                         capture_output=True, text=True, check=True, env=env, timeout=600)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return MemoryReport(fields, got["pool"], got["staging"], got["tenancy"], formula(spec), got["baseline"],
                        got["peak"], got["reset"])


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def memory_table(report: MemoryReport) -> Any:
    from rich.table import Table

    mib = 1 << 20
    s = report.spec
    table = Table(title=f"host memory: {s['batch_size']} requests, {s['num_blocks']} blocks x {s['block_size']}, "
                        f"hidden {s['hidden_width']} + mm {s['mm_width']} bf16", title_justify="left")
    for col in ("what", "measured MiB", "formula MiB", "measured / formula"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for name, measured in (("block pool", report.pool_bytes), ("staging pages", report.staging_bytes),
                           ("tenancy version vectors", report.tenancy_bytes)):
        want = report.formula_bytes[{"block pool": "pool", "staging pages": "staging"}.get(name, "tenancy")]
        table.add_row(name, f"{measured / mib:,.2f}", f"{want / mib:,.2f}", f"{measured / want:.3f}" if want else "-")
    table.add_row("total", f"{report.measured_bytes / mib:,.2f}", f"{report.formula_total / mib:,.2f}",
                  f"{report.measured_bytes / report.formula_total:.3f}")
    table.add_row("peak RSS growth of the run" + ("" if report.peak_reset else " (mark not reset)"),
                  f"{report.rss_growth / mib:,.2f}", f"{report.formula_total / mib:,.2f}",
                  f"{report.rss_growth / report.formula_total:.3f}")
    table.add_row("peak RSS of the process", f"{report.peak_rss / mib:,.2f}", "", "")
    return table


if __name__ == "__main__":
    _child(sys.argv[1])
