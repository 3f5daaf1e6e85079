"""The reference interface's import path ``omni_cache.interface``: the interface types and the two contract errors.

Owns nothing: they are defined in ``omni_cache.runtime.interface`` (and ``omni_cache.runtime.errors``);
this module keeps the path that callers of the reference import from. Upholds: nothing itself.
"""

from __future__ import annotations

from omni_cache.runtime.errors import OmniPrefixCacheStagingTimeoutError, OmniPrefixCacheUnmatchError
from omni_cache.runtime.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    PrefixCacheConfig,
    ReqId,
    StageCacheOutputs,
    StepId,
    TensorName,
    Tid,
    WriteSchedule,
    is_hidden_key,
    mm_of_request,
    without_hidden,
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
