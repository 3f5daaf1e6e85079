"""I7 at landing: an older write that lands after a newer tenant's never overwrites it.

Owns the direct test of ``SlotTenancy.land_all``'s order rule on both of its paths
(a short write, checked without numpy reductions, and a long one): the newer
tenant's rows and version stay in the pool, only the late write's own slots move.
"""

from __future__ import annotations

import pytest
import torch

from omni_cache.block_pool import PrefixBlockPool
from omni_cache.tenancy import SlotTenancy


@pytest.mark.parametrize("num_rows", [8, 200])  # the short (<= 8 slots) and the numpy path
def test_a_late_older_write_never_overwrites_a_newer_tenant(num_rows: int) -> None:
    pool = PrefixBlockPool(1024)
    tenancy = SlotTenancy(pool)
    slots = torch.arange(100, 100 + num_rows)
    older = {"k": torch.full((num_rows, 4), 1.0)}
    newer = {"k": torch.full((num_rows, 4), 2.0)}
    tenancy.register(["k"], slots.numpy(), 1, step_id=1)
    tenancy.register(["k"], slots[: num_rows // 2].numpy(), 2, step_id=2)  # a newer tenant of half the slots
    tenancy.land_all({"k": newer["k"][: num_rows // 2]}, slots[: num_rows // 2], 2)
    tenancy.land_all(older, slots, 1)  # the older write lands late, over all the slots
    rows = pool.rows("k", slots)
    half = num_rows // 2
    assert torch.equal(rows[:half], newer["k"][:half]), "a late older write overwrote a newer tenant (I7)"
    assert torch.equal(rows[half:], older["k"][half:]), "the late write's own slots did not land"
    assert tenancy._keys["k"].landed[slots[:half].numpy()].tolist() == [2] * half
    assert tenancy._keys["k"].landed[slots[half:].numpy()].tolist() == [1] * (num_rows - half)
