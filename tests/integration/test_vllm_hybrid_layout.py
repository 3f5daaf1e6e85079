"""Hybrid KV layouts on vLLM's real classes, without an engine (marker ``vllm``).

The gate on real ``KVCacheConfig`` / spec objects and a real ``VllmConfig``:
full attention beside sliding-window (or chunked-local) groups is accepted
with the full-attention group as ``output_group_id`` (the lowest id of
several); sliding-window only, chunked-local only, Mamba only and R-SWA are
refused with every group and its spec named. Slots: the cache's slots of the
output group equal vLLM's own ``slot_mapping`` from a real
``MultiGroupBlockTable`` (hybrid groups, the sliding ones holding the null
block), and from a real ``BlockTable`` of kernel blocks that vLLM's
``AttentionGroup.map_to_kernel_block_table`` split from 32-token blocks
(kernel block size 16); a packed kernel stride is refused.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_vllm_gate import base_kwargs  # noqa: F401  (fixture)
from vllm_support import require_vllm

from omni_cache.integration import BlockTableView
from omni_cache.integration.vllm_bridge import VllmRunnerBridge
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError

pytestmark = pytest.mark.vllm

BS = 32
KERNEL_BS = 16
MAX_REQS = 4


@pytest.fixture(scope="module")
def vllm_config(base_kwargs):  # noqa: F811  (the fixture imported from test_vllm_gate)
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**base_kwargs).create_engine_config()


@pytest.fixture(scope="module")
def cpu_kernels():
    """vLLM's CPU fallbacks of its Triton kernels (the CPU runner registers them at start)."""
    require_vllm()
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()


def _spec(kind: str):
    from vllm.v1 import kv_cache_interface as k

    common = dict(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32)
    return {
        "full": lambda: k.FullAttentionSpec(**common),
        "mla": lambda: k.MLAAttentionSpec(**{**common, "num_kv_heads": 1}),
        "sliding": lambda: k.SlidingWindowSpec(**common, sliding_window=64),
        "chunked": lambda: k.ChunkedLocalAttentionSpec(**common, attention_chunk_size=64),
        "rswa": lambda: k.RSWASpec(**common, rswa_window=64),
        "mamba": lambda: k.MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,)),
    }[kind]()


def _kv_config(*kinds: str):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], _spec(kind)) for i, kind in enumerate(kinds)]
    return KVCacheConfig(num_blocks=24, kv_cache_tensors=[], kv_cache_groups=groups)


def _gate(vllm_config, kv_cache_config):
    bridge = VllmRunnerBridge.from_vllm_config(vllm_config)
    bridge.on_kv_cache_initialized(vllm_config, kv_cache_config)
    return bridge.hooks.config


@pytest.mark.parametrize(("kinds", "group"), [
    (("sliding", "sliding", "sliding", "full"), 3),  # the tiny Gemma 3's layout
    (("full", "sliding"), 0),
    (("sliding", "full", "mla"), 1),  # several full-attention groups: the lowest id
    (("chunked", "full"), 1),
])
def test_the_gate_addresses_a_hybrid_layout_by_its_full_attention_group(vllm_config, kinds, group) -> None:
    config = _gate(vllm_config, _kv_config(*kinds))
    assert config is not None and (config.output_group_id, config.block_size, config.num_blocks) == (group, BS, 24)


@pytest.mark.parametrize("kinds", [("sliding",), ("sliding", "sliding"), ("chunked",), ("rswa",), ("mamba",),
                                   ("sliding", "rswa")])
def test_the_gate_refuses_a_layout_without_a_full_attention_group(vllm_config, kinds) -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="none is a prefix-cacheable full-attention group") as info:
        _gate(vllm_config, _kv_config(*kinds))
    message = str(info.value)
    assert "cannot run on this stage" in message and f"{len(kinds)} KV-cache group(s)" in message
    for i, group in enumerate(_kv_config(*kinds).kv_cache_groups):
        assert f"group {i}: {type(group.kv_cache_spec).__name__}(block_size={BS}" in message


# ------------------------------------------------------------------ slots against vLLM's slot mapping
def _vllm_slot_mapping(block_table, rows: list[tuple[int, int]]) -> torch.Tensor:
    """vLLM's own ``BlockTable.compute_slot_mapping`` for rows ``(start, end)`` (batch order)."""
    block_table.block_table.gpu = block_table.block_table.cpu  # a CPU "device", as the CPU runner aliases it
    block_table.slot_mapping.gpu = block_table.slot_mapping.cpu
    block_table.commit_block_table(len(rows))
    counts = [end - start for start, end in rows]
    query_start_loc = torch.tensor(np.cumsum([0, *counts]), dtype=torch.int32)
    positions = torch.cat([torch.arange(start, end, dtype=torch.int64) for start, end in rows])
    block_table.compute_slot_mapping(len(rows), query_start_loc, positions)
    return block_table.slot_mapping.cpu[: positions.numel()].clone()


def _batch(block_table, computed: list[int]) -> SimpleNamespace:
    """The fields ``BlockTableView.from_input_batch`` reads of vLLM's ``InputBatch``."""
    ids = [f"r{i}" for i in range(len(computed))]
    return SimpleNamespace(req_ids=ids, num_reqs=len(ids), num_computed_tokens_cpu=np.array(computed),
                           block_table=block_table)


# Two requests: manager blocks per group; the sliding groups hold the null block 0 outside the window.
SLIDING_ROWS = ([0, 0, 7, 8, 13], [0, 12, 14])
FULL_ROWS = ([3, 5, 9, 2, 6], [11, 4, 10])
SPANS = [(120, 150), (40, 96)]  # this step's positions [start, end) of each request


def test_the_output_groups_slots_are_vllms_slot_mapping(cpu_kernels) -> None:
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    table = MultiGroupBlockTable(max_num_reqs=MAX_REQS, max_num_batched_tokens=256, pin_memory=False,
                                 device=torch.device("cpu"), block_sizes=[BS] * 4, max_num_blocks=[16] * 4)
    for row, (sliding, full) in enumerate(zip(SLIDING_ROWS, FULL_ROWS, strict=True)):
        table.add_row((sliding, sliding, sliding, full), row)
    batch = _batch(table, [start for start, _ in SPANS])
    view = BlockTableView.from_input_batch(batch, block_size=BS, kv_cache_group_id=3)
    ours = view.slots_for_spans([(f"r{i}", s, e) for i, (s, e) in enumerate(SPANS)])
    theirs = _vllm_slot_mapping(table[3], SPANS)
    assert torch.equal(ours, theirs)
    assert view.blocks_of("r0") == tuple(FULL_ROWS[0])
    # A sliding group's slots are other slots (the null block's among them): the group choice matters.
    sliding = BlockTableView.from_input_batch(batch, block_size=BS, kv_cache_group_id=0)
    assert not torch.equal(sliding.slots_for_spans([("r1", 0, 64)]), view.slots_for_spans([("r1", 0, 64)]))


def _kernel_group(stride: int = 0):
    """vLLM's ``AttentionGroup`` for a 32-token group whose backend needs 16-token kernel blocks."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.worker.utils import AttentionGroup

    k = BS // KERNEL_BS
    group = AttentionGroup(CPUAttentionBackend, ["model.layers.3.self_attn.attn"], _spec("full"), 3,
                           kernel_block_size=KERNEL_BS, kernel_block_stride=stride)
    group.kernel_block_table = torch.zeros(1, MAX_REQS, 16 * k, dtype=torch.int32)
    group.kernel_block_offsets = torch.arange(k, dtype=torch.int32)
    return group


def _kernel_table(group):
    """A real ``BlockTable`` of kernel blocks: vLLM's mapping of the manager rows ``FULL_ROWS``."""
    from vllm.v1.worker.block_table import BlockTable

    manager = torch.zeros(len(FULL_ROWS), 16, dtype=torch.int32)
    for row, blocks in enumerate(FULL_ROWS):
        manager[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    mapped = group.map_to_kernel_block_table(manager)
    table = BlockTable(KERNEL_BS, MAX_REQS, 32, 256, False, torch.device("cpu"), 1)
    k = BS // KERNEL_BS
    for row, blocks in enumerate(FULL_ROWS):
        table.add_row(mapped[row, : len(blocks) * k].tolist(), row)
    return table


def test_kernel_blocks_split_from_the_managers_give_vllms_slots(cpu_kernels) -> None:
    from vllm.v1.worker.block_table import BlockTable

    table = _kernel_table(_kernel_group())
    assert table.block_size == KERNEL_BS and table.num_blocks_per_row[0] == 2 * len(FULL_ROWS[0])
    view = BlockTableView.from_input_batch(_batch([table], [start for start, _ in SPANS]), block_size=BS)
    assert view.kernel_blocks_per_block == 2 and view.blocks_of("r1") == tuple(FULL_ROWS[1])
    ours = view.slots_for_spans([(f"r{i}", s, e) for i, (s, e) in enumerate(SPANS)])
    assert torch.equal(ours, _vllm_slot_mapping(table, SPANS))  # vLLM's slot mapping at the kernel block size
    manager = BlockTable(BS, MAX_REQS, 16, 256, False, torch.device("cpu"), 1)
    for row, blocks in enumerate(FULL_ROWS):
        manager.add_row(blocks, row)
    assert torch.equal(ours, _vllm_slot_mapping(manager, SPANS))  # ... is the manager's slot space


def test_a_packed_kernel_stride_is_refused(cpu_kernels) -> None:
    table = _kernel_table(_kernel_group(stride=3))  # kernel block j of block b is b*3 + j: not the manager's slots
    with pytest.raises(ValueError, match="does not hold each 32-token block b as kernel blocks b\\*2"):
        BlockTableView.from_input_batch(_batch([table], [0, 0]), block_size=BS)
