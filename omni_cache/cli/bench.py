"""``omni-cache bench``: the manager against a raw-copy floor, and the state-machine cost.

Owns: the ``bench`` subcommand. By default it drives the synthetic engine of
issue 3 (``omni_cache.bench.workload``) through the manager and through the
raw-copy floor at ``--batch-sizes``, checks every materialized row against the
ground truth (I4, I6, I7; I1/I2 at shutdown) and prints a rich table, the
omni_cache/floor tokens/s ratio and PASS/FAIL against the 50% target (exit 1
only with ``--check``, or on a ground-truth failure). ``--machine`` measures the
staging-slot machine instead (issue 2); ``--profile`` adds cProfile and section
timers at the largest batch size, and the per-category breakdown of a decode step
at each batch size. ``--json`` prints one JSON document instead of
tables; ``--plot FILE.png`` draws tokens/s and µs per step against batch size.
``--preset``, ``--sweep`` and ``--memory`` (issue 13) live in
``omni_cache.bench.perfcli``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from omni_cache.bench.perfcli import add_arguments as add_perf_arguments

QUICK = {"batch_sizes": "2,4", "decode_steps": 6, "repeats": 1, "hidden_width": 256, "mm_width": 64,
         "num_blocks": 128, "prompt_tokens": 64, "hit_tokens": 32}


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--batch-sizes wants comma-separated integers, got {text!r}") from exc
    if not sizes or any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"--batch-sizes wants positive integers, got {text!r}")
    return sorted(set(sizes))


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "bench",
        help="benchmark the manager against a raw-copy floor (or, with --machine, the state machine)",
        description=(
            "Synthetic engine: hidden 2048 bf16 + one per-token mm key of width 512, block size 16, "
            "4096 blocks, prompts of 512 tokens (half the requests hit 256 tokens of an earlier "
            "request's blocks), then decode steps; every step materialized and checked against ground "
            "truth. Reports tokens/s and µs per save / materialize / new_step_starts next to a raw-copy "
            "floor measured in the same run, and the ratio (target >= 50%)."
        ),
    )
    parser.add_argument("--batch-sizes", type=_batch_sizes, default=None, metavar="B1,B2",
                        help="requests per run (default 8,32)")
    parser.add_argument("--decode-steps", type=int, default=None, help="decode steps per run (default 200)")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes; medians reported (default 5)")
    parser.add_argument("--async", dest="async_", action="store_true",
                        help="run the manager with eager=False (committer thread); default is eager")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads during the run (default 1: stable on shared 2-core machines)")
    parser.add_argument("--seed", type=int, default=0, help="ground-truth and block-table seed")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny preset for tests and smoke runs (batch 2,4; narrow rows; 6 decode steps)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="write tokens/s and µs per step against batch size (matplotlib, Agg)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the ratio is below target at any size")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the ground-truth check of every step (faster; not recommended)")
    parser.add_argument("--machine", action="store_true",
                        help="measure the state-machine cost (issue 2) instead of the engine")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the manager (cProfile + section timers) at the largest batch size")
    add_perf_arguments(parser)  # --preset, --sweep, --memory (omni_cache.bench.perfcli)
    parser.set_defaults(func=run)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"seed": args.seed}
    if args.quick:
        kwargs.update({k: v for k, v in QUICK.items() if k not in ("batch_sizes", "decode_steps", "repeats")})
    kwargs["decode_steps"] = args.decode_steps if args.decode_steps is not None else (
        QUICK["decode_steps"] if args.quick else 200)
    return kwargs


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    console = Console(stderr=args.json)
    if not console.is_terminal:
        console = Console(stderr=args.json, width=180)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, args.threads))
    try:
        if args.machine:
            return _run_machine(args, console)
        return _run_engine(args, console)
    finally:
        torch.set_num_threads(previous_threads)


def _run_machine(args: argparse.Namespace, console: Any) -> int:
    from omni_cache.bench.machine import run_machine_bench
    from omni_cache.bench.report import machine_table

    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 5)
    if args.quick:
        result = run_machine_bench(cycles=100, triggers=200, repeats=repeats, add_model_sizes=(50, 100))
    else:
        result = run_machine_bench(repeats=repeats)
    if args.json:
        print(json.dumps({"machine": result.to_json()}, indent=2))
        return 0
    console.print(machine_table(result))
    fire = result.get("trigger_table_machine").us
    console.print(
        f"StagingPool cycle {result.get('staging_pool_cycle').us:,.2f} µs vs dict-table "
        f"{result.get('dict_table_cycle').us:,.2f} µs: {result.cycle_ratio:,.1f}x. Per step the runtime fires "
        f"4 staging + 4 write triggers whatever the number of requests: about {8 * fire:,.0f} µs at "
        f"{fire:,.2f} µs per TableMachine.fire")
    return 0


def _run_engine(args: argparse.Namespace, console: Any) -> int:
    import torch

    from omni_cache.bench import report
    from omni_cache.bench.runner import run_bench
    from omni_cache.bench.workload import GroundTruthError, WorkloadSpec

    sizes = args.batch_sizes or _batch_sizes(QUICK["batch_sizes"] if args.quick else "8,32")
    repeats = args.repeats if args.repeats is not None else (QUICK["repeats"] if args.quick else 5)
    kwargs = _engine_kwargs(args)
    from omni_cache.bench.perfcli import run_breakdown, run_extra

    extra = run_extra(args, console, sizes, repeats, kwargs)
    if extra is not None:
        return extra
    progress = None if args.json else (lambda line: console.print(f"[dim]{line}[/dim]"))
    try:
        result = run_bench(sizes, repeats=repeats, eager=not args.async_, check=not args.no_verify,
                           progress=progress, **kwargs)
    except GroundTruthError as exc:
        console.print(f"[bold red]GROUND TRUTH FAILURE[/bold red]: {exc}")
        if args.json:
            print(json.dumps({"ground_truth": "failed", "error": str(exc)}, indent=2))
        return 2
    result.config["torch_threads"] = torch.get_num_threads()
    result.config["quick"] = bool(args.quick)
    if not args.no_verify:
        result.ground_truth = "ok"
    else:
        result.ground_truth = "not checked (--no-verify)"
    profile: dict[str, Any] | None = None
    if args.profile:
        from omni_cache.bench.profiling import profile_manager, section_times

        spec = WorkloadSpec(batch_size=max(sizes), **kwargs)
        by_own, by_cum, meta = profile_manager(spec, eager=not args.async_)
        sections, smeta = section_times(spec, eager=not args.async_)
        meta.update(smeta)
        profile = {"meta": meta, "by_own": [vars(r) for r in by_own], "by_cum": [vars(r) for r in by_cum],
                   "sections": [vars(r) for r in sections],
                   "breakdown": run_breakdown(args, console, sizes, kwargs)}
    if args.plot:
        path = report.write_plot(result, args.plot)
        if not args.json:
            console.print(f"wrote {path}")
    if args.json:
        doc = result.to_json()
        if args.plot:
            doc["plot"] = str(args.plot)
        if profile is not None:
            doc["profile"] = profile
        print(json.dumps(doc, indent=2))
    else:
        console.print(report.engine_table(result))
        for line in report.verdict_lines(result):
            console.print(line)
        if profile is not None:
            from types import SimpleNamespace

            ns = [[SimpleNamespace(**r) for r in profile[k]] for k in ("by_own", "by_cum", "sections")]
            for table in report.profile_tables(*ns, profile["meta"]):
                console.print(table)
    if args.check and not result.passed:
        print("bench --check: omni_cache is below the target ratio at some batch size", file=sys.stderr)
        return 1
    return 0
