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

import pytest
from vllm_support import require_vllm

from omni_cache.integration.ranks import output_rank_index
from omni_cache.vllm_sim.engine import VllmSimConfig
from omni_cache.vllm_sim.parallel import ParallelVllmSimulation

pytestmark = pytest.mark.vllm

REQUESTS = 8  # mixed preset's first requests: shared system prompts (hits), a chunked prefill, a repeat, aborts


def _run(**kwargs):
    require_vllm()
    res = ParallelVllmSimulation(VllmSimConfig(preset="mixed", requests=REQUESTS, **kwargs)).run()
    assert res.ok, [str(m) for m in res.mismatches[:5]]
    assert not res.incomplete, res.incomplete
    assert res.hit_tokens > 0 and res.served_from_cache > 0 and res.rows_verified > 0
    assert res.recompute_requests == res.finished > 0 and res.recompute_exact_rows == res.recompute_rows > 0
    assert res.published == res.consumed > 0 and res.double_consume_refused and not res.unconsumed
    assert res.kv_blocks_engine == 48
    return res


def _ranks(res) -> dict[tuple[int, int], dict]:
    return {(r["tp_rank"], r["pp_rank"]): r for r in res.ranks}


def test_tp2_caches_on_the_output_rank_only() -> None:
    res = _run(tp=2)
    ranks = _ranks(res)
    assert set(ranks) == {(0, 0), (1, 0)} and output_rank_index(2, 1) == 0
    assert ranks[(0, 0)]["output_rank"] and ranks[(0, 0)]["holds_cache"] and ranks[(0, 0)]["host_bytes"] > 0
    assert not ranks[(1, 0)]["holds_cache"] and ranks[(1, 0)]["host_bytes"] == 0
    assert ranks[(1, 0)]["engine_steps"] == ranks[(0, 0)]["engine_steps"] == res.steps  # both ran every step


def test_tp2_check_ranks_compares_every_served_row() -> None:
    res = _run(tp=2, check_ranks=True)
    ranks = _ranks(res)
    assert ranks[(0, 0)]["host_bytes"] == ranks[(1, 0)]["host_bytes"] > 0
    # Every row check (a) verified on the output rank (hidden + 2 keys) was also equal on TP rank 1.
    assert res.rank_rows_compared >= res.rows_verified > 0


def test_pp2_in_eager_mode_serves_from_the_last_stage() -> None:
    res = _run(pp=2)
    ranks = _ranks(res)
    assert set(ranks) == {(0, 0), (0, 1)} and output_rank_index(1, 2) == 1
    first, last = ranks[(0, 0)], ranks[(0, 1)]
    assert last["output_rank"] and last["holds_cache"] and last["host_bytes"] > 0
    assert not first["holds_cache"] and first["host_bytes"] == 0 and first["engine_steps"] > 0
