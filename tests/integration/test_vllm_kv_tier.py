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
    # the blocks the tier run asked for itself, not its preset's
    assert s["kv_blocks"]["asked"] == s["config"]["kv_blocks"] == s["kv_blocks"]["engine"], s["kv_blocks"]


def test_a_tier_run_cut_by_the_steps_limit_is_incomplete_and_runs_no_second_phase() -> None:
    require_vllm()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "omni_cache.cli", "simulate", "--engine", "vllm",
                           "--kv-connector", "example", "--steps-limit", "5", "--json"], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]  # not 1: nothing mismatched
    s = json.loads(proc.stdout)
    assert s["num_mismatches"] == 0 and not s["ok"], s["mismatches"]
    assert s["incomplete"][0].startswith("--steps-limit 5 stopped the run after 5 engine steps"), s["incomplete"]
    assert "the second phase" in s["incomplete"][1] and len(s["incomplete"]) == 2, s["incomplete"]
    assert s["tier"]["tier_entries"] > 0 and s["tier_bytes"] > 0, s["tier"]  # read before shutdown closed the tier


def _tier_run(**kwargs):
    require_vllm()
    from omni_cache.harness.vllm_engine.engine import VllmSimConfig
    from omni_cache.harness.vllm_engine.tier_run import TierSimulation

    sim = TierSimulation(VllmSimConfig(kv_connector="example", seed=1), **kwargs)
    return sim, sim.run()


ENTRY = 32 * (128 + 8 + 16) * 4  # one block's rows: hidden 128, audio.codes 8, audio.embeds 16 (fp32)


def test_a_block_the_tier_cannot_restore_is_recomputed_and_every_row_served_exactly() -> None:
    """A 3-entry tier under the connector's larger store: blocks whose rows were evicted are
    reported to vLLM as failed KV loads (``get_block_ids_with_load_errors``); with
    ``kv_load_failure_policy="recompute"`` vLLM recomputes them, the forward computes their rows, and
    every served row is bit-exact (checks (a), (b), (c)); no "is not readable", no error."""
    sim, res = _tier_run(tier_bytes=3 * ENTRY, expect_load_failures=True, load_failure_policy="recompute")
    t = sim.tier_summary
    assert t["tier_evictions"] > 0 and t["tier_load_failures"] > 0, t
    assert res.ok, [m.detail for m in res.mismatches[:3]]
    assert not res.failed_requests and res.finished == len(sim.phase1) + len(sim.phase2)
    assert res.recompute_requests == res.finished and res.recompute_exact_rows == res.recompute_rows > 0


def test_with_the_fail_policy_only_the_request_fails_and_the_engine_keeps_serving() -> None:
    """The same tier with ``kv_load_failure_policy="fail"``: a request whose block the tier cannot
    restore ends with an error; every other request, and the later recomputation requests of check
    (b) on the same engine, are served exactly."""
    sim, res = _tier_run(tier_bytes=3 * ENTRY, expect_load_failures=True, load_failure_policy="fail")
    t = sim.tier_summary
    assert t["tier_load_failures"] > 0, t
    assert res.failed_requests and all(name.startswith("p2-") for name in res.failed_requests), res.failed_requests
    assert res.ok, [m.detail for m in res.mismatches[:3]]
    assert res.finished == len(sim.phase1) + len(sim.phase2) - len(res.failed_requests) > 0
    assert res.recompute_requests == res.finished and res.recompute_exact_rows == res.recompute_rows > 0


def test_the_safetensors_level_serves_what_memory_evicted(tmp_path) -> None:
    sim, res = _tier_run(tier_bytes=3 * ENTRY, tier_dir=str(tmp_path / "tier"))
    t = sim.tier_summary
    assert res.ok, [m.detail for m in res.mismatches[:3]]
    assert t["tier_spilled"] > 0 and t["tier_disk_hits"] > 0 and t["tier_load_failures"] == 0, t
    assert t["tier_hit_tokens"] == t["external_tokens"] > 0
    # the engine's shutdown ran the connector's: its spill subdirectory is gone, the user's directory stays
    assert (tmp_path / "tier").is_dir() and not list((tmp_path / "tier").iterdir())


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
