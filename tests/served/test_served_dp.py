"""The cache in a served data-parallel engine: ``omni-cache serve tiny-llama --data-parallel-size 2``.

Protects: each replica (its own engine core and worker, a dense model's replica run by vLLM as an
independent engine whose ``data_parallel_rank`` reads 0) claims the shared delivery directory
under its own name, so the second replica is not refused at start as "another running server";
both replicas deliver, ``check-server`` finds every file equal to the cache_salt recomputation,
with prefix hits; each replica's series on ``/metrics`` carries its engine label; at stop both
claims are given back. Real server process on 127.0.0.1, real HTTP client, vLLM's reader,
prometheus_client's parser.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from served_support import ServedEngine

from omni_cache.integration.delivery_files import CLAIM_NAME, claim_holder, claim_name

pytestmark = pytest.mark.vllm


def _delivered_per_engine(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {sample.labels["engine"]: sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == "vllm:omni_cache_delivered_files_total"}


def test_a_data_parallel_server_delivers_from_each_replica(tmp_path: Path) -> None:
    server = ServedEngine(tmp_path, "--data-parallel-size", "2", name="dp2")
    try:
        claims = sorted(p.name for p in server.delivery_dir.iterdir() if p.name.startswith(".omni-cache-server"))
        assert claims == sorted([CLAIM_NAME, claim_name(1)]), claims
        assert claim_holder(str(server.delivery_dir)) is not None
        out = subprocess.run([sys.executable, "-m", "omni_cache.cli", "check-server", server.url, "--json",
                              "--families", "2", "--per-family", "2"], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        report = json.loads(out.stdout)
        assert report["ok"] and report["files_checked"] == report["requests"] == 8 and report["hit_requests"] > 0
        per_engine = _delivered_per_engine(server.url)
        assert set(per_engine) == {"0", "1"} and min(per_engine.values()) > 0, per_engine
        assert sum(per_engine.values()) == 16, per_engine  # 8 checked + 8 truths, each delivered once
    finally:
        server.stop()
    # NOTE: no count of the workers' shutdown lines: vLLM's API server stops its engine cores with no
    # grace by default (force-killing a core still tearing down), so a replica may die before its log.
    assert claim_holder(str(server.delivery_dir)) is None, "a replica kept its claim after the server stopped"
