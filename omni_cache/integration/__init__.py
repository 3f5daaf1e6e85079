"""vLLM integration of the omni prefix cache, testable without vLLM.

Owns nothing stateful itself; re-exports the pieces a vLLM-style model runner
wires in: ``BlockTableView`` (CPU slots of a step), ``stage_prefix_cache_config``
(the configuration gate) and ``PrefixCacheRunnerHooks`` (the per-step calls);
``ranks`` decides which worker of a TP/PP stage holds the cache.
The scheduler adapter is ``omni_cache.integration.adapter.PrefixCacheSchedulerAdapter``.

No module here imports vLLM at module scope (a test scans the package); vLLM
objects are read by their field names. Upholds I5 (config gate, block-size
check) and the protocol order of spec/protocol.md (hooks).
"""

from omni_cache.integration.adapter import PrefixCacheSchedulerAdapter
from omni_cache.integration.block_table import BlockTableView
from omni_cache.integration.config_gate import stage_prefix_cache_config
from omni_cache.integration.runner_hooks import PrefixCacheRunnerHooks

__all__ = [
    "BlockTableView",
    "PrefixCacheRunnerHooks",
    "PrefixCacheSchedulerAdapter",
    "stage_prefix_cache_config",
]
