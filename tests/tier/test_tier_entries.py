"""Tier entries in and out: what a spill file's digest covers, the tier's refusals of bad calls, and
the worker's check of every load's entry against the pool before the first restore.

Protected: a spilled entry of any dtype comes back bit for bit (its digest is computed alike on
write and read); a hash that is not bytes or rows that are not per-token tensors are one
``ValueError`` (with or without a directory); an entry that does not fit the pool (row count,
dtype or row shape against the pool or an earlier entry of the same plan, a key the pool holds
missing) is a counted miss, vacated and dropped from the tier, and never raises after other loads
of its plan were restored -- a key's shape counts from its first registered write, landed or not
(a committer still behind, a deferred write still open), in both directions; a cache started afresh restores what its predecessor stored, and a new
key's pool tensor the allocator refuses is that load's miss.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cache_helpers import BS, config, finished, manager, save, started
from test_disk_level import _applied, _rows
from thread_helpers import Gate

from omni_cache import ModelCachePolicy, OmniPrefixCacheManager
from omni_cache.integration.tier_apply import TierApplier, TierLoad, TierPlan, TierStore
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.tier import HiddenTier


@pytest.mark.parametrize("rows", [
    {"hidden": torch.arange(32, dtype=torch.float32).reshape(4, 8).to(torch.bfloat16)},
    {"hidden": torch.ones(4, 3, dtype=torch.bool), "audio.codes": torch.arange(8, dtype=torch.int8).reshape(4, 2)},
    {"hidden": torch.empty(4, 0)},
], ids=["bfloat16", "bool-int8", "zero-width"])
def test_a_spilled_entry_of_any_dtype_comes_back_bit_for_bit(tmp_path: Path, rows: dict[str, torch.Tensor]) -> None:
    """The rows' digest covers every dtype a pool key may have: a spill and its read agree on it."""
    tier = HiddenTier(0, directory=str(tmp_path))  # nothing fits in memory: every entry spills (a 0-byte one too)
    tier.put(b"h", rows)
    tier.put(b"other", _rows("o"))
    got = tier.get(b"h")
    assert got is not None and set(got) == set(rows)
    assert all(got[k].dtype == rows[k].dtype and torch.equal(got[k], rows[k]) for k in rows)
    stats = tier.stats()
    assert (stats.disk_hits, stats.load_failures) == (1, 0)  # read back from its file


@pytest.mark.parametrize(("call", "arg", "match"), [
    ("put", "h", "a block hash is non-empty bytes"), ("get", "h", "a block hash is non-empty bytes"),
    ("put", b"", "a block hash is non-empty bytes"), ("put", b"h", "'hidden' are not a tensor of one row per token"),
])
def test_a_tier_call_with_a_bad_hash_or_rows_is_one_value_error(tmp_path: Path, call: str, arg: object,
                                                                 match: str) -> None:
    """With or without a directory, a hash that is not bytes and rows that are not per-token tensors are
    refused the same way (ValueError naming them), never a TypeError or IndexError from inside; a hash
    that is not bytes is never ``in`` the tier."""
    for tier in (HiddenTier(1 << 20), HiddenTier(1 << 20, directory=str(tmp_path))):
        assert "h" not in tier and 3 not in tier
        with pytest.raises(ValueError, match=match):
            if call == "put":
                tier.put(arg, {"hidden": torch.tensor(1.0)} if arg == b"h" else _rows("a"))  # type: ignore[arg-type]
            else:
                tier.get(arg)  # type: ignore[arg-type]
        assert tier.stats().puts == 0


@pytest.mark.parametrize("entry", ["wrong dtype", "wrong width", "wrong rows"])
def test_a_tier_entry_that_does_not_fit_the_pool_is_a_miss_and_the_rest_of_the_plan_applies(entry: str) -> None:
    """Every load's entry is checked before the first restore: one that does not fit the pool is a
    counted miss (its block vacated, reported to vLLM), never an exception after other loads were
    restored; the plan's other loads restore their rows."""
    applier, m = _applied()  # the pool holds 'hidden' rows of width 8 (float32)
    good = _rows("g")["hidden"]
    bad = {"wrong dtype": {"hidden": good.to(torch.float64)},
           "wrong width": {"hidden": good[:, :3]},
           "wrong rows": {"hidden": torch.cat([good, good])}}[entry]
    applier.tier.put(b"good", {"hidden": good})
    applier.tier.put(b"bad", bad)
    m.new_step_starts([started("b")])
    failed = applier.apply(TierPlan(loads=(TierLoad("b", 0, b"bad", 5), TierLoad("b", 1, b"good", 6))), m)
    assert failed == {5} and applier.take_load_errors() == {5}
    assert applier.restored_blocks == 1 and applier.num_load_failures == 1
    assert b"bad" not in applier.tier and b"good" in applier.tier  # an entry no load can use is dropped
    why = applier.load_failures[0]["why"]
    assert {"wrong dtype": "width and dtype never change", "wrong width": "width and dtype never change",
            "wrong rows": "8 rows"}[entry] in why
    m.new_step_starts([finished("b"), started("c", hit_end=2 * BS, blocks=[6, 5])])
    step, _ = save(m, [("c", [6, 5, 7], 8, 9)])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="is not readable"):  # block 5 vacated (I6)
        m.materialize(step, ["c"])
    m.shutdown()


def test_a_cache_started_afresh_restores_what_its_predecessor_stored() -> None:
    """The tier outlives a cache (a pipeline's second run, a cache rebuilt on the same worker): its
    entries hold keys the fresh pool never held, and they restore, bit for bit (a key new to the
    pool is not a misfit)."""
    applier, old = _applied()  # 'a' wrote block 2
    applier.apply(TierPlan(stores=(TierStore("a", b"ha", 2),)), old)
    want = applier.tier.get(b"ha")
    old.shutdown()
    fresh = manager(True)
    assert fresh.pool.keys() == []
    fresh.new_step_starts([started("b", hit_end=BS, blocks=[5])])
    assert applier.apply(TierPlan(loads=(TierLoad("b", 0, b"ha", 5),)), fresh) == set()
    step, _ = save(fresh, [("b", [5, 6], BS, BS + 1)])
    got = fresh.materialize(step, ["b"]).hidden_states["b"][:BS]
    assert want is not None and torch.equal(got, want["hidden"]) and applier.num_load_failures == 0
    fresh.shutdown()



def test_a_new_keys_pool_the_allocator_refuses_is_that_loads_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh cache restoring its predecessor's entry allocates the entry's keys' pool tensors first:
    the allocator's refusal is a counted miss naming it (the block vacated), never a restore that
    fails the cache for good."""
    import omni_cache.runtime.block_pool as block_pool

    applier, old = _applied()
    applier.apply(TierPlan(stores=(TierStore("a", b"ha", 2),)), old)
    old.shutdown()
    fresh = manager(True)

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(block_pool.torch, "zeros", refuse)
    fresh.new_step_starts([started("b", hit_end=BS, blocks=[5])])
    assert applier.apply(TierPlan(loads=(TierLoad("b", 0, b"ha", 5),)), fresh) == {5}
    monkeypatch.undo()
    assert fresh.stats()["failed"] is None and applier.num_load_failures == 1
    assert "cannot allocate the block pool of 'hidden'" in applier.load_failures[0]["why"]
    assert applier.tier.get(b"ha") is not None, "an entry the pool could not take now is kept for later"
    fresh.shutdown()


def test_entries_of_one_plan_that_disagree_on_a_new_key_restore_the_first_only() -> None:
    """A fresh pool holds no key: the first entry of a plan fixes a key's dtype and width, and a later
    entry of the same plan that disagrees is a miss (checked before any restore), never a refusal raised
    after the first was restored; an entry without a key the pool holds is a miss too (its block would
    read "is not readable" there)."""
    applier = TierApplier(HiddenTier(1 << 20), BS)
    fresh = manager(True)
    good = _rows("g")["hidden"]
    applier.tier.put(b"f32", {"hidden": good})
    applier.tier.put(b"f64", {"hidden": good.to(torch.float64)})
    applier.tier.put(b"more", {"hidden": good, "audio.codes": good[:, :2]})
    applier.tier.put(b"less", {"hidden": good})
    fresh.new_step_starts([started("b")])
    plan = TierPlan(loads=(TierLoad("b", 0, b"f32", 5), TierLoad("b", 1, b"f64", 6)))
    assert applier.apply(plan, fresh) == {6} and applier.restored_blocks == 1
    assert "width and dtype never change" in applier.load_failures[0]["why"]
    assert applier.apply(TierPlan(loads=(TierLoad("b", 2, b"more", 7),)), fresh) == set()  # brings audio.codes
    assert applier.apply(TierPlan(loads=(TierLoad("b", 3, b"less", 8),)), fresh) == {8}
    assert "lacks key(s) ['audio.codes']" in applier.load_failures[-1]["why"]
    fresh.shutdown()



def test_an_entry_against_a_write_the_committer_has_not_landed_yet_is_a_miss() -> None:
    """With the committer thread, a save's write may still be in transit when the next step's plan is
    applied: its keys' dtype and width are fixed already, so an entry of another dtype is a counted
    miss (as in eager mode), never a restore that fails the cache at its landing (I8)."""
    gate = Gate("before_pool_write", first_only=True)
    m = OmniPrefixCacheManager(config(), eager=False, faults=gate)
    applier = TierApplier(HiddenTier(1 << 20), BS)
    m.new_step_starts([started("a")])
    first, rows = save(m, [("a", [2], 0, 4)])  # float32 rows of width 8, held before their landing
    assert gate.entered.wait(5)
    applier.tier.put(b"bad", {"hidden": _rows("g")["hidden"].to(torch.float64)})
    m.new_step_starts([started("b")])
    try:
        assert applier.apply(TierPlan(loads=(TierLoad("b", 0, b"bad", 5),)), m) == {5}
        assert "width and dtype never change" in applier.load_failures[0]["why"]
    finally:
        gate.release.set()
    assert torch.equal(m.materialize(first, ["a"]).hidden_states["a"], rows)
    assert m.stats()["failed"] is None and applier.num_load_failures == 1
    assert m.shutdown() == {}


def test_a_save_against_a_restore_the_committer_has_not_landed_yet_is_refused_before_its_claim() -> None:
    """The other direction: a restore registered a key new to the pool (float64) whose rows have not
    landed; a save bringing that key as float32 is refused before it claims anything, and the cache
    goes on (no landing of mismatched rows, I8)."""
    gate = Gate("before_pool_write", first_only=True)
    m = OmniPrefixCacheManager(config(), eager=False, faults=gate)
    applier = TierApplier(HiddenTier(1 << 20), BS)
    applier.tier.put(b"h", {"hidden": _rows("g")["hidden"], "x": torch.ones(BS, 2, dtype=torch.float64)})
    m.new_step_starts([started("b", hit_end=BS, blocks=[5])])
    try:
        assert applier.apply(TierPlan(loads=(TierLoad("b", 0, b"h", 5),)), m) == set()
        assert gate.entered.wait(5)
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"block pool key 'x' holds rows of shape \(2,\) "
                           r"torch.float64; this step brought rows of shape \(2,\) torch.float32"):
            save(m, [("b", [5, 6], BS, BS + 1)], mm={"x": torch.ones(1, 2)})
        assert m.stats()["staging"]["claims"] == 0
    finally:
        gate.release.set()
    step, _ = save(m, [("b", [5, 6], BS, BS + 1)], mm={"x": torch.ones(1, 2, dtype=torch.float64)})
    out = m.materialize(step, ["b"])
    assert torch.equal(out.mm_outputs["x"]["b"][:BS], torch.ones(BS, 2, dtype=torch.float64))
    assert m.stats()["failed"] is None and m.shutdown() == {}


def test_an_entry_against_an_open_deferred_write_is_a_miss_and_the_rest_of_the_plan_applies() -> None:
    """A deferred key's write stays open while its request runs (its rows not in the pool yet), but
    the key is held: an entry of another dtype for it, or one without it, is a counted miss checked
    before the first restore (never a refusal raised after the plan's other loads were restored),
    vacated and dropped from the tier; an entry that fits restores."""
    m = manager(True)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"})))
    m.new_step_starts([started("a")])
    first, _ = save(m, [("a", [2], 0, 4)], mm={"audio": torch.ones(4, 2)})
    m.discard_step(first)
    applier = TierApplier(HiddenTier(1 << 20), BS)
    hidden = _rows("g")["hidden"]
    applier.tier.put(b"lacking", {"hidden": hidden})
    applier.tier.put(b"bad", {"hidden": hidden, "audio": torch.ones(BS, 2, dtype=torch.float64)})
    applier.tier.put(b"fits", {"hidden": hidden, "audio": torch.full((BS, 2), 3.0)})
    m.new_step_starts([started("b")])
    plan = TierPlan(loads=(TierLoad("b", 0, b"lacking", 5), TierLoad("b", 1, b"bad", 6), TierLoad("b", 2, b"fits", 7)))
    assert applier.apply(plan, m) == {5, 6}
    assert applier.restored_blocks == 1 and applier.num_load_failures == 2
    whys = [f["why"] for f in applier.load_failures]
    assert "lacks key(s) ['audio']" in whys[0] and "'audio' holds rows of shape (2,) torch.float32" in whys[1], whys
    assert b"bad" not in applier.tier and b"lacking" not in applier.tier and b"fits" in applier.tier
    assert m.stats()["failed"] is None and m.shutdown() == {}


def test_no_block_is_stored_while_a_held_key_has_no_rows_in_the_pool() -> None:
    """A deferred key's write is still open (the key is held, no row of it landed anywhere): an entry
    stored now would lack it and every restore would refuse it, so no block is stored until it lands."""
    from omni_cache.runtime.tier_rows import block_rows

    m = manager(True)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"})))
    m.new_step_starts([started("a")])
    first, _ = save(m, [("a", [2], 0, 4)], mm={"audio": torch.ones(4, 2)})
    m.discard_step(first)
    block = torch.arange(2 * BS, 3 * BS)
    assert sorted(m.pool.sigs()) == ["audio", "hidden"] and m.pool.keys() == ["hidden"]
    assert block_rows(m, block) is None
    m.new_step_starts([finished("a")])  # the deferred write lands at the finish (I9)
    stored = block_rows(m, block)
    assert stored is not None and sorted(stored) == ["audio", "hidden"]
    assert torch.equal(stored["audio"], torch.ones(BS, 2))
    assert m.shutdown() == {}
