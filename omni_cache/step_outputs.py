"""Splitting a step's outputs and snapshotting what its materialize needs.

Owns: ``classify_outputs`` (immediate / deferred / leftover), ``host_copy`` for
leftover values, and the ``StepContext`` the manager keeps per unconsumed
step id.

Upholds I4 (snapshot): everything materialize reads is either in the claimed
staging page, in host copies taken at save, or in planned reads pinned at save;
nothing refers to the caller's live, reusable buffers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache.adapter import PrefixCacheWrite
from omni_cache.interface import ModelCachePolicy, ReqId, StepId, TensorName
from omni_cache.tenancy import PlannedRead


@dataclass
class SplitOutputs:
    """A step's outputs by write path; per-token rows already sliced to unpadded."""

    immediate: dict[TensorName, torch.Tensor] = field(default_factory=dict)
    deferred: dict[TensorName, torch.Tensor] = field(default_factory=dict)
    leftover: dict[TensorName, Any] = field(default_factory=dict)


def is_token_major(value: Any, num_unpadded: int, num_padded: int) -> bool:
    """A tensor of >= 2 dims whose dim 0 is the unpadded or the padded token count."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() >= 2
        and value.shape[0] in (num_unpadded, num_padded)
    )


def classify_outputs(
    policy: ModelCachePolicy,
    hidden_states: torch.Tensor | None,
    mm_outputs: dict[TensorName, Any],
    num_unpadded: int,
    num_padded: int,
) -> SplitOutputs:
    split = SplitOutputs()
    if policy.hidden_key is not None and hidden_states is not None:
        split.immediate[policy.hidden_key] = hidden_states[:num_unpadded]
    for key, value in mm_outputs.items():
        if is_token_major(value, num_unpadded, num_padded):
            target = split.deferred if key in policy.deferred_keys else split.immediate
            target[key] = value[:num_unpadded]
        else:
            split.leftover[key] = value
    return split


def host_copy(value: Any) -> Any:
    """A host-side copy of a leftover value that shares no storage with ``value``."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (list, tuple)):
        items = [host_copy(v) for v in value]
        return type(value)(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    return copy.deepcopy(value)


@dataclass
class StepContext:
    """Everything one step's materialize needs, snapshotted at save (I4)."""

    step_id: StepId
    staging_slot: Any
    saved_at: str
    # req -> its rows of the step (the layout's immutable PrefixCacheWrite).
    spans: dict[ReqId, PrefixCacheWrite]
    # req -> the hit read planned at save (first step after STARTED/RESUMED with a hit).
    hits: dict[ReqId, PlannedRead]
    immediate_keys: tuple[TensorName, ...]
    immediate_write: Any
    deferred_rows: dict[TensorName, torch.Tensor]
    leftover: dict[TensorName, Any]
    hit_keys: tuple[TensorName, ...]
    caches_hidden: bool
    # CUDA events of the deferred rows' host copies (empty on CPU).
    host_events: list[Any] = field(default_factory=list)

    def planned_reads(self) -> list[PlannedRead]:
        return list(self.hits.values())
