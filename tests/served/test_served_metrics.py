"""The cache's metrics beside a wrapped KV connector's, in vLLM's multiprocess Prometheus registry.

Protects, on a real ``omni-cache serve tiny-llama`` process whose ``--kv-transfer-config`` is a
connector of the user's (``stats_example_connector.CountingExampleConnector``: vLLM's
``ExampleConnector``, loaded by module path, with stats and a Prometheus counter of its own),
run with ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM's multiprocess registry: metric values in files,
read back by prometheus_client's multiprocess collector): after requests whose KV the connector
saves, ``reset_prefix_cache`` and a request whose prefix KV comes back through the connector (so
the hidden-state tier restores its rows), ``/metrics`` shows the connector's own counter (equal
to the requests it saved) and every cache series (equal to the worker's numbers through
``/collective_rpc``, the tier's loads and restores equal to the blocks that came back), each
gauge once (no per-process series), and vLLM's stats log carries both connectors' stats (the
module-path child rebuilt by name in the API server).
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from pathlib import Path

import pytest
from served_support import ServedEngine, load, metrics_matching_worker, params, post_json

from omni_cache.harness.served.scrape import scrape_metrics
from omni_cache.integration.metrics import SERIES

pytestmark = pytest.mark.vllm

BS = 32
TESTS = Path(__file__).resolve().parents[1]


def _prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids of the byte-level tokenizer (3..258), different per seed."""
    return [3 + (seed * 7919 + i * 131) % 256 for i in range(n)]


def test_a_wrapped_connectors_metrics_and_the_caches_share_the_multiprocess_registry(tmp_path: Path) -> None:
    storage, registry_dir = tmp_path / "kv-store", tmp_path / "prometheus"
    registry_dir.mkdir()
    child = {"kv_connector": "CountingExampleConnector", "kv_connector_module_path": "stats_example_connector",
             "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    env = {"VLLM_SERVER_DEV_MODE": "1", "PROMETHEUS_MULTIPROC_DIR": str(registry_dir),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    server = ServedEngine(tmp_path, "--kv-transfer-config", json.dumps(child), env=env, name="wrapped")
    try:
        server.complete(_prompt(0, 40))  # the cache starts (and reports) with the engine's first step
        before, _ = metrics_matching_worker(server.url)
        first = [_prompt(s, 150) for s in (1, 2)]  # their KV goes to the store, their rows to the tier
        for prompt in first:
            load(params(server.complete(prompt))["hidden_states_path"])  # type: ignore[arg-type]
        post_json(server.url + "/reset_prefix_cache", {})  # the local prefix cache forgets them
        kept = first[0][: (len(first[0]) - 1) // BS * BS]  # what ExampleConnector stored and looks up
        back = server.complete(kept + _prompt(9, 10))  # type: ignore[arg-type]
        rows = load(params(back)["hidden_states_path"])["hidden_states"]
        assert rows.shape[0] == back["usage"]["prompt_tokens"] == len(kept) + 10
        after, (worker,) = metrics_matching_worker(server.url)
        change = after.delta(before)
        blocks = len(kept) // BS
        assert change["vllm:external_prefix_cache_hits_total"] == len(kept), "no KV came back through the connector"
        assert change["vllm:omni_cache_tier_loads_total"] == change["vllm:omni_cache_tier_restores_total"] == blocks
        assert change["vllm:omni_cache_tier_load_failures_total"] == 0
        assert change["vllm:omni_cache_tier_stores_total"] >= 2 * blocks
        assert change["vllm:omni_cache_hit_tokens_total"] >= len(kept)
        assert worker["tier"]["tier_restored_blocks"] == blocks and worker["reports_metrics"]
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        saved = re.search(r'^vllm:example_saved_requests_total\{[^}]*\} (\S+)$', text, re.M)
        assert saved is not None, "the wrapped connector's own metric is missing"
        assert float(saved.group(1)) == len(os.listdir(storage)) >= len(first)
        for series in SERIES:  # ours, once per engine: no per-process series in the multiprocess registry
            lines = [line for line in text.splitlines() if line.startswith(series.name + ("_total{" if
                     series.kind == "counter" else "_count{" if series.kind == "histogram" else "{"))]
            assert lines and not [line for line in lines if "pid=" in line], (series.name, lines)
            if series.kind == "gauge":
                assert len(lines) == 1, lines
        assert [p for p in os.listdir(registry_dir) if p.endswith(".db")], "vLLM did not use the multiprocess registry"
        deadline = time.monotonic() + 30  # vLLM's stats log (every 10 s) rebuilt both connectors' stats
        while not ("CountingExampleConnector=" in server.log() and "OmniKVConnector=" in server.log()):
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(1.0)
        assert "not logged" not in server.log() and server.healthy()
        assert scrape_metrics(server.url).available
    finally:
        server.stop()
