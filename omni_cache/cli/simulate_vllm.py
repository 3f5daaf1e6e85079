"""``omni-cache simulate --engine vllm``: the real vLLM CPU engine as the thinker.

Owns: the vLLM engine's options, their validation and the exit code (0 only
if checks (a), (b) and (c) all pass; 1 with a report naming step, request,
key and position; 2 for bad arguments or when vLLM is not installed). The run
itself is ``omni_cache.vllm_sim``. Invariants: none enforced here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

from omni_cache.cli.args import float_range
from omni_cache.vllm_sim.models import DEFAULT_MODEL, MODELS
from omni_cache.vllm_sim.workload import PRESETS

__all__ = ["PRESETS", "add_arguments", "add_model_argument", "run_vllm"]

# Options of the simulated engine that mean nothing for the real one.
_SIM_ONLY = ("block_size", "max_num_seqs", "hidden_width", "embeds_width", "dtype", "gpu_staging_bytes",
             "staging_depth", "builder_delay_ms", "publish", "device")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine", choices=["sim", "vllm"], default="sim",
        help="the thinker: the simulated engine (default) or a real vLLM CPU engine (needs the [vllm] "
        f"extra; presets {', '.join(sorted(PRESETS))}, default mixed)",
    )
    add_model_argument(parser, "--engine vllm: ")
    parser.add_argument("--tolerance", type=float_range(0, 1, lo_open=True),
                        help="--engine vllm: check (b) tolerance, max |diff| over the row's max |value| (default 1e-5)")


def add_model_argument(parser: argparse.ArgumentParser, scope: str = "") -> None:
    """``--model`` (``omni_cache.vllm_sim.models``), for every command that builds a real thinker."""
    parser.add_argument("--model", choices=sorted(MODELS),
                        help=f"{scope}the thinker model, built at run time (default {DEFAULT_MODEL}; hybrid: "
                        "sliding-window and full-attention layers, several KV-cache groups)")


def run_vllm(args: argparse.Namespace) -> int:
    from rich.console import Console

    err = Console(stderr=True)
    given = [f"--{name.replace('_', '-')}" for name in _SIM_ONLY if getattr(args, name, None) is not None]
    if given:
        args.error(f"{', '.join(given)} only apply to --engine sim")
    if importlib.util.find_spec("vllm") is None:
        err.print("omni-cache simulate --engine vllm: vLLM is not installed; see the README's third command "
                  "(pip install -e '.[vllm]', then remove torchvision)", markup=False)
        return 2
    from omni_cache.vllm_sim.engine import DEFAULT_TOLERANCE, VllmSimConfig, VllmSimulation
    from omni_cache.vllm_sim.report import render, summarize

    preset = args.preset or "mixed"
    try:
        kwargs: dict[str, Any] = dict(preset=preset, seed=args.seed, requests=args.requests, kv_blocks=args.num_blocks,
                                      max_batched_tokens=args.max_batched_tokens, eager=args.eager,
                                      tolerance=DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance,
                                      model=args.model or DEFAULT_MODEL)
        if args.steps_limit is not None:
            kwargs["steps_limit"] = args.steps_limit
        cfg = VllmSimConfig(**kwargs)
    except (ValueError, TypeError) as exc:
        err.print(f"omni-cache simulate: {exc}", markup=False)
        return 2
    result = VllmSimulation(cfg).run()
    summary = summarize(result)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        render(summary, Console())
    return 0 if result.ok else 1
