"""omni-cache: a formally specified prefix cache for multi-stage (omni) model serving.

Everything public is importable from here. No module imports vLLM at module scope. The public
names are loaded on first use (PEP 562 ``__getattr__``), so ``omni-cache`` parses its arguments
without importing torch; ``from omni_cache import X`` works as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_cache._lazy import lazy_exports

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "PrefixCacheEventKind": "omni_cache.adapter",
    "PrefixCacheRequestEvent": "omni_cache.adapter",
    "PrefixCacheRequestOwner": "omni_cache.adapter",
    "PrefixCacheSchedulerAdapter": "omni_cache.adapter",
    "PrefixCacheStep": "omni_cache.adapter",
    "PrefixCacheWrite": "omni_cache.adapter",
    "PrefixCacheWriteLayout": "omni_cache.adapter",
    "PrefixBlockPool": "omni_cache.block_pool",
    "OmniPrefixCacheStagingTimeoutError": "omni_cache.errors",
    "OmniPrefixCacheUnmatchError": "omni_cache.errors",
    "HIDDEN_KEY": "omni_cache.interface",
    "ModelCachePolicy": "omni_cache.interface",
    "PrefixCacheConfig": "omni_cache.interface",
    "ReqId": "omni_cache.interface",
    "StageCacheOutputs": "omni_cache.interface",
    "StepId": "omni_cache.interface",
    "TensorName": "omni_cache.interface",
    "Tid": "omni_cache.interface",
    "WriteSchedule": "omni_cache.interface",
    "is_hidden_key": "omni_cache.interface",
    "mm_of_request": "omni_cache.interface",
    "without_hidden": "omni_cache.interface",
    "OmniPrefixCacheManager": "omni_cache.manager",
    "STAGING_TABLE": "omni_cache.states",
    "WRITE_TABLE": "omni_cache.states",
    "StateTable": "omni_cache.states",
    "TraceEvent": "omni_cache.trace",
    "TraceRecorder": "omni_cache.trace",
}

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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
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
