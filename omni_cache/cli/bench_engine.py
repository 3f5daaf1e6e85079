"""The real-engine options of ``omni-cache bench``: ``--engine-step``, ``--width-sweep`` and ``--served``.

Owns: their argument definitions (``add_arguments``) and their runs (``run_engine_extra``,
called by ``omni_cache.cli.bench.run`` first; None when neither option was given). Both build
real vLLM CPU engines with the cache (the ``[vllm]`` extra); without vLLM they are refused in
one line, exit 2, before torch is imported.

  --engine-step [MODEL]   what the cache adds to one real engine step, part by part
                          (``vllm_engine.step_cost``), decode steps of 1 to 32 requests and
                          prefill steps of 32 to 512 tokens; the fixed cost (a one-request,
                          one-token decode step) against its target, 250 µs (exit 3 above it)
  --width-sweep [FILE.png]  the cache's cost per step against the forward's over widths
                          128 to 4096, float32 and bfloat16 (``vllm_engine.width_sweep``); a
                          table, and a plot in FILE.png when given

Upholds nothing; the runs fail (exit 1) when a saved step id is left unconsumed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any

from omni_cache.cli.args import EXIT_FAILED, EXIT_INCOMPLETE, EXIT_USAGE, int_list, int_range, plot_path

ENGINE_STEP_MODELS = ("llama", "wide")
SERVED_MODELS = ("wide-llama", "tiny-llama")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-step", nargs="?", const="llama", default=None, choices=ENGINE_STEP_MODELS,
                        metavar="MODEL", help="what the cache adds to one step of a real vLLM CPU engine (MODEL: "
                        "llama, the default, or wide), part by part: begin_step, the block-table view, the write "
                        "layout, save, materialize, the bridge; the fixed cost (a one-token decode step) against "
                        "its 250 µs target (needs the [vllm] extra)")
    parser.add_argument("--width-sweep", nargs="?", const=True, default=None, metavar="FILE.png", type=plot_path,
                        help="the cache's cost per step against the forward's, widths 128 to 4096, float32 and "
                        "bfloat16, on real vLLM CPU engines: a table, and a plot in FILE.png when given")
    parser.add_argument("--widths", type=int_list(128, 8192), default=None, metavar="W1,W2",
                        help="--width-sweep: the widths, multiples of 128 from 128 to 8,192 (default 128,256,512,1024,2048,4096)")
    parser.add_argument("--dtypes", choices=("float32", "bfloat16", "both"), default=None,
                        help="--width-sweep: the dtypes (default both)")
    parser.add_argument("--served", nargs="?", const="wide-llama", default=None, choices=SERVED_MODELS,
                        metavar="MODEL", help="the served comparison (MODEL: wide-llama, the default, or tiny-llama): "
                        "three servers -- prefix caching with the cache (omni-cache serve), off, and without the "
                        "cache -- driven in turn by vLLM's serving benchmark on its prefix-repetition dataset; TTFT "
                        "and throughput medians, the cache's share of TTFT (needs the [vllm] extra)")
    parser.add_argument("--num-prompts", type=int_range(2, 1000), default=None,
                        help="--served: requests per benchmark run, 2 to 1,000 (default 16)")


def run_engine_extra(args: argparse.Namespace, console: Any) -> int | None:
    """Run ``--engine-step``, ``--width-sweep`` or ``--served`` if given; None if none was."""
    if args.engine_step is None and args.width_sweep is None and args.served is None:
        return None
    if importlib.util.find_spec("vllm") is None:
        print("omni-cache bench: error: --engine-step, --width-sweep and --served run real vLLM engines; vLLM is not "
              "installed (see the README's set-up with the [vllm] extra)", file=sys.stderr)
        return EXIT_USAGE
    from omni_cache.harness.vllm_engine.engine import prepare_vllm_env

    prepare_vllm_env()
    repeats = args.repeats if args.repeats is not None else 3
    say = None if args.json else (lambda line: console.print(f"[dim]{line}[/dim]"))
    doc: dict[str, Any] = {}
    rc = 0
    if args.engine_step is not None:
        rc = max(rc, _engine_step(args, console, repeats, say, doc))
    if args.width_sweep is not None:
        rc = max(rc, _width_sweep(args, console, repeats, say, doc))
    if args.served is not None:
        rc = max(rc, _served(args, console, repeats, say, doc))
    if args.json:
        print(json.dumps(doc, indent=2))
    return rc


def _engine_step(args: argparse.Namespace, console: Any, repeats: int, say: Any, doc: dict[str, Any]) -> int:
    from omni_cache.harness.bench.provenance import load_average
    from omni_cache.harness.vllm_engine.engine import engine_kwargs, stdout_to_stderr
    from omni_cache.harness.vllm_engine.models import model_engine_kwargs
    from omni_cache.harness.vllm_engine.step_cost import run_step_cost

    load_before = load_average()
    with stdout_to_stderr():
        from vllm import LLM

        model = model_engine_kwargs(args.engine_step, kv_blocks=256)
        llm = LLM(**engine_kwargs(model.pop("model"), kv_blocks=256, max_batched_tokens=2048, max_model_len=1024,
                                  **model))
    try:
        result = run_step_cost(llm, model=args.engine_step, repeats=repeats, progress=say)
    finally:
        with stdout_to_stderr():
            llm.llm_engine.engine_core.shutdown()
    doc["engine_step"] = {**result.to_json(), "load_average": [load_before, load_average()]}
    if not args.json:
        console.print(step_cost_table(result))
        for line in step_cost_lines(result):
            console.print(line)
    if result.unconsumed:
        return EXIT_FAILED
    return 0 if result.passed else EXIT_INCOMPLETE


def _served(args: argparse.Namespace, console: Any, repeats: int, say: Any, doc: dict[str, Any]) -> int:
    from omni_cache.harness.bench.served import SETUPS, ServedBenchConfig, run_served_bench

    cfg = ServedBenchConfig(model=args.served, repeats=repeats,
                            **({"num_prompts": args.num_prompts} if args.num_prompts else {}))
    result = run_served_bench(cfg, progress=say)
    doc["served"] = result.to_json()
    if not args.json:
        from rich.table import Table

        table = Table(title=f"omni-cache bench --served {cfg.model}: vLLM's serving benchmark, prefix-repetition "
                            f"({cfg.num_prompts} requests, prefixes of {cfg.prefix_len} tokens, medians of "
                            f"{cfg.repeats} repeats)", title_justify="left")
        for col in ("setup", "mean TTFT ms", "median TTFT ms", "p99 TTFT ms", "req/s", "output tok/s"):
            table.add_column(col, justify="left" if col == "setup" else "right")
        for setup, what in SETUPS.items():
            m = result.medians[setup]
            table.add_row(what, f"{m['mean_ttft_ms']:,.0f}", f"{m['median_ttft_ms']:,.0f}", f"{m['p99_ttft_ms']:,.0f}",
                          f"{m['request_throughput']:.3f}", f"{m['output_throughput']:.2f}")
        console.print(table)
        r = result.ratios()
        console.print(f"TTFT speedup over prefix caching off: {r['ttft_speedup']:.3f} with the cache, "
                      f"{r['apc_alone_ttft_speedup']:.3f} without it (kept {r['kept_of_apc_ttft']:.1%}); the cache's "
                      f"share of TTFT {r['cache_share_of_ttft']:.1%}; throughput x{r['throughput_speedup']:.3f} "
                      f"(x{r['apc_alone_throughput_speedup']:.3f} without the cache); {result.seconds:.0f} s")
        console.print(f"the three engines compute on the same CPUs (VLLM_CPU_NUM_OF_RESERVED_CPU="
                      f"{result.reserved_cpus}): {', '.join(result.thread_binding) or 'no binding logged'}")
    return 0


def step_cost_table(result: Any) -> Any:
    from rich.table import Table

    table = Table(title=f"omni-cache bench --engine-step {result.model}: µs per engine step (medians; cache from "
                        f"{result.repeats} totals passes, parts from as many parts passes)", title_justify="left")
    for col in ("stage", "step", "cache", "begin_step", "translate", "new_step_starts", "view", "layout", "save",
                "materialize", "bridge", "model outputs", "engine step", "forward"):
        table.add_column(col, justify="left" if col in ("stage", "step") else "right")
    for c in result.configs:
        p = c.parts_us
        what = f"decode {c.requests} req" if c.kind == "decode" else f"prefill {c.rows} tok"
        table.add_row(c.stage, what, f"{c.cache_us:,.0f}", *(f"{p[k]:,.0f}" for k in (
            "begin_step", "translate", "new_step_starts", "view", "layout", "save", "materialize")),
            f"{c.bridge_us:,.0f}", f"{p['model_outputs']:,.0f}", f"{c.step_us:,.0f}", f"{c.forward_us:,.0f}")
    return table


def step_cost_lines(result: Any) -> list[str]:
    lines = []
    for stage in result.stages:
        one, fit = result.one_token(stage), result.fit(stage)
        verdict = "PASS" if one.cache_us <= result.target_us else "FAIL"
        lines.append(f"{stage}: fixed cost (one-request, one-token decode step) {one.cache_us:,.0f} µs (target <= "
                     f"{result.target_us:,.0f}) {verdict}; {100 * one.cache_us / one.step_us:.1f}% of that engine "
                     f"step; fit: {fit['intercept_us']:,.0f} µs + {fit['per_request_us']:.2f} µs/request + "
                     f"{fit['per_row_us']:.3f} µs/row")
    if result.unconsumed:
        lines.append(f"[red]{result.unconsumed} saved step ids were never materialized[/]")
    return lines


def _width_sweep(args: argparse.Namespace, console: Any, repeats: int, say: Any, doc: dict[str, Any]) -> int:
    from rich.table import Table

    from omni_cache.harness.bench.provenance import load_average, provenance_line
    from omni_cache.harness.bench.report import machine_description
    from omni_cache.harness.vllm_engine.width_sweep import (
        DTYPES,
        WIDTHS,
        run_width_sweep,
        sweep_rows,
        write_sweep_plot,
    )

    dtypes = DTYPES if args.dtypes in (None, "both") else (args.dtypes,)
    load_before = load_average()
    points = run_width_sweep(args.widths or WIDTHS, dtypes, repeats=repeats, progress=say)
    path = None
    if args.width_sweep is not True:
        command = "omni-cache bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else ["--width-sweep"])
        path = write_sweep_plot(points, str(args.width_sweep),
                                title=f"the cache's cost per step vs the forward's (2-layer Llamas, median of "
                                      f"{repeats} passes)",
                                footnote=f"{provenance_line(machine_description(), load_before, load_average())}\n"
                                         f"command: {command}")
    doc["width_sweep"] = {"points": [p.to_json() for p in points], "plot": path,
                          "load_average": [load_before, load_average()]}
    if not args.json:
        rows = sweep_rows(points)
        table = Table(title="the cache's cost per step vs the forward's (µs; share of a model of 28 / 48 layers)",
                      title_justify="left")
        for col in rows[0]:
            table.add_column(col, justify="right")
        for row in rows:
            table.add_row(*row.values())
        console.print(table)
        console.print(f"wrote {path}" if path else "no plot written (pass --width-sweep FILE.png for one)")
    return 0
