"""``omni-cache simulate``: run a simulated omni serving workload through the cache.

Owns: the subcommand's arguments, the progress bar and the exit code. The
simulation itself lives in ``omni_cache.sim``. Exit 0 only if every output
handed to the next stage matched the ground truth and the manager raised no
contract error; 1 otherwise (with a report naming step, request, key and
position); 2 for bad arguments.

Invariants: none enforced here (see ``omni_cache.sim``: the run checks I1, I2,
I4-I7 and I9 from the outside).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from omni_cache.cli import simulate_vllm
from omni_cache.sim.workload import PRESETS


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
    )
    parser.add_argument("--preset", choices=sorted(set(PRESETS) | set(simulate_vllm.PRESETS)),
                        help="workload (default: chat; --engine vllm: mixed)")
    parser.add_argument("--requests", type=int, help="number of requests (multiturn: turns)")
    parser.add_argument("--max-batched-tokens", type=int, help="scheduler token budget per step")
    parser.add_argument("--num-blocks", type=int, help="KV cache blocks")
    parser.add_argument("--block-size", type=int, help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, help="most running requests")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--steps-limit", type=int, help="stop after this many engine steps")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--eager", dest="eager", action="store_true", default=True,
                      help="manager copies inline (default)")
    mode.add_argument("--async", dest="eager", action="store_false",
                      help="manager eager=False: a committer thread lands pool writes")
    parser.add_argument("--hidden-width", type=int, help="hidden row width (default 64)")
    parser.add_argument("--embeds-width", type=int, help="width of the deferred audio.embeds key")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="hidden/embeds dtype")
    parser.add_argument("--gpu-staging-bytes", type=int, help="deferred-key GPU budget before forced flushes")
    parser.add_argument("--staging-depth", type=int, help="staging pages per key (unconsumed step ids)")
    parser.add_argument("--builder-delay-ms", type=float, help="extra latency before each materialize")
    parser.add_argument(
        "--publish", choices=["forward", "schedule"],
        help="when the KV allocator publishes a full block: after its forward (default; vLLM v0) or "
        "when scheduled (vLLM v1: same-step hits)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        help="where the thinker's outputs live (cuda: the manager's stream path)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON (no table, no bar)")
    simulate_vllm.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        return simulate_vllm.run_vllm(args)
    if args.preset is None:
        args.preset = "chat"
    elif args.preset not in PRESETS:
        print(f"omni-cache simulate: preset {args.preset!r} needs --engine vllm", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from omni_cache.sim.config import SimConfig
    from omni_cache.sim.engine import Simulation
    from omni_cache.sim.report import render, summarize

    delay = None if args.builder_delay_ms is None else args.builder_delay_ms / 1e3
    err = Console(stderr=True)
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
        err.print(f"omni-cache simulate: {exc}", markup=False)
        return 2
    with progress:
        result = sim.run()
    summary = summarize(result)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=False, default=str))
    else:
        render(summary, Console())
    return 0 if result.ok else 1
