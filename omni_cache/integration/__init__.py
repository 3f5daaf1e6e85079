"""vLLM integration of the omni prefix cache, testable without vLLM.

Owns nothing stateful itself; re-exports the pieces a vLLM-style model runner
wires in: ``BlockTableView`` (CPU slots of a step), ``stage_prefix_cache_config``
(the configuration gate) and ``PrefixCacheRunnerHooks`` (the per-step calls);
``ranks`` decides which worker of a TP/PP stage holds the cache.
The scheduler adapter is ``omni_cache.integration.adapter.PrefixCacheSchedulerAdapter``.

No module here imports vLLM at module scope (a test scans the package); vLLM
objects are read by their field names. The re-exported names are loaded on first use
(PEP 562), so a light module of the package (``connector_settings``, ``delivery_settings``,
``delivery_paths``, ``delivery_files``) is imported without torch: the launcher checks a server's
settings with them before anything heavy is loaded. Upholds I5 (config gate, block-size check)
and the protocol order of spec/protocol.md (hooks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_cache.runtime.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "BlockTableView": "omni_cache.integration.block_table",
    "PrefixCacheRunnerHooks": "omni_cache.integration.runner_hooks",
    "PrefixCacheSchedulerAdapter": "omni_cache.integration.adapter",
    "stage_prefix_cache_config": "omni_cache.integration.config_gate",
}

__all__ = [
    "BlockTableView",
    "PrefixCacheRunnerHooks",
    "PrefixCacheSchedulerAdapter",
    "stage_prefix_cache_config",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from omni_cache.integration.adapter import PrefixCacheSchedulerAdapter
    from omni_cache.integration.block_table import BlockTableView
    from omni_cache.integration.config_gate import stage_prefix_cache_config
    from omni_cache.integration.runner_hooks import PrefixCacheRunnerHooks
