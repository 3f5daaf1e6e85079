"""The reference interface's import path ``omni_cache.adapter``: the engine-facing value types and the scheduler adapter.

Owns nothing: the value types are defined in ``omni_cache.runtime.events``, the vLLM scheduler
adapter in ``omni_cache.integration.adapter``; this module keeps the path that callers of the
reference (and its tests) import from. Upholds: nothing itself.
"""

from __future__ import annotations

from omni_cache.integration.adapter import PrefixCacheSchedulerAdapter
from omni_cache.runtime.events import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheRequestOwner,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
)

__all__ = [
    "PrefixCacheEventKind",
    "PrefixCacheRequestEvent",
    "PrefixCacheRequestOwner",
    "PrefixCacheSchedulerAdapter",
    "PrefixCacheStep",
    "PrefixCacheWrite",
    "PrefixCacheWriteLayout",
]
