"""Shared by the fault-injection tests (test_faults.py, test_faults_rollback.py): the bound a
released waiter must return within, and a manager with the reference engine on top whose faults
go through the documented seam ``omni_cache.runtime.faults.FaultHooks``.
"""

from __future__ import annotations

from reference_model import EMBEDS, Engine

from omni_cache import ModelCachePolicy, PrefixCacheConfig
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.manager import OmniPrefixCacheManager

BOUND_S = 5.0  # a released waiter must return within this


def make(eager: bool, hooks: FaultHooks, *, depth: int = 3, timeout_s: float = 30.0,
         deferred: bool = False) -> tuple[OmniPrefixCacheManager, Engine]:
    cfg = PrefixCacheConfig(num_blocks=16, block_size=4, staging_depth=depth, staging_capacity_tokens=16,
                            staging_claim_timeout_s=timeout_s)
    m = OmniPrefixCacheManager(cfg, eager=eager, faults=hooks)
    policy = ModelCachePolicy(deferred_keys=frozenset({EMBEDS} if deferred else ()))
    return m, Engine(m, cfg, policy)
