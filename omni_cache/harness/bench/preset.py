"""Named bench workloads: ``omni-cache bench --preset NAME``.

Owns: ``PRESETS`` (name -> cases) and ``run_preset``, which runs every case of a
preset through ``runner.bench_batch`` (the manager next to the raw-copy floor,
step by step in the same passes, median over ``repeats``, every materialized
row checked against the ground truth) and judges each case's ratio against its
own target.

``decode13`` is the decode-heavy workload: hidden 2048 bf16 plus one immediate
per-token mm key of width 512 bf16, block size 16, 4096 blocks, 512-token
prompts, one prefill step per request in order, request i (odd i, never the
first) starting with a 256-token block-aligned hit on request i-1's blocks,
then 200 decode steps of one token per request (a new block whenever a request
crosses a block boundary: its table covers the whole sequence), every step
materialized and checked, all FINISHED at the end. Targets: 0.8 of the floor at
8 requests, 0.9 at 32, 0.8 at 8 requests without hits.

Upholds nothing at run time; the checks (I1, I2, I4, I6, I7) are the runner's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the CLI reads PRESETS before torch is loaded
    from omni_cache.harness.bench.runner import ImplResult, ManagerFactory


@dataclass(frozen=True)
class PresetCase:
    name: str
    spec: dict[str, Any]  # WorkloadSpec keyword arguments
    target: float  # omni_cache / floor tokens/s over the whole run


_DECODE13 = {"staggered": True, "hidden_width": 2048, "mm_width": 512, "block_size": 16, "num_blocks": 4096,
             "prompt_tokens": 512, "decode_steps": 200}

PRESETS: dict[str, tuple[PresetCase, ...]] = {
    "decode13": (
        PresetCase("8 requests, hits", {**_DECODE13, "batch_size": 8, "hit_tokens": 256}, 0.8),
        PresetCase("32 requests, hits", {**_DECODE13, "batch_size": 32, "hit_tokens": 256}, 0.9),
        PresetCase("8 requests, no hits", {**_DECODE13, "batch_size": 8, "hit_tokens": 0}, 0.8),
    ),
}


@dataclass
class CaseResult:
    case: str
    target: float
    omni: ImplResult
    floor: ImplResult

    @property
    def ratio(self) -> float:
        return self.omni.tokens_per_s / self.floor.tokens_per_s

    @property
    def decode_ratio(self) -> float:
        return self.omni.decode_tokens_per_s / self.floor.decode_tokens_per_s

    @property
    def passed(self) -> bool:
        return self.ratio >= self.target

    def to_json(self) -> dict[str, Any]:
        return {"case": self.case, "target": self.target, "ratio": self.ratio, "decode_ratio": self.decode_ratio,
                "pass": self.passed, "omni_cache": asdict(self.omni), "floor": asdict(self.floor)}


def run_preset(
    name: str,
    *,
    repeats: int = 5,
    eager: bool = True,
    check: bool = True,
    decode_steps: int | None = None,
    manager_factory: ManagerFactory | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[CaseResult]:
    """Every case of preset ``name``; ``decode_steps`` overrides the preset's (smoke runs)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    from omni_cache.harness.bench.runner import bench_batch
    from omni_cache.harness.bench.workload import WorkloadSpec

    out = []
    for case in PRESETS[name]:
        kwargs = dict(case.spec)
        if decode_steps is not None:
            kwargs["decode_steps"] = decode_steps
        spec = WorkloadSpec(**kwargs)
        if progress is not None:
            progress(f"{name}: {case.name}: {spec.total_tokens} tokens x {repeats} repeats (+1 warm-up)")
        omni, floor, _stats = bench_batch(spec, repeats=repeats, eager=eager, check=check,
                                          manager_factory=manager_factory)
        out.append(CaseResult(case.name, case.target, omni, floor))
    return out


def preset_table(name: str, results: list[CaseResult], *, mode: str, repeats: int) -> Any:
    from rich.table import Table

    table = Table(title=f"omni-cache bench --preset {name} ({mode}, median of {repeats}, interleaved with the "
                        "raw-copy floor)", title_justify="left")
    for col in ("case", "omni tok/s", "floor tok/s", "omni decode µs/step", "floor decode µs/step",
                "ratio", "decode-only ratio", "target", "verdict"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in results:
        table.add_row(r.case, f"{r.omni.tokens_per_s:,.0f}", f"{r.floor.tokens_per_s:,.0f}",
                      f"{r.omni.decode_us_per_step:,.1f}", f"{r.floor.decode_us_per_step:,.1f}",
                      f"{r.ratio:.2f}", f"{r.decode_ratio:.2f}", f">= {r.target:.1f}",
                      "PASS" if r.passed else "FAIL")
    return table
