"""The CUDA options of ``omni-cache bench``: ``--device cuda`` and its sizes.

Owns: their argument definitions (``add_arguments``) and the run (``run_gpu``, called first by
``omni_cache.cli.bench.run``; None when the GPU bench was not asked for). The measurement is
``omni_cache.harness.bench.gpu``: at each hidden width (bf16) and step size, the save's time on
the engine thread, the copy's time on the side stream against the pinned device-to-host
bandwidth of the same run, and whether the copy overlapped a stand-in forward.

  --device cuda        the GPU bench (``--device cpu``, the default, is the CPU bench)
  --hidden-sizes W,..  hidden widths, bf16 (default 2048,4096)
  --step-tokens N,..   tokens per step, multiples of 16 (default 512,8192)
  --forward-layers N   layers of the stand-in forward (default by width: 36 at 2048, 32 at 4096)
  --timed-steps N      timed steps per run (default 12, after 3 warm-up steps)

Without a CUDA device ``--device cuda`` is refused in one line, exit 2: before torch is
imported where the machine has no NVIDIA driver at all, else once torch says it sees no
device. The CPU bench's own options are refused with it, and its options without it.
Exit 1 when a materialized step differs from the forward's output.

Upholds nothing; the run checks every step's rows (I4, I7) from outside.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

from omni_cache.cli.args import EXIT_FAILED, EXIT_USAGE, int_list, int_range

DEFAULT_HIDDEN = (2048, 4096)
DEFAULT_TOKENS = (512, 8192)
# Where a GPU driver torch.cuda can use shows itself without CUDA being loaded (NVIDIA; AMD's ROCm: kfd).
NVIDIA_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version", "/dev/kfd")
# The CPU bench's options (attribute, its default) that --device cuda does not take.
_CPU_ONLY = (("batch_sizes", None), ("decode_steps", None), ("async_", False), ("quick", False), ("plot", None),
             ("no_verify", False), ("machine", False), ("profile", False), ("preset", None), ("sweep", None),
             ("memory", False), ("engine_step", None), ("width_sweep", None), ("served", None),
             ("num_prompts", None), ("threads", 1))
_GPU_ONLY = ("hidden_sizes", "step_tokens", "forward_layers", "timed_steps")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="cuda: the GPU bench (the save's engine-thread time, the side-stream copy against "
                        "the pinned device-to-host bandwidth, its overlap with a stand-in forward; needs a CUDA "
                        "device); cpu (default): the benches above")
    parser.add_argument("--hidden-sizes", type=int_list(128, 16384), default=None, metavar="W1,W2",
                        help="--device cuda: hidden widths, bf16 (default 2048,4096)")
    parser.add_argument("--step-tokens", type=int_list(16, 65536), default=None, metavar="N1,N2",
                        help="--device cuda: tokens per step, multiples of 16 (default 512,8192)")
    parser.add_argument("--forward-layers", type=int_range(1, 512), default=None,
                        help="--device cuda: layers of the stand-in forward (default 36 at width 2048, 32 else)")
    parser.add_argument("--timed-steps", type=int_range(2, 10_000), default=None,
                        help="--device cuda: timed steps per run, 2 to 10,000, after 3 warm-up steps (default 12)")


def _flag(attr: str) -> str:
    return "--" + attr.rstrip("_").replace("_", "-")


def no_cuda_before_torch() -> str | None:
    """Why this machine cannot have a CUDA device, seen without importing torch; None if it may."""
    if any(os.path.exists(p) for p in NVIDIA_FILES) or shutil.which("nvidia-smi"):
        return None
    return "no NVIDIA driver on this machine (no /dev/nvidiactl, no nvidia-smi)"


def run_gpu(args: argparse.Namespace) -> int | None:
    """The GPU bench if ``--device cuda`` was given (or a refusal); None for the CPU bench."""
    gpu_given = [_flag(a) for a in _GPU_ONLY if getattr(args, a, None) is not None]
    if args.device != "cuda":
        if gpu_given:
            return _refuse(f"{', '.join(gpu_given)} only {'applies' if len(gpu_given) == 1 else 'apply'} "
                           "to --device cuda")
        return None
    cpu_given = [_flag(a) for a, default in _CPU_ONLY if getattr(args, a, default) != default]
    if cpu_given:
        return _refuse(f"--device cuda runs the GPU bench alone; it does not take {', '.join(cpu_given)}")
    tokens = list(args.step_tokens or DEFAULT_TOKENS)
    if bad := [t for t in tokens if t % 16]:
        return _refuse(f"--step-tokens must be multiples of the block size 16, got {bad}")
    if (reason := no_cuda_before_torch()) is not None:
        return _refuse(f"--device cuda: no CUDA device: {reason}")
    import torch

    if not torch.cuda.is_available():
        return _refuse(f"--device cuda: no CUDA device: torch {torch.__version__} sees none")
    return _run(args, list(args.hidden_sizes or DEFAULT_HIDDEN), tokens)


def _refuse(message: str) -> int:
    print(f"omni-cache bench: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _run(args: argparse.Namespace, hidden: list[int], tokens: list[int]) -> int:
    from omni_cache.cli.output import OutputConsole as Console
    from omni_cache.harness.bench.gpu import GpuBenchError, run_gpu_bench
    from omni_cache.harness.bench.provenance import source_commit

    console = Console(stderr=args.json, width=200)
    say = None if args.json else (lambda line: console.print(f"[dim]{line}[/dim]"))
    repeats = args.repeats if args.repeats is not None else 3
    try:
        result = run_gpu_bench(hidden, tokens, steps=args.timed_steps or 12, repeats=repeats,
                               layers=args.forward_layers, seed=args.seed, progress=say)
    except GpuBenchError as exc:
        print(f"omni-cache bench: GROUND TRUTH FAILURE: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ground_truth": "failed", "error": str(exc)}, indent=2))
        return EXIT_FAILED
    result.config.update(measured_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), commit=source_commit(),
                         command="omni-cache bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else []))
    if args.json:
        print(json.dumps({"gpu": result.to_json(), "ground_truth": "ok"}, indent=2))
        return 0
    console.print(gpu_table(result))
    console.print(f"pinned device-to-host: {result.d2h_gbps:,.1f} GB/s ({result.reference_bytes >> 20} MiB copies, "
                  f"median of 10, same run); every step's rows checked: "
                  f"{sum(c.rows_checked for c in result.cases):,} rows")
    return 0


def gpu_table(result: Any) -> Any:
    """The GPU bench's rich table: one row per (hidden, tokens) case."""
    from rich.table import Table

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:,.3f}"

    table = Table(title=f"omni-cache bench --device cuda: {result.device}, torch {result.torch_version}, "
                  f"bf16, medians of {result.config['repeats']} x {result.config['steps']} steps",
                  title_justify="left")
    for col in ("hidden", "tokens", "forward ms", "save ms (engine)", "save p90", "copy ms (stream)",
                "copy GB/s", "vs D2H floor", "overlap", "placement b/i/p/a", "step ms base", "step ms cache"):
        table.add_column(col, justify="right")
    for c in result.cases:
        place = c.copy_placement
        table.add_row(str(c.hidden), f"{c.tokens:,}", ms(c.forward_ms_base), ms(c.save_ms), ms(c.save_ms_p90),
                      ms(c.copy_ms), "-" if c.copy_gbps is None else f"{c.copy_gbps:,.1f}",
                      "-" if c.copy_vs_floor is None else f"{c.copy_vs_floor:.2f}x",
                      "-" if c.overlap_fraction is None else f"{c.overlap_fraction:.0%}",
                      "/".join(str(place.get(k, 0)) for k in ("before", "inside", "partly", "after")),
                      ms(c.step_ms_base), ms(c.step_ms_cache))
    return table
