"""omni-cache: a formally specified prefix cache for multi-stage (omni) model serving.

Everything public is importable from here. No module imports vLLM at module scope. The public
names are loaded on first use (PEP 562 ``__getattr__``), so ``omni-cache`` parses its arguments
without importing torch; ``from omni_cache import X`` works as usual.

Upholds nothing itself: the runtime's modules name what they uphold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_cache.runtime.lazy import lazy_exports

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "PrefixCacheEventKind": "omni_cache.runtime.events",
    "PrefixCacheRequestEvent": "omni_cache.runtime.events",
    "PrefixCacheRequestOwner": "omni_cache.runtime.events",
    "PrefixCacheSchedulerAdapter": "omni_cache.integration.adapter",
    "PrefixCacheStep": "omni_cache.runtime.events",
    "PrefixCacheWrite": "omni_cache.runtime.events",
    "PrefixCacheWriteLayout": "omni_cache.runtime.events",
    "PrefixBlockPool": "omni_cache.runtime.block_pool",
    "OmniPrefixCacheStagingTimeoutError": "omni_cache.runtime.errors",
    "OmniPrefixCacheUnmatchError": "omni_cache.runtime.errors",
    "HIDDEN_KEY": "omni_cache.runtime.interface",
    "ModelCachePolicy": "omni_cache.runtime.interface",
    "PrefixCacheConfig": "omni_cache.runtime.interface",
    "ReqId": "omni_cache.runtime.interface",
    "StageCacheOutputs": "omni_cache.runtime.interface",
    "StepId": "omni_cache.runtime.interface",
    "TensorName": "omni_cache.runtime.interface",
    "Tid": "omni_cache.runtime.interface",
    "WriteSchedule": "omni_cache.runtime.interface",
    "is_hidden_key": "omni_cache.runtime.interface",
    "mm_of_request": "omni_cache.runtime.interface",
    "without_hidden": "omni_cache.runtime.interface",
    "OmniPrefixCacheManager": "omni_cache.runtime.manager",
    "STAGING_TABLE": "omni_cache.runtime.states",
    "WRITE_TABLE": "omni_cache.runtime.states",
    "StateTable": "omni_cache.runtime.states",
    "TraceEvent": "omni_cache.runtime.trace",
    "TraceRecorder": "omni_cache.runtime.trace",
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
    from omni_cache.integration.adapter import PrefixCacheSchedulerAdapter
    from omni_cache.runtime.block_pool import PrefixBlockPool
    from omni_cache.runtime.errors import OmniPrefixCacheStagingTimeoutError, OmniPrefixCacheUnmatchError
    from omni_cache.runtime.events import (
        PrefixCacheEventKind,
        PrefixCacheRequestEvent,
        PrefixCacheRequestOwner,
        PrefixCacheStep,
        PrefixCacheWrite,
        PrefixCacheWriteLayout,
    )
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
    from omni_cache.runtime.manager import OmniPrefixCacheManager
    from omni_cache.runtime.states import STAGING_TABLE, WRITE_TABLE, StateTable
    from omni_cache.runtime.trace import TraceEvent, TraceRecorder
