"""I7 at landing: an older write that lands after a newer tenant's never overwrites it.

Owns the direct test of ``SlotTenancy.land_all``'s order rule on both of its paths
(a short write, checked without numpy reductions, and a long one): the newer
tenant's rows and version stay in the pool, only the late write's own slots move. Through the
manager: an older write that lands after a newer tenant's keeps its rows for a pinned read
(async), and a new tenant's deferred write first queues the older tenant's open one.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from cache_helpers import E, aborted, config, finished, manager, save, settle, slots, started, truth
from thread_helpers import Gate

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheRequestEvent,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.block_pool import PrefixBlockPool
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.runtime.tenancy import SlotTenancy

K = "mm.k"  # a per-token key beside hidden


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
    """The preserved-rows total counts each row kept for a pinned read exactly once (I7's bound).

    Kills the mutant: ``tenancy:SlotTenancy._preserve_locked:int_off:d559aa41`` (the total grows by 2 a
    row).

    The preserved-rows total counts each row kept for a pinned read exactly once (I7's bound)."""
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
    """A late write preserves each row a pinned read needs, and counts it once (I7).

    Kills the mutant: ``tenancy:SlotTenancy._preserve_late_locked:int_off:d559aa41`` (the total grows by 2
    a row).

    A late write preserves each row a pinned read needs, and counts it once (I7)."""
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
    """A late older write never overwrites a newer tenant's rows, on short and long slot lists alike (I7).

    A write of tid 1
    lands late over every slot; a newer tid 2 already landed on the even slots only: the odd
    slots take tid 1's rows, the even ones keep tid 2's (I7), on either side of the 8-slot switch.

    Kills the mutants: ``tenancy:_all_below:cmp_flip:6543e02d`` (the reduction of a list over 8 slots, ``<
    bound`` -> ``>= bound``) and the same flip of the short list's ``max``.

    A late older write never overwrites a newer tenant's rows, on short and long slot lists alike (I7)."""
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
    """A zero-row write that lands after a newer one changes nothing (I7).

    A zero-row write
    (a step whose requests have no rows for a key) that lands after a newer one changes nothing.

    Kills the mutant: ``tenancy:_all_below:cmp_flip:a603cfb3`` (``len(values) <= 8`` -> ``> 8``: an empty
    slot list would go to the numpy reduction, which refuses an empty array).

    A zero-row write that lands after a newer one changes nothing (I7)."""
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
    """Landing rows of a key the pool has never seen creates the key; it never crashes on missing versions.

    Kills the mutants: ``tenancy:SlotTenancy.land_all:cmp_flip:706dab0d`` (``known is not None`` -> ``is
    None``) and ``boolop_swap:a25032de`` (``or`` -> ``and``): a key with no versions yet (no register
    before the landing) must land, not crash on its missing versions.

    Landing rows of a key the pool has never seen creates the key; it never crashes on missing versions."""
    ten, slots_np = _tenancy()
    rows = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    ten.land_all({"k": rows}, torch.from_numpy(slots_np), 1)
    assert torch.equal(ten.pool.rows("k", torch.from_numpy(slots_np)), rows)
    assert ten._keys["k"].landed[slots_np].tolist() == [1, 1]


@pytest.mark.parametrize("carried", [False, True], ids=["sig-read-at-landing", "sig-carried-by-the-write"])
def test_land_all_refuses_rows_of_another_width_with_the_contract_error(carried: bool) -> None:
    """Landing rows of another width for a known key is refused with the contract error ("width and dtype
    never change"), never by torch mid-landing.

    Kills the mutant: ``tenancy:SlotTenancy.land_all:boolop_swap:a25032de`` (``or`` -> ``and``): once a
    key's tensor exists, a write of another width must be refused by the row check, naming the contract
    ("width and dtype never change"), not by torch's ``index_copy_`` mid-landing.

    Landing rows of another width for a known key is refused with the contract error ("width and dtype
    never change"), never by torch mid-landing."""
    ten, slots_np = _tenancy()
    slots = torch.from_numpy(slots_np)
    ten.land_all({"k": torch.ones(2, 3)}, slots, 1)
    wide = torch.full((2, 5), 2.0)
    sigs = {"k": (wide.dtype, wide.shape[1:])} if carried else None
    with pytest.raises(OmniPrefixCacheUnmatchError, match="width and dtype never change"):
        ten.land_all({"k": wide}, slots, 2, slots_np=slots_np, sigs=sigs)
    assert torch.equal(ten.pool.rows("k", slots), torch.ones(2, 3))
    assert ten._keys["k"].landed[slots_np].tolist() == [1, 1]


def test_delayed_hit_survives_newer_tenant_pushed_ahead_async() -> None:
    held: set[int] = set()  # the steps whose writes' device->host copy waits for the release
    gate = Gate("before_device_to_host", lambda write: write.step_id in held)
    m = OmniPrefixCacheManager(config(), eager=False, faults=gate)
    m.register_policy(ModelCachePolicy(needs_full_hidden_states=False, deferred_keys=frozenset({"audio"})))
    try:
        m.new_step_starts([started("Z")])
        s0, _ = save(m, [("Z", [5], 0, 4)], hidden=False, mm_keys=("audio",))
        m.discard_step(s0)
        held.add(s0)
        m.new_step_starts([finished("Z")])
        assert gate.entered.wait(5)  # the committer is busy with Z's write
        m.new_step_starts([started("A")])
        s1, _ = save(m, [("A", [0], 0, 4)], hidden=False, mm_keys=("audio",))  # A's deferred write T1: pending
        m.discard_step(s1)
        m.new_step_starts([started("C", 4, [0, 1])])
        s2, _ = save(m, [("C", [0, 1], 4, 6)], hidden=False, mm_keys=("audio",))  # plans T1; T1 queued
        m.new_step_starts([finished("A"), aborted("C"), started("B")])
        s3, _ = save(m, [("B", [0], 0, 4)], hidden=False, mm_keys=("audio",))  # new tenant T3 of block 0
        m.discard_step(s3)
        m.new_step_starts([finished("B")])  # T3 jumps to the front, ahead of the queued T1
        gate.release.set()
        deadline = time.monotonic() + 5
        while m.stats()["write_queue"] and time.monotonic() < deadline:
            time.sleep(0.01)
        out = m.materialize(s2, ["C"])
        want = torch.cat([truth("Aaudio", range(0, 4), 4), truth("Caudio", range(4, 6), 4)])
        assert torch.equal(out.mm_outputs["audio"]["C"], want)
    finally:
        gate.release.set()
        m.shutdown()


def test_a_new_tenants_deferred_write_first_lands_the_older_tenants_open_one() -> None:
    """A new tenant's deferred write first queues the older tenant's open write on the same slots, so the
    older one never lands last (I7, contract 4.6).

    A's deferred K on block 0 is still open (A is live: the engine preempted
    it and gave block 0 to B). B's save registers its own deferred K there: the older tenant's open
    write is found and queued first (eager: it lands in the save), so a late landing of A's K can
    never come after B's (contract 4.6's "older tenants first"); B's own K stays open.

    Kills the mutant: ``tenancy:SlotTenancy.register:negate_cond:f178e4b5`` (the older-tenant scan done
    for the wrong schedule).

    A new tenant's deferred write first queues the older tenant's open write on the same slots, so the
    older one never lands last (I7, contract 4.6)."""
    m = manager()
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({K})))
    m.new_step_starts([started("A", scheduled=4), started("B", scheduled=4)])
    layout_a = PrefixCacheWriteLayout.packed([("A", 0, 4)], slots([0], 0, 4))
    m.materialize(m.save_outputs(truth("A", range(4)), {K: torch.ones(4, 3)}, num_tokens_unpadded=4,
                                 num_tokens_padded=4, write_layout=layout_a), ["A"])
    assert m.stats()["deferred_open"] == 1  # A's K: open until A finishes
    layout_b = PrefixCacheWriteLayout.packed([("B", 0, 4)], slots([0], 0, 4))  # block 0 again: B is its tenant
    step_b = m.save_outputs(truth("B", range(4)), {K: torch.full((4, 3), 2.0)}, num_tokens_unpadded=4,
                            num_tokens_padded=4, write_layout=layout_b)
    # Open now: B's own K only (A's, behind B's on the same slots, was queued and landed).
    assert m.stats()["deferred_open"] == 1, "B's save left the older tenant's deferred write open"
    m.materialize(step_b, ["B"])
    m.new_step_starts([PrefixCacheRequestEvent("B", E.FINISHED)])
    settle(m)
    assert torch.equal(m.pool.rows(K, slots([0], 0, 4)), torch.full((4, 3), 2.0))  # B's rows, never A's
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED)])
    assert torch.equal(m.pool.rows(K, slots([0], 0, 4)), torch.full((4, 3), 2.0))
    m.shutdown()


# ---- versions across a key added later, and writes of some keys only ----------------------
@pytest.mark.parametrize("scan_older", [False, True], ids=["one-call", "per-key"])
def test_a_key_added_later_keeps_every_earlier_keys_versions_and_a_partial_write_leaves_the_rest_absent(
    scan_older: bool,
) -> None:
    """The version table grows a column group per new key (every vector a view of it); the writes of
    every key register and land in one call, a write of some keys per key. Whatever the path, a
    read gets exactly the landed version of its key, and a key the slots' tenant did not write is
    absent there (I6/I7)."""
    pool = PrefixBlockPool(64)
    ten = SlotTenancy(pool)
    first, second, third = torch.arange(0, 4), torch.arange(4, 8), torch.arange(8, 10)
    rows = {tag: torch.full((4, 2), float(tag)) for tag in (1, 2, 3)}
    # every key (without the older-tenant scan, as a save registers): one call; with the scan: per key
    ten.register(["a"], first.numpy(), 1, step_id=1, scan_older=scan_older)
    ten.land_all({"a": rows[1]}, first, 1)
    ten.register(["a", "b"], second.numpy(), 2, step_id=2, scan_older=scan_older)  # adds "b": the table grows
    ten.land_all({"a": rows[2], "b": -rows[2]}, second, 2)
    ten.register(["a"], third.numpy(), 3, step_id=3)  # some keys only: per key
    ten.land_all({"a": rows[3][:2]}, third, 3)

    def read(key: str, at: torch.Tensor) -> torch.Tensor:
        plan = ten.plan([key], at)
        try:
            return ten.read(key, plan, what="test")
        finally:
            ten.unplan(plan)

    assert torch.equal(read("a", first), rows[1]), "the landed version of an earlier key moved when a key was added"
    assert torch.equal(read("a", second), rows[2]) and torch.equal(read("b", second), -rows[2])
    assert torch.equal(read("a", third), rows[3][:2])
    for unwritten in (first, third):  # "b" was never written by these slots' tenant
        with pytest.raises(OmniPrefixCacheUnmatchError, match="is not readable"):
            read("b", unwritten)
    assert ten._keys["a"].landed[:10].tolist() == [1] * 4 + [2] * 4 + [3] * 2
    assert ten._keys["b"].landed[:10].tolist() == [0] * 4 + [2] * 4 + [0] * 2


def test_a_landing_that_fails_at_a_later_key_leaves_the_earlier_keys_at_the_new_version() -> None:
    """Keys land one after another: when a later key's scatter raises, an earlier key's rows are in
    the pool already, so its slots read as the new version and a read planned at the older version
    gets the rows preserved for it, never the new ones (I7)."""
    pool = PrefixBlockPool(64)
    ten = SlotTenancy(pool)
    at = torch.arange(0, 4)
    ten.register(["a", "b"], at.numpy(), 1, step_id=1, scan_older=False)
    ten.land_all({"a": torch.full((4, 2), 1.0), "b": torch.full((4, 2), 1.0)}, at, 1)
    plan = ten.plan(["a"], at)  # a hit pins version 1 of "a"
    ten.register(["a", "b"], at.numpy(), 2, step_id=2, scan_older=False)
    with pytest.raises(IndexError):  # "a" lands, then "b"'s rows do not match its slots
        ten.land_all({"a": torch.full((4, 2), 2.0), "b": torch.full((3, 2), 2.0)}, at, 2)
    assert ten._keys["a"].landed[:4].tolist() == [2] * 4 and ten._keys["b"].landed[:4].tolist() == [1] * 4
    assert torch.equal(ten.read("a", plan, what="test"), torch.full((4, 2), 1.0)), "a planned read got rows it did not plan"
    ten.unplan(plan)
