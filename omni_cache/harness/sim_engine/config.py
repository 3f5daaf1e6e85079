"""Configuration of one simulation run.

Owns: ``SimConfig`` (every knob of ``omni-cache simulate``, resolved from a
preset plus overrides) and its translation to the cache's
``PrefixCacheConfig``. The staging page holds a whole padded step
(``staging_capacity_tokens`` >= the thinker's capacity) so I10 never fires on a
legal step; ``staging_depth`` bounds the builder's lag (I2).

Upholds nothing (configuration).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from omni_cache.harness.sim_engine.scheduler import PUBLISH_MODES
from omni_cache.harness.sim_engine.truth import TruthSpec
from omni_cache.harness.sim_engine.workload import PRESETS, Preset, Workload
from omni_cache.runtime.interface import PrefixCacheConfig

HOST_BYTES_LIMIT = 8 << 30
"""The most host memory a simulation may plan to allocate (a typo should not allocate 25 GB)."""


@dataclass(frozen=True)
class SimConfig:
    preset: str = "chat"
    requests: int = 48
    max_batched_tokens: int = 256
    num_blocks: int = 160
    block_size: int = 16
    max_num_seqs: int = 24
    seed: int = 0
    steps_limit: int = 100_000
    eager: bool = True
    hidden_width: int = 64
    embeds_width: int = 32
    dtype: str = "float32"
    gpu_staging_bytes: int = 512 << 20
    staging_depth: int = 4
    claim_timeout_s: float = 20.0
    pad_multiple: int = 8
    pad_probability: float = 0.5
    max_model_len: int | None = None
    builder_delay_s: float = 0.0
    """Extra latency before each materialize (a slow output builder)."""
    publish: str = "schedule"
    device: str = "cpu"
    """Where the thinker's outputs live: "cpu", or "cuda" (the manager's stream path)."""
    """When the allocator publishes a block: "schedule" (vLLM v1) or "forward" (vLLM v0)."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose from {sorted(PRESETS)}")
        for name in ("max_batched_tokens", "num_blocks", "block_size", "max_num_seqs", "steps_limit", "staging_depth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.publish not in PUBLISH_MODES:
            raise ValueError(f"--publish must be one of {PUBLISH_MODES}, got {self.publish!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        if self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}: a run that asks for nothing verifies nothing")
        if self.max_model_len is None and self.model_len < Workload.shortest_request_tokens(self.preset_obj):
            raise ValueError(
                f"--num-blocks {self.num_blocks} x --block-size {self.block_size} cannot run a single {self.preset} "
                f"request: the shortest needs {Workload.shortest_request_tokens(self.preset_obj)} tokens and a request "
                f"may use at most half the KV cache ({self.model_len} tokens); the smallest that can is "
                f"--num-blocks {self.smallest_num_blocks()}")
        need = self.host_bytes_estimate()
        if need > HOST_BYTES_LIMIT:
            raise ValueError(
                f"this configuration needs about {need / 2**30:.1f} GiB of host memory ((1 + --staging-depth) x "
                f"--max-batched-tokens + --num-blocks x --block-size rows of {need // max(1, self._rows()):,} bytes); "
                f"the simulator refuses above {HOST_BYTES_LIMIT >> 30} GiB: lower --max-batched-tokens, "
                "--num-blocks, --hidden-width or --embeds-width")

    def _rows(self) -> int:
        return (1 + self.staging_depth) * self.capacity_tokens + self.num_blocks * self.block_size

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> SimConfig:
        """The preset's defaults, then every override that is not None."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        p = PRESETS[name]
        base: dict[str, Any] = {
            "preset": name,
            "requests": p.requests,
            "max_batched_tokens": p.max_batched_tokens,
            "num_blocks": p.num_blocks,
            "block_size": p.block_size,
            "max_num_seqs": p.max_num_seqs,
            "hidden_width": p.hidden_width,
            "embeds_width": p.embeds_width,
            "gpu_staging_bytes": p.gpu_staging_bytes,
        }
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - fields
        if unknown:
            raise TypeError(f"unknown SimConfig fields {sorted(unknown)}")
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    @property
    def preset_obj(self) -> Preset:
        return PRESETS[self.preset]

    @property
    def capacity_tokens(self) -> int:
        """Rows of the largest (padded) step."""
        m = max(1, self.pad_multiple)
        return -(-self.max_batched_tokens // m) * m

    @property
    def model_len(self) -> int:
        """Longest request: at most half the KV cache, so two always fit."""
        if self.max_model_len is not None:
            return self.max_model_len
        return self.num_blocks * self.block_size // 2

    def smallest_num_blocks(self) -> int:
        """The fewest KV blocks (at this block size) with which the preset's shortest request can run."""
        need = Workload.shortest_request_tokens(self.preset_obj)
        return -(-2 * need // self.block_size)

    def host_bytes_estimate(self) -> int:
        """Host memory the run allocates up front or at most: thinker buffers, staging pages, block pool."""
        spec = self.truth_spec()
        row = sum(spec.row_bytes(k) for k in spec.per_token_keys)
        return (1 + self.staging_depth) * self.capacity_tokens * row + self.num_blocks * self.block_size * row

    def truth_spec(self) -> TruthSpec:
        return TruthSpec(hidden_width=self.hidden_width, dtype=self.dtype, embeds_width=self.embeds_width)

    def cache_config(self) -> PrefixCacheConfig:
        return PrefixCacheConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            gpu_staging_bytes=self.gpu_staging_bytes,
            staging_depth=self.staging_depth,
            staging_capacity_tokens=self.capacity_tokens,
            staging_claim_timeout_s=self.claim_timeout_s,
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
