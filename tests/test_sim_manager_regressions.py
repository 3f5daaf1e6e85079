"""Manager regressions found with ``omni-cache simulate`` (kept as plain tests once fixed).

Same-step prefix hit (vLLM v1): the KV allocator publishes a block's hash when
the block is *scheduled* (``allocate_slots`` -> ``cache_blocks``), so a second
request scheduled later in the same step hits blocks whose KV the same forward
computes. Two requests with one uncached system prompt arriving together is
the common case. The thinker's rows for those slots are in this very save; the
manager must serve them to the second request's materialize. It used to raise
"is not readable" (I6), because the hit's read was planned before this step's
writes were registered (fixed in 92a1f79; ``omni-cache simulate`` publishes at
schedule time by default, so every preset exercises it).
"""

from __future__ import annotations

import pytest
import torch

from omni_cache.runtime.events import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.interface import ModelCachePolicy, PrefixCacheConfig
from omni_cache.runtime.manager import OmniPrefixCacheManager


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_same_step_hit_serves_rows_of_the_same_save(eager: bool) -> None:
    bs = 4
    mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=8, block_size=bs, staging_capacity_tokens=16), eager=eager)
    mgr.register_policy(ModelCachePolicy())
    try:
        # A computes positions [0, 5) on blocks (0, 1); B shares block 0 (a 4-token hit
        # published when A was scheduled) and computes positions [4, 6) on block 2.
        mgr.new_step_starts(PrefixCacheStep(
            (
                PrefixCacheRequestEvent("A", PrefixCacheEventKind.STARTED, block_ids=((0, 1),), scheduled_tokens=5),
                PrefixCacheRequestEvent("B", PrefixCacheEventKind.STARTED, hit_end=4, block_ids=((0, 2),), scheduled_tokens=2),
            ),
            {"A": 5, "B": 2},
        ))
        hidden = torch.arange(7 * 2, dtype=torch.float32).reshape(7, 2)
        layout = PrefixCacheWriteLayout.packed([("A", 0, 5), ("B", 4, 6)], torch.tensor([0, 1, 2, 3, 4, 8, 9]))
        sid = mgr.save_outputs(hidden, {}, num_tokens_unpadded=7, num_tokens_padded=7, write_layout=layout)
        out = mgr.materialize(sid, ["A", "B"])
        assert out.hidden_states is not None
        assert torch.equal(out.hidden_states["A"], hidden[0:5])
        assert torch.equal(out.hidden_states["B"], torch.cat([hidden[0:4], hidden[5:7]]))
    finally:
        mgr.shutdown()
