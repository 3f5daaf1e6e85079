"""The workload options of ``omni-cache bench``: ``--preset``, ``--sweep``, ``--memory``, ``--profile``.

Owns: their argument definitions (``add_arguments``) and their runs
(``run_extra``, called by ``omni_cache.cli.bench.run`` before the default
engine bench; it returns None when none of these options was given). Kept out
of ``cli/bench.py`` so that module stays the default bench's; the runs themselves are
``omni_cache.harness.bench``'s. Upholds nothing;
every run it starts checks the ground truth (runner).

  --preset decode13   the decode-heavy workload: ratios at 8 and 32 requests and at 8
                      without hits against their targets (0.8 / 0.9 / 0.8)
  --sweep [FILE.png]  bookkeeping per decode step over requests 1/8/32/128 and
                      num_blocks 1k/4k/16k; plotted into FILE.png only when given
  --memory            pool + staging + tenancy bytes vs the formula vs peak RSS
  --profile           the per-category breakdown of a decode step at each batch size
                      (8 and 32 by default)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from omni_cache.cli.args import EXIT_INCOMPLETE, plot_path
from omni_cache.harness.bench.preset import PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="run a named workload against its targets (decode13: the decode-heavy workload: hidden 2048 + "
                             "mm 512 bf16, 512-token prompts, then 200 one-token decode steps at 8 and 32 requests)")
    parser.add_argument("--sweep", nargs="?", const=True, default=None, metavar="FILE.png",
                        type=plot_path,
                        help="bookkeeping per decode step over requests 1/8/32/128 x num_blocks 1k/4k/16k: a table, "
                             "and a plot in FILE.png when given (nothing is written without it)")
    parser.add_argument("--memory", action="store_true",
                        help="host bytes of pool + staging + tenancy vs the documented formula vs peak RSS")


def run_extra(args: argparse.Namespace, console: Any, sizes: list[int], repeats: int,
              kwargs: dict[str, Any]) -> int | None:
    """Run whichever of the options was given; None if none was."""
    if not (args.preset or args.sweep or args.memory):
        return None
    eager, rc = not args.async_, 0
    doc: dict[str, Any] = {}
    mode = "eager" if eager else "async"
    say = None if args.json else (lambda line: console.print(f"[dim]{line}[/dim]"))
    steps = args.decode_steps
    if args.preset:
        from omni_cache.harness.bench.preset import preset_table, run_preset
        from omni_cache.harness.bench.report import ground_truth_line

        results = run_preset(args.preset, repeats=repeats, eager=eager, check=not args.no_verify,
                             decode_steps=steps, progress=say)
        doc["preset"] = {"name": args.preset, "mode": mode, "repeats": repeats,
                         "cases": [r.to_json() for r in results], "pass": all(r.passed for r in results)}
        rows = sum(r.omni.rows_checked + r.floor.rows_checked for r in results)
        doc["preset"]["rows_checked"] = rows
        if not args.json:
            console.print(preset_table(args.preset, results, mode=mode, repeats=repeats))
            console.print(ground_truth_line(not args.no_verify, rows))
        missed = [r for r in results if not r.passed]
        if missed:
            rc = EXIT_INCOMPLETE  # ran clean, missed its target (the bench's exit code for FAIL)
            print("omni-cache bench: FAIL: " + "; ".join(
                f"{args.preset} {r.case}: omni_cache/floor {r.ratio:.2f} < target {r.target:.2f}" for r in missed), file=sys.stderr)
    if args.profile:
        doc["breakdown"] = run_breakdown(args, console, sizes, kwargs)
    if args.sweep:
        from omni_cache.harness.bench.provenance import load_average, provenance_line
        from omni_cache.harness.bench.report import machine_description
        from omni_cache.harness.bench.sweep import (
            growth_lines,
            run_sweep,
            sweep_summary,
            sweep_table,
            write_sweep_plot,
        )

        load_before = load_average()
        points = run_sweep(repeats=repeats, eager=eager, decode_steps=steps, progress=say)
        path = None
        if args.sweep is not True:  # a FILE.png was given
            command = "omni-cache bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else ["--sweep", "..."])
            path = write_sweep_plot(
                points, args.sweep,
                title=f"{mode} mode; full widths: median of {repeats} pass{'es' if repeats != 1 else ''}; narrow rows: per-step minimum of "
                      f"{max(5, 2 * repeats)} passes",
                footnote=f"{provenance_line(machine_description(), load_before, load_average())}\n"
                         f"command: {command}")
        doc["sweep"] = {**sweep_summary(points), "plot": None if path is None else str(path)}
        if not args.json:
            console.print(sweep_table(points, mode=mode, repeats=repeats))
            for line in growth_lines(points):
                console.print(line)
            console.print(f"wrote {path}" if path is not None else "no plot written (pass --sweep FILE.png for one)")
    if args.memory:
        from omni_cache.harness.bench.memory import memory_report, memory_table
        from omni_cache.harness.bench.preset import PRESETS as _P2
        from omni_cache.harness.bench.workload import WorkloadSpec

        spec_kwargs = dict(_P2[args.preset][0].spec) if args.preset else {"batch_size": max(sizes), **kwargs}
        if steps is not None:
            spec_kwargs["decode_steps"] = steps
        report = memory_report(WorkloadSpec(**spec_kwargs))
        doc["memory"] = report.to_json()
        if not args.json:
            console.print(memory_table(report))
    if args.json:
        print(json.dumps(doc, indent=2))
    return rc


def run_breakdown(args: argparse.Namespace, console: Any, sizes: list[int],
                  kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """``--profile``: the per-category breakdown of a decode step at each size (the preset's, if any)."""
    from omni_cache.harness.bench.breakdown import breakdown_table, step_breakdown
    from omni_cache.harness.bench.workload import WorkloadSpec

    if args.preset:
        cases = PRESETS[args.preset]
        base = {k: v for k, v in cases[0].spec.items() if k != "batch_size"}
        sizes = sorted({c.spec["batch_size"] for c in cases})
    else:
        base = dict(kwargs)
    if args.decode_steps is not None:
        base["decode_steps"] = args.decode_steps
    breakdowns = [step_breakdown(WorkloadSpec(batch_size=b, **base)) for b in sizes]
    if not args.json:
        console.print(breakdown_table(breakdowns))
    return [b.to_json() for b in breakdowns]
