"""The thinker on real vLLM worker processes (marker ``vllm``): TP=2 and PP=2.

Each test starts one engine with vLLM's ``mp`` executor: the engine core in
this process, two spawned workers running the project's worker class. The
runs are the ``simulate --engine vllm`` job with checks (a), (b), (c) on every
row the output rank served, and the rank facts: only the output rank (TP rank
0 of the last stage) holds a cache and host bytes; with ``check_ranks`` both
TP ranks hold one and every row they served is equal, bit for bit; with PP=2
in eager mode the first stage passes its steps through (it allocates nothing)
and the engine runs at all (the worker allocates the intermediate-tensors
buffer vLLM's skipped warm-up would have).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from vllm_support import require_vllm

from omni_cache.harness.vllm_engine.engine import VllmSimConfig
from omni_cache.harness.vllm_engine.parallel import ParallelVllmSimulation
from omni_cache.integration.ranks import output_rank_index

pytestmark = pytest.mark.vllm

REQUESTS = 8  # mixed preset's first requests: shared system prompts (hits), a chunked prefill, a repeat, aborts


def _cli(*flags: str) -> dict[str, Any]:
    """The command as a user runs it: a fresh ``python -m omni_cache.cli`` process (its workers are
    spawned from it, so its entry-point guard and its own environment preparation are exercised)."""
    require_vllm()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    out = subprocess.run([sys.executable, "-m", "omni_cache.cli", "simulate", "--engine", "vllm", *flags, "--json"],
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    s = json.loads(out.stdout)
    b, c = s["checks"]["b_recompute"], s["checks"]["c_step_ids"]
    assert s["ok"] and s["num_mismatches"] == 0 and not s["incomplete"]
    assert s["hit_tokens"] > 0 and s["served_from_cache_tokens"] > 0 and s["rows_verified"] > 0
    assert s["preemptions"] > 0  # the preset's promise, run as the preset
    assert b["requests"] == s["requests"]["finished"] > 0 and b["bit_identical_rows"] == b["rows"] > 0
    assert c["published"] == c["consumed"] > 0 and c["unconsumed_at_shutdown"] == 0 and c["second_materialize_refused"]
    assert s["kv_blocks"] == {"asked": 48, "engine": 48}
    return s


def _ranks(ranks: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    return {(r["tp_rank"], r["pp_rank"]): r for r in ranks}


def test_tp2_caches_on_the_output_rank_only() -> None:
    s = _cli("--tp", "2")
    ranks = _ranks(s["ranks"])
    assert set(ranks) == {(0, 0), (1, 0)} and output_rank_index(2, 1) == 0
    assert ranks[(0, 0)]["output_rank"] and ranks[(0, 0)]["holds_cache"] and ranks[(0, 0)]["host_bytes"] > 0
    assert not ranks[(1, 0)]["holds_cache"] and ranks[(1, 0)]["host_bytes"] == 0
    assert ranks[(1, 0)]["engine_steps"] == ranks[(0, 0)]["engine_steps"] == s["steps"]["run"]  # both ran every step


def test_pp2_in_eager_mode_serves_from_the_last_stage() -> None:
    s = _cli("--pp", "2")
    assert s["mode"] == "eager" and s["config"]["pp"] == 2
    ranks = _ranks(s["ranks"])
    assert set(ranks) == {(0, 0), (0, 1)} and output_rank_index(1, 2) == 1
    first, last = ranks[(0, 0)], ranks[(0, 1)]
    assert last["output_rank"] and last["holds_cache"] and last["host_bytes"] > 0
    assert not first["holds_cache"] and first["host_bytes"] == 0 and first["engine_steps"] > 0


def test_tp2_check_ranks_compares_every_served_row() -> None:
    require_vllm()
    res = ParallelVllmSimulation(VllmSimConfig(preset="mixed", requests=REQUESTS, tp=2, check_ranks=True)).run()
    assert res.ok, [str(m) for m in res.mismatches[:5]]
    assert res.hit_tokens > 0 and res.served_from_cache > 0 and res.recompute_exact_rows == res.recompute_rows > 0
    ranks = _ranks(res.ranks)
    assert ranks[(0, 0)]["host_bytes"] == ranks[(1, 0)]["host_bytes"] > 0
    # Every row check (a) verified on the output rank (hidden + 2 keys) was equal on TP rank 1 too.
    assert res.rank_rows_compared == res.rows_verified > 0
