"""Tests that kill mutants of the read path (tenancy, reader, copier) that survived the rest of the suite.

Split from tests/test_mutation_kills.py (issue 11 item 9, tools/ast_mutants.py), which
holds the staging, write-book and manager ones.

Each test names the mutant it was written against; each was checked by applying
that mutant to a copy (``tools/ast_mutants.py --only ID --tests FILE``) and seeing it fail.

Invariants touched: I7 (no preserved copy, never read a planned version early),
I8 (a failed planned write), I11 (the pool's leaf lock), and the chunked copy.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch
from cache_helpers import MODES, assert_waits_for_lock, config, finished, manager, save, started

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    WriteSchedule,
)
from omni_cache.block_pool import PrefixBlockPool
from omni_cache.copier import CopyEngine
from omni_cache.errors import PHRASE_NOT_READABLE, PHRASE_WRITE_FAILED
from omni_cache.faults import FaultHooks
from omni_cache.manager import OmniPrefixCacheManager
from omni_cache.reader import StepReader
from omni_cache.tenancy import NotLandedYet, SlotTenancy
from omni_cache.writes import WriteBook


# ---- I7: a planned row overwritten by a newer tenant with no preserved copy ---------------
def _tenancy() -> tuple[SlotTenancy, np.ndarray]:
    return SlotTenancy(PrefixBlockPool(8)), np.array([2, 3], dtype=np.int64)


def test_read_refuses_newer_rows_when_the_settled_planned_write_left_no_copy() -> None:
    """Mutants: delete the "no preserved copy" raise, or the ``version not in settled`` guard."""
    ten, slots = _tenancy()
    ten.register(["k"], slots, 1, step_id=11)  # the planned version: tid 1, never lands (it failed)
    plan = ten.plan(["k"], torch.from_numpy(slots))
    ten.register(["k"], slots, 2, step_id=12)
    ten.land_all({"k": torch.full((2, 3), 2.0)}, torch.from_numpy(slots), 2)  # a newer tenant lands
    with pytest.raises(NotLandedYet) as late:  # tid 1 may still land late: wait for it
        ten.read("k", plan, what="step 5 request 'r'")
    assert late.value.tids == [1]
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_READABLE) as info:
        ten.read("k", plan, what="step 5 request 'r'", settled={1})
    msg = str(info.value)
    assert "KV slot 2" in msg and "planned version 1" in msg and "version 2" in msg and "no preserved copy" in msg


def test_read_serves_the_planned_rows_when_the_older_write_lands_late() -> None:
    ten, slots = _tenancy()
    ten.register(["k"], slots, 1, step_id=11)
    plan = ten.plan(["k"], torch.from_numpy(slots))
    ten.register(["k"], slots, 2, step_id=12)
    ten.land_all({"k": torch.full((2, 3), 2.0)}, torch.from_numpy(slots), 2)
    ten.land_all({"k": torch.full((2, 3), 1.0)}, torch.from_numpy(slots), 1)  # late: kept for the pin only
    assert torch.equal(ten.read("k", plan, what="r", settled={1}), torch.full((2, 3), 1.0))
    assert torch.equal(ten.pool.rows("k", torch.from_numpy(slots)), torch.full((2, 3), 2.0))  # newer stays
    ten.unplan(plan)
    assert ten.num_preserved() == 0


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


# ---- I11: tenancy bookkeeping under the pool's leaf lock ----------------------------------
@pytest.mark.parametrize("what", ["unplan", "plan", "register", "read", "land_all", "num_preserved"])
def test_tenancy_bookkeeping_waits_for_the_pool_lock(what: str) -> None:
    """Mutants: ``unplan`` (and its siblings, and the stats count) without ``with self.pool.lock``."""
    ten, slots = _tenancy()
    ten.register(["k"], slots, 1, step_id=11)
    ten.land_all({"k": torch.ones(2, 3)}, torch.from_numpy(slots), 1)
    plan = ten.plan(["k"], torch.from_numpy(slots))
    calls = {
        "unplan": lambda: ten.unplan(plan),
        "plan": lambda: ten.plan(["k"], torch.from_numpy(slots)),
        "register": lambda: ten.register(["k"], slots, 2, step_id=12),
        "read": lambda: ten.read("k", plan, what="r"),
        "land_all": lambda: ten.land_all({"k": torch.full((2, 3), 2.0)}, torch.from_numpy(slots), 2),
        "num_preserved": ten.num_preserved,
    }
    assert_waits_for_lock(ten.pool.lock, calls[what], f"SlotTenancy.{what}")
    if what == "unplan":
        assert ten._keys["k"].num_pins == 0 and int(ten._keys["k"].pins.sum()) == 0


# ---- the chunked synchronous copy ---------------------------------------------------------
class _CopyLog(torch.Tensor):
    """A tensor that records the row count of every ``copy_`` into it (or a slice of it)."""

    copies: ClassVar[list[int]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.copy_:
            cls.copies.append(args[0].shape[0] if args[0].dim() else 1)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize(
    ("shape", "dtype", "chunk_bytes", "slices"),
    [
        ((10, 6), torch.float32, 3 * 24 + 12, [3, 3, 3, 1]),  # 3 rows per slice, a short last one
        ((9, 6), torch.float32, 3 * 24, [3, 3, 3]),  # exact multiple
        ((7, 6), torch.float32, 24, [1] * 7),  # one row per slice
        ((3, 6), torch.float32, 10, [1, 1, 1]),  # a row larger than a chunk: still one row per slice
        ((2, 1), torch.float32, 4, [1, 1]),  # two rows are split; shape[1] == 1 is not "one row"
        ((10, 1), torch.float32, 12, [3, 3, 3, 1]),
        ((10,), torch.float32, 12, [3, 3, 3, 1]),  # 1-D: rows are elements
        ((5, 6), torch.float32, 5 * 24, [5]),  # fits: one copy
        ((1, 6), torch.float32, 4, [1]),  # one row: one copy, whatever its size
        ((), torch.float64, 4, [1]),  # 0-D: one copy, never indexed by rows
    ],
    ids=str,
)
def test_chunked_copy_copies_every_row_in_slices_of_at_most_chunk_bytes(
    shape: tuple[int, ...], dtype: torch.dtype, chunk_bytes: int, slices: list[int]
) -> None:
    """Mutants: the chunk loop's start, step and slice bounds; the one-copy shortcut's conditions."""
    src = torch.arange(1, 1 + max(1, int(np.prod(shape))), dtype=dtype).reshape(shape)
    engine = CopyEngine(use_cuda=False, chunk_bytes=chunk_bytes)
    _CopyLog.copies = []
    dst = torch.zeros(shape, dtype=dtype).as_subclass(_CopyLog)
    engine._chunked(dst, src)
    assert torch.equal(dst.as_subclass(torch.Tensor), src)
    assert _CopyLog.copies == slices


@pytest.mark.parametrize("eager", MODES)
def test_round_trip_with_a_tiny_copy_chunk(eager: bool) -> None:
    """Every copy path (staging page, deferred host copy) chunked by a 40-byte ``copy_chunk_bytes``."""
    m = manager(eager, copy_chunk_bytes=40)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"})))
    m.new_step_starts([started("a")])
    audio = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    s1, rows = save(m, [("a", [0, 1], 0, 8)], mm={"audio": audio})
    out = m.materialize(s1, ["a"])
    assert torch.equal(out.hidden_states["a"], rows) and torch.equal(out.mm_outputs["audio"]["a"], audio)
    m.new_step_starts([finished("a"), started("b", hit_end=8, blocks=[0, 1, 2])])
    s2, rows_b = save(m, [("b", [0, 1, 2], 8, 12)], mm={"audio": torch.ones(4, 3)})
    out = m.materialize(s2, ["b"])
    assert torch.equal(out.hidden_states["b"], torch.cat([rows, rows_b]))
    assert torch.equal(out.mm_outputs["audio"]["b"], torch.cat([audio, torch.ones(4, 3)]))
    m.shutdown()


# ---- I8: a hit whose planned write failed raises the sticky failure -----------------------
def _reader_for(book: WriteBook, tenancy: SlotTenancy) -> StepReader:
    return StepReader(None, tenancy, book, CopyEngine(use_cuda=False, chunk_bytes=1 << 20),  # type: ignore[arg-type]
                      FaultHooks(), lambda writes, why: None)


def test_a_hit_whose_planned_write_failed_raises_write_failed_not_a_tenancy_bug() -> None:
    """Mutant: delete ``self.book.check_failed(what)`` in ``StepReader._read_hit``.

    The planned write failed (it is terminal, so the book no longer lists it) and its
    rows never landed: the read must raise the sticky "write failed" error at once,
    not retry 10,000 times and report a tenancy bug.
    """
    ten, slots = _tenancy()
    book = WriteBook(1.0)
    write = book.register(WriteSchedule.JOIN_ON_FINISH, 1, torch.from_numpy(slots), {"k": torch.ones(2, 3)})
    ten.register(["k"], slots, write.tid, step_id=1)
    plan = ten.plan(["k"], torch.from_numpy(slots))
    book.fail(write, RuntimeError("disk on fire"), where="the committer")
    assert book.get(write.tid) is None
    ctx = SimpleNamespace(step_id=7, saved_at="engine.py:3")
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_WRITE_FAILED) as info:
        _reader_for(book, ten)._read_hit(ctx, "r", plan, "k")  # type: ignore[arg-type]
    assert "step 7" in str(info.value) and "disk on fire" in str(info.value)


def test_a_read_that_never_converges_raises_instead_of_returning_nothing() -> None:
    """Mutant: delete the final ``raise AssertionError`` of ``_read_hit`` (it would return None as rows)."""

    class NeverLands(SlotTenancy):
        def read(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise NotLandedYet([99])

    class Forgetful(WriteBook):
        def get(self, tid):  # type: ignore[no-untyped-def]
            return None

    ten = NeverLands(PrefixBlockPool(8))
    plan = SlotTenancy(PrefixBlockPool(8)).plan(["k"], torch.tensor([0]))
    ctx = SimpleNamespace(step_id=7, saved_at="engine.py:3")
    with pytest.raises(AssertionError, match="never landed: tenancy bug"):
        _reader_for(Forgetful(1.0), ten)._read_hit(ctx, "r", plan, "k")  # type: ignore[arg-type]


# ---- I7: a planned version that has not landed is waited for, never read early -------------
def test_read_before_the_planned_write_lands_says_not_landed_yet() -> None:
    """Mutant: delete ``raise NotLandedYet`` for rows behind the planned version (stale rows served)."""
    ten, slots = _tenancy()
    ten.register(["k"], slots, 1, step_id=11)
    ten.land_all({"k": torch.full((2, 3), 1.0)}, torch.from_numpy(slots), 1)
    ten.register(["k"], slots, 2, step_id=12)  # a newer tenant is registered, not landed
    plan = ten.plan(["k"], torch.from_numpy(slots))  # the hit plans version 2
    with pytest.raises(NotLandedYet) as late:
        ten.read("k", plan, what="r")
    assert late.value.tids == [2]
    ten.land_all({"k": torch.full((2, 3), 2.0)}, torch.from_numpy(slots), 2)
    assert torch.equal(ten.read("k", plan, what="r"), torch.full((2, 3), 2.0))


def test_materialize_waits_for_a_held_planned_write_and_serves_its_rows() -> None:
    """The same I7 mutant through the manager (async): the hit's deferred write is held in the committer."""

    class HoldDeferred(FaultHooks):
        def __init__(self) -> None:
            self.entered, self.release = threading.Event(), threading.Event()

        def before_device_to_host(self, write) -> None:  # type: ignore[no-untyped-def]
            if write.schedule is WriteSchedule.JOIN_ON_FINISH:
                self.entered.set()
                assert self.release.wait(10)

    hold = HoldDeferred()
    m = OmniPrefixCacheManager(config(), eager=False, faults=hold)
    # audio only (no hidden): b's step has no write of its own to wait for before reading its hit
    m.register_policy(ModelCachePolicy(needs_full_hidden_states=False, deferred_keys=frozenset({"audio"})))
    try:
        audio_a = torch.arange(24, dtype=torch.float32).reshape(8, 3) + 1
        m.new_step_starts([started("a")])
        s1, _ = save(m, [("a", [0, 1], 0, 8)], mm={"audio": audio_a})
        m.discard_step(s1)
        m.new_step_starts([finished("a"), started("b", hit_end=8, blocks=[0, 1, 2])])
        assert hold.entered.wait(5)  # a's audio write is in the committer, held before its copy
        s2, _ = save(m, [("b", [0, 1, 2], 8, 12)], mm={"audio": torch.ones(4, 3)})
        threading.Timer(0.3, hold.release.set).start()
        out = m.materialize(s2, ["b"])
        assert torch.equal(out.mm_outputs["audio"]["b"], torch.cat([audio_a, torch.ones(4, 3)]))
        assert out.hidden_states is None
    finally:
        hold.release.set()
        m.shutdown()


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
