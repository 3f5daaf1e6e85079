"""``omni-cache pipeline`` with a tensor-parallel thinker, the hybrid-layout thinker and a KV connector (marker ``vllm``).

Each test runs the command as a user does, a fresh ``python -m omni_cache.cli``
process (a TP thinker's workers are spawned from it, so its entry-point guard
and its own environment preparation are exercised), on a short workload: the
talker's output with prefix caching on the thinker must equal prefix caching
off, both negative controls must be caught, every hit row must have gone
through the cache, and the numbers must add up (prefill with prefix caching plus
the hits is prefill without). With ``--tp 2`` only the output rank (TP rank 0)
holds the cache and host bytes; with ``--model hybrid`` the thinker has its four
KV-cache groups; with ``--kv-connector example`` the second run's prefixes come back
through ``ExampleConnector`` and the hidden-state tier, and the talker's output stays
identical. (``--pp 2`` runs the same code path with a second stage; it is measured in
docs/pipeline.md, not here, to keep CI's time.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_support import require_vllm

pytestmark = pytest.mark.vllm

FLAGS = ("--requests", "4", "--talker-tokens", "6")


def _pipeline(*flags: str, repeats: int = 1) -> dict[str, Any]:
    require_vllm()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    out = subprocess.run([sys.executable, "-m", "omni_cache.cli", "pipeline", *FLAGS, "--repeats", str(repeats),
                          *flags, "--json"],
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, (out.returncode, out.stdout[-3000:], out.stderr[-3000:])
    return json.loads(out.stdout)


def _assert_identical_and_accounted(s: dict[str, Any], repeats: int = 1) -> None:
    assert s["ok"] and s["exit_code"] == 0 and s["num_mismatches"] == 0, s["mismatches"]
    assert s["requests"] == 4 and s["talker_identical"] and s["identity"]["compared"] == 4 * repeats
    assert s["thinker_answers_identical"] == 4 * repeats and s["prompt_rows_max_rel_diff"] == 0.0
    assert s["controls_caught"] == 2 and s["controls"]["computed_rows_only"]["compared"] == s["hit_requests"] > 0
    assert s["hit_tokens"] > 0 and s["served_from_cache_tokens"] == s["hit_tokens"]
    assert s["rows_verified"] > s["hit_tokens"] and s["second_materialize_refused"]
    assert s["prefill_tokens_with_apc"] + s["hit_tokens"] == s["prefill_tokens_without_apc"]
    assert s["cache_cost"]["steps"] > 0 and s["cache_cost"]["forward_ms_per_step"] > 0


def test_a_tensor_parallel_thinker_hands_identical_rows_from_the_output_rank_only() -> None:
    """Two runs on the same workers: the second attaches a fresh cache to each worker (the first
    one's forward wrapper taken off again) and must be as clean and identical as the first."""
    s = _pipeline("--tp", "2", repeats=2)
    _assert_identical_and_accounted(s, repeats=2)
    assert (s["model"], s["tp"], s["pp"]) == ("llama", 2, 1)
    ranks = sorted(s["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1] and [r["output_rank"] for r in ranks] == [True, False]
    assert ranks[0]["holds_cache"] and ranks[0]["host_bytes"] > 0
    assert not ranks[1]["holds_cache"] and ranks[1]["host_bytes"] == 0


def test_the_hybrid_layout_thinker_hands_identical_rows() -> None:
    s = _pipeline("--model", "hybrid")
    _assert_identical_and_accounted(s)
    assert s["model"] == "hybrid" and s["kv_groups"] == 4 and s["ranks"] == []


def test_prefixes_back_through_the_kv_connector_hand_identical_rows() -> None:
    """Run 1 stores KV (ExampleConnector, on disk) and rows (the tier); run 2 starts from an emptied
    prefix cache and a fresh omni cache, so its prefixes are loaded through the connector: every
    token loaded is restored by the tier (checked row by row against the forward's rows by
    ``TierTruth``) and the talker's output of run 2 equals prefix caching off too."""
    s = _pipeline("--kv-connector", "example", repeats=2)
    _assert_identical_and_accounted(s, repeats=2)
    tier = s["tier"]
    assert s["kv_connector"] == "example" and s["tier_load_failures"] == 0 and tier["unstored_loads"] == 0
    assert s["tier_hit_tokens"] == tier["external_tokens"] > 0 and s["tier_bytes"] > 0


def test_the_connector_is_installed_only_while_its_own_engine_steps() -> None:
    """``kv_scope.scope_connector`` on a stand-in engine: vLLM's process-wide worker connector is
    taken away, set during the scoped engine's ``step``/``reset_prefix_cache`` and its core's
    ``shutdown`` only, and a second
    connector found installed there is refused."""
    require_vllm()
    import vllm.distributed.kv_transfer.kv_transfer_state as state
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    from omni_cache.harness.pipeline.kv_scope import scope_connector

    seen: list[object] = []
    engine = SimpleNamespace(step=lambda: seen.append(state._KV_CONNECTOR_AGENT),
                             reset_prefix_cache=lambda: seen.append(state._KV_CONNECTOR_AGENT) or True,
                             engine_core=SimpleNamespace(shutdown=lambda: seen.append(state._KV_CONNECTOR_AGENT)))
    connector, saved = object(), state._KV_CONNECTOR_AGENT
    try:
        with pytest.raises(RuntimeError, match="no worker-side KV connector"):
            state._KV_CONNECTOR_AGENT = None
            scope_connector(SimpleNamespace(llm_engine=engine))
        state._KV_CONNECTOR_AGENT = connector
        assert scope_connector(SimpleNamespace(llm_engine=engine)) is connector
        assert not has_kv_transfer_group()  # every other engine in the process steps without it
        engine.step()
        assert engine.reset_prefix_cache() is True and seen == [connector, connector]
        engine.engine_core.shutdown()  # the worker shuts its connector down: it must find it
        assert seen == [connector] * 3 and not has_kv_transfer_group()
        state._KV_CONNECTOR_AGENT = object()
        with pytest.raises(RuntimeError, match="another KV connector"):
            engine.step()
    finally:
        state._KV_CONNECTOR_AGENT = saved
