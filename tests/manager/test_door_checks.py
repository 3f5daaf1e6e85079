"""What the manager accepts at its door: a refused layout, hit or width changes nothing.

  --  the slot mapping covers the step's rows exactly, as a 1-D integer CPU mapping: a layout
      whose writes leave rows to no request, or a malformed ``slots_cpu``, is refused before
      anything is claimed; a scheduled request missing from the layout is refused too; the KV
      slots lie in ``[0, num_slots)`` (a negative slot is refused at save and changes nothing).
  I5  a negative or start-only hit span is refused, and so is a hit on a block outside
      ``[0, num_blocks)``.
  --  a key's width and dtype never change: a save that brings another width (immediate or
      deferred, also while the first width's deferred write is pending) is refused at the
      door and burns no step id.

The types checked at the door (step ids, write bounds, the config) are in
test_door_checks_types.py; what the manager keeps (no autograd, leftovers by type, the bounded
claim-wait history, a page under its pool write) is in test_door_checks_kept.py.
"""

from __future__ import annotations

import time

import pytest
import torch
from cache_helpers import (
    BS,
    MODES,
    WIDTH,
    config,
    finished,
    manager,
    save,
    settle,
    slots,
    staging_claims,
    started,
    truth,
)
from thread_helpers import Gate

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheRequestEvent,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.block_pool import PrefixBlockPool
from omni_cache.runtime.events import PrefixCacheEventKind as E
from omni_cache.runtime.manager import OmniPrefixCacheManager

K = "mm.k"  # a per-token key beside hidden


# ---- I10/I11: a key's width/dtype is checked before the claim -----------------------------
def _wrong_width_save(m, deferred: bool) -> None:  # type: ignore[no-untyped-def]
    layout = PrefixCacheWriteLayout.packed([("z", 0, 4)], torch.arange(60, 64))
    hidden = truth("z", range(4)) if deferred else truth("z", range(4), width=WIDTH + 2)
    mm = {"audio": torch.ones(4, 5)} if deferred else {}
    m.save_outputs(hidden, mm, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)


@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("eager", MODES)
def test_width_change_is_refused_before_the_claim_even_when_staging_is_full(eager: bool, deferred: bool) -> None:
    """A key whose width changes is refused at the save door before any claim, even with staging full: no
    wait, no timeout, no later failure.

    With every page held by an unconsumed step, a save that brings a key with a new
    width must be refused at once with the shape error -- not wait for a page and
    time out (the claim comes after the check), and not fail the manager later.

    Kills the mutant: delete the pre-claim ``check_sigs`` calls in ``save_outputs``.

    A key whose width changes is refused at the save door before any claim, even with staging full: no
    wait, no timeout, no later failure."""
    m = manager(eager, staging_depth=2, staging_claim_timeout_s=1.5)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"})))
    m.new_step_starts([started("x")])
    s0, _ = save(m, [("x", [3], 0, 4)], mm={"audio": torch.ones(4, 3)})
    m.discard_step(s0)
    m.new_step_starts([finished("x"), started("a"), started("b"), started("z")])  # x's audio lands
    settle(m)
    s1, _ = save(m, [("a", [0], 0, 4)], mm={"audio": torch.ones(4, 3)})
    s2, _ = save(m, [("b", [1], 0, 4)], mm={"audio": torch.ones(4, 3)})
    claims = m.stats()["staging"]["claims"]
    assert m.pool.has_key("audio") and m.staging.slot_states() == ["saved", "saved"]
    t0 = time.perf_counter()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="width and dtype never change") as info:
        _wrong_width_save(m, deferred)
    assert not isinstance(info.value, OmniPrefixCacheStagingTimeoutError)
    assert time.perf_counter() - t0 < 1.0, "the shape check ran only after waiting for a page"
    assert m.stats()["failed"] is None
    assert m.stats()["staging"]["claims"] == claims  # nothing was claimed for the refused save
    m.discard_step(s1)
    s3, _ = save(m, [("z", [15], 0, 4)], mm={"audio": torch.ones(4, 3)})
    assert s3 == s2 + 1  # the refused save burned no step id
    m.discard_step(s2)
    m.discard_step(s3)
    assert m.stats()["failed"] is None
    m.shutdown()


def test_width_change_is_refused_by_the_staging_page_before_waiting_for_the_previous_write() -> None:
    """A key whose width changes is refused by the staging page's shape before the save waits for the
    previous write (async) or claims a page.

    The first step's write is held in the committer, so only the staging page knows
    hidden's width. A save with another width must be refused at once, not wait for
    that write (and time out) or claim a page.

    Kills the mutant: delete the pre-claim ``staging.check_sigs`` call (async: the pool has no tensor
    yet).

    A key whose width changes is refused by the staging page's shape before the save waits for the
    previous write (async) or claims a page."""
    hold = Gate("before_device_to_host")  # every device->host copy waits here until released
    m = OmniPrefixCacheManager(config(staging_claim_timeout_s=1.5), eager=False, faults=hold)
    try:
        m.new_step_starts([started("a"), started("z")])
        s1, _ = save(m, [("a", [0], 0, 4)])
        assert hold.entered.wait(5) and not m.pool.has_key("hidden")
        t0 = time.perf_counter()
        with pytest.raises(OmniPrefixCacheUnmatchError, match="width and dtype never change"):
            _wrong_width_save(m, deferred=False)
        assert time.perf_counter() - t0 < 1.0, "the shape check ran only after waiting for the previous write"
        assert m.stats()["staging"]["claims"] == 1
        hold.release.set()
        m.discard_step(s1)
        s2, _ = save(m, [("z", [15], 0, 4)])
        assert s2 == s1 + 1 and m.stats()["failed"] is None
        m.discard_step(s2)
    finally:
        hold.release.set()
        m.shutdown()


# ---- slot range: the first and last legal KV slot, and one past each ----------------------
def test_check_slots_accepts_exactly_zero_to_num_slots_minus_one() -> None:
    """The block pool accepts exactly the KV slots ``0 .. num_slots - 1`` and refuses the rest.

    Kills the mutants: ``low < 0`` -> ``low < -1`` / ``low < 1`` in ``PrefixBlockPool.check_slots``.

    The block pool accepts exactly the KV slots ``0 .. num_slots - 1`` and refuses the rest."""
    pool = PrefixBlockPool(8)
    pool.check_slots(torch.tensor([0, 7]))
    pool.check_slots(torch.tensor([], dtype=torch.int64))
    for bad in ([-1, 3], [3, 8]):
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"KV slots out of range \[0, 8\)"):
            pool.check_slots(torch.tensor(bad))


@pytest.mark.parametrize("eager", MODES)
def test_a_negative_slot_is_refused_at_save_and_changes_nothing(eager: bool) -> None:
    m = manager(eager)
    m.new_step_starts([started("a")])
    layout = PrefixCacheWriteLayout.packed([("a", 0, 4)], torch.tensor([-1, 0, 1, 2]))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="KV slots out of range"):
        m.save_outputs(truth("a", range(4)), {}, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)
    stats = m.stats()
    assert stats["failed"] is None and stats["staging"]["claims"] == 0 and stats["writes_in_flight"] == 0
    step, rows = save(m, [("a", [0], 0, 4)])
    assert torch.equal(m.materialize(step, ["a"]).hidden_states["a"], rows)
    m.shutdown()


# ---- I5: hit block ids inside [0, num_blocks) ---------------------------------------------
@pytest.mark.parametrize("blocks", [[31, 32], [-1, 0], [0, 32, 1]], ids=["past-end", "negative", "middle"])
def test_a_hit_on_a_block_outside_the_pool_is_refused_and_changes_nothing(blocks: list[int]) -> None:
    """A hit on a block outside ``[0, num_blocks)`` is refused at the door and changes nothing (I5).

    Kills the mutants: the "outside [0, num_blocks)" raise of ``validate_hit`` and its bounds (num_blocks
    32).

    A hit on a block outside ``[0, num_blocks)`` is refused at the door and changes nothing (I5)."""
    m = manager(True)
    before = m.stats()
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"are outside \[0, 32\) \(I5\)"):
        m.new_step_starts([started("a", hit_end=4 * len(blocks), blocks=blocks)])
    after = m.stats()
    assert (after["hits"], after["live_requests"]) == (before["hits"], before["live_requests"]) == (0, 0)
    m.new_step_starts([started("a", hit_end=8, blocks=[0, 31])])  # the first and last block are fine
    assert m.stats()["hits"] == 1
    m.shutdown()


@pytest.mark.parametrize(("blocks", "twice"), [([1, 1, 3], 1), ([2, 5, 2], 2), ([4, 4], 4)],
                         ids=["adjacent", "apart", "whole-hit"])
def test_a_hit_naming_one_block_twice_is_refused_and_changes_nothing(blocks: list[int], twice: int) -> None:
    """A hit whose blocks repeat one id would serve one block's rows at two prefix positions: no
    engine's prefix maps two positions to one KV slot. Refused at the door, naming the block (I5)."""
    m = manager(True)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"block id {twice} appears twice among its {len(blocks)} hit blocks.*\(I5\)"):
        m.new_step_starts([started("a", hit_end=4 * len(blocks), blocks=blocks)])
    stats = m.stats()
    assert (stats["hits"], stats["live_requests"]) == (0, 0)
    # a longer block list repeats nothing within the hit: only the hit's blocks count
    m.new_step_starts([started("a", hit_end=8, blocks=[1, 3, 1])])
    assert m.stats()["hits"] == 1
    m.shutdown()


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "immediate"])
def test_width_change_is_refused_at_save_and_burns_no_step_id(deferred: bool) -> None:
    m = manager()
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"} if deferred else ())))
    m.new_step_starts([started("A")])
    s1, _ = save(m, [("A", [0], 0, 4)], mm_keys=("audio",))
    m.discard_step(s1)
    m.new_step_starts([finished("A"), started("B")])
    layout = PrefixCacheWriteLayout.packed([("B", 0, 4)], slots([1], 0, 4))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="width and dtype never change"):
        m.save_outputs(truth("B", range(0, 4)), {"audio": torch.ones(4, 6)}, num_tokens_unpadded=4,
                       num_tokens_padded=4, write_layout=layout)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="width and dtype never change"):
        save(m, [("B", [1], 0, 4)], width=6)  # hidden: the staging page and the pool refuse it
    m.new_step_starts([finished("B"), started("C")])
    s2, _ = save(m, [("C", [2], 0, 4)], mm_keys=("audio",))
    assert s2 == s1 + 1 and m.stats()["failed"] is None
    m.discard_step(s2)


def test_scheduled_request_missing_from_layout() -> None:
    m = manager()
    m.new_step_starts([started("A"), started("B")], num_scheduled_tokens={"A": 4, "B": 4})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="slot mapping covers"):
        save(m, [("A", [0], 0, 4)])


@pytest.mark.parametrize(("hit_start", "hit_end"), [(0, -4), (4, 0)])
def test_malformed_hit_spans_are_rejected(hit_start: int, hit_end: int) -> None:
    m = manager()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="I5"):
        m.new_step_starts([PrefixCacheRequestEvent("A", E.STARTED, hit_start, hit_end, ((0,),))])
    assert m.stats()["live_requests"] == 0


def _assert_refused_and_usable(m, call, eager: bool) -> None:  # type: ignore[no-untyped-def]
    """``call`` raises "slot mapping covers", claims nothing, burns no step id, fails nothing;
    the manager then saves and serves the next step exactly."""
    claims, issued = staging_claims(m), m._ids_issued
    with pytest.raises(OmniPrefixCacheUnmatchError, match="slot mapping covers"):
        call()
    settle(m)
    assert staging_claims(m) == claims and m._ids_issued == issued, "a refused save claimed a page or an id"
    assert m.stats()["failed"] is None and not m.book.live(), m.stats()
    m.new_step_starts([started("ok")])
    step = save(m, [("ok", [5], 0, 3)])[0]
    assert m._ids_issued == issued + 1
    assert torch.equal(m.materialize(step, ["ok"]).hidden_states["ok"], truth("ok", range(3)))


@pytest.mark.parametrize("gap", ["middle", "tail", "head"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_slot_mapping_covers_layout_gap_refused(eager: bool, gap: str) -> None:
    """Rows of the step that belong to no request are refused ("slot mapping covers"); unchecked, they
    were scattered into the pool over another request's cached block (X's block 1)."""
    from omni_cache.runtime.events import PrefixCacheWrite

    m = manager(eager=eager)
    m.new_step_starts([started("X")])
    m.materialize(save(m, [("X", [1, 2], 0, 5)])[0], ["X"])
    m.new_step_starts([started("A"), started("B")])
    settle(m)
    # 6 rows; the uncovered row's KV slot is X's slot 4 (block 1, offset 0).
    writes = {
        "middle": (PrefixCacheWrite("A", 0, 2, 0, 2), PrefixCacheWrite("B", 3, 6, 0, 3)),
        "tail": (PrefixCacheWrite("A", 0, 2, 0, 2), PrefixCacheWrite("B", 2, 5, 0, 3)),
        "head": (PrefixCacheWrite("A", 1, 3, 0, 2), PrefixCacheWrite("B", 3, 6, 0, 3)),
    }[gap]
    hole = {"middle": 2, "tail": 5, "head": 0}[gap]
    slot_ids = torch.tensor([24, 25, 26, 27, 28, 29])
    slot_ids[hole] = 4
    layout = PrefixCacheWriteLayout(writes, 6, slot_ids)
    hidden = torch.full((6, 8), -3.0)
    _assert_refused_and_usable(m, lambda: m.save_outputs(
        hidden, {}, num_tokens_unpadded=6, num_tokens_padded=6, write_layout=layout), eager)
    # X's block 1 is intact: a hit on it still reads X's rows.
    m.new_step_starts([started("Y", BS, [1, 3])])
    settle(m)
    out = m.materialize(save(m, [("Y", [1, 3], BS, BS + 1)], tag_of={"Y": "X"})[0], ["Y"])
    assert torch.equal(out.hidden_states["Y"], truth("X", range(BS + 1)))
    m.shutdown()


@pytest.mark.parametrize("bad", ["2-D", "float", "bool", "short", "meta device"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_slot_mapping_covers_malformed_slots_refused_before_claim(eager: bool, bad: str) -> None:
    """A 2-D, non-integer, too short or non-CPU ``slots_cpu`` is a precondition error raised before
    anything is claimed; unchecked, a 2-D mapping passed validation, its scatter failed and the manager
    was failed for good (in async mode after the step id was returned)."""
    m = manager(eager=eager)
    m.new_step_starts([started("A")])
    good = slots([0, 1], 0, 5)
    mapping = {
        "2-D": good.reshape(5, 1),
        "float": good.to(torch.float32),
        "bool": torch.ones(5, dtype=torch.bool),
        "short": good[:4],
        "meta device": torch.empty(5, dtype=torch.int64, device="meta"),
    }[bad]
    rows = truth("A", range(5))

    def call() -> object:
        layout = PrefixCacheWriteLayout.packed([("A", 0, 5)], mapping)
        return m.save_outputs(rows, {}, num_tokens_unpadded=5, num_tokens_padded=5, write_layout=layout)

    _assert_refused_and_usable(m, call, eager)
    m.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_a_deferred_keys_width_is_fixed_by_its_first_save(eager: bool) -> None:
    """A's deferred K (width 3) is still pending when B's save brings K at width 5. The save is
    refused at the door with the contract error, and nothing changes: no slot claimed, no step id,
    the cache not failed. Found by an independent attack: the save was accepted, and A's finish
    then failed the whole cache for good when the two widths met in the pool (I8)."""
    m = manager(eager=eager)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({K})))
    m.new_step_starts([started("A"), started("B")])
    layout_a = PrefixCacheWriteLayout.packed([("A", 0, 4)], slots([0], 0, 4))
    step_a = m.save_outputs(truth("A", range(4)), {K: torch.ones(4, 3)}, num_tokens_unpadded=4,
                            num_tokens_padded=4, write_layout=layout_a)
    m.materialize(step_a, ["A"])
    settle(m)  # async: A's page is free only once its immediate write landed and let go of it
    before = m.stats()
    layout_b = PrefixCacheWriteLayout.packed([("B", 0, 4)], slots([1], 0, 4))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="a key's width and dtype never change") as info:
        m.save_outputs(truth("B", range(4)), {K: torch.ones(4, 5)}, num_tokens_unpadded=4,
                       num_tokens_padded=4, write_layout=layout_b)
    assert repr(K) in str(info.value) and "(3,)" in str(info.value) and "(5,)" in str(info.value), info.value
    after = m.stats()
    assert after["failed"] is None and after["saved"] == before["saved"]
    assert m.staging.slot_states() == ["free"] * m.config.staging_depth
    step_b = m.save_outputs(truth("B", range(4)), {K: torch.full((4, 3), 2.0)}, num_tokens_unpadded=4,
                            num_tokens_padded=4, write_layout=layout_b)  # the held width is accepted
    m.materialize(step_b, ["B"])
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED), PrefixCacheRequestEvent("B", E.FINISHED)])
    settle(m)
    assert m.stats()["failed"] is None
    assert torch.equal(m.pool.rows(K, slots([0, 1], 0, 8)), torch.cat([torch.ones(4, 3), torch.full((4, 3), 2.0)]))
    m.shutdown()
