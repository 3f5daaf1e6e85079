"""The cache in a served tensor-parallel engine: ``omni-cache serve tiny-llama --tensor-parallel-size 2``.

Protects: with two worker processes, the output rank alone holds the cache and delivers (it alone
holds the files' locks: a second holder would block every reader), the outcome reaches each
response through vLLM's aggregation of the workers' connector output, and ``check-server`` finds
every file equal to the cache_salt recomputation, with prefix hits; the cache's series on
``/metrics`` come from the output rank alone: equal to its numbers (read through
``/collective_rpc``), never to the ranks' sum, and the other rank reports nothing. Real server
process on 127.0.0.1, real HTTP client, vLLM's reader.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from served_support import ServedEngine, metrics_matching_worker

pytestmark = pytest.mark.vllm


def test_a_tensor_parallel_server_delivers_every_file_from_the_output_rank(tmp_path: Path) -> None:
    server = ServedEngine(tmp_path, "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
                          "--shutdown-timeout", "60",  # the workers shut down (vLLM's 0 may kill them first)
                          name="tp2", env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        out = subprocess.run([sys.executable, "-m", "omni_cache.cli", "check-server", server.url, "--json",
                              "--families", "2", "--per-family", "2"], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        report = json.loads(out.stdout)
        assert report["ok"] and report["files_checked"] == report["requests"] == 8 and report["hit_requests"] > 0
        assert report["metrics"]["change"]["vllm:omni_cache_delivered_files_total"] == 16  # 8 + 8 truths, once
        scrape, workers = metrics_matching_worker(server.url, rank=0)
        output, other = workers
        assert output["output_rank"] and output["reports_metrics"] and output["manager"]["saved_rows"] > 0
        assert not other["output_rank"] and not other["reports_metrics"] and other["manager"] is None
        assert scrape.samples["vllm:omni_cache_delivered_files_total"] == output["delivery"]["files"] > 0
    finally:
        server.stop()
    log = server.log()
    assert log.count("0 unconsumed step ids") == 1, "exactly one rank (the output rank) holds the cache"
