"""Model Runner V2 wiring on vLLM's real V2 data classes, on CPU (marker ``vllm``).

V2 (vLLM 0.32's default wherever Triton has a GPU backend) cannot run here, so
its per-step objects are built from vLLM's own classes: ``SchedulerOutput``,
``NewRequestData``, ``CachedRequestData`` and V2's ``InputBatch``
(``vllm.v1.worker.gpu.input_batch``), and the real ``BlockTables.append_block_ids``
of V2 runs on a ``BlockTables`` shell (its device buffers need pinned memory,
so only the attributes that method touches are set). The steps follow V2's
runner: a preempted request comes back through ``scheduled_new_reqs`` with its
prefix hit and ``overwrite=True`` blocks. The bridge must then serve the full
prefix (the "16 instead of 80 rows" case), read slots from the CPU mirror,
refuse a mirror that drifted from the runner's block counts, and pass finished
ids of a zero-token step through.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm_support import require_vllm

from omni_cache.integration.block_table import BlockTableView
from omni_cache.integration.vllm_bridge import VllmRunnerBridge
from omni_cache.runtime.interface import PrefixCacheConfig

pytestmark = pytest.mark.vllm
BS = 32
WIDTH = 4


@pytest.fixture(scope="module")
def v2():
    require_vllm()
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.input_batch import InputBatch

    return SimpleNamespace(SchedulerOutput=SchedulerOutput, NewRequestData=NewRequestData,
                           CachedRequestData=CachedRequestData, BlockTables=BlockTables, InputBatch=InputBatch)


def _block_tables(v2, max_reqs: int = 4, max_blocks: int = 8):
    bt = object.__new__(v2.BlockTables)  # the device buffers need pinned memory: set what append_block_ids uses
    bt.block_sizes = [BS]
    bt.num_kv_cache_groups = 1
    bt.num_blocks = SimpleNamespace(np=np.zeros((1, max_reqs), dtype=np.int32))
    staged: list[tuple[int, int, list[int]]] = []
    bt.block_tables = [SimpleNamespace(gpu=torch.zeros((max_reqs, max_blocks), dtype=torch.int32),
                                       stage_write=lambda i, s, x: staged.append((i, s, list(x))))]
    bt.staged = staged
    return bt


def _new(v2, rid, prompt_len, computed, blocks):
    return v2.NewRequestData(req_id=rid, prompt_token_ids=list(range(prompt_len)), mm_features=[],
                             sampling_params=None, pooling_params=None, block_ids=(list(blocks),),
                             num_computed_tokens=computed, lora_request=None)


def _so(v2, new=(), cached=(), scheduled=None, finished=(), preempted=None):
    ids = [c[0] for c in cached]
    cached_data = v2.CachedRequestData(
        req_ids=ids, resumed_req_ids=set(), new_token_ids=[[] for _ in ids], all_token_ids={},
        new_block_ids=[c[2] for c in cached], num_computed_tokens=[c[1] for c in cached],
        num_output_tokens=[0 for _ in ids])
    scheduled = dict(scheduled or {})
    return v2.SchedulerOutput(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached_data, num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()), scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, num_common_prefix_blocks=[0], finished_req_ids=set(finished),
        free_encoder_mm_hashes=[], preempted_req_ids=None if preempted is None else set(preempted))


def _input_batch(v2, order, state_of, computed, scheduled):
    """V2's InputBatch for a step: the fields the view reads, real; the rest unset."""
    required = {f.name: None for f in dataclasses.fields(v2.InputBatch)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    positions = [p for rid in order for p in range(computed[rid], computed[rid] + scheduled[rid])]
    return v2.InputBatch(**{**required, **dict(
        req_ids=list(order), num_reqs=len(order),
        idx_mapping_np=np.array([state_of[r] for r in order], dtype=np.intp),
        num_computed_tokens_np=np.array([computed[r] for r in order], dtype=np.int32),
        num_scheduled_tokens=np.array([scheduled[r] for r in order], dtype=np.int32),
        num_tokens=len(positions), num_tokens_after_padding=len(positions),
        positions=torch.tensor(positions, dtype=torch.int64),
        input_ids=torch.zeros(len(positions), dtype=torch.int32))})


def _rows(order, computed, scheduled, salt=0.0):
    """Hidden rows that name their request and position."""
    rows = [[float(ord(rid[0])), float(p), salt, 1.0] for rid in order
            for p in range(computed[rid], computed[rid] + scheduled[rid])]
    return torch.tensor(rows, dtype=torch.float32)


class _Runner:
    """What V2's runner does around the bridge: block-table updates, then the forward."""

    def __init__(self, v2, bridge):
        self.v2, self.bridge = v2, bridge
        self.block_tables = _block_tables(v2)
        bridge.install_v2_block_mirror(self.block_tables)
        self.state_of: dict[str, int] = {}

    def step(self, so, order, computed, salt=0.0):
        self.bridge.begin_step(so)  # first, before V2's finish_requests / add_requests
        for new in so.scheduled_new_reqs:  # V2 add_requests: overwrite the row
            idx = self.state_of.setdefault(new.req_id, len(self.state_of))
            self.block_tables.append_block_ids(idx, new.block_ids, overwrite=True)
        cached = so.scheduled_cached_reqs
        for rid, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):  # V2 update_requests
            if blocks is not None:
                self.block_tables.append_block_ids(self.state_of[rid], blocks, overwrite=False)
        if so.total_num_scheduled_tokens == 0:
            return None
        sched = so.num_scheduled_tokens
        batch = _input_batch(self.v2, order, self.state_of, computed, sched)
        return self.bridge.after_forward_v2(self, batch, _rows(order, computed, sched, salt))


def _bridge():
    bridge = VllmRunnerBridge({"consumer": "queue"})
    bridge.hooks.configure(PrefixCacheConfig(num_blocks=16, block_size=BS, staging_capacity_tokens=256))
    bridge.on_model_loaded(SimpleNamespace())
    return bridge


def test_a_preempted_request_back_through_new_reqs_gets_its_full_prefix(v2) -> None:
    bridge = _bridge()
    runner = _Runner(v2, bridge)
    # step 1: A's 80-token prompt on blocks 1, 2, 3
    s1 = runner.step(_so(v2, new=[_new(v2, "A", 80, 0, [1, 2, 3])], scheduled={"A": 80}), ["A"], {"A": 0})
    first = bridge.hooks.materialize(s1).hidden_states["A"]
    assert first.shape[0] == 80
    # step 2: A is preempted (its blocks stay cached in the prefix cache), nothing scheduled
    s2 = runner.step(_so(v2, preempted={"A"}), [], {})
    assert s2 is None
    # step 3: A comes back through scheduled_new_reqs with a 64-token hit on blocks 1, 2 and a new block 5
    so3 = _so(v2, new=[_new(v2, "A", 80, 64, [1, 2, 5])], scheduled={"A": 17})
    s3 = runner.step(so3, ["A"], {"A": 64}, salt=3.0)
    out = bridge.hooks.materialize(s3).hidden_states["A"]
    assert out.shape[0] == 81, "the resumed request must get its full prefix, not only this step's 17 rows"
    assert torch.equal(out[:64], first[:64])  # the hit rows, from the cache
    assert torch.equal(out[64:, 1], torch.arange(64, 81, dtype=torch.float32)) and bool((out[64:, 2] == 3.0).all())
    assert bridge.shutdown() == {}


def test_the_v2_view_reads_slots_from_the_cpu_mirror(v2) -> None:
    bridge = _bridge()
    runner = _Runner(v2, bridge)
    bt = runner.block_tables
    so = _so(v2, new=[_new(v2, "A", 40, 0, [7, 3]), _new(v2, "B", 10, 0, [9])], scheduled={"A": 40, "B": 10})
    sid = runner.step(so, ["B", "A"], {"A": 0, "B": 0})
    assert [w[2] for w in bt.staged] == [[7, 3], [9]]  # vLLM's own append_block_ids ran
    batch = _input_batch(v2, ["B", "A"], runner.state_of, {"A": 32, "B": 8}, {"A": 8, "B": 2})
    view = bridge.v2_mirror.view(batch, block_size=BS)
    expect = [9 * BS + p for p in (8, 9)] + [3 * BS + p % BS for p in range(32, 40)]
    assert view.slots_for_spans([("B", 8, 10), ("A", 32, 40)]).tolist() == expect
    bt.num_blocks.np[0, runner.state_of["A"]] = 5  # a row changed behind the mirror's back
    with pytest.raises(RuntimeError, match="differ from the runner's"):
        bridge.v2_mirror.view(batch, block_size=BS)
    with pytest.raises(ValueError, match="block size mismatch"):
        BlockTableView.from_v2_input_batch(batch, bridge.v2_mirror.table, bridge.v2_mirror.counts,
                                           table_block_size=24, block_size=BS)
    bridge.hooks.discard(sid)
    assert bridge.shutdown() == {}


def test_a_mirror_that_drifted_fails_a_served_cache_not_the_engine(v2) -> None:
    """Served (a worker-side consumer), the mirror's refusal of a row changed behind its back is
    contained: the step's rows are not saved, the cache fails for good naming it, nothing raises."""
    bridge = VllmRunnerBridge({"consumer": "discard"})
    bridge.hooks.configure(PrefixCacheConfig(num_blocks=16, block_size=BS, staging_capacity_tokens=256))
    bridge.on_model_loaded(SimpleNamespace())
    assert bridge.resolve_consumer(None) == "discard" and bridge.contained
    runner = _Runner(v2, bridge)
    runner.step(_so(v2, new=[_new(v2, "A", 40, 0, [7, 3])], scheduled={"A": 40}), ["A"], {"A": 0})
    runner.block_tables.num_blocks.np[0, runner.state_of["A"]] = 5  # a row changed behind the mirror's back
    so = _so(v2, cached=[("A", 40, None)], scheduled={"A": 1})
    assert runner.step(so, ["A"], {"A": 40}) is None  # no exception reaches the engine
    assert bridge.failed is not None and "its block-table view failed: RuntimeError" in bridge.failed
    assert bridge.shutdown() == {}


@pytest.mark.parametrize("where", ["save", "consume"])
def test_any_fault_of_the_cache_fails_a_served_cache_not_the_engine(v2, where: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Served, a fault of any kind in the cache's own calls (here a RuntimeError, as torch raises:
    not a contract error) is contained like a contract error: the cache fails for good naming it and
    nothing reaches the engine."""
    from omni_cache.runtime.manager import OmniPrefixCacheManager

    bridge = VllmRunnerBridge({"consumer": "discard"})
    bridge.hooks.configure(PrefixCacheConfig(num_blocks=16, block_size=BS, staging_capacity_tokens=256))
    bridge.on_model_loaded(SimpleNamespace())
    assert bridge.resolve_consumer(None) == "discard" and bridge.contained
    runner = _Runner(v2, bridge)

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("an internal fault of the cache")

    target = bridge.hooks if where == "save" else OmniPrefixCacheManager
    monkeypatch.setattr(target, "after_forward" if where == "save" else "discard_step", boom)
    runner.step(_so(v2, new=[_new(v2, "A", 40, 0, [7, 3])], scheduled={"A": 40}), ["A"], {"A": 0})  # no raise
    monkeypatch.undo()
    assert bridge.failed is not None and "RuntimeError: an internal fault of the cache" in bridge.failed
    assert sum(bridge.errors.counts().values()) == 1
    unconsumed = bridge.shutdown()
    assert len(unconsumed) == (1 if where == "consume" else 0)  # the fault kept that step id from its consume


def test_a_zero_token_step_still_passes_finished_ids(v2) -> None:
    bridge = _bridge()
    runner = _Runner(v2, bridge)
    s1 = runner.step(_so(v2, new=[_new(v2, "A", 40, 0, [1, 2])], scheduled={"A": 40}), ["A"], {"A": 0})
    bridge.hooks.materialize(s1)
    assert bridge.hooks.manager.stats()["live_requests"] == 1
    assert runner.step(_so(v2, finished={"A"}), [], {}) is None  # zero tokens scheduled, A aborted
    assert bridge.hooks.manager.stats()["live_requests"] == 0  # the manager saw A end
    bridge.shutdown()


def _hybrid_new(v2, rid, prompt_len, computed, sliding, full):
    return dataclasses.replace(_new(v2, rid, prompt_len, computed, full), block_ids=(list(sliding), list(full)))


def test_a_hybrid_layout_mirrors_and_serves_the_output_group(v2) -> None:
    """Two KV-cache groups (0: sliding window, its early blocks the null block 0; 1: full
    attention): the mirror holds group 1, slots and hits are group 1's."""
    bridge = VllmRunnerBridge({"consumer": "queue"})
    bridge.hooks.configure(PrefixCacheConfig(num_blocks=16, block_size=BS, staging_capacity_tokens=256,
                                             output_group_id=1))
    bridge.on_model_loaded(SimpleNamespace())
    bt = _block_tables(v2)
    bt.block_sizes, bt.num_kv_cache_groups = [BS, BS], 2
    bt.num_blocks = SimpleNamespace(np=np.zeros((2, 4), dtype=np.int32))
    bt.block_tables = bt.block_tables * 2
    runner = _Runner.__new__(_Runner)
    runner.v2, runner.bridge, runner.block_tables, runner.state_of = v2, bridge, bt, {}
    mirror = bridge.install_v2_block_mirror(bt)
    assert mirror.group_id == 1
    s1 = runner.step(_so(v2, new=[_hybrid_new(v2, "A", 80, 0, [7, 8, 9], [1, 2, 3])], scheduled={"A": 80}),
                     ["A"], {"A": 0}, salt=1.0)
    first = bridge.hooks.materialize(s1).hidden_states["A"]
    assert mirror.table[0, :3].tolist() == [1, 2, 3]  # the full-attention group's row
    so2 = _so(v2, new=[_hybrid_new(v2, "B", 80, 64, [0, 0, 10], [1, 2, 5])], scheduled={"B": 16})
    s2 = runner.step(so2, ["B"], {"B": 64}, salt=2.0)
    out = bridge.hooks.materialize(s2).hidden_states["B"]
    assert out.shape[0] == 80 and torch.equal(out[:64], first[:64])  # the hit, from group 1's blocks 1, 2
    batch = _input_batch(v2, ["B"], runner.state_of, {"B": 64}, {"B": 16})
    assert mirror.view(batch, block_size=BS).slots_for_spans([("B", 64, 80)]).tolist() == [5 * BS + p for p in range(16)]
    assert bridge.shutdown() == {}
