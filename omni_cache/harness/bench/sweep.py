"""Does the per-step bookkeeping grow with the number of requests or the pool size?

Owns: ``run_sweep`` (``omni-cache bench --sweep``), its table, its growth summary and its plot. For every
(requests, num_blocks) of the grid it runs the decode13 shape (one prefill step per request,
odd requests hit the previous one's blocks, then decode steps; every step materialized and
checked). Prompts are shorter than decode13's (64 tokens, hit 32) so 128 requests fit 1k
blocks; the bookkeeping of a decode step does not depend on prompt length. The columns, all µs
per decode step unless named otherwise:

* ``omni_cache`` / ``floor``: ``runner.bench_batch`` at the full widths (hidden 2048, mm 512):
  the manager next to the raw-copy floor, step by step in the same passes, median over
  ``repeats``. The floor clones per request and key, the manager once per key, so at many
  requests the floor's copies grow faster than the manager's: their difference is no
  bookkeeping measure.
* ``copies`` / ``output views``: ``breakdown.step_breakdown`` at the full widths, the manager's
  copies and its one view and dict entry per request and key, as its exclusive timers read
  them (a separate, timed run: they show how the copies grow, nothing is subtracted from them).
* ``narrow omni`` / ``narrow outputs`` / ``bookkeeping``: ``narrow.narrow_bookkeeping``, the
  direct measurement. The same workload with every key 8 columns wide (copies cost their calls,
  not their bytes), the manager and ``narrow.OutputFloor`` (the copies and the per-request
  output views and dicts the manager itself returns, nothing else) step by step in the same
  passes; per step the minimum over ``max(5, 2 * repeats)`` passes, then the median over the
  decode steps. **bookkeeping = narrow omni - narrow outputs**: what a decode step costs beyond
  its copies and its outputs, read in one run, robust to load bursts (the minimum).
* ``runtime Python lines / step``: a count no load can move, the Python lines of the runtime
  (the package minus its drivers: harness and cli) one decode step runs, counted with
  ``sys.settrace``. It is the same at every number of requests when no loop over the step's
  requests is left in the runtime (``tests/manager/test_step_cost.py`` holds that at 2 and 64 requests).

Flat means: the bookkeeping barely moves across the grid while the copies grow with the
requests. ``growth_per_request`` puts a number on it per pool size: the least-squares slope
(µs per extra request) of the bookkeeping next to the slopes of the narrow copies and outputs
and of the full-width copies and output views; ``pool_spread_us`` is the bookkeeping's largest
spread across pool sizes at one number of requests. Upholds nothing at run time; the checks
are the runner's.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omni_cache.harness.bench.breakdown import step_breakdown
from omni_cache.harness.bench.narrow import narrow_bookkeeping
from omni_cache.harness.bench.runner import ManagerFactory, bench_batch
from omni_cache.harness.bench.workload import WorkloadSpec
from omni_cache.harness.figures import save_figure

REQUESTS: tuple[int, ...] = (1, 8, 32, 128)
NUM_BLOCKS: tuple[int, ...] = (1024, 4096, 16384)
SWEEP_SHAPE: dict[str, Any] = {"staggered": True, "prompt_tokens": 64, "hit_tokens": 32, "decode_steps": 48}


@dataclass
class SweepPoint:
    requests: int
    num_blocks: int
    omni_decode_us: float
    floor_decode_us: float
    copies_us: float  # breakdown: the copies category (full widths, timed run)
    views_us: float  # breakdown: the output views category (full widths, timed run)
    narrow_omni_us: float = 0.0  # narrow rows: the manager (per-step min over passes, median over steps)
    narrow_outputs_us: float = 0.0  # narrow rows: OutputFloor, the copies and outputs alone (same passes)
    python_lines: int = 0  # runtime Python lines of one decode step (load-independent)

    @property
    def bookkeeping_us(self) -> float:
        """Narrow rows: the manager's decode step minus its copies and outputs, measured in the same passes."""
        return self.narrow_omni_us - self.narrow_outputs_us

    @property
    def over_floor_us(self) -> float:
        return self.omni_decode_us - self.floor_decode_us


def run_sweep(
    *,
    requests: tuple[int, ...] = REQUESTS,
    num_blocks: tuple[int, ...] = NUM_BLOCKS,
    repeats: int = 5,
    eager: bool = True,
    decode_steps: int | None = None,
    manager_factory: ManagerFactory | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[SweepPoint]:
    points = []
    for nb in num_blocks:
        for b in requests:
            shape = dict(SWEEP_SHAPE)
            if decode_steps is not None:
                shape["decode_steps"] = decode_steps
            spec = WorkloadSpec(batch_size=b, num_blocks=nb, **shape)
            if progress is not None:
                progress(f"sweep: {b} requests, {nb} blocks")
            omni, floor, _ = bench_batch(spec, repeats=repeats, eager=eager, manager_factory=manager_factory)
            split = step_breakdown(spec, passes=max(1, repeats), manager_factory=manager_factory)
            by = {r.category: r.us_per_step for r in split.rows}
            narrow = narrow_bookkeeping(spec, passes=max(5, 2 * repeats), eager=eager, manager_factory=manager_factory)
            points.append(SweepPoint(b, nb, omni.decode_us_per_step, floor.decode_us_per_step,
                                     by["copies"], by["output views"], narrow.omni_us, narrow.floor_us,
                                     python_lines_per_decode_step(spec, manager_factory=manager_factory)))
    return points


def python_lines_per_decode_step(spec: WorkloadSpec, *, manager_factory: ManagerFactory | None = None) -> int:
    """Python lines of the runtime run by one decode step of ``spec`` (eager; after the prefill
    steps and one untraced decode step), counted with ``sys.settrace``."""
    import os
    import sys

    import omni_cache
    from omni_cache.harness.bench.runner import default_manager_factory, manager_step
    from omni_cache.harness.bench.workload import build_workload
    from omni_cache.runtime.interface import ModelCachePolicy

    package = os.path.dirname(omni_cache.__file__) + os.sep
    drivers = tuple(package + d + os.sep for d in ("harness", "cli"))
    workload = build_workload(spec)
    decode = [s for s in workload.steps if s.phase == "decode"]
    if len(decode) < 2:
        raise ValueError("python_lines_per_decode_step needs two decode steps")
    manager = (manager_factory or default_manager_factory)(spec.cache_config(), True)
    lines = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal lines
        name = frame.f_code.co_filename
        if event == "line" and name.startswith(package) and not name.startswith(drivers):
            lines += 1
        return tracer

    try:
        manager.register_policy(ModelCachePolicy())
        for step in workload.steps[: workload.steps.index(decode[1])]:
            manager_step(manager, step)
        previous = sys.gettrace()  # a coverage tracer, if any: restored after
        sys.settrace(tracer)
        try:
            manager_step(manager, decode[1])
        finally:
            sys.settrace(previous)
    finally:
        manager.shutdown()
    return lines


@dataclass
class Growth:
    """Per pool size: µs per decode step added by each extra request (least-squares slope over the
    sweep's requests) of the bookkeeping and of what it is compared with; and the bookkeeping's
    spread across pool sizes at one number of requests."""

    num_blocks: int
    bookkeeping_us_per_request: float
    narrow_outputs_us_per_request: float  # the narrow copies and outputs (OutputFloor)
    copies_and_views_us_per_request: float  # the breakdown's copies + output views, full widths

    @property
    def share_of_outputs(self) -> float:
        """Bookkeeping growth as a fraction of the narrow copies' and outputs' growth."""
        out = self.narrow_outputs_us_per_request
        return self.bookkeeping_us_per_request / out if out > 0 else float("inf")


def growth_per_request(points: list[SweepPoint]) -> list[Growth]:
    """One ``Growth`` per pool size that has at least two numbers of requests."""
    rows = []
    for nb in sorted({p.num_blocks for p in points}):
        row = [p for p in points if p.num_blocks == nb]
        xs = [float(p.requests) for p in row]
        if len(set(xs)) < 2:
            continue

        def slope(ys: list[float], xs: list[float] = xs) -> float:
            return statistics.linear_regression(xs, ys).slope

        rows.append(Growth(nb, slope([p.bookkeeping_us for p in row]), slope([p.narrow_outputs_us for p in row]),
                           slope([p.copies_us + p.views_us for p in row])))
    return rows


def pool_spread_us(points: list[SweepPoint]) -> float:
    """The largest bookkeeping spread across pool sizes at one number of requests."""
    by: dict[int, list[float]] = {}
    for p in points:
        by.setdefault(p.requests, []).append(p.bookkeeping_us)
    return max(max(v) - min(v) for v in by.values())


def sweep_summary(points: list[SweepPoint]) -> dict[str, Any]:
    book = [p.bookkeeping_us for p in points]
    floors = [p.floor_decode_us for p in points]
    lines = [p.python_lines for p in points]
    return {"points": [{**asdict(p), "over_floor_us": p.over_floor_us, "bookkeeping_us": p.bookkeeping_us}
                       for p in points],
            "python_lines_min": min(lines), "python_lines_max": max(lines),
            "bookkeeping_us_min": min(book), "bookkeeping_us_max": max(book),
            "bookkeeping_pool_spread_us": pool_spread_us(points),
            "growth_per_request": [{**asdict(g), "share_of_outputs": g.share_of_outputs}
                                   for g in growth_per_request(points)],
            "floor_us_min": min(floors), "floor_us_max": max(floors)}


def growth_lines(points: list[SweepPoint]) -> list[str]:
    """What the sweep says about growth, in words (printed under its table)."""
    lines = [f"per extra request ({g.num_blocks} blocks, least squares): bookkeeping "
             f"{g.bookkeeping_us_per_request:+.3f} µs, narrow copies + outputs {g.narrow_outputs_us_per_request:+.3f} µs "
             f"(bookkeeping {g.share_of_outputs:.0%} of it), full-width copies + output views "
             f"{g.copies_and_views_us_per_request:+.3f} µs" for g in growth_per_request(points)]
    lines.append(f"pool size: bookkeeping within {pool_spread_us(points):.1f} µs across num_blocks at every number of requests")
    return lines


def sweep_table(points: list[SweepPoint], *, mode: str, repeats: int) -> Any:
    from rich.table import Table

    table = Table(title=f"omni-cache bench --sweep ({mode}, median of {repeats}): µs per decode step",
                  title_justify="left")
    for col in ("requests", "num_blocks", "omni_cache", "floor", "copies", "output views", "narrow omni",
                "narrow outputs", "bookkeeping (narrow omni - narrow outputs)", "runtime Python lines / step"):
        table.add_column(col, justify="right")
    for p in points:
        table.add_row(str(p.requests), str(p.num_blocks), f"{p.omni_decode_us:,.1f}", f"{p.floor_decode_us:,.1f}",
                      f"{p.copies_us:,.1f}", f"{p.views_us:,.1f}", f"{p.narrow_omni_us:,.1f}",
                      f"{p.narrow_outputs_us:,.1f}", f"{p.bookkeeping_us:,.1f}", str(p.python_lines))
    return table


def write_sweep_plot(points: list[SweepPoint], path: str | Path, *, title: str = "",
                     footnote: str = "") -> Path:
    """A figure that reads on its own. Left: the bookkeeping per decode step (narrow rows: the
    manager's step time minus its own copies and outputs) and those copies + outputs against
    requests, one line per pool size, each labelled with its growth per extra request; right: the
    manager and the floor at the full widths (µs per decode step, log axes). The caption defines
    the terms; ``footnote`` (machine, date, commit, command) goes under it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    sizes = sorted({p.requests for p in points})
    pools = sorted({p.num_blocks for p in points})
    fig, (ax_book, ax_abs) = plt.subplots(1, 2, figsize=(12, 5.6))
    slopes = {g.num_blocks: g for g in growth_per_request(points)}
    for i, nb in enumerate(pools):
        row = sorted((p for p in points if p.num_blocks == nb), key=lambda p: p.requests)
        xs = [p.requests for p in row]
        g = slopes.get(nb)
        book_rate = f" ({g.bookkeeping_us_per_request:+.2f} µs/request)" if g else ""
        out_rate = f" ({g.narrow_outputs_us_per_request:+.2f} µs/request)" if g else ""
        ax_book.plot(xs, [p.bookkeeping_us for p in row], "o-", color=f"C{i}",
                     label=f"bookkeeping, {nb} blocks{book_rate}")
        ax_book.plot(xs, [p.narrow_outputs_us for p in row], "s:", color=f"C{i}", alpha=0.5,
                     label=f"copies + outputs, {nb} blocks{out_rate}")
        ax_abs.plot(xs, [p.omni_decode_us for p in row], "o-", color=f"C{i}", label=f"omni_cache, {nb} blocks")
        ax_abs.plot(xs, [p.floor_decode_us for p in row], "s--", color=f"C{i}", alpha=0.5,
                    label=f"floor, {nb} blocks")
    ax_book.set_title("bookkeeping vs copies + outputs (narrow rows)", fontsize=10)
    ax_book.set_ylabel("µs per decode step (linear)")
    ax_book.set_ylim(bottom=0)
    ax_abs.set_title("omni_cache vs floor (full widths)", fontsize=10)
    ax_abs.set_yscale("log")
    ax_abs.set_ylabel("µs per decode step (log scale)")
    for ax in (ax_book, ax_abs):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(s) for s in sizes])
        ax.set_xlabel("requests in the batch, one decode token each (log scale)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Does the cache's per-step bookkeeping grow with the requests or the pool size?",
                 fontsize=12, fontweight="bold", y=0.985)
    fig.text(0.5, 0.925,
             (f"{title}\n" if title else "") +
             "bookkeeping = the manager's decode-step time minus its own tensor copies and output views, with rows "
             "narrowed so copies are tiny (what the cache adds beyond moving data).\nfloor = the same copies with no "
             "bookkeeping (the fastest any cache could serve this workload). blocks = KV blocks in the pool. "
             "Flat bookkeeping lines = no growth.",
             ha="center", va="top", fontsize=8.5)
    if footnote:
        fig.text(0.01, 0.01, footnote, ha="left", va="bottom", fontsize=7.5, color="0.25")
    fig.tight_layout(rect=(0, 0.07 if footnote else 0, 1, 0.85))
    return save_figure(fig, path)
