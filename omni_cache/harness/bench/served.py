"""``omni-cache bench --served``: what the cache costs a served engine, with vLLM's own benchmark.

Owns: ``ServedBenchConfig`` and ``run_served_bench``: three servers of one built-in model on
127.0.0.1, alive side by side -- prefix caching with the cache (``omni-cache serve``: the omni
worker, each request's file delivered), prefix caching off, and prefix caching without the
cache (the upper bound: it serves no rows, so what prefix caching buys when nobody needs them)
-- each driven in turn, repeat after repeat with the order rotating, by vLLM's serving benchmark
(``vllm.benchmarks.serve``) on its prefix-repetition dataset (each repeat a fresh seed: new
prefixes, no hit from an earlier repeat; the same workload for the three servers). Reported:
medians over repeats of TTFT (mean, median, p99) and throughput, the speedups against prefix
caching off, how much of what prefix caching alone buys the cache keeps, and the cache's share
of TTFT (the TTFT it adds over prefix caching without the cache, over its TTFT).

The three engines compute on the same CPUs. vLLM's CPU backend reserves cores for its scheduler
process -- one, and one more when a KV connector is configured (the cache's server runs
``OmniKVConnector`` for the delivery) -- and reserves none where that would leave no core to
compute on; on a 2-core machine the cache's server would compute on both cores and the others on
one. So every server gets the same ``VLLM_CPU_NUM_OF_RESERVED_CPU``: the environment's own value,
else 1 (what vLLM reserves for a server without a connector).

Upholds: every repeat's benchmark completes all its requests, and the three servers' OpenMP
binding lines (their ``core ids``/``reserved_cpus``, as each logs them at INFO) are equal, and on
vLLM's CPU platform each server logged one; else the run fails, naming what differed.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SETUPS", "ServedBenchConfig", "run_served_bench", "thread_binding_lines"]

SETUPS: dict[str, str] = {
    "cache": "prefix caching with the cache (omni-cache serve; every request's file delivered)",
    "off": "prefix caching off (vLLM alone)",
    "apc": "prefix caching without the cache (vLLM alone: the upper bound, it serves no rows)",
}
METRICS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "request_throughput", "output_throughput",
           "total_token_throughput", "mean_e2el_ms")


@dataclass(frozen=True)
class ServedBenchConfig:
    model: str = "wide-llama"
    repeats: int = 3
    num_prompts: int = 16
    prefix_len: int = 512
    suffix_len: int = 64
    num_prefixes: int = 2
    output_len: int = 8
    max_concurrency: int = 2
    seed: int = 0
    reserved_cpus: int = 1  # VLLM_CPU_NUM_OF_RESERVED_CPU of every server unless the environment sets it


@dataclass
class ServedBenchResult:
    config: ServedBenchConfig
    runs: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    medians: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0
    load_average: list[float | None] = field(default_factory=list)
    reserved_cpus: str = ""
    thread_binding: list[str] = field(default_factory=list)  # the same for the three servers (checked)

    def ratios(self) -> dict[str, float]:
        m = self.medians
        cache, off, apc = m["cache"], m["off"], m["apc"]
        ttft_speedup = off["mean_ttft_ms"] / cache["mean_ttft_ms"]
        apc_ttft_speedup = off["mean_ttft_ms"] / apc["mean_ttft_ms"]
        return {
            "ttft_speedup": ttft_speedup,
            "apc_alone_ttft_speedup": apc_ttft_speedup,
            "kept_of_apc_ttft": ttft_speedup / apc_ttft_speedup,
            "throughput_speedup": cache["request_throughput"] / off["request_throughput"],
            "apc_alone_throughput_speedup": apc["request_throughput"] / off["request_throughput"],
            "cache_share_of_ttft": (cache["mean_ttft_ms"] - apc["mean_ttft_ms"]) / cache["mean_ttft_ms"],
        }

    def to_json(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "setups": SETUPS, "medians": self.medians, "runs": self.runs,
                "ratios": self.ratios(), "seconds": self.seconds, "load_average": self.load_average,
                "reserved_cpus": self.reserved_cpus, "thread_binding": self.thread_binding}


_BINDING = re.compile(r"\b(local_rank=\d+, core ids=\[[^\]]*\]|reserved_cpus=\[[^\]]*\])")


def thread_binding_lines(log: str) -> list[str]:
    """The OpenMP binding a vLLM CPU server logged (each rank's ``core ids`` and the
    ``reserved_cpus``), in order; empty where it logged none (not a CPU engine)."""
    return _BINDING.findall(log)


def _benchmark(url: str, served_name: str, tokenizer: str, cfg: ServedBenchConfig, seed: int) -> dict[str, float]:
    """One run of vLLM's serving benchmark against ``url`` (its prints kept off stdout)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "vllm", "--base-url", url, "--model", served_name, "--tokenizer", tokenizer,
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(cfg.prefix_len),
        "--prefix-repetition-suffix-len", str(cfg.suffix_len),
        "--prefix-repetition-num-prefixes", str(cfg.num_prefixes),
        "--prefix-repetition-output-len", str(cfg.output_len), "--num-prompts", str(cfg.num_prompts),
        "--max-concurrency", str(cfg.max_concurrency), "--seed", str(seed), "--ignore-eos", "--disable-tqdm",
        "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
    ])
    with contextlib.redirect_stdout(io.StringIO()):
        result = main(args)
    # NOTE: the prefix-repetition dataset makes num_prompts // num_prefixes prompts per prefix
    # (3 prompts and 2 prefixes give 2), so "every request" is every one it sent, none failed
    if int(result.get("failed", 0)) or int(result.get("completed", 0)) < cfg.num_prefixes:
        raise RuntimeError(f"the benchmark against {url} completed {result.get('completed')} requests and "
                           f"{result.get('failed')} failed")
    return {k: float(result[k]) for k in METRICS}


def run_served_bench(cfg: ServedBenchConfig, progress: Callable[[str], None] | None = None) -> ServedBenchResult:
    from vllm.platforms import current_platform

    from omni_cache.harness.bench.provenance import load_average
    from omni_cache.harness.served.launch import (
        BUILTIN,
        builtin_model_dir,
        plain_server_command,
        serve_command,
    )
    from omni_cache.harness.served.process import ServerProcess, free_port

    say = progress or (lambda _line: None)
    t0 = time.perf_counter()
    result = ServedBenchResult(cfg, runs={s: [] for s in SETUPS}, load_average=[load_average()])
    if cfg.model not in BUILTIN:
        raise ValueError(f"--served takes a built-in model ({', '.join(BUILTIN)}), got {cfg.model!r}")
    tokenizer = builtin_model_dir(cfg.model)
    servers: dict[str, ServerProcess] = {}
    # NOTE: the same reservation for all three: vLLM reserves one more core where a KV connector is
    # configured, which on a small machine changes how many cores the model computes on
    result.reserved_cpus = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", str(cfg.reserved_cpus))
    bindings: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="omni-cache-served-bench-") as tmp:
        try:
            for setup in SETUPS:
                port = free_port()
                common = ["--port", str(port)]
                if setup == "cache":
                    argv, env = serve_command(cfg.model, common, delivery={"delivery_dir": f"{tmp}/files"},
                                              python=sys.executable)
                else:
                    argv, env = plain_server_command(cfg.model, common, prefix_caching=setup == "apc",
                                                     python=sys.executable)
                say(f"starting the {setup} server ({SETUPS[setup]})")
                servers[setup] = ServerProcess(argv, port=port, log_path=Path(tmp) / f"{setup}.log",
                                               env={**env, "VLLM_ENABLE_V1_MULTIPROCESSING": None,
                                                    "VLLM_CPU_NUM_OF_RESERVED_CPU": result.reserved_cpus,
                                                    "VLLM_LOGGING_LEVEL": "INFO"})  # the binding is an INFO line
                bindings[setup] = thread_binding_lines(servers[setup].log())
            if (current_platform.is_cpu() and not all(bindings.values())) \
                    or len({tuple(b) for b in bindings.values()}) != 1:
                raise RuntimeError("the three servers' CPU bindings are not the same, so their times do not compare: "
                                   + "; ".join(f"{s}: {', '.join(b) or 'no binding logged'}" for s, b in bindings.items()))
            result.thread_binding = bindings["cache"]
            order = list(SETUPS)
            for setup in order:  # a first run warms each server up (its prefixes never come back)
                say(f"warm-up: {setup}")
                _benchmark(servers[setup].url, cfg.model, tokenizer, cfg, seed=cfg.seed + 10_000)
            for repeat in range(cfg.repeats):
                for setup in order[repeat % 3:] + order[: repeat % 3]:  # rotate which goes first
                    say(f"repeat {repeat + 1}/{cfg.repeats}: {setup}")
                    result.runs[setup].append(_benchmark(servers[setup].url, cfg.model, tokenizer, cfg,
                                                         seed=cfg.seed + repeat))
        finally:
            for server in servers.values():
                server.stop()
    result.medians = {s: {k: statistics.median(r[k] for r in runs) for k in METRICS} for s, runs in result.runs.items()}
    result.seconds = time.perf_counter() - t0
    result.load_average.append(load_average())
    return result
