"""The reference-parity port's renaming shim and the helpers its test files share.

For tests/manager/test_reference_parity*.py. Importing this module installs a pure renaming
shim (``_install_shim``): ``vllm_omni.core.prefix_cache.<m>`` names omni-cache's module ``<m>``
(adapter, interface, manager), so the ported tests import the reference's module names and
nothing else is adapted. A test module imports from here before its
``vllm_omni`` imports (the import order sorts it first). Also here, used by more than one of the
port's files: the event kind ``K``, the sizes, ``new_req`` (a vLLM-shaped new request),
``BlockView`` (a reference-protocol view backed by dicts) and ``make_manager``.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import torch
from cache_helpers import slots


def _install_shim() -> None:
    """Make ``vllm_omni.core.prefix_cache.<m>`` name omni-cache's module ``<m>`` (renaming only)."""
    import omni_cache.integration.adapter
    import omni_cache.runtime.interface
    import omni_cache.runtime.manager

    for pkg in ("vllm_omni", "vllm_omni.core", "vllm_omni.core.prefix_cache"):
        sys.modules.setdefault(pkg, types.ModuleType(pkg))
    for name, module in (("adapter", omni_cache.integration.adapter), ("interface", omni_cache.runtime.interface),
                         ("manager", omni_cache.runtime.manager)):
        sys.modules.setdefault(f"vllm_omni.core.prefix_cache.{name}", module)


_install_shim()

from vllm_omni.core.prefix_cache.adapter import PrefixCacheEventKind, PrefixCacheSchedulerAdapter  # noqa: E402
from vllm_omni.core.prefix_cache.interface import PrefixCacheConfig  # noqa: E402
from vllm_omni.core.prefix_cache.manager import OmniPrefixCacheManager  # noqa: E402

K = PrefixCacheEventKind
NUM_BLOCKS, BLOCK_SIZE, HIDDEN, DTYPE = 16, 4, 8, torch.float32


def new_req(req_id, computed=0, blocks=None):
    return SimpleNamespace(req_id=req_id, num_computed_tokens=computed, block_ids=blocks)


class BlockView:
    """A reference-protocol view backed by dicts: blocks, batch order, computed tokens."""

    def __init__(self) -> None:
        self.req_blocks: dict[str, list[int]] = {}
        self.order: list[str] = []
        self.computed: dict[str, int] = {}
        self.adapter = PrefixCacheSchedulerAdapter()

    def slots_for(self, req_id, start, end):
        blocks = self.req_blocks[req_id]
        return slots(blocks, start, end, BLOCK_SIZE)

    def batch_req_ids(self):
        return list(self.order)

    def token_range(self, req_id, n):
        start = self.computed.get(req_id, 0)
        return start, start + n

    def step_slots_cpu(self, req_ids, counts):
        parts = [self.slots_for(r, self.computed.get(r, 0), self.computed.get(r, 0) + int(counts.get(r, 0)))
                 for r in req_ids if int(counts.get(r, 0)) > 0]
        return torch.cat(parts) if parts else torch.empty((0,), dtype=torch.long)


def make_manager(policy=None, **config):
    mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, **config), eager=True)
    if policy is not None:
        mgr.register_policy(policy)
    return mgr, BlockView()
