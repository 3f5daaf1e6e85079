"""Rendering bench results: rich tables, the pass/fail line, and the plot.

Owns: ``engine_table``, ``verdict_lines``, ``machine_table``,
``profile_tables`` (rich renderables) and ``write_plot`` (matplotlib, Agg
backend: tokens/s and µs per step against batch size, omni_cache next to the
raw-copy floor, from one run). Upholds nothing; it only presents numbers the
runner measured and checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from omni_cache.harness.bench.machine import MachineBenchResult
from omni_cache.harness.bench.runner import FLOOR, OMNI, BenchResult
from omni_cache.harness.figures import save_figure


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def engine_table(result: BenchResult) -> Table:
    cfg = result.config
    table = Table(
        title=(f"omni-cache bench ({cfg['mode']}, torch threads {cfg.get('torch_threads', '?')}): "
               f"hidden {cfg['hidden_width']} + {cfg['mm_key']} {cfg['mm_width']} {cfg['dtype']}, "
               f"block {cfg['block_size']}, {cfg['num_blocks']} blocks, prompt {cfg['prompt_tokens']} "
               f"(half hit {cfg['hit_tokens']}), {cfg['decode_steps']} decode steps, "
               f"median of {cfg['repeats']}"),
        title_justify="left",
    )
    for col in ("batch", "impl", "tokens/s", "µs/step", "decode tok/s", "decode µs/step",
                "µs save", "µs materialize", "µs new_step_starts", "ratio"):
        table.add_column(col, justify="left" if col == "impl" else "right")
    for b in result.batch_sizes:
        for impl in (OMNI, FLOOR):
            r = result.get(impl, b)
            ratio = f"{result.ratio(b):.0%}" if impl == OMNI else ""
            table.add_row(
                str(b), impl, _fmt(r.tokens_per_s, 0), _fmt(r.us_per_step), _fmt(r.decode_tokens_per_s, 0),
                _fmt(r.decode_us_per_step), _fmt(r.us_per_call["save"]), _fmt(r.us_per_call["materialize"]),
                _fmt(r.us_per_call["new_step_starts"]), ratio,
            )
    return table


def verdict_lines(result: BenchResult) -> list[str]:
    """One line per batch size (ratio; PASS/FAIL unless --quick), growth, ground truth, overall."""
    lines = []
    sizes = result.batch_sizes
    quick = bool(result.config.get("quick"))
    for b in sizes:
        ratio = result.ratio(b)
        verdict = "" if quick else (
            f" (target >= {result.target_ratio:.0%}) {'PASS' if ratio >= result.target_ratio else 'FAIL'}")
        decode_ratio = result.ratio(b, decode=True)  # nan: the run had no decode step
        decode = (f"decode steps only {decode_ratio:.1%}; decode step time omni_cache - floor "
                  f"{result.overhead_us_per_step(b):+,.1f} µs" if decode_ratio == decode_ratio else "no decode steps")
        lines.append(f"batch {b}: omni_cache/floor tokens/s = {ratio:.1%}{verdict}; {decode}")
    if len(sizes) > 1:
        lines.append(
            f"change of that difference: {result.overhead_growth_us_per_request():+,.1f} µs per extra request "
            f"(batch {sizes[0]} -> {sizes[-1]})"
        )
        lines.append(
            "(omni_cache - floor is a difference of two timings, not the bookkeeping: the floor clones each "
            "request's rows, the cache copies once per key, so it can be negative; `omni-cache bench --sweep "
            "FILE.png` measures the bookkeeping alone)"
        )
    rows = sum(r.rows_checked for r in result.results)
    checked = result.ground_truth == "ok"
    lines.append(ground_truth_line(checked, rows))
    if quick:
        lines.append(f"no verdict for --quick (a smoke run; the {result.target_ratio:.0%} target is judged on the "
                     "full workload)")
    else:
        lines.append(f"overall: {'PASS' if result.passed else 'FAIL'}"
                     + ("" if checked else " (the speed target only: no row was checked against the ground truth)"))
    return lines


def ground_truth_line(checked: bool, rows: int) -> str:
    """What a bench run verified: the rows checked against the ground truth, or that none were."""
    if not checked:
        return "ground truth: not checked (--no-verify): no materialized row was compared"
    if not rows:
        return "ground truth: nothing compared (the run materialized no row)"
    return f"ground truth: ok ({rows:,} materialized rows checked, every key)"


def machine_description() -> str:
    """CPU model and count of this machine, for the plot's footnote and the JSON."""
    import os
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:  # pragma: no cover - not Linux
        pass
    return f"{model}, {os.cpu_count()} CPUs, {platform.system()}"


def machine_table(result: MachineBenchResult) -> Table:
    cfg = result.config
    table = Table(title=f"state-machine cost (median of {cfg['repeats']})", title_justify="left")
    for col in ("case", "what", "median", "unit", "x dict baseline"):
        table.add_column(col, justify="right" if col in ("median", "x dict baseline") else "left")
    base = {"cycle": result.get("dict_table_cycle").us, "trigger": result.get("trigger_dict").us}
    for row in result.rows:
        kind = row.unit.split("/")[-1]
        rel = f"{row.us / base[kind]:,.1f}x" if kind in base and base[kind] > 0 else ""
        table.add_row(row.name, escape(row.what), f"{row.us:,.2f}", row.unit, rel)
    return table


def profile_tables(by_own: list[Any], by_cum: list[Any], sections: list[Any], meta: dict[str, Any]) -> list[Table]:
    tables = []
    for title, rows in (("by own time", by_own), ("by cumulative time", by_cum)):
        table = Table(title=f"cProfile at batch {meta['batch_size']} ({meta['mode']}, {meta['steps']} decode steps) "
                            f"{title}, µs per step (cProfile-inflated)", title_justify="left")
        for col in ("own µs", "cum µs", "calls", "function"):
            table.add_column(col, justify="left" if col == "function" else "right")
        for r in rows:
            table.add_row(_fmt(r.own_us_per_step), _fmt(r.cum_us_per_step), _fmt(r.calls_per_step), escape(r.function))
        tables.append(table)
    table = Table(title=f"section timers at batch {meta['batch_size']} (inclusive, nested; "
                        f"{meta.get('timed_us_per_step', 0):,.1f} µs per decode step in the cache calls)",
                  title_justify="left")
    for col in ("section", "calls/step", "µs/step", "µs/call"):
        table.add_column(col, justify="left" if col == "section" else "right")
    for r in sections:
        table.add_row(r.section, _fmt(r.calls_per_step), _fmt(r.us_per_step), _fmt(r.us_per_call))
    tables.append(table)
    return tables


def write_plot(result: BenchResult, path: str | Path) -> Path:
    """The bench on one figure that reads without the README (PNG or SVG by the file's suffix).

    Three panels against batch size (bars, axes from zero): tokens/s of
    omni_cache and of the floor; omni_cache as a percentage of the floor with the
    target line; µs per decode step. The title and caption say what the floor
    and the target are; a footnote gives the workload, the machine, the load
    average before and after the run, and the command.
    """
    import os
    import time

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"plot folder {str(path.parent)!r} does not exist")
    cfg = result.config
    sizes = result.batch_sizes
    x = list(range(len(sizes)))
    labels = [f"batch {b}" for b in sizes]
    width = 0.38
    colors = {OMNI: "C0", FLOOR: "C2"}
    fig, (ax_tps, ax_ratio, ax_us) = plt.subplots(1, 3, figsize=(14, 5.6))

    def bars(ax: Any, values: dict[str, list[float]], fmt_value: str) -> None:
        for i, impl in enumerate((OMNI, FLOOR)):
            xs = [v + (i - 0.5) * width for v in x]
            drawn = ax.bar(xs, values[impl], width, color=colors[impl], label=impl)
            ax.bar_label(drawn, labels=[fmt_value.format(v) for v in values[impl]], fontsize=8, padding=2)
        ax.set_ylim(0, max(max(v) for v in values.values()) * 1.32)

    bars(ax_tps, {impl: [result.get(impl, b).tokens_per_s for b in sizes] for impl in (OMNI, FLOOR)}, "{:,.0f}")
    ax_tps.set_title("tokens/s through the cache calls (higher is better)", fontsize=10)
    ax_tps.set_ylabel("tokens/s")

    ratios = [100 * result.ratio(b) for b in sizes]
    target = 100 * result.target_ratio
    ok = [r >= target for r in ratios]
    drawn = ax_ratio.bar(x, ratios, 0.5, color=["C0" if good else "C3" for good in ok])
    ax_ratio.bar_label(drawn, labels=[f"{r:.0f}%" for r in ratios], fontsize=9, padding=2)
    ax_ratio.axhline(target, color="C3", linestyle="--", linewidth=1.5, label=f"target: {target:.0f}% of the floor")
    ax_ratio.axhline(100, color="0.5", linestyle=":", linewidth=1, label="100% = as fast as the floor")
    ax_ratio.set_ylim(0, max(135.0, max(ratios) * 1.35))
    ax_ratio.set_title("omni_cache tokens/s as % of the floor's", fontsize=10)
    ax_ratio.set_ylabel("% of floor")

    bars(ax_us, {impl: [result.get(impl, b).decode_us_per_step for b in sizes] for impl in (OMNI, FLOOR)},
         "{:,.0f}")
    ax_us.set_title("µs per decode step (lower is better)", fontsize=10)
    ax_us.set_ylabel("µs")

    for ax in (ax_tps, ax_ratio, ax_us):
        ax.set_xticks(x, labels)
        ax.set_xlim(-0.7, len(sizes) - 0.3)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", ncol=2 if ax is not ax_ratio else 1)

    quick = bool(cfg.get("quick"))
    verdict = ("no verdict (--quick smoke run)" if quick else
               ("PASS" if result.passed else "FAIL") + " at " + ", ".join(
                   f"batch {b}: {result.ratio(b):.0%}" for b in sizes))
    fig.suptitle(f"omni-cache bench ({cfg['mode']}, median of {cfg['repeats']} repeat{'s' if cfg['repeats'] != 1 else ''}): {verdict}",
                 fontsize=12, fontweight="bold", y=0.985)
    fig.text(0.5, 0.915,
             "floor = the same tensor copies with no bookkeeping (step rows into a staging buffer, scattered into "
             "the pool, per-request clone, index_select + cat for hits): the fastest any cache could serve this "
             f"workload.\ntarget = omni_cache reaches at least {target:.0f}% of the floor's tokens/s at every batch "
             "size. Both run step by step in the same pass, alternating which goes first; every row is checked "
             "against ground truth.", ha="center", va="top", fontsize=8.5, wrap=True)
    load = cfg.get("load_avg_1min") or [None, None]
    load_text = "1-min load average {} before, {} after the run".format(
        *("?" if v is None else f"{v:.2f}" for v in load))
    cpus = os.cpu_count() or 1
    if any(v is not None and v > cpus / 2 for v in load):  # more runnable work than half the CPUs
        load_text += ": other work competed with the run, so every figure is slowed and the ratio moves"
    when = cfg.get("measured_at") or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    fig.text(0.01, 0.01,
             f"workload: hidden {cfg['hidden_width']} + {cfg['mm_key']} {cfg['mm_width']} {cfg['dtype']}, block "
             f"{cfg['block_size']}, {cfg['num_blocks']} blocks, {cfg['prompt_tokens']}-token prompts (half hit "
             f"{cfg['hit_tokens']}), {cfg['decode_steps']} decode steps, torch threads "
             f"{cfg.get('torch_threads', '?')}.\nmachine: {cfg.get('machine', '?')}; {load_text}.\n"
             f"measured {when}, commit {cfg.get('commit', '?')}: {cfg.get('command') or 'omni-cache bench'}",
             ha="left", va="bottom", fontsize=7.5, color="0.25")
    fig.tight_layout(rect=(0, 0.09, 1, 0.86))
    return save_figure(fig, path)
