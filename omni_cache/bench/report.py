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

from omni_cache.bench.machine import MachineBenchResult
from omni_cache.bench.runner import FLOOR, OMNI, BenchResult


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
    lines = []
    sizes = result.batch_sizes
    for b in sizes:
        ratio = result.ratio(b)
        verdict = "PASS" if ratio >= result.target_ratio else "FAIL"
        lines.append(
            f"batch {b}: omni_cache/floor tokens/s = {ratio:.1%} (target >= {result.target_ratio:.0%}) {verdict}; "
            f"decode steps only {result.ratio(b, decode=True):.1%}; bookkeeping (omni_cache - floor) "
            f"{result.overhead_us_per_step(b):,.1f} µs per decode step"
        )
    if len(sizes) > 1:
        lines.append(
            f"bookkeeping growth: {result.overhead_growth_us_per_request():+,.1f} µs per decode step per extra "
            f"request (batch {sizes[0]} -> {sizes[-1]}; 0 means it does not grow with the number of requests)"
        )
    rows = sum(r.rows_checked for r in result.results)
    lines.append(f"ground truth: {result.ground_truth} ({rows:,} materialized rows checked, every key)")
    if result.config.get("quick"):
        lines.append("overall: n/a for --quick (a smoke run: the 50% target is defined for the full "
                     "workload at batch 8 and 32; run without --quick to judge it)")
    else:
        lines.append(f"overall: {'PASS' if result.passed else 'FAIL'}")
    return lines


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
    """tokens/s and µs per step against batch size, omni_cache and the floor (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    sizes = result.batch_sizes
    fig, (ax_tps, ax_us) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl, style, color in ((OMNI, "o-", "C0"), (FLOOR, "s--", "C2")):
        rows = [result.get(impl, b) for b in sizes]
        ax_tps.plot(sizes, [r.tokens_per_s for r in rows], style, color=color, label=f"{impl} (all steps)")
        ax_tps.plot(sizes, [r.decode_tokens_per_s for r in rows], style, color=color, alpha=0.4,
                    label=f"{impl} (decode steps)")
        ax_us.plot(sizes, [r.us_per_step for r in rows], style, color=color, label=f"{impl} (all steps)")
        ax_us.plot(sizes, [r.decode_us_per_step for r in rows], style, color=color, alpha=0.4,
                   label=f"{impl} (decode steps)")
    ax_tps.set_title("tokens/s (cache calls only)")
    ax_us.set_title("µs per step")
    for ax in (ax_tps, ax_us):
        ax.set_xlabel("batch size (requests)")
        ax.set_xticks(sizes)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    cfg = result.config
    fig.suptitle(f"omni-cache bench ({cfg['mode']}, median of {cfg['repeats']}): "
                 + ", ".join(f"batch {b}: {result.ratio(b):.0%} of floor" for b in sizes), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    return path
