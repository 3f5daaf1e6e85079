"""The cache in a real vLLM engine with a hybrid KV layout (marker ``vllm``; one engine per module).

The tiny Gemma 3 text model of ``--model hybrid`` (three sliding-window layers,
window 64, one full-attention layer, dummy weights) runs with vLLM's hybrid
KV-cache manager on: four KV-cache groups, rows addressed by the
full-attention group 3. Here: a miss, a miss under the default retention
interval, then hits (shared prefix, exact repeat), every served row bit-exact
(check (a)) and every prompt equal to its recomputation (check (b)); the CLI's
JSON with ``kv_groups`` above 1 and hits; the cache addressed by a
sliding-window group instead is caught; a sliding-window-only model is refused
at engine start, before any step.
"""

from __future__ import annotations

import json
import random

import pytest
from vllm_support import engine_start_in_subprocess, require_vllm, shutdown_llm

from omni_cache.cli import main
from omni_cache.harness.vllm_engine.engine import VllmSimConfig, VllmSimulation, stdout_to_stderr
from omni_cache.harness.vllm_engine.workload import PlannedRequest
from omni_cache.integration import config_gate
from omni_cache.integration.kv_groups import OutputGroup

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm():
    require_vllm()
    with stdout_to_stderr():
        engine = VllmSimulation(VllmSimConfig(model="hybrid", kv_blocks=24)).build_llm()
    yield engine
    shutdown_llm(engine)


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def _plan() -> list[PlannedRequest]:
    system = _tokens(0, 128)
    a = system + _tokens(1, 40)
    return [PlannedRequest("A", tuple(a), 4, 0),
            PlannedRequest("B", tuple(system + _tokens(2, 30)), 4, 6),
            PlannedRequest("C", tuple(system + _tokens(3, 50)), 4, 12),
            PlannedRequest("D", tuple(a), 4, 18)]  # an exact repeat of A


def _run(llm, plan=None, **config):
    sim = VllmSimulation(VllmSimConfig(preset="pressure", model="hybrid", **config), plan=plan or _plan())
    return sim, sim.run(llm)


def test_hybrid_layout_hits_are_served_from_the_full_attention_group(llm) -> None:
    sim, res = _run(llm)
    assert res.ok, [str(m) for m in res.mismatches[:5]]
    assert (res.kv_groups, res.output_group_id) == (4, 3)
    groups = sim.runner_of(llm).kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["SlidingWindowSpec"] * 3 + ["FullAttentionSpec"]
    assert res.hit_tokens == 128 + 160, res.hit_tokens  # C's shared prefix (B misses) and D's repeat
    assert res.served_from_cache == res.hit_tokens  # every hit row came from the cache, each checked by (a)
    assert res.recompute_requests == 4 and res.recompute_exact_rows == res.recompute_rows > 0


def test_the_cli_reports_kv_groups_and_hits(llm, monkeypatch, capsys) -> None:
    real_run = VllmSimulation.run
    monkeypatch.setattr(VllmSimulation, "run", lambda self, _llm=None: real_run(self, llm))
    assert main(["simulate", "--engine", "vllm", "--model", "hybrid", "--requests", "12", "--num-blocks", "24", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["model"] == "hybrid" and summary["num_mismatches"] == 0
    assert summary["kv_groups"] == 4 and summary["output_group_id"] == 3
    assert summary["hit_tokens"] > 0 and summary["served_from_cache_tokens"] == summary["hit_tokens"]


def test_rows_addressed_by_a_sliding_window_group_are_caught(llm, monkeypatch) -> None:
    """Group 0 frees its blocks outside the window (its hit blocks are the null block 0 there):
    a cache addressed by it cannot serve the prefix, and the run must say so."""
    monkeypatch.setattr(config_gate, "select_output_group",
                        lambda kv_cache_config: OutputGroup(0, 32, "SlidingWindowSpec", 4))
    _, res = _run(llm)
    assert res.output_group_id == 0
    assert not res.ok
    # The hits' first blocks in group 0 are the null block, named again for every position outside the
    # window: the cache refuses such a hit at the door (I5: a prefix's blocks are distinct), never serves zeros.
    assert any("block id 0 appears twice among its" in m.detail for m in res.mismatches), [str(m) for m in res.mismatches[:3]]


def test_a_sliding_window_only_model_is_refused_at_engine_start() -> None:
    setup = """
        import json, os
        from omni_cache.harness.vllm_engine.models import model_dir, sim_model
        model = sim_model("hybrid")
        path = model_dir("hybrid")
        config = dict(model.config, layer_types=["sliding_attention"] * 4)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
        """
    line = engine_start_in_subprocess(
        "engine_kwargs(path, kv_blocks=24, max_batched_tokens=256, max_model_len=512, "
        "kv_cache_memory_bytes=model.kv_cache_memory_bytes(24), **model.engine_options)", setup, whole_message=True)
    assert line.startswith("REFUSED OmniPrefixCacheUnmatchError steps 0"), line
    assert "none is a prefix-cacheable full-attention group" in line
    assert "group 0: SlidingWindowSpec(block_size=32, sliding_window=64)" in line


def test_the_readme_hybrid_command_runs_as_printed() -> None:
    """The README's ``omni-cache simulate --engine vllm --model hybrid --json``, exactly, in a fresh
    process: the ``mixed`` preset as the preset, so its promise applies (the engine must preempt; exit
    3 otherwise). The CLI test above runs its own sizes (``--requests``, ``--num-blocks``), where the
    promise does not apply: it passed while this command exited 3 (the pool then held the sliding
    windows of every running request with room to spare, and nothing was preempted)."""
    import os
    import subprocess
    import sys

    require_vllm()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "omni_cache.cli", "simulate", "--engine", "vllm", "--model", "hybrid",
                           "--json"], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    s = json.loads(proc.stdout)
    assert s["ok"] is True and s["num_mismatches"] == 0 and s["kv_groups"] == 4 and s["hit_tokens"] > 0
    assert s["preemptions"] > 0 and not s["incomplete"], s["incomplete"]
