"""``omni-cache simulate``: run a simulated omni serving workload through the cache.

Owns: the subcommand's arguments, the progress bar and the exit code. The
simulation itself lives in ``omni_cache.harness.sim_engine``. Exit 0 only if every request
asked for ran and every output handed to the next stage matched the ground
truth with no contract error; 1 on a mismatch or contract error (with a
report naming step, request, key and position); 2 for bad arguments or a
configuration that cannot run one request (the message names the smallest
that can); 3 when the run was clean but did less than asked (requests dropped
as too long for the KV cache, or steps cut by ``--steps-limit``) unless
``--allow-incomplete`` says that is intended.

Upholds nothing itself (``omni_cache.harness.sim_engine``'s run checks I1, I2, I4-I7 and I9
from the outside).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from omni_cache.cli import simulate_vllm
from omni_cache.cli.args import (
    EXIT_FAILED,
    float_range,
    incomplete_exit,
    int_range,
    positive_int,
    seed_int,
)
from omni_cache.cli.bench_gpu import no_cuda_before_torch
from omni_cache.harness.sim_engine.workload import PRESETS


def register(subparsers: Any) -> None:
    presets = ", ".join(f"{name} ({p.description})" for name, p in PRESETS.items())
    parser = subparsers.add_parser(
        "simulate",
        help="simulate a two-stage omni engine end to end and verify every cached output",
        description=(
            "Simulate a two-stage omni engine (paged KV allocator with prefix caching, token-budget "
            "scheduler with chunked prefill, preemption and aborts, a thinker with known per-token "
            "outputs) with the omni prefix cache between the stages; materialize runs on a builder "
            "thread and every output is checked against the ground truth. Deterministic from --seed. "
            f"Presets: {presets}. Unset options take the preset's defaults."
        ),
        epilog="Exit codes: 0 every request asked ran and was verified; 1 a mismatch or contract error; "
        "2 bad arguments, or a configuration that cannot run one request; 3 clean but incomplete "
        "(requests dropped or steps cut, or none finished and verified whole; with --engine vllm: other KV blocks than asked, or a preemption preset "
        "that preempted nothing; --allow-incomplete makes that 0).",
    )
    parser.add_argument("--preset", metavar="NAME", choices=sorted(set(PRESETS) | set(simulate_vllm.PRESETS)),
                        help=f"workload: {', '.join(sorted(PRESETS))} (default chat); with --engine vllm: "
                        f"{', '.join(sorted(simulate_vllm.PRESETS))} (default mixed)")
    parser.add_argument("--requests", type=positive_int,
                        help="number of requests, >= 1 (multiturn: turns; --kv-connector: per phase, each "
                        "phase-1 prompt returning in phase 2)")
    parser.add_argument("--max-batched-tokens", type=int_range(1, 1 << 20),
                        help="scheduler token budget per step, 1 to 1,048,576")
    parser.add_argument("--num-blocks", type=int_range(1, 1 << 24), help="KV cache blocks, 1 to 16,777,216 (a request may use half)")
    parser.add_argument("--block-size", type=int_range(1, 4096), help="tokens per KV block, 1 to 4096")
    parser.add_argument("--max-num-seqs", type=int_range(1, 1 << 16), help="most running requests, 1 to 65,536")
    parser.add_argument("--seed", type=seed_int, default=0, help="workload seed, 0 to 2**32 - 1 (default: 0)")
    parser.add_argument("--steps-limit", type=positive_int,
                        help="stop after this many engine steps, >= 1 (default 100,000; a cut run exits 3 unless "
                        "--allow-incomplete)")
    parser.add_argument("--allow-incomplete", action="store_true",
                        help="exit 0 even when requests were dropped or steps were cut (still reported)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--eager", dest="eager", action="store_true", default=True,
                      help="manager copies inline (default)")
    mode.add_argument("--async", dest="eager", action="store_false",
                      help="manager eager=False: a committer thread lands pool writes")
    parser.add_argument("--hidden-width", type=int_range(1, 1 << 16), help="hidden row width, 1 to 65,536 (default 64)")
    parser.add_argument("--embeds-width", type=int_range(1, 1 << 16), help="width of the deferred audio.embeds key, 1 to 65,536")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="hidden/embeds dtype")
    parser.add_argument("--gpu-staging-bytes", type=positive_int,
                        help="deferred-key GPU budget before forced flushes, >= 1")
    parser.add_argument("--staging-depth", type=int_range(1, 1024),
                        help="staging pages per key (unconsumed step ids), 1 to 1024")
    parser.add_argument("--builder-delay-ms", type=float_range(0, 10_000),
                        help="extra latency before each materialize, 0 to 10,000 ms (a save waits for a staging "
                        "slot at most 20 s: a slower builder would end the run with the staging timeout)")
    parser.add_argument(
        "--publish", choices=["forward", "schedule"],
        help="when the KV allocator publishes a full block: when scheduled (default; vLLM v1: same-step "
        "hits) or after its forward (vLLM v0)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        help="where the thinker's outputs live (cuda: the manager's stream path)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON (no table, no bar)")
    simulate_vllm.add_arguments(parser)
    parser.set_defaults(func=run, error=parser.error)


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        return simulate_vllm.run_vllm(args)
    if given := simulate_vllm.vllm_only_given(args):
        args.error(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} to --engine vllm")
    if getattr(args, "kv_connector", None) is not None:
        args.error("--kv-connector needs --engine vllm")
    if getattr(args, "model", None) is not None:
        args.error(f"--model {args.model} only applies to --engine vllm")
    if args.device == "cuda" and (no_cuda := no_cuda_before_torch()) is not None:
        args.error(f"--device cuda: {no_cuda}")
    if args.preset is None:
        args.preset = "chat"
    elif args.preset not in PRESETS:
        args.error(f"--preset {args.preset} needs --engine vllm (the simulated engine's presets: "
                   f"{', '.join(sorted(PRESETS))})")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from omni_cache.cli.output import OutputConsole as Console
    from omni_cache.harness.sim_engine.config import SimConfig
    from omni_cache.harness.sim_engine.engine import Simulation
    from omni_cache.harness.sim_engine.report import render, summarize

    delay = None if args.builder_delay_ms is None else args.builder_delay_ms / 1e3
    try:
        cfg = SimConfig.from_preset(
            args.preset,
            requests=args.requests,
            max_batched_tokens=args.max_batched_tokens,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            seed=args.seed,
            steps_limit=args.steps_limit,
            eager=args.eager,
            hidden_width=args.hidden_width,
            embeds_width=args.embeds_width,
            dtype=args.dtype,
            gpu_staging_bytes=args.gpu_staging_bytes,
            staging_depth=args.staging_depth,
            builder_delay_s=delay,
            publish=args.publish,
            device=args.device,
        )
        sim_kwargs: dict[str, Any] = {}
        show_bar = not args.json and sys.stdout.isatty()
        progress = Progress(
            TextColumn("[bold]simulate"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
            TimeElapsedColumn(), transient=True, disable=not show_bar,
        )
        task = progress.add_task("simulate", total=cfg.requests)
        sim_kwargs["on_progress"] = lambda done, created: progress.update(task, completed=done)
        sim = Simulation(cfg, **sim_kwargs)
    except (ValueError, TypeError) as exc:
        args.error(str(exc))  # the subcommand's usage, one line, exit 2
    with progress:
        result = sim.run()
    summary = summarize(result)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=False, default=str))
    else:
        render(summary, Console())
    if not result.ok:
        return EXIT_FAILED
    if not result.complete:
        return incomplete_exit("omni-cache simulate", list(result.incomplete_reasons()),
                               f"{result.talker_completed} of {result.requests_asked} requests asked were verified "
                               "whole", allow=args.allow_incomplete)
    return 0
