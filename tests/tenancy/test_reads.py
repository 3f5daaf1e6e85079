"""The read path of I7 and I8: a hit reads the rows its plan names, or says why it cannot.

A read never returns newer rows than planned (I7), waits for a planned write that is still
held, and reports a planned write that failed or has not landed as a contract error with its
reason (I8), never as an internal assertion. A KV slot has one tenant for all keys: a key
its newest tenant did not write is absent there ("is not readable"), never served from an
older tenant, also when the tenant's step carried no per-token key at all (I6, I7). A hit
planned in the step that computes its rows (vLLM publishes a block's hash when it is
scheduled) reads them from that step's own save.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cache_helpers import (
    BS,
    E,
    config,
    finished,
    manager,
    save,
    save_without_hidden,
    settle,
    slots,
    started,
    truth,
)
from thread_helpers import Gate

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
    TraceRecorder,
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

K = "mm.k"  # a per-token key beside hidden


# ---- I7: planned rows that are gone are "not readable" -------------------------------------
def test_a_hit_whose_planned_rows_are_gone_is_not_readable() -> None:
    """A hit whose planned rows are gone ends in the "is not readable" contract error naming key and slot,
    never a retry loop (I6, I7).

    The planned version landed, a newer tenant overwrote its slots and the preserved copy is
    gone (removed here by hand: no correct runtime path loses it). The read must end in the
    contract error naming the key and slot, not in a retry loop or an assertion.

    Kills the mutant: ``reader:StepReader.read_planned:del_call:cf8df906`` (a landed planned write never
    counted as settled: the read retried 10,000 times and ended in an AssertionError "tenancy bug").

    A hit whose planned rows are gone ends in the "is not readable" contract error naming key and slot,
    never a retry loop (I6, I7)."""
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
    """A read whose settled planned write left no preserved copy refuses the newer rows instead of serving
    them (I7).

    Kills the mutants: delete the "no preserved copy" raise, or the ``version not in settled`` guard.

    A read whose settled planned write left no preserved copy refuses the newer rows instead of serving
    them (I7)."""
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
    """A hit whose planned write failed raises the sticky "write failed" at once (I8).

    The planned write failed (it is terminal, so the book no longer lists it) and its
    rows never landed: the read must raise the sticky "write failed" error at once,
    not retry 10,000 times and report a tenancy bug.

    Kills the mutant: delete ``self.book.check_failed(what)`` in ``StepReader.read_hit``.

    A hit whose planned write failed raises the sticky "write failed" at once (I8)."""
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
    """A hit read that never converges raises; it never returns no rows (I6).

    Kills the mutant: delete the final ``raise AssertionError`` of ``read_hit`` (it would return None as
    rows).

    A hit read that never converges raises; it never returns no rows (I6)."""

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
    """A read of rows behind its planned version says "not landed yet"; stale rows are never served (I7).

    Kills the mutant: delete ``raise NotLandedYet`` for rows behind the planned version (stale rows
    served).

    A read of rows behind its planned version says "not landed yet"; stale rows are never served (I7)."""
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

    hold = Gate("before_device_to_host", lambda write: write.schedule is WriteSchedule.JOIN_ON_FINISH)
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


@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_I7_absent_key_not_served_from_older_tenant(eager: bool, deferred: bool) -> None:
    """C writes hidden and K on block 0; A reuses block 0 writing hidden only; B hits block 0 with K.

    B's hit must raise "is not readable" for K: block 0's tenant (A) never wrote K,
    and C's K rows belong to an older tenant (I7, I6). Without the rule B got A's hidden rows
    glued to C's K rows, silently.
    """
    m = manager(eager=eager)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({K}) if deferred else frozenset()))
    m.new_step_starts([started("C")])
    m.materialize(save(m, [("C", [0, 1], 0, 5)], mm_key=K)[0], ["C"])
    m.new_step_starts([PrefixCacheRequestEvent("C", E.FINISHED), started("A")])
    settle(m)
    # A, a different prompt, takes block 0 over; its steps carry hidden but not K.
    m.materialize(save(m, [("A", [0, 2], 0, 3)])[0], ["A"])
    m.materialize(save(m, [("A", [0, 2], 3, 5)])[0], ["A"])
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED), started("B", BS, [0, 3])])
    settle(m)
    step = save(m, [("B", [0, 3], BS, BS + 2)], mm_key=K, tag_of={"B": "A"})[0]
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_READABLE) as info:
        m.materialize(step, ["B"])
    assert repr(K) in str(info.value) and "KV slot 0" in str(info.value), info.value
    assert m.stats()["failed"] is None
    m.shutdown()


@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_I7_a_step_that_writes_no_key_still_becomes_the_slots_tenant(eager: bool, deferred: bool) -> None:
    """Hidden opted out: A writes K on block 3; B takes block 3 over with a step that carries no
    per-token key (its mm outputs are a leftover only); C hits block 3 with K.

    C's hit must raise "is not readable": block 3's tenant (B) wrote no K, and A's K rows belong
    to an older tenant (I6/I7). Found by an independent attack: a save that registered no write
    left the slots' tenant unchanged, so C was served A's rows as B's, silently."""
    m = manager(eager=eager)
    m.register_policy(ModelCachePolicy(needs_full_hidden_states=False,
                                       deferred_keys=frozenset({K}) if deferred else frozenset()))

    m.new_step_starts([started("A")])
    m.materialize(save_without_hidden(m, "A", [3], 0, BS, {K: truth("A", range(BS))}), ["A"])
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED), started("B")])
    settle(m)
    out_b = m.materialize(save_without_hidden(m, "B", [3], 0, BS, {"meta": [1, 2, 3]}), ["B"])
    assert out_b.hidden_states is None and out_b.mm_outputs == {"meta": {"B": [1, 2, 3]}}, out_b
    m.new_step_starts([PrefixCacheRequestEvent("B", E.FINISHED), started("C", BS, [3, 5])])
    settle(m)
    hit = save_without_hidden(m, "C", [3, 5], BS, BS + 2, {K: truth("C", range(BS, BS + 2))})
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_READABLE) as info:
        m.materialize(hit, ["C"])
    message = str(info.value)
    assert f"step {hit}" in message and "'C'" in message and repr(K) in message and f"KV slot {3 * BS}" in message
    assert m.stats()["failed"] is None
    m.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_I7_key_written_by_the_current_tenant_stays_readable(eager: bool) -> None:
    """The converse (so the absent rule cannot be "refuse every mm hit"): when the tenant's
    write carried hidden and K, a hit reads both, exactly."""
    m = manager(eager=eager)
    m.new_step_starts([started("A")])
    m.materialize(save(m, [("A", [0, 2], 0, 5)], mm_key=K)[0], ["A"])
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED), started("B", BS, [0, 3])])
    settle(m)
    step = save(m, [("B", [0, 3], BS, BS + 2)], mm_key=K, tag_of={"B": "A"})[0]
    out = m.materialize(step, ["B"])
    want = truth("A", range(BS + 2))
    assert torch.equal(out.hidden_states["B"], want)
    assert torch.equal(out.mm_outputs[K]["B"], -want[:, :2])
    m.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_I7_hit_without_the_key_still_reads_hidden(eager: bool) -> None:
    """A hit whose own step does not carry K only needs hidden: the absent K does not refuse it."""
    m = manager(eager=eager)
    m.new_step_starts([started("C")])
    m.materialize(save(m, [("C", [0, 1], 0, 5)], mm_key=K)[0], ["C"])
    m.new_step_starts([PrefixCacheRequestEvent("C", E.FINISHED), started("A")])
    settle(m)
    m.materialize(save(m, [("A", [0, 2], 0, 5)])[0], ["A"])
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED), started("B", BS, [0, 3])])
    settle(m)
    out = m.materialize(save(m, [("B", [0, 3], BS, BS + 2)], tag_of={"B": "A"})[0], ["B"])
    assert torch.equal(out.hidden_states["B"], truth("A", range(BS + 2)))
    assert K not in out.mm_outputs
    m.shutdown()


def test_a_keyless_tenant_is_noted_for_the_tenancy_trace() -> None:
    """A step that writes no key on a slot still becomes its tenant, and the tenancy trace notes it (I6, I7).

    A step that writes no key on
    block 0 still becomes its tenant (I6/I7); the trace notes it (``tenant``, its step and slots),
    which is how TLC's tenancy check learns that the older rows there are no longer readable.

    Kills the mutant: ``tenancy:SlotTenancy.take_slots:del_call:882653a7``.

    A step that writes no key on a slot still becomes its tenant, and the tenancy trace notes it (I6, I7)."""
    rec = TraceRecorder()
    m = OmniPrefixCacheManager(config(), eager=True, recorder=rec)
    m.register_policy(ModelCachePolicy(needs_full_hidden_states=False))
    m.new_step_starts([started("a")])
    m.materialize(save_without_hidden(m, "a", [0], 0, 4, {K: truth("a", range(4))}), ["a"])
    m.new_step_starts([PrefixCacheRequestEvent("a", E.FINISHED), started("b")])
    step_b = save_without_hidden(m, "b", [0], 0, 4, {"meta": ["b"]})  # no per-token key at all
    m.materialize(step_b, ["b"])
    m.shutdown()
    tenants = [(e.step_id, e.get("slots")) for e in rec.events("tenancy", notes=True) if e.trigger == "tenant"]
    assert tenants == [(step_b, (0, 1, 2, 3))], tenants


def test_a_planned_reads_pending_deferred_write_is_queued_by_the_save_that_plans_it() -> None:
    """A save that plans a hit needing another request's open deferred write queues that write at once (I7,
    I9), and the trace notes say so.

    A is live, so its
    deferred K is still open (it lands at A's FINISHED); B's save plans a hit on A's blocks, which
    needs that write: the save queues it at once (eager: it lands inside the save), so B's
    materialize finds it landed instead of starting it then, and it leaves the open set
    (``deferred_open``, the ``gpu_staging_bytes`` budget). The rows are A's either way.

    The trace notes that TLC validates say the same (mutants ``writes:WriteBook.enqueue:negate_cond:
    09249d7e``, front and back swapped, and ``tenancy:SlotTenancy.read:del_call:bb1391f6``, reads
    not noted, which would leave the tenancy trace check nothing to check a read against): A's K
    is queued at the front, each immediate write at the back, and each key of B's hit is read at
    the versions its plan named.

    Kills the mutant: ``scheduling:WriteScheduler.after_save:del_call:98f1dacc``.

    A save that plans a hit needing another request's open deferred write queues that write at once (I7,
    I9), and the trace notes say so."""
    rec = TraceRecorder()
    m = OmniPrefixCacheManager(config(), eager=True, recorder=rec)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({K})))
    m.new_step_starts([started("A", scheduled=8)])
    layout_a = PrefixCacheWriteLayout.packed([("A", 0, 8)], slots([0, 1], 0, 8))
    step_a = m.save_outputs(truth("A", range(8)), {K: torch.ones(8, 3)}, num_tokens_unpadded=8,
                            num_tokens_padded=8, write_layout=layout_a)
    m.materialize(step_a, ["A"])
    assert m.stats()["deferred_open"] == 1  # A's K waits for A's FINISHED
    written = m.stats()["writes_written"]
    m.new_step_starts([started("B", hit_end=8, blocks=[0, 1], scheduled=4)])
    layout_b = PrefixCacheWriteLayout.packed([("B", 8, 12)], slots([0, 1, 2], 8, 12))
    step_b = m.save_outputs(truth("B", range(8, 12)), {K: torch.full((4, 3), 2.0)}, num_tokens_unpadded=4,
                            num_tokens_padded=4, write_layout=layout_b)
    stats = m.stats()
    # Open now: B's own K only (A's, which B's plan needs, was queued and landed in the save).
    assert stats["deferred_open"] == 1, f"B's plan left A's deferred write open: {stats['deferred_open']} open"
    assert stats["writes_written"] >= written + 1  # A's K landed in B's save (eager), before any read
    out = m.materialize(step_b, ["B"])
    assert torch.equal(out.mm_outputs[K]["B"], torch.cat([torch.ones(8, 3), torch.full((4, 3), 2.0)]))
    m.shutdown()
    notes = [e for e in rec.events(notes=True) if e.kind == "note"]
    tid_of = {(e.step_id, bool(e.get("deferred"))): e.get("tid") for e in notes if e.trigger == "register"
              and e.machine == "pool_write"}
    queued = [(e.trigger, e.get("tids")) for e in notes if e.obj == "queue"]
    assert queued[:3] == [("enqueue_back", (tid_of[step_a, False],)), ("enqueue_front", (tid_of[step_a, True],)),
                          ("enqueue_back", (tid_of[step_b, False],))], queued
    (plan,) = [e for e in notes if e.machine == "tenancy" and e.trigger == "plan"]
    reads = sorted((e.get("key"), e.get("plan"), e.get("served")) for e in notes if e.trigger == "read")
    assert reads == [(HIDDEN_KEY, plan.get("plan"), (tid_of[step_a, False],) * 8),
                     (K, plan.get("plan"), (tid_of[step_a, True],) * 8)], reads


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_same_step_hit_serves_rows_of_the_same_save(eager: bool) -> None:
    bs = 4
    mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=8, block_size=bs, staging_capacity_tokens=16), eager=eager)
    mgr.register_policy(ModelCachePolicy())
    try:
        # A computes positions [0, 5) on blocks (0, 1); B shares block 0 (a 4-token hit
        # published when A was scheduled) and computes positions [4, 6) on block 2.
        mgr.new_step_starts(PrefixCacheStep(
            (
                PrefixCacheRequestEvent("A", PrefixCacheEventKind.STARTED, block_ids=((0, 1),), scheduled_tokens=5),
                PrefixCacheRequestEvent("B", PrefixCacheEventKind.STARTED, hit_end=4, block_ids=((0, 2),), scheduled_tokens=2),
            ),
            {"A": 5, "B": 2},
        ))
        hidden = torch.arange(7 * 2, dtype=torch.float32).reshape(7, 2)
        layout = PrefixCacheWriteLayout.packed([("A", 0, 5), ("B", 4, 6)], torch.tensor([0, 1, 2, 3, 4, 8, 9]))
        sid = mgr.save_outputs(hidden, {}, num_tokens_unpadded=7, num_tokens_padded=7, write_layout=layout)
        out = mgr.materialize(sid, ["A", "B"])
        assert out.hidden_states is not None
        assert torch.equal(out.hidden_states["A"], hidden[0:5])
        assert torch.equal(out.hidden_states["B"], torch.cat([hidden[0:4], hidden[5:7]]))
    finally:
        mgr.shutdown()
