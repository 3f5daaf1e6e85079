"""``worker_probe`` without vLLM: what a worker hands the driver.

A stand-in bridge (the probe only uses its ``step_ids`` queue, ``observer``,
``hooks.materialize`` / ``manager`` / ``rank_stats`` and ``shutdown``) shows
that the probe copies each forward record (the engine may reuse its buffers),
that every published step id is materialized once by the probe's consumer and
handed over once, that a materialize error is reported with its step, that
everything it hands over survives a pickle round trip (it crosses processes),
and that ``finish`` reports the exactly-once facts check (c) needs.
"""

from __future__ import annotations

import pickle
import queue
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omni_cache.harness.vllm_engine import worker_probe
from omni_cache.integration.vllm_bridge import ForwardRecord, PublishedStep
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.interface import StageCacheOutputs


class _Manager:
    def __init__(self) -> None:
        self.consumed: set[int] = set()

    def materialize(self, step_id: int, req_ids: Any) -> Any:
        if step_id in self.consumed:
            raise OmniPrefixCacheUnmatchError(f"step id {step_id} was already consumed")
        self.consumed.add(step_id)
        return StageCacheOutputs({"r": torch.full((2, 4), float(step_id))}, {})


class _Hooks:
    def __init__(self, *, output_rank: bool = True, fail: int | None = None) -> None:
        self.manager = _Manager()
        self.output_rank, self.fail = output_rank, fail

    def materialize(self, step_id: int) -> Any:
        if step_id == self.fail:
            raise OmniPrefixCacheUnmatchError(f"step id {step_id}: staging slot lost")
        return self.manager.materialize(step_id, ())

    def rank_stats(self) -> dict[str, Any]:
        return {"output_rank": self.output_rank, "host_bytes": 123 if self.output_rank else 0}


def _bridge(**kw: Any) -> SimpleNamespace:
    return SimpleNamespace(step_ids=queue.Queue(), hooks=_Hooks(**kw), mm_outputs_fn=None, observer=None,
                           engine_step=0, preemptions=0, zero_token_steps=0, shutdown=lambda: {})


def _worker(bridge: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(model_runner=SimpleNamespace(omni_cache=bridge, kv_cache_config=SimpleNamespace(num_blocks=48, kv_cache_groups=[object()])))


def _so() -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="r", num_computed_tokens=0, prompt=[1])],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[],
                                                                 resumed_req_ids=set(), new_block_ids=[]))


def _step(bridge: SimpleNamespace, step: int, hidden: torch.Tensor) -> None:
    bridge.engine_step = step
    rec = ForwardRecord(engine_step=step, step_id=step, req_ids=("r",), spans=(("r", 0, 2),), hidden_states=hidden,
                        input_ids=torch.tensor([5, 6]), positions=torch.tensor([0, 1]),
                        slot_mapping=torch.tensor([0, 1]), mm_outputs={}, block_ids={"r": (0,)},
                        scheduler_output=_so())
    bridge.observer(rec)
    bridge.step_ids.put(PublishedStep(step, step, ("r",), (("r", 0, 2),)))


def test_the_probe_hands_over_each_record_and_served_step_once() -> None:
    bridge = _bridge()
    worker = _worker(bridge)
    info = worker_probe.install(worker)
    assert info["num_blocks"] == 48 and info["kv_groups"] == 1
    assert bridge.mm_outputs_fn is worker_probe.derive_mm and bridge.observer is not None
    with pytest.raises(RuntimeError, match="already installed"):
        worker_probe.install(worker)
    buf = torch.zeros(2, 4)
    _step(bridge, 1, buf)
    buf.fill_(9.0)  # the engine reuses its buffer: the record must hold the rows as they were
    _step(bridge, 2, torch.ones(2, 4))
    first = pickle.loads(pickle.dumps(worker_probe.settle(worker)))  # crosses a process boundary
    assert [r.engine_step for r in first["records"]] == [1, 2]
    assert torch.equal(first["records"][0].hidden_states, torch.zeros(2, 4))
    assert first["records"][0].scheduler_output.scheduled_new_reqs[0].req_id == "r"
    assert [(s[0], s[1]) for s in first["served"]] == [(1, 1), (2, 2)] and first["errors"] == []
    assert torch.equal(first["served"][1][3].hidden_states["r"], torch.full((2, 4), 2.0))
    assert worker_probe.drain(worker) == {"served": [], "errors": [], "records": []}  # handed over once
    final = pickle.loads(pickle.dumps(worker_probe.finish(worker)))
    assert final["published"] == [1, 2] and final["consumed"] == {1: 1, 2: 1}
    assert final["double_consume_refused"] and final["unconsumed"] == {} and final["rank"]["host_bytes"] == 123
    assert not hasattr(bridge, worker_probe.ATTR)


def test_a_failed_materialize_is_reported_with_its_step() -> None:
    bridge = _bridge(fail=2)
    worker = _worker(bridge)
    worker_probe.install(worker)
    _step(bridge, 1, torch.zeros(2, 4))
    _step(bridge, 2, torch.zeros(2, 4))
    out = worker_probe.settle(worker)
    assert [s[1] for s in out["served"]] == [1]
    (err,) = out["errors"]
    assert err[:2] == (2, 2) and "staging slot lost" in err[2]
    assert worker_probe.finish(worker)["consumed"] == {1: 1, 2: 1}


def test_a_rank_that_is_not_the_output_rank_keeps_no_records() -> None:
    bridge = _bridge(output_rank=False)
    worker = _worker(bridge)
    worker_probe.install(worker)
    _step(bridge, 1, torch.zeros(2, 4))
    out = worker_probe.settle(worker)
    assert out["records"] == [] and [s[1] for s in out["served"]] == [1]
    assert worker_probe.stats(worker)["host_bytes"] == 0
    worker_probe.finish(worker)


def test_a_worker_without_the_cache_is_named() -> None:
    with pytest.raises(RuntimeError, match="no omni cache"):
        worker_probe.install(SimpleNamespace(model_runner=SimpleNamespace()))
