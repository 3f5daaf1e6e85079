"""``omni-cache simulate --engine vllm``: the real vLLM CPU engine as the thinker.

Owns: the vLLM engine's options, their validation and the exit code (0 only
if checks (a), (b) and (c) all pass; 1 with a report naming step, request,
key and position; 2 for bad arguments, a KV-cache size override in the
environment, or when vLLM is not installed; 3 when the checks passed but the
run did less than asked: the engine got other KV blocks than asked, or a preset
that promises preemptions had none; 0 with ``--allow-incomplete``). ``--tp``/``--pp`` run the engine on worker
processes (``omni_cache.harness.vllm_engine.parallel``). The run itself is
``omni_cache.harness.vllm_engine``. Upholds nothing itself.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

from omni_cache.cli.args import float_range, incomplete_exit, int_range
from omni_cache.harness.vllm_engine.grid import check_kv_connector, check_parallel_config
from omni_cache.harness.vllm_engine.models import DEFAULT_MODEL, MODELS
from omni_cache.harness.vllm_engine.speculative import check_speculative
from omni_cache.harness.vllm_engine.workload import PRESETS

__all__ = ["PRESETS", "add_arguments", "add_model_argument", "run_vllm"]

# Options of the simulated engine that mean nothing for the real one.
_SIM_ONLY = ("block_size", "max_num_seqs", "hidden_width", "embeds_width", "dtype", "gpu_staging_bytes",
             "staging_depth", "builder_delay_ms", "publish", "device")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine", choices=["sim", "vllm"], default="sim",
        help="the thinker: the simulated engine (default) or a real vLLM CPU engine (needs the [vllm] extra)",
    )
    parser.add_argument("--kv-connector", choices=["example"], default=None,
                        help="--engine vllm: run vLLM's ExampleConnector under omni-cache's OmniKVConnector (disk "
                        "store in a temp dir), reset the prefix cache and serve prefixes that come back through it "
                        "(docs/kv-tier.md)")
    add_model_argument(parser, "--engine vllm: ")
    add_speculative_argument(parser, "--engine vllm: ")
    parser.add_argument("--tolerance", type=float_range(0, 1, lo_open=True),
                        help="--engine vllm: check (b) tolerance, max |diff| over the row's max |value| (default 1e-5)")
    parser.add_argument("--tp", type=int_range(1, 8), help="--engine vllm: tensor-parallel worker processes, 1 to 8 "
                        "(default 1: the engine in this process); the cache lives on the output rank only")
    parser.add_argument("--pp", type=int_range(1, 2), help="--engine vllm: pipeline-parallel stages, 1 or 2 (default 1)")
    parser.add_argument("--check-ranks", action="store_true", default=None,
                        help="--engine vllm --tp N: a cache on every TP rank, each one's served rows compared "
                        "bit for bit with the output rank's")


VLLM_ONLY = ("tolerance", "tp", "pp", "check_ranks", "speculative")
SPECULATIVE_METHODS = ("ngram", "draft", "eagle")  # omni_cache.harness.vllm_engine.speculative.METHODS


def vllm_only_given(args: argparse.Namespace) -> list[str]:
    """The ``--engine vllm`` options given to a simulated-engine run."""
    return [f"--{name.replace('_', '-')}" for name in VLLM_ONLY if getattr(args, name, None) is not None]


def add_speculative_argument(parser: argparse.ArgumentParser, scope: str = "") -> None:
    """``--speculative`` (``omni_cache.harness.vllm_engine.speculative``), for every command that builds a real thinker."""
    parser.add_argument("--speculative", choices=SPECULATIVE_METHODS,
                        help=f"{scope}speculative decoding on the thinker: ngram (prompt lookup), draft (a tiny draft "
                        "model) or eagle (a tiny EAGLE head), built at run time; prompts hold traps the proposer "
                        "falls into, so drafts are rejected too (docs/speculative.md)")


def add_model_argument(parser: argparse.ArgumentParser, scope: str = "") -> None:
    """``--model`` (``omni_cache.harness.vllm_engine.models``), for every command that builds a real thinker."""
    parser.add_argument("--model", choices=sorted(MODELS),
                        help=f"{scope}the thinker model, built at run time (default {DEFAULT_MODEL}; hybrid: "
                        "sliding-window and full-attention layers, several KV-cache groups; wide: 16 layers of "
                        "width 1024, a forward that dominates the step)")


def run_vllm(args: argparse.Namespace) -> int:
    given = [f"--{name.replace('_', '-')}" for name in _SIM_ONLY if getattr(args, name, None) is not None]
    if given:
        args.error(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} to --engine sim")
    if args.preset is not None and getattr(args, "kv_connector", None) is not None:
        args.error(f"--kv-connector runs its own two-phase workload (prompts, a prefix-cache reset, the same "
                   f"prefixes through the tier): not --preset {args.preset}")
    if args.preset is not None and args.preset not in PRESETS:
        args.error(f"--preset {args.preset} is a preset of the simulated engine; --engine vllm takes "
                   f"{', '.join(sorted(PRESETS))}")
    # The thinker's grid, model, connector and speculative method, checked before torch or vLLM is
    # imported (and whether or not vLLM is installed): one line naming the flags, exit 2.
    grid = argparse.Namespace(tp=args.tp or 1, pp=args.pp or 1, model=args.model or DEFAULT_MODEL,
                              check_ranks=bool(args.check_ranks), kv_connector=getattr(args, "kv_connector", None),
                              speculative=args.speculative)
    try:
        check_parallel_config(grid)
        check_kv_connector(grid)
        check_speculative(grid)
    except ValueError as exc:
        args.error(str(exc))
    from omni_cache.cli.output import OutputConsole as Console

    err = Console(stderr=True)
    if importlib.util.find_spec("vllm") is None:
        err.print("omni-cache simulate --engine vllm: vLLM is not installed; see the README's 'Run the main job on a "
                  "real vLLM engine' (pip install -e '.[vllm]', then remove torchvision)", markup=False)
        return 2
    from omni_cache.harness.vllm_engine.engine import DEFAULT_TOLERANCE, VllmSimConfig, VllmSimulation
    from omni_cache.harness.vllm_engine.parallel import make_simulation
    from omni_cache.harness.vllm_engine.promises import kv_space_override
    from omni_cache.harness.vllm_engine.report import render, summarize

    preset = args.preset or "mixed"
    try:
        kwargs: dict[str, Any] = dict(preset=preset, seed=args.seed, requests=args.requests, kv_blocks=args.num_blocks,
                                      max_batched_tokens=args.max_batched_tokens, eager=args.eager,
                                      tolerance=DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance,
                                      tp=args.tp or 1, pp=args.pp or 1, check_ranks=bool(args.check_ranks),
                                      model=args.model or DEFAULT_MODEL, speculative=args.speculative)
        if args.steps_limit is not None:
            kwargs["steps_limit"] = args.steps_limit
        if getattr(args, "kv_connector", None) is not None:
            kwargs["kv_connector"] = args.kv_connector
        cfg = VllmSimConfig(**kwargs)
    except (ValueError, TypeError) as exc:
        args.error(str(exc))  # the subcommand's usage, one line, exit 2
    refusal = kv_space_override()
    if refusal:
        err.print(f"omni-cache simulate: {refusal}", markup=False, soft_wrap=True)
        return 2
    if cfg.kv_connector is not None:
        from omni_cache.harness.vllm_engine.tier_run import TierSimulation

        sim: VllmSimulation = TierSimulation(cfg)
    elif cfg.speculative is not None:
        from omni_cache.harness.vllm_engine.spec_run import SpecSimulation

        sim = SpecSimulation(cfg)
    else:
        sim = make_simulation(cfg)
    result = sim.run()
    summary = summarize(result)
    if cfg.kv_connector is not None:
        from omni_cache.harness.vllm_engine.tier_run import add_tier_summary, render_tier

        add_tier_summary(summary, sim)
    if cfg.speculative is not None:
        from omni_cache.harness.vllm_engine.spec_run import add_spec_summary

        add_spec_summary(summary, sim)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        render(summary, Console())
        if cfg.kv_connector is not None:
            render_tier(summary, Console())
        if cfg.speculative is not None:
            from omni_cache.harness.vllm_engine.spec_run import render_spec

            render_spec(summary, Console())
    if not result.ok:
        return 1
    if result.incomplete:
        return incomplete_exit("omni-cache simulate", list(result.incomplete), "the run did less than asked",
                               allow=args.allow_incomplete)
    return 0
