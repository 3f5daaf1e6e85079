"""The read path of I7 and I8: a hit reads the rows its plan names, or says why it cannot.

A read never returns newer rows than planned (I7), waits for a planned write that is still
held, and reports a planned write that failed or has not landed as a contract error with its
reason (I8), never as an internal assertion.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cache_helpers import BS, config, finished, manager, save, started

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    WriteSchedule,
)
from omni_cache.runtime.block_pool import PrefixBlockPool
from omni_cache.runtime.copier import CopyEngine
from omni_cache.runtime.errors import PHRASE_NOT_READABLE, PHRASE_WRITE_FAILED
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.interface import HIDDEN_KEY
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.runtime.reader import StepReader
from omni_cache.runtime.tenancy import NotLandedYet, SlotTenancy
from omni_cache.runtime.writes import WriteBook


# ---- I7: planned rows that are gone are "not readable" -------------------------------------
def test_a_hit_whose_planned_rows_are_gone_is_not_readable() -> None:
    """Mutant: ``reader:StepReader.read_planned:del_call:cf8df906`` (a landed planned write never counted
    as settled: the read retried 10,000 times and ended in an AssertionError "tenancy bug").

    The planned version landed, a newer tenant overwrote its slots and the preserved copy is
    gone (removed here by hand: no correct runtime path loses it). The read must end in the
    contract error naming the key and slot, not in a retry loop or an assertion."""
    m = manager()
    m.new_step_starts([started("A")])
    step, _ = save(m, [("A", [1], 0, BS)])
    m.materialize(step, ["A"])
    m.new_step_starts([finished("A"), started("B", hit_end=BS, blocks=[1, 2])])
    hit_step, _ = save(m, [("B", [1, 2], BS, BS + 2)])  # plans A's rows of block 1
    m.new_step_starts([started("C")])
    c_step, _ = save(m, [("C", [1], 0, BS)])  # a new tenant of block 1 lands over the pinned rows
    versions = m.tenancy._keys[HIDDEN_KEY]
    assert versions.preserved, "the pinned rows were preserved before the overwrite"
    versions.preserved.clear()
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_READABLE) as info:
        m.materialize(hit_step, ["B"])
    assert f"step {hit_step}" in str(info.value) and "'B'" in str(info.value) and "KV slot 4" in str(info.value)
    m.materialize(c_step, ["C"])
    m.shutdown()


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


# ---- I8: a hit whose planned write failed raises the sticky failure -----------------------
def _reader_for(book: WriteBook, tenancy: SlotTenancy) -> StepReader:
    return StepReader(None, tenancy, book, CopyEngine(use_cuda=False, chunk_bytes=1 << 20),  # type: ignore[arg-type]
                      FaultHooks(), lambda writes, why: None)


def test_a_hit_whose_planned_write_failed_raises_write_failed_not_a_tenancy_bug() -> None:
    """Mutant: delete ``self.book.check_failed(what)`` in ``StepReader.read_hit``.

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
        _reader_for(book, ten).read_hit(ctx, "r", plan, "k")  # type: ignore[arg-type]
    assert "step 7" in str(info.value) and "disk on fire" in str(info.value)


def test_a_read_that_never_converges_raises_instead_of_returning_nothing() -> None:
    """Mutant: delete the final ``raise AssertionError`` of ``read_hit`` (it would return None as rows)."""

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
        _reader_for(Forgetful(1.0), ten).read_hit(ctx, "r", plan, "k")  # type: ignore[arg-type]


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
