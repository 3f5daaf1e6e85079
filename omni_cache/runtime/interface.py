"""Interface types of the omni prefix cache (the reference interface's public page).

Owns: the vocabulary (``TensorName``, ``ReqId``, ``Tid``, ``StepId``,
``HIDDEN_KEY``), sizing (``PrefixCacheConfig``), the per-model cache policy
(``ModelCachePolicy``), the value returned by materialize
(``StageCacheOutputs``) and the two contract errors.

Naming aligns with vLLM's v1/core KV-cache design. Nothing here holds state;
every class is an immutable value. Upholds I10 (config validation: capacity is
never clamped) and the policy half of I6 (``get_hit_keys`` decides which keys a
hit must be able to read).
"""

from __future__ import annotations

import enum
import math
import operator
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from omni_cache.runtime.errors import (
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
)

__all__ = [
    "HIDDEN_KEY",
    "ModelCachePolicy",
    "OmniPrefixCacheStagingTimeoutError",
    "OmniPrefixCacheUnmatchError",
    "PrefixCacheConfig",
    "ReqId",
    "StageCacheOutputs",
    "StepId",
    "TensorName",
    "Tid",
    "WriteSchedule",
    "is_hidden_key",
    "mm_of_request",
    "without_hidden",
]

TensorName = str
"""Which cached tensor: ``HIDDEN_KEY`` or a dotted multimodal name."""
ReqId = str
"""An engine request id."""
Tid = int
"""Handle of one pool write (monotonic; also the row version it writes)."""
StepId = int
"""What ``save_outputs`` returns; consumed exactly once (I1)."""

HIDDEN_KEY: TensorName = "hidden"
"""The reserved, shared name of the per-token hidden states."""


def is_hidden_key(key: TensorName) -> bool:
    """True for the reserved hidden-state identity."""
    return key == HIDDEN_KEY


def without_hidden(keys: Iterable[TensorName]) -> set[TensorName]:
    """Drop the reserved hidden identity; the rest are mm names."""
    return {k for k in keys if not is_hidden_key(k)}


class WriteSchedule(enum.Enum):
    """When a key's rows reach the block pool."""

    JOIN_NEXT_STEP = "join_next_step"
    """Hidden and non-deferred per-token mm: copied at save, landed before the next save."""
    JOIN_ON_FINISH = "join_on_finish"
    """Deferred keys: kept on a device clone until finish/abort or the GPU budget."""


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"PrefixCacheConfig.{name} must be a positive int, got {value!r}")


MAX_SLOTS = 1 << 40
"""The most KV slots (``num_blocks x block_size``) a config may address: per-slot bookkeeping is
allocated for each at start, and no engine has more."""

MAX_STAGING_DEPTH = 1024
"""The most staging slots (``staging_depth``, steps in flight) a config may ask for: each slot's
bookkeeping is built at start, and no engine keeps more steps unconsumed."""


@dataclass(frozen=True)
class PrefixCacheConfig:
    """Sizing and flow-control knobs (mirrors KVCacheConfig).

    A staging slot holds one step (the whole batch), not one request:
    ``staging_capacity_tokens`` rows per page, ``staging_depth`` pages per key.
    Pinned staging is allocated lazily per key at
    depth * capacity_tokens * width * dtype. There is no clamp: a step larger
    than capacity raises (I10).
    """

    num_blocks: int
    block_size: int
    gpu_staging_bytes: int = 512 << 20
    staging_depth: int = 4
    staging_capacity_tokens: int = 1024
    staging_claim_timeout_s: float = 30.0
    copy_chunk_bytes: int = 16 << 20
    output_group_id: int = 0
    """The KV-cache group whose slots address the rows (``block_ids[output_group_id]`` of an event);
    the reference's name. The configuration gate picks the engine's full-attention group."""

    def __post_init__(self) -> None:
        group = self.output_group_id
        if isinstance(group, bool) or not isinstance(group, int) or group < 0:
            raise ValueError(f"PrefixCacheConfig.output_group_id must be an int >= 0, got {group!r}")
        for name in (
            "num_blocks",
            "block_size",
            "gpu_staging_bytes",
            "staging_depth",
            "staging_capacity_tokens",
            "copy_chunk_bytes",
        ):
            _require_positive_int(name, getattr(self, name))
        timeout = self.staging_claim_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
            or timeout > threading.TIMEOUT_MAX  # every wait of the cache is bounded by it
        ):
            raise ValueError(
                f"PrefixCacheConfig.staging_claim_timeout_s must be a positive finite "
                f"number of seconds up to {threading.TIMEOUT_MAX:.0f}, got {timeout!r}"
            )
        if self.staging_depth > MAX_STAGING_DEPTH:
            raise ValueError(f"PrefixCacheConfig.staging_depth must be at most {MAX_STAGING_DEPTH} (staging slots "
                             f"are built at start), got {self.staging_depth}")
        if self.num_slots > MAX_SLOTS:
            raise ValueError(
                f"PrefixCacheConfig.num_blocks x block_size must address at most {MAX_SLOTS} KV slots "
                f"(2**40), got {self.num_blocks} x {self.block_size} = {self.num_slots}")

    @property
    def num_slots(self) -> int:
        """KV slots addressed by the block pool: num_blocks * block_size."""
        return self.num_blocks * self.block_size

    @classmethod
    def from_vllm_config(
        cls,
        *,
        num_blocks: int,
        block_size: int,
        scheduler_config: Any = None,
        model_config: Any = None,
        output_group_id: int = 0,
    ) -> PrefixCacheConfig:
        """Size device->host staging from the running scheduler.

        capacity = ``scheduler_config.max_num_batched_tokens``, else
        ``max_model_len`` (scheduler config, then model config), else 1024;
        never clamped: a non-positive or non-int value of the attribute chosen raises
        ``ValueError`` (naming it). ``staging_depth`` stays the default (4).
        ``output_group_id``: the KV-cache group whose slots address the rows.
        """
        capacity: Any = None
        chosen = "default"
        for source, attr in (
            (scheduler_config, "max_num_batched_tokens"),
            (scheduler_config, "max_model_len"),
            (model_config, "max_model_len"),
        ):
            value = getattr(source, attr, None) if source is not None else None
            if value is not None:
                capacity, chosen = value, attr
                break
        if capacity is None:
            capacity = 1024
        if isinstance(capacity, bool) or not hasattr(capacity, "__index__") or operator.index(capacity) <= 0:
            raise ValueError(
                f"PrefixCacheConfig.from_vllm_config: {chosen}={capacity!r} must be a positive int "
                "(the staging capacity in tokens); it is never clamped"
            )
        return cls(
            num_blocks=num_blocks,
            block_size=block_size,
            staging_capacity_tokens=operator.index(capacity),
            output_group_id=output_group_id,
        )


def mm_of_request(mm_outputs: dict[TensorName, dict[ReqId, Any]] | None, req_id: ReqId) -> dict[TensorName, Any]:
    """One request's mm values ``{key: value}`` from key-major ``mm_outputs[key][req]``.

    The one accessor for code that thinks per request: it is the only place
    that knows the nesting order.
    """
    return {key: per_req[req_id] for key, per_req in (mm_outputs or {}).items() if req_id in per_req}


class StageCacheOutputs(NamedTuple):
    """Plain value object: per-request merged stage outputs.

    ``hidden_states[req]`` is the cached prefix rows followed by this step's rows
    (``None`` when the policy opts out of hidden). ``mm_outputs`` is KEY-MAJOR, as
    in the reference: ``mm_outputs[key][req]`` ("tensor name -> req -> payload
    element"); for a per-token key it is the same merge as hidden, for a leftover
    key the host copy taken at save. ``mm_for(req)`` gives one request's
    ``{key: value}``.
    """

    hidden_states: dict[ReqId, Any] | None
    mm_outputs: dict[TensorName, dict[ReqId, Any]]

    def mm_for(self, req_id: ReqId) -> dict[TensorName, Any]:
        """One request's mm values ``{key: value}`` (see ``mm_of_request``)."""
        return mm_of_request(self.mm_outputs, req_id)


@dataclass(frozen=True)
class ModelCachePolicy:
    """Replaces getattr probing on models for cache behavior decisions.

    Hidden's name is ``HIDDEN_KEY`` (shared identity). This object answers
    whether this model caches it, and which mm keys are deferred.
    """

    needs_full_hidden_states: bool = True
    deferred_keys: frozenset[TensorName] = field(default_factory=frozenset)
    mm_outputs_written_in_sample: bool = False

    def __post_init__(self) -> None:
        given = self.deferred_keys
        # A str is an iterable of characters: "codes" would defer "c", "o", ... and not "codes".
        collection = isinstance(given, Iterable) and not isinstance(given, (str, bytes))
        keys = tuple(given) if collection else ()
        if not collection or not all(isinstance(k, str) and k for k in keys):
            raise TypeError(f"ModelCachePolicy.deferred_keys must be a collection of mm key names (non-empty "
                            f"str), got {given!r}")
        object.__setattr__(self, "deferred_keys", frozenset(keys))
        if self.mm_outputs_written_in_sample and self.needs_full_hidden_states:
            raise OmniPrefixCacheUnmatchError(
                "ModelCachePolicy: mm_outputs_written_in_sample=True cannot be combined with "
                "needs_full_hidden_states=True: mm written during sampling is not part of the "
                "forward's per-token outputs, so a hit cannot serve it beside the hidden rows"
            )
        if any(is_hidden_key(k) for k in self.deferred_keys):
            raise OmniPrefixCacheUnmatchError(
                f"ModelCachePolicy: deferred_keys must not contain the hidden key {HIDDEN_KEY!r}; "
                "hidden is always written JOIN_NEXT_STEP"
            )

    @property
    def hidden_key(self) -> TensorName | None:
        """Pool key for hidden, or None when this model opts out."""
        return HIDDEN_KEY if self.needs_full_hidden_states else None

    @classmethod
    def from_model(cls, model: Any) -> ModelCachePolicy:
        """Shim over legacy per-model attributes (deprecation window)."""
        return cls(
            needs_full_hidden_states=bool(
                getattr(model, "requires_full_prefix_cached_hidden_states", True)
            ),
            # as the model gives it: the constructor checks it (a str is refused, never split)
            deferred_keys=cast("frozenset[TensorName]", getattr(model, "deferred_prefix_cache_mm_keys", None) or frozenset()),
            mm_outputs_written_in_sample=bool(
                getattr(model, "mm_outputs_written_in_sample", False)
            ),
        )

    def get_hit_keys(self, keys: Iterable[TensorName]) -> list[TensorName]:
        """Keys to plan/prefetch for a hit: hidden first (if cached), then mm sorted."""
        keys = list(keys)
        head = [HIDDEN_KEY] if self.hidden_key is not None else []
        return head + sorted(without_hidden(keys))

    def skip_immediate_mm(self, key: TensorName) -> bool:
        """Immediate on-device clone must not take hidden or deferred keys from mm."""
        return is_hidden_key(key) or key in self.deferred_keys

    def schedule_for(self, key: TensorName) -> WriteSchedule:
        """The write path of a per-token key."""
        return WriteSchedule.JOIN_ON_FINISH if key in self.deferred_keys else WriteSchedule.JOIN_NEXT_STEP
