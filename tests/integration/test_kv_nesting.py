"""The tier plan and the wrapper are found wherever vLLM nests them, without vLLM.

vLLM's ``MultiConnector`` nests each child's metadata in ``MultiKVConnectorMetadata.metadata``
(a tuple in the order of its ``connectors``) and exposes its children as ``sub_connectors``.
With ``OmniKVConnector`` as one of those children, the runner bridge must still apply its tier
plan: a block whose KV came back through the connector is then served with exactly its own rows,
never with the block's previous tenant's. Two wrappers in one tree are refused, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from cache_helpers import BS, finished, manager, save, started, truth

from omni_cache.integration.kv_nesting import omni_connector, omni_metadata
from omni_cache.integration.tier_apply import TierApplier, TierLoad, TierPlan
from omni_cache.integration.vllm_bridge import VllmRunnerBridge
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.tier import HiddenTier


@dataclass
class MultiMeta:
    """vLLM 0.32's ``MultiKVConnectorMetadata``: its fields, by name."""

    metadata: tuple[Any, ...]
    extra_async_saves: dict[str, int] | None = None


@dataclass
class OmniMeta(MultiMeta):
    """``OmniTierMetadata``: a ``MultiKVConnectorMetadata`` plus the plan."""

    omni_tier: TierPlan = field(default_factory=TierPlan)


class _Hooks:
    """The bridge's hooks reduced to the manager (the step itself is not under test here)."""

    def __init__(self, m: Any) -> None:
        self.manager = m
        self.config = None

    def begin_step(self, scheduler_output: Any) -> None:
        return None


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_plan_nested_in_multi_connector_metadata_restores_the_blocks_own_rows(depth: int) -> None:
    m = manager(True)
    m.new_step_starts([started("a")])
    s1, rows_a = save(m, [("a", [3], 0, BS)])  # block 3's previous tenant
    m.materialize(s1, ["a"])
    m.new_step_starts([finished("a")])
    applier = TierApplier(HiddenTier(1 << 20), BS)
    own = {"hidden": truth("c", range(BS))}
    applier.tier.put(b"h-c", own)
    meta: Any = OmniMeta(metadata=(None,), omni_tier=TierPlan(loads=(TierLoad("c", 0, b"h-c", 3),)))
    for _ in range(depth):  # MultiConnector[ExampleConnector-like child, <meta>]
        meta = MultiMeta(metadata=(SimpleNamespace(requests=[]), meta))
    bridge = VllmRunnerBridge(hooks=_Hooks(m))  # type: ignore[arg-type]
    bridge.tier_applier = applier
    bridge.begin_step(SimpleNamespace(kv_connector_metadata=meta, total_num_scheduled_tokens=1))
    m.new_step_starts([started("c", hit_end=BS, blocks=[3, 5])])
    s2, _ = save(m, [("c", [3, 5], BS, BS + 1)])
    out = m.materialize(s2, ["c"])
    served = out.hidden_states["c"][:BS]
    assert not torch.equal(served, rows_a), "the block's previous tenant's rows were served"
    assert torch.equal(served, own["hidden"]) and applier.restored_blocks == 1
    m.shutdown()


def test_the_wrapper_is_found_among_sub_connectors_at_any_depth() -> None:
    omni = SimpleNamespace(omni_tier_applier="applier", omni_delivery=None)
    example = SimpleNamespace(sub_connectors=None)
    assert omni_connector(omni) is omni
    assert omni_connector(SimpleNamespace(sub_connectors=[example, omni])) is omni
    assert omni_connector(SimpleNamespace(sub_connectors=[SimpleNamespace(sub_connectors=[omni])])) is omni
    assert omni_connector(SimpleNamespace(sub_connectors=[example])) is None and omni_connector(None) is None


def test_two_wrappers_in_one_tree_are_refused_never_guessed() -> None:
    a, b = OmniMeta(metadata=()), OmniMeta(metadata=())
    with pytest.raises(OmniPrefixCacheUnmatchError, match="2 OmniKVConnector metadata"):
        omni_metadata(MultiMeta(metadata=(a, b)))
    omni = SimpleNamespace(omni_tier_applier=None)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="at most one OmniKVConnector"):
        omni_connector(SimpleNamespace(sub_connectors=[omni, omni]))


def test_a_delivery_plan_alone_is_found_nested_too() -> None:
    ours = SimpleNamespace(metadata=(), omni_delivery="plan")
    assert omni_metadata(ours) is ours
    assert omni_metadata(MultiMeta(metadata=(SimpleNamespace(requests=[]), ours))) is ours
    assert omni_metadata(MultiMeta(metadata=(SimpleNamespace(requests=[]),))) is None and omni_metadata(None) is None
