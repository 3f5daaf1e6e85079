"""``omni-cache bench``: the manager against a raw-copy floor, and the state-machine cost.

Owns: the ``bench`` subcommand. By default it drives the synthetic engine
(``omni_cache.harness.bench.workload``) through the manager and through the raw-copy
floor at ``--batch-sizes``, checks every materialized row against the ground
truth (I4, I6, I7; I1/I2 at shutdown) and prints a rich table, the
omni_cache/floor tokens/s ratio and PASS/FAIL against the 50% target. Exit 0 on
PASS; 1 on a ground-truth failure; 2 for bad arguments (including batch sizes
the KV blocks cannot hold); 3 on FAIL, naming the batch size and ratio that
missed. ``--quick`` is a smoke run: it prints the ratios but no verdict.
``--machine`` measures the staging-slot machine instead; ``--profile`` adds
cProfile and section timers at the largest batch size. ``--json`` prints one
JSON document instead of tables; ``--plot FILE.png|FILE.svg`` draws the result
(``omni_cache.harness.bench.report.write_plot``).
At each batch size ``--profile`` also prints the per-category breakdown of a decode
step. ``--preset``, ``--sweep`` and ``--memory`` (decode-step cost) live in
``omni_cache.cli.bench_workloads``; a preset that misses its targets exits 3 too.
``--engine-step``, ``--width-sweep`` and ``--served`` (real vLLM engines) live in
``omni_cache.cli.bench_engine``; ``--device cuda`` (the GPU bench) in ``omni_cache.cli.bench_gpu``.

Upholds nothing itself: it checks what the runtime upholds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TypedDict

from omni_cache.cli.args import (
    EXIT_FAILED,
    EXIT_INCOMPLETE,
    int_list,
    int_range,
    plot_path,
    seed_int,
)
from omni_cache.cli.bench_engine import add_arguments as add_engine_arguments
from omni_cache.cli.bench_gpu import add_arguments as add_gpu_arguments
from omni_cache.cli.bench_gpu import run_gpu
from omni_cache.cli.bench_workloads import add_arguments as add_perf_arguments


class _QuickRun(TypedDict):
    """``--quick``: the batch sizes, decode steps and repeats, and the workload's narrow shape."""

    batch_sizes: str
    decode_steps: int
    repeats: int
    hidden_width: int
    mm_width: int
    num_blocks: int
    prompt_tokens: int
    hit_tokens: int


QUICK: _QuickRun = {"batch_sizes": "2,4", "decode_steps": 6, "repeats": 1, "hidden_width": 256, "mm_width": 64,
         "num_blocks": 128, "prompt_tokens": 64, "hit_tokens": 32}


_batch_sizes = int_list(1, 4096)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark the manager against a raw-copy floor (or, with --machine, the state machine)",
        description=(
            "Synthetic engine: hidden 2048 bf16 + one per-token mm key of width 512, block size 16, "
            "4096 blocks, prompts of 512 tokens (half the requests hit 256 tokens of an earlier "
            "request's blocks), then decode steps; every step materialized and checked against ground "
            "truth. Reports tokens/s and µs per save / materialize / new_step_starts next to a raw-copy "
            "floor measured in the same run, and the ratio (target >= 50%). The floor is the same tensor "
            "copies with no bookkeeping: the fastest any cache could serve this workload."
        ),
        epilog="Exit codes: 0 PASS (or --quick / --machine done); 1 a ground-truth failure; 2 bad arguments; "
        "3 FAIL: a ratio below the target (the message names the batch size and ratio).",
    )
    parser.add_argument("--batch-sizes", type=_batch_sizes, default=None, metavar="B1,B2",
                        help="requests per run, each 1 to 4,096 (default 8,32)")
    parser.add_argument("--decode-steps", type=int_range(0, 100_000), default=None,
                        help="decode steps per run, 0 to 100,000 (default 200)")
    parser.add_argument("--repeats", type=int_range(1, 1000), default=None,
                        help="timed passes, 1 to 1000; medians reported (default 5)")
    parser.add_argument("--async", dest="async_", action="store_true",
                        help="run the manager with eager=False (committer thread); default is eager")
    parser.add_argument("--threads", type=int_range(1, 1024), default=1,
                        help="torch intra-op threads during the run, 1 to 1,024 (default 1: stable on shared machines)")
    parser.add_argument("--seed", type=seed_int, default=0, help="ground-truth and block-table seed, 0 to 2**32 - 1")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny smoke run (batch 2,4; narrow rows; 6 decode steps): ratios, no verdict; with "
                             "--sweep: one repeat of its grid; with --machine: fewer cycles, one repeat")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    parser.add_argument("--plot", metavar="FILE.png", type=plot_path, default=None,
                        help="write the figure (tokens/s, ratio to the floor with the target, µs per step) to a "
                        ".png or .svg in an existing folder (needs matplotlib)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the ground-truth check of every step (faster; not recommended)")
    parser.add_argument("--machine", action="store_true",
                        help="measure the state-machine cost instead of the engine")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the manager (cProfile + section timers) at the largest batch size")
    add_perf_arguments(parser)  # --preset, --sweep, --memory (omni_cache.cli.bench_workloads)
    add_engine_arguments(parser)  # --engine-step, --width-sweep, --served (omni_cache.cli.bench_engine)
    add_gpu_arguments(parser)  # --device cuda and its sizes (omni_cache.cli.bench_gpu)
    parser.set_defaults(func=run, error=parser.error)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"seed": args.seed}
    if args.quick:
        kwargs.update({k: v for k, v in QUICK.items() if k not in ("batch_sizes", "decode_steps", "repeats")})
    kwargs["decode_steps"] = args.decode_steps if args.decode_steps is not None else (
        QUICK["decode_steps"] if args.quick else 200)
    return kwargs


def _refuse_unused_flags(args: argparse.Namespace) -> None:
    """A flag the chosen run would ignore is refused, naming it (one line, exit 2, before torch)."""
    def given(*flags: tuple[str, Any]) -> list[str]:
        return [flag for flag, present in flags if present]

    def not_for(unused: list[str], run: str) -> str:
        return f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply to {run}"

    problems = []
    if args.machine and (unused := given(("--preset", args.preset), ("--sweep", args.sweep), ("--memory", args.memory),
                                         ("--profile", args.profile), ("--plot", args.plot),
                                         ("--batch-sizes", args.batch_sizes), ("--decode-steps", args.decode_steps is not None),
                                         ("--no-verify", args.no_verify), ("--async", args.async_),
                                         ("--seed", args.seed != 0))):
        problems.append(not_for(unused, "--machine (it draws no workload)"))
    if args.plot and (modes := given(("--preset", args.preset), ("--sweep", args.sweep), ("--memory", args.memory),
                                     ("--engine-step", args.engine_step is not None),
                                     ("--width-sweep", args.width_sweep is not None),
                                     ("--served", args.served is not None))):
        problems.append(f"--plot draws the default bench, not {', '.join(modes)} (--sweep and --width-sweep take their own FILE.png)")
    if not args.width_sweep and (unused := given(("--widths", args.widths), ("--dtypes", args.dtypes))):
        problems.append(f"{', '.join(unused)} {'goes' if len(unused) == 1 else 'go'} with --width-sweep")
    if args.widths and (odd := [w for w in args.widths if w % 128]):
        problems.append(f"--widths must be multiples of 128 (heads of 128), got {', '.join(map(str, odd))}")
    engines = given(("--engine-step", args.engine_step is not None), ("--width-sweep", args.width_sweep is not None),
                    ("--served", args.served is not None))
    if engines and (unused := given(("--machine", args.machine), ("--quick", args.quick), ("--preset", args.preset),
                                    ("--sweep", args.sweep), ("--memory", args.memory), ("--profile", args.profile),
                                    ("--batch-sizes", args.batch_sizes),
                                    ("--decode-steps", args.decode_steps is not None), ("--async", args.async_),
                                    ("--threads", args.threads != 1), ("--no-verify", args.no_verify),
                                    ("--seed", args.seed != 0))):
        problems.append(not_for(unused, f"{' and '.join(engines)} (a real vLLM engine's run)"))
    # --profile's breakdown and --memory take the default workload's sizes and seed unless a preset is given
    own = given(("--preset", args.preset)) or ([] if args.profile or args.memory else given(("--sweep", args.sweep)))
    if own and (unused := given(("--batch-sizes", args.batch_sizes), ("--seed", args.seed != 0))):
        problems.append(not_for(unused, f"{' and '.join(own)} (its own workloads)"))
    if args.sweep and args.no_verify:
        problems.append("--no-verify does not apply to --sweep (its passes are always checked against the ground "
                        "truth)")
    if args.memory and not own and (unused := given(("--repeats", args.repeats is not None),
                                                    ("--no-verify", args.no_verify), ("--async", args.async_))):
        problems.append(not_for(unused, "--memory (it counts bytes; nothing is timed or served)"))
    if args.num_prompts is not None and args.served is None:
        problems.append("--num-prompts goes with --served")
    if args.preset and args.quick:
        problems.append(f"--preset {args.preset} runs its own workload against its targets; --quick does not apply")
    if args.decode_steps is not None and args.sweep and args.decode_steps < 2:
        problems.append(f"--sweep counts the lines of a decode step after the first: --decode-steps >= 2, "
                        f"got {args.decode_steps}")
    if args.decode_steps == 0 and args.profile:
        problems.append("--profile times decode steps: --decode-steps >= 1, got 0")
    if problems:
        args.error("; ".join(problems))


def run(args: argparse.Namespace) -> int:
    _refuse_unused_flags(args)
    if (gpu := run_gpu(args)) is not None:  # --device cuda: refused without CUDA, before torch
        return gpu
    if any(v is not None for v in (args.engine_step, args.width_sweep, args.served)):  # real engines: refused without vLLM, before torch
        from omni_cache.cli.bench_engine import run_engine_extra
        from omni_cache.cli.output import OutputConsole as Console

        return run_engine_extra(args, Console(stderr=args.json, width=200)) or 0
    import torch

    from omni_cache.cli.output import OutputConsole as Console

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
    from omni_cache.harness.bench.machine import run_machine_bench
    from omni_cache.harness.bench.report import machine_table

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

    from omni_cache.harness.bench import report
    from omni_cache.harness.bench.runner import run_bench
    from omni_cache.harness.bench.workload import GroundTruthError, WorkloadSpec

    sizes = args.batch_sizes or _batch_sizes(QUICK["batch_sizes"] if args.quick else "8,32")
    repeats = args.repeats if args.repeats is not None else (QUICK["repeats"] if args.quick else 5)
    kwargs = _engine_kwargs(args)
    from omni_cache.cli.bench_workloads import run_breakdown, run_extra

    extra = run_extra(args, console, sizes, repeats, kwargs)
    if extra is not None:
        return extra
    _check_fits(args, sizes, kwargs)
    if args.plot:
        _check_matplotlib(args)
    load_before = _load()
    progress = None if args.json else (lambda line: console.print(f"[dim]{line}[/dim]"))
    try:
        result = run_bench(sizes, repeats=repeats, eager=not args.async_, check=not args.no_verify,
                           progress=progress, **kwargs)
    except GroundTruthError as exc:
        console.print(f"[bold red]GROUND TRUTH FAILURE[/bold red]: {exc}")
        if args.json:
            print(json.dumps({"ground_truth": "failed", "error": str(exc)}, indent=2))
        return EXIT_FAILED
    result.config["torch_threads"] = torch.get_num_threads()
    result.config["machine"] = report.machine_description()
    result.config["load_avg_1min"] = [load_before, _load()]
    result.config["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    from omni_cache.harness.bench.provenance import source_commit

    result.config["commit"] = source_commit()
    result.config["command"] = "omni-cache bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else [])
    result.config["quick"] = bool(args.quick)
    if not args.no_verify:
        result.ground_truth = "ok"
    else:
        result.ground_truth = "not checked (--no-verify)"
    profile: dict[str, Any] | None = None
    if args.profile:
        from omni_cache.harness.bench.profiling import profile_manager, section_times

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

            own_rows, cum_rows, section_rows = ([SimpleNamespace(**r) for r in profile[k]]
                                                for k in ("by_own", "by_cum", "sections"))
            for table in report.profile_tables(own_rows, cum_rows, section_rows, profile["meta"]):
                console.print(table)
    if args.quick:
        return 0
    missed = [b for b in result.batch_sizes if not result.ratio(b) >= result.target_ratio]
    if missed:
        print("omni-cache bench: FAIL: " + "; ".join(
            f"batch {b}: omni_cache/floor tokens/s {result.ratio(b):.1%} < target {result.target_ratio:.0%}"
            for b in missed), file=sys.stderr)
        return EXIT_INCOMPLETE
    return 0


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - not on every platform
        return None


def _check_fits(args: argparse.Namespace, sizes: list[int], kwargs: dict[str, Any]) -> None:
    """Refuse (exit 2, bench's usage) batch sizes or decode steps the bench's KV blocks cannot hold."""
    from omni_cache.harness.bench.workload import WorkloadSpec

    try:
        WorkloadSpec(batch_size=max(sizes), **kwargs)
        return
    except ValueError as exc:
        problem = str(exc)
    fits = 0
    for b in range(1, max(sizes) + 1):
        try:
            WorkloadSpec(batch_size=b, **kwargs)
        except ValueError:
            break
        fits = b
    one = WorkloadSpec(batch_size=1, **{**kwargs, "decode_steps": 0})
    where = f" (--quick has {one.num_blocks})" if args.quick else ""
    hint = (f"the largest batch that fits at --decode-steps {kwargs['decode_steps']} is {fits}" if fits else
            f"--decode-steps {kwargs['decode_steps']} is too long for one request")
    args.error(f"--batch-sizes {','.join(map(str, sizes))}: {problem}{where}; {hint}")


def _check_matplotlib(args: argparse.Namespace) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        args.error("--plot needs matplotlib: pip install 'omni-cache[plot]'")
