"""Fakes that mirror vLLM v1's field names, for testing the integration without vLLM.

Owns: stand-ins for ``vllm.v1.core.sched.output`` (``NewRequestData``,
``CachedRequestData``, ``SchedulerOutput``), the worker's ``BlockTable`` /
``MultiGroupBlockTable`` / ``InputBatch``, the config objects the gate reads
(``CacheConfig``, ``ModelConfig``, ``KVTransferConfig``, ``VllmConfig``,
``KVCacheConfig``, the ``*Spec`` classes) and the ground truth. The engine
fakes (scheduler, model runner) are in ``fakes_vllm_engine.py``.

Ground truth: the hidden row of position ``p`` of a request is a deterministic
function of the request's tokens ``[0, p]`` (``truth_rows``), and output
tokens are a deterministic function of the prompt (``token_at``), so two
requests that share a block-aligned prefix share those rows exactly -- which is
what makes a prefix hit sound. Supports I4-I9 checks in the integration tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

WIDTH = 4
_MOD = (1 << 31) - 1


# --------------------------------------------------------------------------- #
# Ground truth
# --------------------------------------------------------------------------- #


def token_at(prompt: Sequence[int], p: int) -> int:
    """Token at position ``p``: the prompt, then outputs derived from it."""
    if p < len(prompt):
        return int(prompt[p])
    k = p - len(prompt)
    return 1000 + (sum(prompt) * 31 + k * 7) % 997


def truth_rows(prompt: Sequence[int], start: int, end: int) -> torch.Tensor:
    """Hidden rows of positions ``[start, end)``: a rolling hash of tokens ``[0, p]``."""
    h = 0
    rows = []
    for p in range(end):
        h = (h * 1000003 + token_at(prompt, p) + 1) % _MOD
        if p >= start:
            rows.append([float(h % 4093), float(p), float((h // 4093) % 4091), float(token_at(prompt, p))])
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, WIDTH)


def truth_codes(prompt: Sequence[int], start: int, end: int) -> torch.Tensor:
    """A per-token mm tensor (e.g. audio codes): int64, 2 columns."""
    rows = truth_rows(prompt, start, end)
    return torch.stack([rows[:, 0].to(torch.int64) * 3 + 1, rows[:, 3].to(torch.int64)], dim=1)


# --------------------------------------------------------------------------- #
# vllm.v1.core.sched.output
# --------------------------------------------------------------------------- #


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int] | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    mm_features: list[Any] = field(default_factory=list)
    sampling_params: Any = None
    pooling_params: Any = None
    lora_request: Any = None


@dataclass
class CachedRequestData:
    req_ids: list[str]
    resumed_req_ids: set[str]
    new_token_ids: list[list[int]]
    all_token_ids: dict[str, list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls([], set(), [], {}, [], [], [])


@dataclass
class SchedulerOutput:
    """vLLM's SchedulerOutput: note there is no ``aborted_req_ids`` field."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    num_common_prefix_blocks: list[int] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    preempted_req_ids: set[str] | None = None

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData.make_empty(), {}, 0)


@dataclass
class OmniSchedulerOutput(SchedulerOutput):
    """The omni engine's SchedulerOutput, which also reports aborts."""

    aborted_req_ids: set[str] = field(default_factory=set)


# --------------------------------------------------------------------------- #
# vllm.v1.worker.block_table / gpu_input_batch
# --------------------------------------------------------------------------- #


class _CpuBuffer:
    def __init__(self, *size: int) -> None:
        self.cpu = torch.zeros(*size, dtype=torch.int32)
        self.np = self.cpu.numpy()


class BlockTable:
    def __init__(self, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int) -> None:
        self.block_size = block_size
        self.block_table = _CpuBuffer(max_num_reqs, max_num_blocks_per_req)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def append_row(self, block_ids: list[int], row_idx: int) -> None:
        start = int(self.num_blocks_per_row[row_idx])
        self.block_table.np[row_idx, start : start + len(block_ids)] = block_ids
        self.num_blocks_per_row[row_idx] += len(block_ids)

    def add_row(self, block_ids: list[int], row_idx: int) -> None:
        self.num_blocks_per_row[row_idx] = 0
        self.append_row(block_ids, row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        n = int(self.num_blocks_per_row[src])
        self.block_table.np[tgt, :n] = self.block_table.np[src, :n]
        self.num_blocks_per_row[tgt] = n

    def get_cpu_tensor(self) -> torch.Tensor:
        return self.block_table.cpu


class MultiGroupBlockTable:
    def __init__(self, block_sizes: list[int], max_num_reqs: int, max_num_blocks_per_req: int) -> None:
        self.block_tables = [BlockTable(bs, max_num_reqs, max_num_blocks_per_req) for bs in block_sizes]

    def __getitem__(self, idx: int) -> BlockTable:
        return self.block_tables[idx]


class InputBatch:
    """The persistent batch: holes on remove, filled by add, tail moved in by condense."""

    def __init__(self, *, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int) -> None:
        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.num_computed_tokens_cpu_tensor = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.num_computed_tokens_cpu = self.num_computed_tokens_cpu_tensor.numpy()
        self.block_table = MultiGroupBlockTable([block_size], max_num_reqs, max_num_blocks_per_req)
        self._empty: list[int] = []

    @property
    def req_ids(self) -> list[str]:
        return self._req_ids  # type: ignore[return-value]

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, req_id: str, num_computed_tokens: int, block_ids: list[int]) -> int:
        if self._empty:
            self._empty.sort()
            idx = self._empty.pop(0)
            self._req_ids[idx] = req_id
        else:
            idx = len(self._req_ids)
            self._req_ids.append(req_id)
        self.req_id_to_index[req_id] = idx
        self.num_computed_tokens_cpu[idx] = num_computed_tokens
        self.block_table[0].add_row(block_ids, idx)
        return idx

    def remove_request(self, req_id: str) -> None:
        idx = self.req_id_to_index.pop(req_id)
        self._req_ids[idx] = None
        self._empty.append(idx)

    def condense(self) -> None:
        """Move tail rows into the holes (vLLM's condense changes the batch order)."""
        holes = sorted(self._empty)
        self._empty = []
        for hole in holes:
            while self._req_ids and self._req_ids[-1] is None:
                self._req_ids.pop()
            if hole >= len(self._req_ids):
                break
            src = len(self._req_ids) - 1
            rid = self._req_ids.pop()
            assert rid is not None
            self._req_ids[hole] = rid
            self.req_id_to_index[rid] = hole
            self.num_computed_tokens_cpu[hole] = self.num_computed_tokens_cpu[src]
            self.block_table[0].move_row(src, hole)
        while self._req_ids and self._req_ids[-1] is None:
            self._req_ids.pop()


# --------------------------------------------------------------------------- #
# Config objects the gate reads
# --------------------------------------------------------------------------- #


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    hash_block_size: int | None = None


@dataclass
class ModelConfig:
    runner_type: str = "generate"
    pooler_config: Any = None
    max_model_len: int = 4096


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096


@dataclass
class KVTransferConfig:
    kv_connector: str | None = None
    kv_role: str | None = None

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")


@dataclass
class SpeculativeConfig:
    method: str = "eagle"
    num_speculative_tokens: int = 3


@dataclass
class VllmConfig:
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    model_config: ModelConfig = field(default_factory=ModelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer_config: KVTransferConfig | None = None
    speculative_config: SpeculativeConfig | None = None


@dataclass
class KVCacheSpec:
    block_size: int


class AttentionSpec(KVCacheSpec):
    pass


class FullAttentionSpec(AttentionSpec):
    pass


class MLAAttentionSpec(FullAttentionSpec):
    pass


class SlidingWindowSpec(AttentionSpec):
    pass


class MambaSpec(KVCacheSpec):
    pass


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[Any]
    kv_cache_groups: list[KVCacheGroupSpec]


def kv_cache_config(num_blocks: int, block_size: int, *specs: KVCacheSpec) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layers.{i}"], s) for i, s in enumerate(specs or (FullAttentionSpec(block_size),))]
    return KVCacheConfig(num_blocks, [], groups)
