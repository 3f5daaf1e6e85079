"""The output KV-cache group: hits are read from ``block_ids[output_group_id]`` (I5).

Events carry one tuple of block ids per KV-cache group (vLLM's hybrid manager:
sliding-window groups beside a full-attention one). A manager whose
``PrefixCacheConfig.output_group_id`` names the full-attention group must serve
a hit from that group's blocks, never from group 0's (a sliding-window group's
blocks hold the null block for positions outside the window); an event without
the group is refused with the group named, changing nothing.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cache_helpers import MODES, E, manager, save

from omni_cache import OmniPrefixCacheUnmatchError, PrefixCacheConfig, PrefixCacheRequestEvent
from omni_cache.integration.adapter import PrefixCacheSchedulerAdapter

# group 0: a sliding-window group (null block 0 outside the window); group 1: full attention
SLIDING = (0, 0, 7)
FULL = (4, 5, 9)


def _hybrid_started(req: str, hit_end: int, groups: tuple[tuple[int, ...], ...]) -> PrefixCacheRequestEvent:
    return PrefixCacheRequestEvent(req, E.STARTED, 0, hit_end, groups)


def test_output_group_id_defaults_to_zero_and_is_validated() -> None:
    assert PrefixCacheConfig(num_blocks=4, block_size=4).output_group_id == 0
    assert PrefixCacheConfig.from_vllm_config(num_blocks=4, block_size=4, output_group_id=3).output_group_id == 3
    for bad in (-1, True, 1.0, "1"):
        with pytest.raises(ValueError, match="output_group_id must be an int >= 0"):
            PrefixCacheConfig(num_blocks=4, block_size=4, output_group_id=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("eager", MODES)
def test_a_hit_is_read_from_the_output_groups_blocks(eager: bool) -> None:
    m = manager(eager, output_group_id=1)
    m.new_step_starts([_hybrid_started("a", 0, ((1, 2, 3), FULL))])
    s1, rows_a = save(m, [("a", list(FULL), 0, 12)])  # the step's slots: the full-attention group's
    m.materialize(s1, ["a"])
    m.new_step_starts([_hybrid_started("b", 8, (SLIDING, (4, 5, 11)))])
    s2, rows_b = save(m, [("b", [4, 5, 11], 8, 12)])
    out = m.materialize(s2, ["b"]).hidden_states["b"]
    assert torch.equal(out, torch.cat([rows_a[:8], rows_b]))
    assert m.stats()["hit_tokens"] == 8
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_an_event_without_the_output_group_is_refused_and_changes_nothing(eager: bool) -> None:
    m = manager(eager, output_group_id=1)
    before = m.stats()
    with pytest.raises(OmniPrefixCacheUnmatchError,
                       match=r"carries no block_ids for KV-cache group 1 \(output_group_id; the event carries 1 groups\)"):
        m.new_step_starts([_hybrid_started("b", 8, (FULL,))])
    assert m.stats() == before
    m.shutdown()


def test_the_adapter_keeps_every_group_for_the_manager_to_choose() -> None:
    """vLLM's ``NewRequestData.block_ids`` is one list per group; the event keeps them all, in order."""

    new = SimpleNamespace(req_id="b", num_computed_tokens=8, block_ids=([0, 0, 7], [4, 5, 11]))
    so = SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens={"b": 4})
    (event,) = PrefixCacheSchedulerAdapter().translate_scheduler_output(so)
    assert event.block_ids == (SLIDING, (4, 5, 11))
    assert event.group_block_ids(1) == (4, 5, 11) and event.group_block_ids(2) == ()
