"""A slot mapping the engine's block tables cannot have produced is refused, never served.

Protected ("slot mapping covers", contract section 4.3, I4/I5): two rows of one step mapped to one
KV slot (the second would overwrite the first, and a later hit would read it as the first's) and
a request whose new rows map into the blocks of its own pending hit (its cached prefix would be
overwritten by, and then read back as, its own new rows). Each refusal names the rows (request and
position) and the slot, changes nothing (no staging claim, no step id, the hit still pending), and
the same step with a correct mapping is then served the true rows: in eager and async mode, on a
decode-sized step and on one of more than 256 rows.
"""

from __future__ import annotations

import pytest
import torch
from cache_helpers import MODES, WIDTH, manager, save, slots, staging_claims, started, truth

from omni_cache import OmniPrefixCacheUnmatchError, PrefixCacheWriteLayout
from omni_cache.runtime.errors import PHRASE_SLOT_MAPPING


def _save_mapped(m, spans, slot_ids):  # type: ignore[no-untyped-def]
    rows = torch.cat([truth(r, range(s, e), WIDTH) for r, s, e in spans])
    layout = PrefixCacheWriteLayout.packed(spans, slot_ids)
    n = rows.shape[0]
    return m.save_outputs(rows, None, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout), rows


@pytest.mark.parametrize("eager", MODES)
@pytest.mark.parametrize("size", [4, 300], ids=["decode-sized", "over-256-rows"])
def test_I5_two_rows_at_one_kv_slot_are_refused_naming_both(eager: bool, size: int) -> None:
    m = manager(eager, num_blocks=256, staging_capacity_tokens=512)
    m.new_step_starts([started("a"), started("b")])
    half = size // 2
    good = torch.cat([slots(range(0, 128), 0, half), slots(range(128, 256), 0, size - half)])
    bad = good.clone()
    bad[size - 1] = good[1]  # b's last row onto a's second slot
    claims = staging_claims(m)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_SLOT_MAPPING) as info:
        _save_mapped(m, [("a", 0, half), ("b", 0, size - half)], bad)
    message = str(info.value)
    assert f"row 1 (request 'a', position 1) and row {size - 1} (request 'b', position {size - half - 1}) both " \
           f"map to KV slot {int(good[1])}" in message
    assert staging_claims(m) == claims and m.stats()["unconsumed_step_ids"] == {}
    step, rows = _save_mapped(m, [("a", 0, half), ("b", 0, size - half)], good)
    out = m.materialize(step, ["a", "b"]).hidden_states
    assert torch.equal(out["a"], rows[:half]) and torch.equal(out["b"], rows[half:])
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_I5_new_rows_mapped_into_the_requests_own_hit_are_refused(eager: bool) -> None:
    """a is saved on blocks 3,4,5; b hits a's first two blocks and computes its third position range
    on block 9. A mapping that puts b's new rows into block 3 (its own hit) is refused; b's hit is
    still pending afterwards and the correct mapping serves b a's prefix then its own rows."""
    m = manager(eager)
    m.new_step_starts([started("a")])
    s1, rows_a = save(m, [("a", [3, 4, 5], 0, 12)])
    m.materialize(s1, ["a"])
    m.new_step_starts([started("b", hit_end=8, blocks=[3, 4, 9])])
    claims = staging_claims(m)
    wrong = slots([3], 0, 4)  # positions 8..11 written over the hit's first block
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_SLOT_MAPPING) as info:
        _save_mapped(m, [("b", 8, 12)], wrong)
    assert f"request 'b' outside its own hit, but its position 8 is at KV slot {int(wrong[0])}, in block 3 of its " \
           "hit [0, 8) (blocks [3, 4])" in str(info.value)
    assert staging_claims(m) == claims and m.stats()["unconsumed_step_ids"] == {}
    step, rows_b = _save_mapped(m, [("b", 8, 12)], slots([3, 4, 9], 8, 12))
    served = m.materialize(step, ["b"]).hidden_states["b"]
    assert torch.equal(served, torch.cat([rows_a[:8], rows_b]))
    m.shutdown()
