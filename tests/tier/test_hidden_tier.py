"""The hidden-state tier without vLLM: ``HiddenTier`` and rows in and out of the block pool.

A block's rows go to the tier under its hash (``block_rows`` through a planned
read: the tenant's version or nothing) and come back as a new write into the
block's *new* slots (``restore_rows``): the hit read that follows serves exactly
them, a key the entry lacks is refused ("is not readable"), and a previous
tenant's late write never lands over them.
"""

from __future__ import annotations

import pytest
import torch
from cache_helpers import BS, MODES, finished, manager, save, settle, slots, started, truth

from omni_cache.integration.tier_apply import TierApplier, TierLoad, TierPlan, TierStore
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.tier import HiddenTier
from omni_cache.runtime.tier_rows import block_rows, restore_rows


def _rows(tag: str, n: int = 4) -> dict[str, torch.Tensor]:
    return {"hidden": truth(tag, range(n)), "audio.codes": -truth(tag, range(n))[:, :2]}


ENTRY = sum(t.nbytes for t in _rows("x").values())


def test_get_returns_exactly_the_newest_put_as_private_copies() -> None:
    tier = HiddenTier(10 * ENTRY)
    first, second = _rows("a"), _rows("b")
    assert tier.put(b"h", first) and tier.put(b"h", second)
    got = tier.get(b"h")
    assert got is not None and all(torch.equal(got[k], second[k]) for k in second)
    got["hidden"].zero_()
    second["hidden"].zero_()
    again = tier.get(b"h")
    assert again is not None and torch.equal(again["hidden"], truth("b", range(4)))
    assert tier.get(b"other") is None
    assert tier.stats().entries == 1 and tier.stats().bytes == ENTRY


def test_the_counters_start_at_zero_and_count_each_call_once() -> None:
    """``stats()`` is what the worker's summary and the metrics report: exact counts, from zero."""
    from dataclasses import asdict

    tier = HiddenTier(10 * ENTRY)
    assert set(asdict(tier.stats()).values()) == {0}
    tier.put(b"h", _rows("a"))
    assert tier.get(b"h") is not None and tier.get(b"h") is not None and tier.get(b"other") is None
    s = asdict(tier.stats())
    assert {k: v for k, v in s.items() if v} == {"entries": 1, "bytes": ENTRY, "puts": 1, "hits": 2, "misses": 1}


def test_lru_eviction_under_the_byte_budget() -> None:
    tier = HiddenTier(2 * ENTRY)
    tier.put(b"1", _rows("1"))
    tier.put(b"2", _rows("2"))
    assert tier.get(b"1") is not None  # 1 is now the most recently used
    tier.put(b"3", _rows("3"))
    assert b"2" not in tier and b"1" in tier and b"3" in tier
    s = tier.stats()
    assert (s.entries, s.bytes, s.evictions) == (2, 2 * ENTRY, 1)
    assert not HiddenTier(ENTRY - 1).put(b"big", _rows("big"))  # never stored half


def test_the_safetensors_level_keeps_what_memory_evicts(tmp_path) -> None:
    tier = HiddenTier(ENTRY, directory=str(tmp_path))
    tier.put(b"1", _rows("1"))
    tier.put(b"2", _rows("2"))  # 1 spills to disk
    s = tier.stats()
    assert s.spilled == 1 and s.entries == 1
    got = tier.get(b"1")
    assert got is not None and all(torch.equal(got[k], _rows("1")[k]) for k in got)
    assert tier.stats().disk_hits == 1


def test_a_file_of_another_hash_is_never_served(tmp_path) -> None:
    tier = HiddenTier(ENTRY, directory=str(tmp_path))
    tier.put(b"1", _rows("1"))
    tier.put(b"2", _rows("2"))
    path_1 = tier._path(b"1")
    impostor = HiddenTier(0, directory=str(tmp_path))
    impostor._path = lambda h: path_1  # type: ignore[method-assign]  # a digest collision
    assert impostor.get(b"9") is None


@pytest.mark.parametrize("eager", MODES)
def test_rows_stored_from_old_slots_come_back_into_new_slots_and_serve_the_hit(eager: bool) -> None:
    m = manager(eager)
    m.new_step_starts([started("a")])
    s1, rows_a = save(m, [("a", [1, 2], 0, 8)], mm_key="audio.codes")
    m.materialize(s1, ["a"])
    settle(m)
    stored = block_rows(m, slots([2], 0, BS))  # block 2 holds positions 4..7 of "a"
    assert stored is not None and torch.equal(stored["hidden"], rows_a[4:8])
    # the content comes back into new block 7 for "b" (block 1 still local): hit of 8 tokens
    restore_rows(m, slots([7], 0, BS), stored)
    m.new_step_starts([finished("a"), started("b", hit_end=8, blocks=[1, 7, 9])])
    s2, rows_b = save(m, [("b", [1, 7, 9], 8, 10)], mm_key="audio.codes")
    out = m.materialize(s2, ["b"])
    assert torch.equal(out.hidden_states["b"], torch.cat([rows_a[:8], rows_b]))
    assert torch.equal(out.mm_outputs["audio.codes"]["b"][:8], -rows_a[:8, :2])
    m.shutdown()


def test_a_key_the_tier_entry_lacks_is_refused_never_served_from_the_old_tenant() -> None:
    m = manager(True)
    m.new_step_starts([started("a")])
    s1, _ = save(m, [("a", [3], 0, 4)], mm_key="audio.codes")  # block 3: hidden and audio.codes
    m.materialize(s1, ["a"])
    m.new_step_starts([finished("a")])
    restore_rows(m, slots([3], 0, BS), {"hidden": truth("c", range(4))})  # no audio.codes
    m.new_step_starts([started("c", hit_end=4, blocks=[3, 5])])
    s2, _ = save(m, [("c", [3, 5], 4, 6)], mm_key="audio.codes")
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"'audio\.codes' at KV slot 12 is not readable"):
        m.materialize(s2, ["c"])
    m.shutdown()


def test_a_previous_tenants_late_deferred_write_never_lands_over_restored_rows() -> None:
    m = manager(True)
    m.register_policy(__import__("omni_cache").ModelCachePolicy(deferred_keys=frozenset({"audio.embeds"})))
    m.new_step_starts([started("a")])
    emb = torch.full((4, 3), 5.0)
    s1, _ = save(m, [("a", [4], 0, 4)], mm={"audio.embeds": emb})  # deferred: lands at a's finish
    m.materialize(s1, ["a"])
    assert [w.state for w in m.book.live()] == ["pending"]
    restored = {"hidden": truth("r", range(4)), "audio.embeds": torch.full((4, 3), 9.0)}
    restore_rows(m, slots([4], 0, BS), restored)  # block 4 reassigned while a's write is still open
    m.new_step_starts([finished("a"), started("r", hit_end=4, blocks=[4, 6])])
    s2, _ = save(m, [("r", [4, 6], 4, 5)], mm={"audio.embeds": torch.zeros(1, 3)})
    out = m.materialize(s2, ["r"])
    assert torch.equal(out.hidden_states["r"][:4], restored["hidden"])
    assert torch.equal(out.mm_outputs["audio.embeds"]["r"][:4], restored["audio.embeds"])
    m.shutdown()


def test_a_refused_restore_changes_nothing() -> None:
    m = manager(True)
    before = m.tenancy._table.copy()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="3 rows for 4 KV slots"):
        restore_rows(m, slots([2], 0, BS), {"hidden": truth("x", range(3))})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="out of range"):
        restore_rows(m, torch.arange(10_000, 10_004), {"hidden": truth("x", range(4))})
    assert (m.tenancy._table == before).all() and not m.book.live()
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_a_restore_that_fails_once_registered_fails_the_manager_for_good(eager: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A restored block's write is registered (its version published) before it is queued: a failure
    while queuing it cannot be undone, so the manager fails for good (I8) instead of leaving a write
    nobody queues for the next save to wait on."""
    m = manager(eager)

    def boom(*args: object, **kwargs: object) -> list[object]:
        raise MemoryError("copy queue")

    monkeypatch.setattr(m.book, "enqueue", boom)
    with pytest.raises(MemoryError, match="copy queue"):
        restore_rows(m, slots([2], 0, BS), {"hidden": truth("x", range(4))})
    monkeypatch.undo()
    failed = m.stats()["failed"]
    assert failed is not None and "tier restore" in failed and not m.book.live(), m.stats()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="write failed"):
        save(m, [("a", [3], 0, 4)])
    m.shutdown()


def test_the_applier_stores_before_it_loads_and_counts_a_miss() -> None:
    m = manager(True)
    m.new_step_starts([started("a")])
    s1, rows_a = save(m, [("a", [2], 0, 4)])
    m.materialize(s1, ["a"])
    applier = TierApplier(HiddenTier(1 << 20), BS)
    # block 2 is stored and, in the same plan, handed to "b" whose external KV has the same content
    applier.apply(TierPlan(stores=(TierStore("a", b"h2", 2),),
                           loads=(TierLoad("b", 0, b"h2", 2), TierLoad("b", 1, b"unknown", 3))), m)
    assert applier.stored_blocks == 1 and applier.restored_blocks == 1 and applier.tier_hit_tokens == BS
    assert applier.load_failures == [{"req_id": "b", "block_index": 1, "block_id": 3, "block_hash": b"unknown".hex(),
                                       "why": "the tier holds no rows for its hash"}]
    got = applier.tier.get(b"h2")
    assert got is not None and torch.equal(got["hidden"], rows_a)
    m.shutdown()


def test_misses_are_counted_for_ever_and_only_the_first_are_kept_in_detail() -> None:
    """A server runs for ever: every miss is counted, the detail list stays bounded."""
    m = manager(True)
    applier = TierApplier(HiddenTier(1 << 20), BS)
    for i in range(100):
        applier.apply(TierPlan(loads=(TierLoad(f"r{i}", 0, b"unknown-%d" % i, 3),)), m)
    assert applier.num_load_failures == 100 and applier.tier_failures()["misses"] == 100
    assert applier.summary()["tier_load_failures"] == 100
    assert len(applier.load_failures) == 64 and applier.load_failures[0]["req_id"] == "r0"
    m.shutdown()


def test_a_load_the_tier_cannot_serve_is_handed_to_vllm_as_a_failed_load_once() -> None:
    """The block of a load the tier cannot serve is returned by ``apply`` and held for
    ``take_load_errors`` (``OmniKVConnector.get_block_ids_with_load_errors``), once."""
    m = manager(True)
    m.new_step_starts([started("a")])
    s1, _ = save(m, [("a", [2], 0, 4)])
    m.materialize(s1, ["a"])
    applier = TierApplier(HiddenTier(1 << 20), BS)
    failed = applier.apply(TierPlan(stores=(TierStore("a", b"h2", 2),),
                                    loads=(TierLoad("b", 0, b"h2", 5), TierLoad("b", 1, b"unknown", 3))), m)
    assert failed == {3}
    assert applier.take_load_errors() == {3} and applier.take_load_errors() == set()
    m.shutdown()


def test_rows_larger_than_the_budget_without_a_disk_level_are_refused_and_counted() -> None:
    """A put whose rows alone exceed the budget, with no disk level to spill to, stores nothing and
    counts one refusal (``TierStats.refused``); a later put that fits is stored."""
    small = {"hidden": torch.zeros(2, 4)}
    tier = HiddenTier(small["hidden"].nbytes)
    assert tier.put(b"big", {"hidden": torch.zeros(4, 4)}) is False
    stats = tier.stats()
    assert (stats.refused, stats.puts, stats.entries, stats.bytes) == (1, 0, 0, 0)
    assert tier.get(b"big") is None
    assert tier.put(b"ok", small) is True
    assert (tier.stats().refused, tier.stats().puts) == (1, 1)


def test_a_put_of_no_rows_is_refused_and_stores_nothing() -> None:
    """``put`` with no keys raises ValueError ("no rows to store"), never a ragged-rows message, and
    the tier is unchanged."""
    tier = HiddenTier(1 << 20)
    with pytest.raises(ValueError, match="no rows to store"):
        tier.put(b"h", {})
    assert b"h" not in tier and tier.stats().puts == 0
