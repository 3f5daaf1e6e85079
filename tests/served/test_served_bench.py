"""``omni-cache bench --served``: the served three-way comparison runs end to end.

Protects: the benchmark starts the three real servers (prefix caching with the cache through
``omni-cache serve``, prefix caching off, prefix caching without the cache), drives each with
vLLM's own serving benchmark (``vllm.benchmarks.serve``, prefix-repetition), completes every
request, reports each setup's TTFT and throughput medians and the ratios computed from them, and
stops every server; the three engines compute on the same CPUs (vLLM reserves one more core for
its scheduler where a KV connector is configured, so without the bench's equal
``VLLM_CPU_NUM_OF_RESERVED_CPU`` the cache's server would compute on more cores than the others on a
small machine). Figures are not judged here (a shared 2-core machine); docs/performance.md has
the measured run. Also: ``--num-prompts`` without ``--served`` is refused before torch loads.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from vllm_support import require_vllm

from omni_cache.harness.bench.served import SETUPS, ServedBenchConfig, ServedBenchResult, thread_binding_lines


@pytest.mark.vllm
def test_the_served_comparison_runs_three_real_servers_with_vllms_benchmark() -> None:
    require_vllm()
    out = subprocess.run([sys.executable, "-m", "omni_cache.cli", "bench", "--served", "tiny-llama", "--repeats", "1",
                          "--num-prompts", "4", "--json"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    doc = json.loads(out.stdout)["served"]
    assert set(doc["medians"]) == set(SETUPS) and all(len(runs) == 1 for runs in doc["runs"].values())
    for setup in SETUPS:
        m = doc["medians"][setup]
        assert m["mean_ttft_ms"] > 0 and m["request_throughput"] > 0, (setup, m)
    # the same CPUs for the three engines, checked from each server's own log line
    assert doc["reserved_cpus"] == "1" and any("core ids=" in line for line in doc["thread_binding"]), doc
    r = doc["ratios"]
    m = doc["medians"]
    assert r["ttft_speedup"] == pytest.approx(m["off"]["mean_ttft_ms"] / m["cache"]["mean_ttft_ms"])
    assert r["cache_share_of_ttft"] == pytest.approx(
        (m["cache"]["mean_ttft_ms"] - m["apc"]["mean_ttft_ms"]) / m["cache"]["mean_ttft_ms"])


def test_the_ratios_are_the_medians_ratios() -> None:
    result = ServedBenchResult(ServedBenchConfig(), medians={
        "cache": {"mean_ttft_ms": 110.0, "request_throughput": 9.0},
        "off": {"mean_ttft_ms": 200.0, "request_throughput": 5.0},
        "apc": {"mean_ttft_ms": 100.0, "request_throughput": 10.0}})
    r = result.ratios()
    assert r["ttft_speedup"] == pytest.approx(200 / 110) and r["apc_alone_ttft_speedup"] == pytest.approx(2.0)
    assert r["kept_of_apc_ttft"] == pytest.approx((200 / 110) / 2.0)
    assert r["cache_share_of_ttft"] == pytest.approx(10 / 110)
    assert r["throughput_speedup"] == pytest.approx(1.8) and r["apc_alone_throughput_speedup"] == pytest.approx(2.0)


def test_num_prompts_without_served_is_refused_before_torch() -> None:
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "omni_cache.cli", "bench", "--num-prompts", "4"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--num-prompts goes with --served" in out.stderr
    assert "torch" not in {line.split("|")[-1].strip().split(".")[0] for line in out.stderr.splitlines()
                           if line.startswith("import time:")}


def test_the_binding_is_read_from_vllms_log_lines() -> None:
    """The lines vLLM's CPU backend logs at start (``ompmultiprocessing``), as a server writes them."""
    log = "\n".join([
        "(EngineCore pid=7865) INFO 12-05 15:15:59 [ompmultiprocessing.py:185] OpenMP thread binding info: ",
        "(EngineCore pid=7865) INFO 12-05 15:15:59 [ompmultiprocessing.py:185] \tlocal_world_size=2, reserve_cpu_num=1",
        "(EngineCore pid=7865) INFO 12-05 15:15:59 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]",
        "(EngineCore pid=7865) INFO 12-05 15:15:59 [ompmultiprocessing.py:185] \tlocal_rank=1, core ids=[2]",
        "(EngineCore pid=7865) INFO 12-05 15:15:59 [ompmultiprocessing.py:185] \treserved_cpus=[3]",
        "(APIServer pid=7850) INFO 12-05 15:16:02 [api_server.py:140] Starting vLLM server"])
    assert thread_binding_lines(log) == ["local_rank=0, core ids=[0, 1]", "local_rank=1, core ids=[2]",
                                         "reserved_cpus=[3]"]
    assert thread_binding_lines("(APIServer pid=1) INFO no binding here") == []
