"""I7 at landing: an older write that lands after a newer tenant's never overwrites it.

Owns the direct test of ``SlotTenancy.land_all``'s order rule on both of its paths
(a short write, checked without numpy reductions, and a long one): the newer
tenant's rows and version stay in the pool, only the late write's own slots move.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_cache import (
    OmniPrefixCacheUnmatchError,
)
from omni_cache.runtime.block_pool import PrefixBlockPool
from omni_cache.runtime.tenancy import SlotTenancy


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


# ---- I7: the preserved-rows counter counts rows --------------------------------------------
def test_the_preserved_rows_total_counts_each_row_kept_for_a_pin() -> None:
    """Mutant: ``tenancy:SlotTenancy._preserve_locked:int_off:d559aa41`` (the total grows by 2 a row)."""
    ten = SlotTenancy(PrefixBlockPool(8))
    slots_np = np.array([2, 3], dtype=np.int64)
    ten.register(["k"], slots_np, 1, step_id=11)
    ten.land_all({"k": torch.full((2, 3), 1.0)}, torch.from_numpy(slots_np), 1)
    plan = ten.plan(["k"], torch.from_numpy(slots_np))  # pins version 1 of both slots
    ten.register(["k"], slots_np, 2, step_id=12)
    ten.land_all({"k": torch.full((2, 3), 2.0)}, torch.from_numpy(slots_np), 2)  # overwrites the pinned rows
    assert ten.num_preserved_total == 2, "two pinned rows were preserved before the overwrite"
    assert torch.equal(ten.read("k", plan, what="r"), torch.full((2, 3), 1.0))
    ten.unplan(plan)


# ---- I7: a late older write's preserved rows are counted per row ---------------------------
def test_a_late_write_preserves_and_counts_each_pinned_row_once() -> None:
    """Mutant: ``tenancy:SlotTenancy._preserve_late_locked:int_off:d559aa41`` (the total grows by 2 a row)."""
    ten = SlotTenancy(PrefixBlockPool(8))
    slots_np = np.array([2, 3], dtype=np.int64)
    slots_t = torch.from_numpy(slots_np)
    ten.register(["k"], slots_np, 1, step_id=11)
    plan = ten.plan(["k"], slots_t)  # pins version 1, which has not landed yet
    ten.register(["k"], slots_np, 2, step_id=12)  # a newer tenant of the same slots
    ten.land_all({"k": torch.full((2, 3), 2.0)}, slots_t, 2)  # the newer write lands first
    ten.land_all({"k": torch.full((2, 3), 1.0)}, slots_t, 1)  # the older one late: kept for the pin only
    assert ten.num_preserved_total == 2, "two pinned rows of the late write were preserved"
    assert torch.equal(ten.read("k", plan, what="r"), torch.full((2, 3), 1.0)), "the planned version is served"
    assert torch.equal(ten.pool.rows("k", slots_t), torch.full((2, 3), 2.0)), "the pool keeps the newer rows"
    ten.unplan(plan)
    assert ten.num_preserved() == 0


# ---- I7: a planned row overwritten by a newer tenant with no preserved copy ---------------
def _tenancy() -> tuple[SlotTenancy, np.ndarray]:
    return SlotTenancy(PrefixBlockPool(8)), np.array([2, 3], dtype=np.int64)


@pytest.mark.parametrize("num_slots", [4, 8, 9, 24])
def test_a_late_write_never_overwrites_newer_rows_on_short_or_long_slot_lists(num_slots: int) -> None:
    """Mutants: ``tenancy:_all_below:cmp_flip:6543e02d`` (the reduction of a list over 8 slots,
    ``< bound`` -> ``>= bound``) and the same flip of the short list's ``max``. A write of tid 1
    lands late over every slot; a newer tid 2 already landed on the even slots only: the odd
    slots take tid 1's rows, the even ones keep tid 2's (I7), on either side of the 8-slot switch."""
    ten = SlotTenancy(PrefixBlockPool(2 * num_slots))
    slots = np.arange(0, 2 * num_slots, 2, dtype=np.int64)
    even = slots[::2].copy()
    ten.register(["k"], slots, 1, step_id=11)
    ten.register(["k"], even, 2, step_id=12)
    ten.land_all({"k": torch.full((len(even), 3), 2.0)}, torch.from_numpy(even), 2)
    ten.land_all({"k": torch.full((num_slots, 3), 1.0)}, torch.from_numpy(slots), 1)  # late
    want = torch.where(torch.arange(num_slots)[:, None] % 2 == 0, 2.0, 1.0).expand(num_slots, 3)
    assert torch.equal(ten.pool.rows("k", torch.from_numpy(slots)), want)
    assert ten._keys["k"].landed[slots].tolist() == [2 if i % 2 == 0 else 1 for i in range(num_slots)]
    # every slot newer: the late write lands nowhere
    ten = SlotTenancy(PrefixBlockPool(2 * num_slots))
    ten.register(["k"], slots, 1, step_id=11)
    ten.register(["k"], slots, 2, step_id=12)
    ten.land_all({"k": torch.full((num_slots, 3), 2.0)}, torch.from_numpy(slots), 2)
    ten.land_all({"k": torch.full((num_slots, 3), 1.0)}, torch.from_numpy(slots), 1)
    assert torch.equal(ten.pool.rows("k", torch.from_numpy(slots)), torch.full((num_slots, 3), 2.0))
    assert ten._keys["k"].landed[slots].tolist() == [2] * num_slots


def test_an_empty_late_write_lands_as_nothing() -> None:
    """Mutant: ``tenancy:_all_below:cmp_flip:a603cfb3`` (``len(values) <= 8`` -> ``> 8``: an empty
    slot list would go to the numpy reduction, which refuses an empty array). A zero-row write
    (a step whose requests have no rows for a key) that lands after a newer one changes nothing."""
    ten, slots = _tenancy()
    none = np.zeros(0, dtype=np.int64)
    ten.register(["k"], none, 1, step_id=11)
    ten.register(["k"], slots, 2, step_id=12)
    ten.land_all({"k": torch.full((2, 3), 2.0)}, torch.from_numpy(slots), 2)
    ten.land_all({"k": torch.zeros(0, 3)}, torch.from_numpy(none), 1)  # late and empty
    assert torch.equal(ten.pool.rows("k", torch.from_numpy(slots)), torch.full((2, 3), 2.0))
    assert ten._keys["k"].landed[slots].tolist() == [2, 2]


# ---- land_all's row-shape check on the landing path itself ---------------------------------
def test_land_all_lands_a_key_it_has_never_seen() -> None:
    """Mutants: ``tenancy:SlotTenancy.land_all:cmp_flip:706dab0d`` (``known is not None`` ->
    ``is None``) and ``boolop_swap:a25032de`` (``or`` -> ``and``): a key with no versions yet
    (no register before the landing) must land, not crash on its missing versions."""
    ten, slots_np = _tenancy()
    rows = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    ten.land_all({"k": rows}, torch.from_numpy(slots_np), 1)
    assert torch.equal(ten.pool.rows("k", torch.from_numpy(slots_np)), rows)
    assert ten._keys["k"].landed[slots_np].tolist() == [1, 1]


@pytest.mark.parametrize("carried", [False, True], ids=["sig-read-at-landing", "sig-carried-by-the-write"])
def test_land_all_refuses_rows_of_another_width_with_the_contract_error(carried: bool) -> None:
    """Mutant: ``tenancy:SlotTenancy.land_all:boolop_swap:a25032de`` (``or`` -> ``and``): once a key's
    tensor exists, a write of another width must be refused by the row check, naming the
    contract ("width and dtype never change"), not by torch's ``index_copy_`` mid-landing."""
    ten, slots_np = _tenancy()
    slots = torch.from_numpy(slots_np)
    ten.land_all({"k": torch.ones(2, 3)}, slots, 1)
    wide = torch.full((2, 5), 2.0)
    sigs = {"k": (wide.dtype, wide.shape[1:])} if carried else None
    with pytest.raises(OmniPrefixCacheUnmatchError, match="width and dtype never change"):
        ten.land_all({"k": wide}, slots, 2, slots_np=slots_np, sigs=sigs)
    assert torch.equal(ten.pool.rows("k", slots), torch.ones(2, 3))
    assert ten._keys["k"].landed[slots_np].tolist() == [1, 1]
