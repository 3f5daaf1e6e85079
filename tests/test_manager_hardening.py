"""Regressions for runtime holes, one test per invariant guarded.

Each test was written first and seen failing on the code before its fix (the
commit that adds it names the break it was checked against):

  I7  a key that a KV slot's newest tenant did not write is absent there: a hit
      that needs it raises "is not readable"; it is never served from an older
      tenant (immediate and deferred paths, eager and async modes).
  slot mapping covers: a layout whose writes leave rows of the step to no
      request, or whose ``slots_cpu`` is not a 1-D integer CPU mapping of enough
      entries, is refused before anything is claimed.
  I8  a failure inside a save is either fully undone or sticky, never half.
"""

from __future__ import annotations

import pytest
import torch
from cache_helpers import BS, config, manager, save_without_hidden, settle, slots, started, truth

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheRequestEvent,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.errors import PHRASE_NOT_READABLE
from omni_cache.runtime.events import PrefixCacheEventKind as E
from omni_cache.runtime.interface import HIDDEN_KEY
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.runtime.trace import TraceRecorder

K = "mm.k"


def _save(m, spans, *, with_k: bool, tag_of=None) -> int:  # type: ignore[no-untyped-def]
    """Save one step of ``(req, blocks, start, end)`` spans: hidden, plus per-token ``K`` if ``with_k``."""
    tag_of = tag_of or {}
    rows = torch.cat([truth(tag_of.get(r, r), range(s, e)) for r, _, s, e in spans])
    slot_ids = torch.cat([slots(b, s, e) for _, b, s, e in spans])
    mm = {K: -rows[:, :2].clone()} if with_k else {}
    layout = PrefixCacheWriteLayout.packed([(r, s, e) for r, _, s, e in spans], slot_ids)
    n = rows.shape[0]
    return m.save_outputs(rows, mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)


@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_I7_absent_key_not_served_from_older_tenant(eager: bool, deferred: bool) -> None:
    """C writes hidden and K on block 0; A reuses block 0 writing hidden only; B hits block 0 with K.

    B's hit must raise "is not readable" for K: block 0's tenant (A) never wrote K,
    and C's K rows belong to an older tenant (I7, I6). Today B got A's hidden rows
    glued to C's K rows, silently.
    """
    m = manager(eager=eager)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({K}) if deferred else frozenset()))
    m.new_step_starts([started("C")])
    m.materialize(_save(m, [("C", [0, 1], 0, 5)], with_k=True), ["C"])
    m.new_step_starts([PrefixCacheRequestEvent("C", E.FINISHED), started("A")])
    settle(m)
    # A, a different prompt, takes block 0 over; its steps carry hidden but not K.
    m.materialize(_save(m, [("A", [0, 2], 0, 3)], with_k=False), ["A"])
    m.materialize(_save(m, [("A", [0, 2], 3, 5)], with_k=False), ["A"])
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED), started("B", BS, [0, 3])])
    settle(m)
    step = _save(m, [("B", [0, 3], BS, BS + 2)], with_k=True, tag_of={"B": "A"})
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
    m.materialize(_save(m, [("A", [0, 2], 0, 5)], with_k=True), ["A"])
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED), started("B", BS, [0, 3])])
    settle(m)
    step = _save(m, [("B", [0, 3], BS, BS + 2)], with_k=True, tag_of={"B": "A"})
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
    m.materialize(_save(m, [("C", [0, 1], 0, 5)], with_k=True), ["C"])
    m.new_step_starts([PrefixCacheRequestEvent("C", E.FINISHED), started("A")])
    settle(m)
    m.materialize(_save(m, [("A", [0, 2], 0, 5)], with_k=False), ["A"])
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED), started("B", BS, [0, 3])])
    settle(m)
    out = m.materialize(_save(m, [("B", [0, 3], BS, BS + 2)], with_k=False, tag_of={"B": "A"}), ["B"])
    assert torch.equal(out.hidden_states["B"], truth("A", range(BS + 2)))
    assert K not in out.mm_outputs
    m.shutdown()



# ---- item 2/3: the slot mapping covers the step's rows exactly, as a 1-D integer CPU mapping ----


def _claims(m) -> int:  # type: ignore[no-untyped-def]
    return m.stats()["staging"]["claims"]


def _assert_refused_and_usable(m, call, eager: bool) -> None:  # type: ignore[no-untyped-def]
    """``call`` raises "slot mapping covers", claims nothing, burns no step id, fails nothing;
    the manager then saves and serves the next step exactly."""
    claims, issued = _claims(m), m._ids_issued
    with pytest.raises(OmniPrefixCacheUnmatchError, match="slot mapping covers"):
        call()
    settle(m)
    assert _claims(m) == claims and m._ids_issued == issued, "a refused save claimed a page or an id"
    assert m.stats()["failed"] is None and not m.book.live(), m.stats()
    m.new_step_starts([started("ok")])
    step = _save(m, [("ok", [5], 0, 3)], with_k=False)
    assert m._ids_issued == issued + 1
    assert torch.equal(m.materialize(step, ["ok"]).hidden_states["ok"], truth("ok", range(3)))


@pytest.mark.parametrize("gap", ["middle", "tail", "head"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_slot_mapping_covers_layout_gap_refused(eager: bool, gap: str) -> None:
    """Rows of the step that belong to no request are refused ("slot mapping covers"); today they
    were scattered into the pool over another request's cached block (X's block 1)."""
    from omni_cache.runtime.events import PrefixCacheWrite

    m = manager(eager=eager)
    m.new_step_starts([started("X")])
    m.materialize(_save(m, [("X", [1, 2], 0, 5)], with_k=False), ["X"])
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
    out = m.materialize(_save(m, [("Y", [1, 3], BS, BS + 1)], with_k=False, tag_of={"Y": "X"}), ["Y"])
    assert torch.equal(out.hidden_states["Y"], truth("X", range(BS + 1)))
    m.shutdown()


@pytest.mark.parametrize("bad", ["2-D", "float", "bool", "short", "meta device"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_slot_mapping_covers_malformed_slots_refused_before_claim(eager: bool, bad: str) -> None:
    """A 2-D, non-integer, too short or non-CPU ``slots_cpu`` is a precondition error raised before
    anything is claimed; today a 2-D mapping passed validation, its scatter failed and the manager
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


# ---- item 4: a failure inside a save is fully undone or sticky (I8), never half ----


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_I8_bookkeeping_memory_error_in_save_is_undone_and_surfaces_itself(eager: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``MemoryError`` from per-slot bookkeeping of a new key (a huge pool) surfaces as itself;
    the save leaves nothing claimed, no write in flight and no step id burned, and the manager
    stays usable. Today: an unrelated "cannot abort staging slot" error, a leaked claimed page
    and a pool write that never lands, with ``failed`` still None."""
    from omni_cache.runtime import tenancy as tenancy_mod

    m = manager(eager=eager)
    real = tenancy_mod._KeyVersions.__init__

    def huge(self, num_slots: int, *table_and_column: object) -> None:  # type: ignore[no-untyped-def]
        raise MemoryError(f"cannot allocate version vectors of {num_slots} slots")

    monkeypatch.setattr(tenancy_mod._KeyVersions, "__init__", huge)
    m.new_step_starts([started("A")])
    claims, issued = _claims(m), m._ids_issued
    with pytest.raises(MemoryError, match="version vectors"):
        _save(m, [("A", [0, 1], 0, 5)], with_k=False)
    assert _claims(m) == claims and m._ids_issued == issued
    assert m.staging.slot_states() == ["free"] * m.config.staging_depth, m.staging.slot_states()
    assert not m.book.live() and m.stats()["failed"] is None, m.stats()
    monkeypatch.setattr(tenancy_mod._KeyVersions, "__init__", real)
    step = _save(m, [("A", [0, 1], 0, 5)], with_k=False)
    assert torch.equal(m.materialize(step, ["A"]).hidden_states["A"], truth("A", range(5)))
    m.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_I8_failure_after_a_write_is_registered_is_sticky_and_chained(eager: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A failure once a pool write is registered cannot be undone: it surfaces as itself and
    fails the manager for good (every later entry raises "write failed", chained to it)."""
    m = manager(eager=eager)
    m.new_step_starts([started("A")])

    def boom(*args: object, **kwargs: object) -> set[int]:
        raise MemoryError("per-slot bookkeeping")

    monkeypatch.setattr(m.tenancy, "register", boom)
    with pytest.raises(MemoryError, match="per-slot bookkeeping"):
        _save(m, [("A", [0, 1], 0, 5)], with_k=False)
    failed = m.stats()["failed"]
    assert failed is not None and "MemoryError" in failed, m.stats()
    assert all(w.state == "failed" for w in m.book.live()) and not m.book.live(), m.book.describe_in_flight()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="write failed") as info:
        _save(m, [("A", [0, 1], 0, 5)], with_k=False)
    assert isinstance(info.value.__cause__, MemoryError), repr(info.value.__cause__)
    m.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_I8_refused_save_does_not_fix_a_keys_row_shape(eager: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A save that fails after its claim (here: the staging copy) is undone, and undone entirely:
    the staging page it allocated for a key no saved step ever carried is dropped, so a later
    save may bring that key with another width. Today the refused save locked the width in."""
    m = manager(eager=eager)
    m.new_step_starts([started("A")])
    real = m.copies.copy_all
    calls = {"n": 0}

    def flaky(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device->host copy failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(m.copies, "copy_all", flaky)
    rows = truth("A", range(5))
    layout = PrefixCacheWriteLayout.packed([("A", 0, 5)], slots([0, 1], 0, 5))
    with pytest.raises(RuntimeError, match="copy failed"):
        m.save_outputs(rows, {K: torch.ones(5, 3)}, num_tokens_unpadded=5, num_tokens_padded=5, write_layout=layout)
    assert m.stats()["failed"] is None and m.staging.slot_states() == ["free"] * m.config.staging_depth
    step = m.save_outputs(rows, {K: torch.ones(5, 6)}, num_tokens_unpadded=5, num_tokens_padded=5,
                          write_layout=layout)
    out = m.materialize(step, ["A"])
    assert torch.equal(out.mm_outputs[K]["A"], torch.ones(5, 6))
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


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_a_zero_row_write_leaves_its_hit_for_the_first_step_that_schedules_it(eager: bool) -> None:
    """B starts with a 4-token hit on A's block, but its first step schedules nothing for it (a
    zero-row write next to C's rows): B gets ``(0, width)`` rows there, and the step that does
    schedule B serves ``[0, token_end)``, the hit then its rows (contract section 4.4). Found by an
    independent attack: the zero-row write took the hit, so B got the prefix in a step that
    scheduled none of its tokens and only its new rows in the next."""
    from omni_cache.runtime.events import PrefixCacheWrite

    m = manager(eager=eager)
    m.new_step_starts([started("A")])
    m.materialize(_save(m, [("A", [0, 1], 0, BS)], with_k=False), ["A"])
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED), started("B", BS, [0, 2]), started("C")])
    settle(m)
    rows_c = truth("C", range(3))
    layout = PrefixCacheWriteLayout([PrefixCacheWrite("C", 0, 3, 0, 3), PrefixCacheWrite("B", 3, 3, BS, BS)], 3,
                                    slots([3], 0, 3))
    step = m.save_outputs(rows_c, {}, num_tokens_unpadded=3, num_tokens_padded=3, write_layout=layout)
    out = m.materialize(step, ["C", "B"])
    assert torch.equal(out.hidden_states["C"], rows_c)
    assert out.hidden_states["B"].shape == (0, truth("B", range(1)).shape[1]), out.hidden_states["B"].shape
    step = _save(m, [("B", [0, 2], BS, BS + 2)], with_k=False, tag_of={"B": "A"})
    assert torch.equal(m.materialize(step, ["B"]).hidden_states["B"], truth("A", range(BS + 2)))
    m.shutdown()


def test_a_planned_reads_pending_deferred_write_is_queued_by_the_save_that_plans_it() -> None:
    """Mutant: ``scheduling:WriteScheduler.after_save:del_call:98f1dacc``. A is live, so its
    deferred K is still open (it lands at A's FINISHED); B's save plans a hit on A's blocks, which
    needs that write: the save queues it at once (eager: it lands inside the save), so B's
    materialize finds it landed instead of starting it then, and it leaves the open set
    (``deferred_open``, the ``gpu_staging_bytes`` budget). The rows are A's either way.

    The trace notes that TLC validates say the same (mutants ``writes:WriteBook.enqueue:negate_cond:
    09249d7e``, front and back swapped, and ``tenancy:SlotTenancy.read:del_call:bb1391f6``, reads
    not noted, which would leave the tenancy trace check nothing to check a read against): A's K
    is queued at the front, each immediate write at the back, and each key of B's hit is read at
    the versions its plan named."""
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


def test_a_new_tenants_deferred_write_first_lands_the_older_tenants_open_one() -> None:
    """Mutant: ``tenancy:SlotTenancy.register:negate_cond:f178e4b5`` (the older-tenant scan done for
    the wrong schedule). A's deferred K on block 0 is still open (A is live: the engine preempted
    it and gave block 0 to B). B's save registers its own deferred K there: the older tenant's open
    write is found and queued first (eager: it lands in the save), so a late landing of A's K can
    never come after B's (contract 4.6's "older tenants first"); B's own K stays open."""
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


def test_a_keyless_tenant_is_noted_for_the_tenancy_trace() -> None:
    """Mutant: ``tenancy:SlotTenancy.take_slots:del_call:882653a7``. A step that writes no key on
    block 0 still becomes its tenant (I6/I7); the trace notes it (``tenant``, its step and slots),
    which is how TLC's tenancy check learns that the older rows there are no longer readable."""
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
