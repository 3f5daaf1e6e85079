"""omni-cache: a formally specified prefix cache for multi-stage (omni) model serving.

Everything public is importable from here. No module imports vLLM at module scope.
"""

from omni_cache.adapter import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheRequestOwner,
    PrefixCacheSchedulerAdapter,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
)
from omni_cache.block_pool import PrefixBlockPool
from omni_cache.errors import OmniPrefixCacheStagingTimeoutError, OmniPrefixCacheUnmatchError
from omni_cache.interface import (
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
from omni_cache.manager import OmniPrefixCacheManager
from omni_cache.states import STAGING_TABLE, WRITE_TABLE, StateTable
from omni_cache.trace import TraceEvent, TraceRecorder

__version__ = "0.1.0"

__all__ = [
    "HIDDEN_KEY",
    "STAGING_TABLE",
    "WRITE_TABLE",
    "ModelCachePolicy",
    "OmniPrefixCacheManager",
    "OmniPrefixCacheStagingTimeoutError",
    "OmniPrefixCacheUnmatchError",
    "PrefixBlockPool",
    "PrefixCacheConfig",
    "PrefixCacheEventKind",
    "PrefixCacheRequestEvent",
    "PrefixCacheRequestOwner",
    "PrefixCacheSchedulerAdapter",
    "PrefixCacheStep",
    "PrefixCacheWrite",
    "PrefixCacheWriteLayout",
    "ReqId",
    "StageCacheOutputs",
    "StateTable",
    "StepId",
    "TensorName",
    "Tid",
    "TraceEvent",
    "TraceRecorder",
    "WriteSchedule",
    "__version__",
    "is_hidden_key",
    "mm_of_request",
    "without_hidden",
]
