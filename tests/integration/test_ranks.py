"""Rank gating without vLLM: the cache lives on the output rank only.

vLLM returns a step's output from TP rank 0 of the last pipeline stage; the
hooks build a manager there and nowhere else (every other rank allocates
nothing: no pool, no staging, no copies), unless ``all_tp_ranks`` keeps one on
every TP rank of the last stage to check that they agree. Also: the host bytes
each rank reports, vLLM's output-rank index, the CPU thread binding and the
environment a multi-process engine needs.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fakes_vllm import NewRequestData, VllmConfig, kv_cache_config
from test_runner_hooks import BS, PROMPT, Model, SpyFactory, _run, _so

from omni_cache.integration import PrefixCacheRunnerHooks
from omni_cache.integration.ranks import (
    WorkerRank,
    cache_bytes,
    data_parallel_replica,
    output_rank_index,
    prepare_parallel_env,
    thread_binding,
    vllm_worker_rank,
)
from omni_cache.integration.vllm_bridge import VllmRunnerBridge

GRID = [WorkerRank(t, tp, p, pp) for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 3)) for p in range(pp)
        for t in range(tp)]


def _hooks(spy: SpyFactory, **kw: Any) -> PrefixCacheRunnerHooks:
    hooks = PrefixCacheRunnerHooks(manager_factory=spy, eager=True, **kw)
    hooks.on_model_loaded(Model())
    hooks.on_kv_cache_initialized(VllmConfig(), kv_cache_config(16, BS))
    return hooks


def _step(hooks: PrefixCacheRunnerHooks) -> int | None:
    return _run(hooks, _so(NewRequestData("r", PROMPT, ([1, 2, 3],), 0)))


@pytest.mark.parametrize("rank", GRID, ids=str)
def test_only_the_output_rank_builds_a_manager_and_holds_bytes(rank: WorkerRank) -> None:
    spy = SpyFactory()
    hooks = _hooks(spy, rank=rank)
    step_id = _step(hooks)
    stats = hooks.rank_stats()
    assert stats["tp_rank"] == rank.tp_rank and stats["pp_rank"] == rank.pp_rank
    if rank.tp_rank == 0 and rank.pp_rank == rank.pp_size - 1:
        assert step_id is not None and len(spy.managers) == 1 and hooks.manager is not None
        assert stats["holds_cache"] and stats["output_rank"]
        assert stats["pool_bytes"] > 0 and stats["staging_bytes"] > 0
        assert stats["host_bytes"] == stats["pool_bytes"] + stats["staging_bytes"]
        assert hooks.stats()["manager"]["pool_bytes"] and hooks.stats()["host_bytes"] == stats["host_bytes"]
        hooks.materialize(step_id)
    else:
        # No manager, no call into one, nothing allocated: the hooks are no-ops here.
        assert step_id is None and spy.managers == [] and spy.calls == [] and hooks.manager is None
        assert not stats["holds_cache"] and stats["host_bytes"] == 0
        assert hooks.stats()["manager"] is None


@pytest.mark.parametrize("rank", [r for r in GRID if r.is_last_pp_stage], ids=str)
def test_all_tp_ranks_keeps_a_cache_on_every_tp_rank_of_the_last_stage(rank: WorkerRank) -> None:
    spy = SpyFactory()
    hooks = _hooks(spy, rank=rank, all_tp_ranks=True)
    step_id = _step(hooks)
    assert step_id is not None and len(spy.managers) == 1
    assert hooks.rank_stats()["host_bytes"] > 0
    hooks.materialize(step_id)


def test_all_tp_ranks_never_puts_a_cache_on_an_earlier_stage() -> None:
    spy = SpyFactory()
    hooks = _hooks(spy, rank=WorkerRank(1, 2, 0, 2), all_tp_ranks=True)
    assert _step(hooks) is None and spy.managers == []


def test_the_rank_is_asked_once_lazily_and_must_be_a_worker_rank() -> None:
    asked: list[int] = []

    def rank() -> WorkerRank:
        asked.append(1)
        return WorkerRank(1, 2, 0, 1)

    spy = SpyFactory()
    hooks = _hooks(spy, rank=rank)
    assert asked == []
    for _ in range(3):
        assert _step(hooks) is None
    assert asked == [1] and spy.managers == []
    bad = _hooks(SpyFactory(), rank=lambda: (0, 1))  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError, match="WorkerRank"):
        _step(bad)


def test_the_bridge_setting_keeps_a_cache_on_every_tp_rank() -> None:
    assert VllmRunnerBridge({"all_tp_ranks": True}).hooks.all_tp_ranks
    assert not VllmRunnerBridge({}).hooks.all_tp_ranks


def test_vllm_worker_rank_reads_both_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("vllm.distributed.parallel_state")
    fake.get_tp_group = lambda: types.SimpleNamespace(rank_in_group=1, world_size=2)  # type: ignore[attr-defined]
    fake.get_pp_group = lambda: types.SimpleNamespace(rank_in_group=2, world_size=3)  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.distributed"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", fake)
    assert vllm_worker_rank() == WorkerRank(1, 2, 2, 3)

    def uninitialized() -> Any:
        raise AssertionError("tensor model parallel group is not initialized")

    fake.get_tp_group = uninitialized  # type: ignore[attr-defined]
    assert vllm_worker_rank() == WorkerRank()


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2), (8, 4)])
def test_output_rank_index_is_vllms(tp: int, pp: int) -> None:
    # vLLM's MultiprocExecutor._get_output_rank: world_size - tensor_parallel_size.
    assert output_rank_index(tp, pp) == tp * pp - tp
    holders = [r for r in (WorkerRank(t, tp, p, pp) for p in range(pp) for t in range(tp)) if r.holds_cache()]
    assert [r.rank for r in holders] == [output_rank_index(tp, pp)]


def test_worker_rank_refuses_impossible_coordinates() -> None:
    with pytest.raises(ValueError, match="outside"):
        WorkerRank(2, 2, 0, 1)
    with pytest.raises(ValueError, match="sizes"):
        WorkerRank(0, 0, 0, 1)


def test_cache_bytes_of_no_manager_is_zero() -> None:
    assert cache_bytes(None) == {"pool_bytes": 0, "staging_bytes": 0, "host_bytes": 0}


@pytest.mark.parametrize(("world", "cpus", "want"), [
    (2, [0, 1], "0|1"), (2, [0, 1, 2, 3], "0,1|2,3"), (3, [0, 1, 2, 3], "0,1|2|3"),
    (4, [0, 1], "0|1|0|1"), (1, [5, 6], "5,6"), (2, [3, 1], "1|3"),
])
def test_thread_binding_gives_each_worker_its_cpus(world: int, cpus: list[int], want: str) -> None:
    assert thread_binding(world, cpus) == want


def test_prepare_parallel_env_binds_threads_and_keeps_a_users_binding() -> None:
    env: dict[str, str] = {}
    assert prepare_parallel_env(1, env) == {} and env == {}
    set_ = prepare_parallel_env(2, env)
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and env["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1
    assert set_ == env
    mine = {"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7"}
    prepare_parallel_env(2, mine)
    assert mine["VLLM_CPU_OMP_THREADS_BIND"] == "0-3|4-7"


@pytest.mark.parametrize(("config", "want"), [
    (None, 0),  # no parallel config at all
    (SimpleNamespace(), 0),  # neither attribute
    (SimpleNamespace(data_parallel_index=1, data_parallel_rank=0), 1),  # a dense model's replica (rank reset)
    (SimpleNamespace(data_parallel_index=2, data_parallel_rank=2), 2),  # a MoE model's replica
    (SimpleNamespace(data_parallel_rank=3), 3),  # a config without the index
    (SimpleNamespace(data_parallel_index=np.int64(1), data_parallel_rank=0), 1),  # a numpy integer
    (SimpleNamespace(data_parallel_index=True, data_parallel_rank=1), 1),  # a bool is no replica
    (SimpleNamespace(data_parallel_index="1", data_parallel_rank=0), 0),  # nor a string
    (SimpleNamespace(data_parallel_index=-1, data_parallel_rank=1), 1),  # nor a negative number
])
def test_the_data_parallel_replica_is_the_index_a_replica_keeps(config: object, want: int) -> None:
    assert data_parallel_replica(config) == want
