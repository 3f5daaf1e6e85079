"""Hidden rows follow KV through a real vLLM KV connector (marker ``vllm``).

vLLM's ``ExampleConnector`` (disk store in a temp dir) runs under
``OmniKVConnector``; phase-2 prompts get their prefix KV back from it after
``reset_prefix_cache()``. Each run is a real engine (about 45 s on a 2-core box).
Check (a) models the tier from the forward's own rows (``TierTruth``), so a row
restored into the wrong slots or of another block fails it; check (b) compares
every full-prompt row with a recomputation that skips every prefix cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from vllm_support import require_vllm

pytestmark = pytest.mark.vllm


def test_simulate_kv_connector_example_serves_tier_hits_bit_exact() -> None:
    require_vllm()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "omni_cache.cli", "simulate", "--engine", "vllm",
                           "--kv-connector", "example", "--json"], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(proc.stdout)
    assert s["ok"] is True and s["num_mismatches"] == 0
    assert s["tier_hit_tokens"] > 0 and s["tier_hit_tokens"] == s["tier"]["external_tokens"]
    assert s["tier_load_failures"] == 0 and s["tier_bytes"] > 0
    b = s["checks"]["b_recompute"]
    assert b["requests"] == s["requests"]["finished"] == s["config"]["requests"]
    assert b["rows"] > 0 and b["bit_identical_rows"] == b["rows"]


def _tier_run(**kwargs):
    require_vllm()
    from omni_cache.harness.vllm_engine.engine import VllmSimConfig
    from omni_cache.harness.vllm_engine.tier_run import TierSimulation

    sim = TierSimulation(VllmSimConfig(kv_connector="example", seed=1), **kwargs)
    return sim, sim.run()


def test_a_block_the_tier_evicted_is_refused_never_served() -> None:
    entry = 32 * (128 + 8 + 16) * 4  # one block's rows: hidden 128, audio.codes 8, audio.embeds 16 (fp32)
    sim, res = _tier_run(tier_bytes=3 * entry, expect_load_failures=True)
    t = sim.tier_summary
    assert t["tier_evictions"] > 0 and t["tier_load_failures"] > 0, t
    assert res.mismatches, "an evicted block's hit was served"
    for m in res.mismatches:  # only the contract error: no wrong row, no zeros
        assert "is not readable" in m.detail and "hit rows are absent" in m.detail, m.detail


def test_the_safetensors_level_serves_what_memory_evicted(tmp_path) -> None:
    entry = 32 * (128 + 8 + 16) * 4
    sim, res = _tier_run(tier_bytes=3 * entry, tier_dir=str(tmp_path / "tier"))
    t = sim.tier_summary
    assert res.ok, [m.detail for m in res.mismatches[:3]]
    assert t["tier_spilled"] > 0 and t["tier_disk_hits"] > 0 and t["tier_load_failures"] == 0, t
    assert t["tier_hit_tokens"] == t["external_tokens"] > 0


def test_a_load_the_connector_reports_failed_is_recomputed_and_served_exactly() -> None:
    """The wrapped connector reports its first load's blocks in ``invalid_block_ids``: vLLM
    recomputes them (``kv_load_failure_policy="recompute"``), and every row still verifies."""
    require_vllm()
    from kv_fault_connector import FailingExampleConnector

    from omni_cache.harness.vllm_engine.engine import VllmSimConfig
    from omni_cache.harness.vllm_engine.tier_run import TierSimulation

    class FailingOnce(TierSimulation):
        def kv_transfer_config(self):  # type: ignore[no-untyped-def]
            config = super().kv_transfer_config()
            child = config["kv_connector_extra_config"]["connectors"][0]
            child.update(kv_connector="FailingExampleConnector", kv_connector_module_path="kv_fault_connector")
            return config

    FailingExampleConnector.reported.clear()
    sim = FailingOnce(VllmSimConfig(kv_connector="example"))
    res = sim.run()
    assert len(FailingExampleConnector.reported) == 1 and FailingExampleConnector.reported[0], "no load failed"
    assert res.ok, [m.detail for m in res.mismatches[:3]]
    t = sim.tier_summary
    assert t["tier_hit_tokens"] == t["external_tokens"] > 0 and t["tier_load_failures"] == 0
    assert res.recompute_exact_rows == res.recompute_rows > 0


def test_under_multi_connector_a_reloaded_block_is_served_with_exactly_its_own_rows() -> None:
    """``kv_connector="MultiConnector"`` whose ``connectors`` hold ``OmniKVConnector`` (wrapping
    ``ExampleConnector``): vLLM nests the wrapper's metadata in ``MultiKVConnectorMetadata``, and the
    tier plan is still applied, so every block whose KV came back through the connector is served
    with its own rows (check (a) models the tier; a previous tenant's row fails it)."""
    require_vllm()
    from omni_cache.harness.vllm_engine.engine import VllmSimConfig
    from omni_cache.harness.vllm_engine.tier_run import TierSimulation

    class UnderMulti(TierSimulation):
        def kv_transfer_config(self):  # type: ignore[no-untyped-def]
            wrapped = super().kv_transfer_config()
            return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"connectors": [wrapped]}}

    sim = UnderMulti(VllmSimConfig(kv_connector="example", seed=1))
    res = sim.run()
    assert res.ok, [m.detail for m in res.mismatches[:3]]
    t = sim.tier_summary
    assert t["tier_hit_tokens"] == t["external_tokens"] > 0 and t["tier_load_failures"] == 0, t
    assert res.recompute_exact_rows == res.recompute_rows > 0
