"""Trace validation: real runtime traces accepted, tampered ones rejected, by both replays.

Drives ``omni_cache.runtime.staging.StagingPool`` (and ``WriteBook``, and the manager)
with a ``TraceRecorder``, replays the recorded transitions with the pure-Python
``replay`` and with TLC (``check_trace_tlc``: a generated trace module checked
against tla/staging/StagingSlot.tla), and checks that tampered traces -- a
reused step id (I1), an illegal edge, a lost release, a consume on the wrong
slot -- are rejected by both, at the same event.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading

import pytest
import torch

from omni_cache.runtime.errors import (
    PHRASE_NOT_SAVED,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
)
from omni_cache.runtime.interface import WriteSchedule
from omni_cache.runtime.staging import StagingPool
from omni_cache.runtime.states import STAGING_TABLE, WRITE_TABLE
from omni_cache.runtime.trace import TraceEvent, TraceRecorder
from omni_cache.runtime.writes import WriteBook
from omni_cache.verify import TraceReplayError, check_trace_tlc, replay, validate_trace
from omni_cache.verify.tenancy_trace import check_tenancy_trace_tlc, has_tenancy_notes
from omni_cache.verify.testing import assert_trace_valid, require_tlc
from omni_cache.verify.traces import trace_module


def _staging_trace() -> list[TraceEvent]:
    """A real StagingPool run: claims, saves, consumes (one from a builder thread),
    a write hold outliving its consumer, rejected double/unknown consumes, an abort,
    and a claim timeout."""
    rec = TraceRecorder()
    pool = StagingPool(2, 8, 1.0, recorder=rec)
    rows = torch.ones(4, 3)

    s0 = pool.claim(4)
    pool.claimed_page(s0, "hidden", rows).copy_(rows)
    pool.hold(s0)  # a pool write reads page 0 (I3); registered before the id is issued, as the manager does
    pool.save(s0, 1, "test:1")
    s1 = pool.claim(4)
    pool.save(s1, 2, "test:2")

    # The builder consumes step 2 on its own thread while the engine goes on.
    done = threading.Event()

    def builder() -> None:
        slot = pool.consume(2, caller="materialize")
        pool.done_reading(slot)
        done.set()

    threading.Thread(target=builder).start()
    assert done.wait(5.0)

    slot = pool.consume(1, caller="discard_step")
    pool.done_reading(slot)  # page 0 stays materialized: the write still holds it
    assert pool.slot_states()[0] == "materialized"
    for bad in (1, 99):  # I1: rejected, no transition recorded (only the "reject" note)
        n = len(rec.events(notes=True))
        with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED):
            pool.consume(bad, caller="materialize")
        assert [(e.kind, e.trigger) for e in rec.events(notes=True)[n:]] == [("note", "reject")]
    s = pool.claim(4)  # the free page (slot 1)
    pool.abort(s)
    pool.unhold(s0)  # the write landed: page 0 is released now
    pool.save(pool.claim(2), 3, "test:3")  # one save at a time: the engine thread saves
    pool.save(pool.claim(2), 4, "test:4")
    with pytest.raises(OmniPrefixCacheStagingTimeoutError):
        pool.claim(2, timeout_s=0.01)

    # A concurrent stretch: the engine saves steps 5..12, a builder consumes them.
    for sid in (3, 4):
        pool.done_reading(pool.consume(sid, caller="materialize"))
    ids: queue.Queue[int | None] = queue.Queue()

    def consumer() -> None:
        while (sid := ids.get()) is not None:
            pool.done_reading(pool.consume(sid, caller="materialize"))

    t = threading.Thread(target=consumer)
    t.start()
    for sid in range(5, 13):
        slot = pool.claim(2)
        pool.save(slot, sid, f"test:{sid}")
        ids.put(sid)
    ids.put(None)
    t.join(5.0)
    assert pool.slot_states() == ["free", "free"]
    return rec.events(notes=True)


@pytest.fixture(scope="module")
def staging_trace() -> list[TraceEvent]:
    return _staging_trace()


def _tamper(events: list[TraceEvent], index: int, **changes: object) -> list[TraceEvent]:
    out = list(events)
    out[index] = dataclasses.replace(out[index], **changes)  # type: ignore[arg-type]
    return out


def _first(events: list[TraceEvent], trigger: str, nth: int = 0) -> int:
    return [i for i, e in enumerate(events) if e.trigger == trigger and e.kind == "fire"][nth]


def tampered_traces(events: list[TraceEvent]) -> dict[str, tuple[list[TraceEvent], int]]:
    """name -> (tampered trace, index of the first bad event)."""
    second_save = _first(events, "save", 1)
    first_release = _first(events, "release", 0)
    consume = _first(events, "consume", 0)
    other_slot = next(e.obj for e in events if e.obj not in (events[consume].obj, "pool"))
    without_release = events[:first_release] + events[first_release + 1 :]
    # After the lost release, the first event on that slot no longer starts from "materialized".
    lost_at = next(
        i for i in range(first_release, len(without_release))
        if without_release[i].obj == events[first_release].obj and without_release[i].kind == "fire"
    )
    return {
        "reused step id": (_tamper(events, second_save, step_id=events[_first(events, "save")].step_id), second_save),
        "illegal edge": (_tamper(events, consume, source="claimed", trigger="consume"), consume),
        "lost release": (without_release, lost_at),
        "consume on the wrong slot": (_tamper(events, consume, obj=other_slot), consume),
    }


def test_real_staging_trace_replays(staging_trace: list[TraceEvent]) -> None:
    assert {e.trigger for e in staging_trace if e.kind == "fire"} == set(STAGING_TABLE.triggers)  # every trigger
    assert {e.trigger for e in staging_trace if e.kind == "note"} == {
        "open", "hold", "unhold", "done_reading", "reject"}  # and every note the trace spec maps
    final = replay(staging_trace, STAGING_TABLE)
    assert set(final.values()) == {"free"}
    assert validate_trace(staging_trace) == final


@pytest.mark.parametrize("name", ["reused step id", "illegal edge", "lost release", "consume on the wrong slot"])
def test_python_replay_rejects_tampered_trace(staging_trace: list[TraceEvent], name: str) -> None:
    events, bad_index = tampered_traces(staging_trace)[name]
    with pytest.raises(TraceReplayError) as info:
        replay(events)
    assert info.value.index == bad_index


def test_replay_of_a_double_consume_event() -> None:
    """A consume of an already consumed id (slot re-saved with a new id) is rejected (I1)."""
    ev = TraceEvent
    events = [
        ev("staging_slot", "staging slot 0", "claim", "free", "claimed", None),
        ev("staging_slot", "staging slot 0", "save", "claimed", "saved", 1),
        ev("staging_slot", "staging slot 0", "consume", "saved", "materialized", 1),
        ev("staging_slot", "staging slot 0", "release", "materialized", "free", 1),
        ev("staging_slot", "staging slot 0", "claim", "free", "claimed", None),
        ev("staging_slot", "staging slot 0", "save", "claimed", "saved", 2),
        ev("staging_slot", "staging slot 0", "consume", "saved", "materialized", 1),
    ]
    replay(events[:6])
    with pytest.raises(TraceReplayError, match="I1") as info:
        replay(events)
    assert info.value.index == 6


def test_an_empty_trace_is_refused_not_reported_valid() -> None:
    """A recorder never passed to the manager records nothing: validating it would check nothing."""
    from omni_cache.verify.traces import validate_trace

    with pytest.raises(AssertionError, match="holds no events"):
        validate_trace(TraceRecorder())
    with pytest.raises(AssertionError, match="holds no events"):
        validate_trace([])
    pool = StagingPool(1, 4, 1.0, recorder=(recorder := TraceRecorder()))
    pool.claim(1)
    assert validate_trace(recorder) == {("staging_slot", "staging slot 0"): "claimed"}


def test_write_book_trace_replays_and_tampering_is_caught() -> None:
    rec = TraceRecorder()
    book = WriteBook(1.0, rec)
    slots = torch.arange(2)
    w1 = book.register(WriteSchedule.JOIN_NEXT_STEP, 1, slots, {"hidden": torch.ones(2, 3)})
    w2 = book.register(WriteSchedule.JOIN_ON_FINISH, 1, slots, {"mm.a": torch.ones(2, 3)})
    book.enqueue([w1])
    book.enqueue([w2], front=True)
    first = book.start_next(block=False)
    assert first is w2
    for trigger in ("finish_copy", "commit"):
        book.fire(w2, trigger)
    assert book.start_next(block=False) is w1
    book.fail(w1, RuntimeError("copy failed"), where="test")
    events = rec.events()
    final = replay(events, WRITE_TABLE)
    assert final == {("pool_write", "write tid 2"): "written", ("pool_write", "write tid 1"): "failed"}
    skipped = [e for e in events if not (e.obj == "write tid 2" and e.trigger == "finish_copy")]
    with pytest.raises(TraceReplayError, match="is in 'copying'"):
        replay(skipped)


@pytest.mark.tlc
def test_tlc_accepts_real_trace_and_rejects_tampered_ones(staging_trace: list[TraceEvent]) -> None:
    require_tlc()
    cases = {"real": (staging_trace, None), **tampered_traces(staging_trace)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:  # 2 cores: two TLCs at a time
        verdicts = dict(zip(cases, pool.map(check_trace_tlc, [events for events, _ in cases.values()]), strict=True))
    real = verdicts.pop("real")
    assert real.accepted, real.explain() + "\n" + real.output
    assert real.num_events == len(staging_trace)
    for name, verdict in verdicts.items():
        assert not verdict.accepted, f"TLC accepted the tampered trace ({name})"
        assert verdict.stuck_at == cases[name][1], f"{name}: {verdict.explain()}"  # where Python stopped too


@pytest.mark.tlc
def test_manager_trace_is_valid_for_both_replays() -> None:
    """The manager (async committer, hits) records both machines; both replays accept the trace."""
    from cache_helpers import config, save, settle, started

    from omni_cache.runtime.manager import OmniPrefixCacheManager

    rec = TraceRecorder()
    m = OmniPrefixCacheManager(config(), eager=False, recorder=rec)
    try:
        m.new_step_starts([started("a")])
        s1, _ = save(m, [("a", [0, 1], 0, 8)])
        m.materialize(s1, ["a"])
        settle(m)
        for i in range(5):  # each request hits a's two blocks and computes 4 more tokens
            req = f"r{i}"
            m.new_step_starts([started(req, hit_end=8, blocks=[0, 1, 2 + i])])
            step, _ = save(m, [(req, [0, 1, 2 + i], 8, 12)])
            if i % 2:
                m.materialize(step, [req])
            else:
                m.discard_step(step)
        settle(m)
    finally:
        m.shutdown()
    events = rec.events()
    assert {e.machine for e in events} == {"staging_slot", "pool_write"}
    # Tenancy (every r{i} plans hits on a's blocks and reads them) is validated by TLC too:
    # this config has no deferred keys, so each tenant has one write (the model's scope).
    assert has_tenancy_notes(rec), "this run must exercise the tenancy trace check"
    tenancy = check_tenancy_trace_tlc(rec)
    assert tenancy.accepted and tenancy.num_events > 20, tenancy.explain() + tenancy.output
    final = assert_trace_valid(rec, tlc=True)
    assert {s for (machine, _), s in final.items() if machine == "staging_slot"} == {"free"}


@pytest.mark.tlc
def test_a_tenant_that_writes_no_key_maps_onto_the_tenancy_spec() -> None:
    """Hidden opted out; a's step writes K on block 0, b's step takes block 0 over writing no key
    (a ``tenant`` note: ``SlotTenancy.take_slots``), c's hit there is refused ("is not readable",
    outside the model: an unregistered tenant's slot is not plannable), then d's step writes K on
    block 0 again and e's hit reads d's rows. TLC accepts the whole trace; the mapping's version of
    block 0's slots skips the keyless tenant (the model's ``reuse`` without ``register``)."""
    from cache_helpers import config, save_without_hidden, started, truth

    from omni_cache import ModelCachePolicy, OmniPrefixCacheUnmatchError
    from omni_cache.runtime.events import PrefixCacheEventKind as E
    from omni_cache.runtime.events import PrefixCacheRequestEvent
    from omni_cache.runtime.manager import OmniPrefixCacheManager

    rec = TraceRecorder()
    m = OmniPrefixCacheManager(config(), eager=True, recorder=rec)
    m.register_policy(ModelCachePolicy(needs_full_hidden_states=False))

    def step(req: str, blocks: list[int], start: int, end: int, with_k: bool) -> int:
        mm = {"k": truth(req, range(start, end))} if with_k else {"meta": [req]}
        return save_without_hidden(m, req, blocks, start, end, mm)

    try:
        m.new_step_starts([started("a")])
        m.materialize(step("a", [0], 0, 4, True), ["a"])
        m.new_step_starts([PrefixCacheRequestEvent("a", E.FINISHED), started("b")])
        m.materialize(step("b", [0], 0, 4, False), ["b"])
        m.new_step_starts([PrefixCacheRequestEvent("b", E.FINISHED), started("c", hit_end=4, blocks=[0, 1])])
        refused = step("c", [0, 1], 4, 6, True)
        with pytest.raises(OmniPrefixCacheUnmatchError, match="is not readable"):
            m.materialize(refused, ["c"])
        m.new_step_starts([PrefixCacheRequestEvent("c", E.FINISHED), started("d")])
        m.materialize(step("d", [0], 0, 4, True), ["d"])
        m.new_step_starts([PrefixCacheRequestEvent("d", E.FINISHED), started("e", hit_end=4, blocks=[0, 2])])
        out = m.materialize(step("e", [0, 2], 4, 6, True), ["e"])
        assert torch.equal(out.mm_outputs["k"]["e"][:4], truth("d", range(4))), "e reads d's rows"
    finally:
        m.shutdown()
    notes = [e.trigger for e in rec.events("tenancy", notes=True)]
    assert "tenant" in notes and notes.count("register") == 4, notes
    tenancy = check_tenancy_trace_tlc(rec)
    assert tenancy.accepted and tenancy.num_events >= 20, tenancy.explain() + tenancy.output


@pytest.mark.tlc
def test_a_block_a_newer_tenant_wrote_only_in_part_maps_onto_the_tenancy_spec() -> None:
    """a writes blocks 1 and 2, c (block 2's next tenant) writes only its first two slots, and b's
    hit on both blocks is refused ("is not readable": the runtime's block rule plans the slots behind
    c's rows absent, the plan note's ``mixed``, which the per-slot model leaves out); then c writes the
    rest of block 2 and d's hit reads a's and c's rows. TLC accepts the whole trace."""
    from cache_helpers import config, save, started

    from omni_cache import OmniPrefixCacheUnmatchError
    from omni_cache.runtime.events import PrefixCacheEventKind as E
    from omni_cache.runtime.events import PrefixCacheRequestEvent
    from omni_cache.runtime.manager import OmniPrefixCacheManager

    rec = TraceRecorder()
    m = OmniPrefixCacheManager(config(), eager=True, recorder=rec)
    try:
        m.new_step_starts([started("a")])
        m.materialize(save(m, [("a", [1, 2], 0, 8)])[0], ["a"])
        m.new_step_starts([PrefixCacheRequestEvent("a", E.FINISHED), started("c")])
        m.materialize(save(m, [("c", [2], 0, 2)])[0], ["c"])
        m.new_step_starts([started("b", hit_end=8, blocks=[1, 2, 3])])
        refused = save(m, [("b", [1, 2, 3], 8, 9)])[0]
        with pytest.raises(OmniPrefixCacheUnmatchError, match="at KV slot 10 is not readable"):
            m.materialize(refused, ["b"])
        m.materialize(save(m, [("c", [2], 2, 4)])[0], ["c"])
        m.new_step_starts([PrefixCacheRequestEvent("b", E.FINISHED), started("d", hit_end=8, blocks=[1, 2, 4])])
        m.materialize(save(m, [("d", [1, 2, 4], 8, 9)])[0], ["d"])
    finally:
        m.shutdown()
    plans = [e for e in rec.events("tenancy", notes=True) if e.trigger == "plan"]
    assert [p.versions_of("mixed") for p in plans] == [(("hidden", (10, 11)),), ()], plans
    tenancy = check_tenancy_trace_tlc(rec)
    assert tenancy.accepted and tenancy.num_events >= 20, tenancy.explain() + tenancy.output


def test_trace_module_is_plain_tla() -> None:
    ev = TraceEvent("staging_slot", "staging slot 3", "claim", "free", "claimed", None)
    note = TraceEvent("staging_slot", "staging slot 3", "hold", "claimed", "claimed", 7, "note",
                      (("holds", 1), ("reading", False)))
    text = trace_module([ev, note])
    assert 'ev |-> "claim", slot |-> 3, src |-> "free", dst |-> "claimed", step |-> -1, holds |-> -1' in text
    assert 'ev |-> "hold", slot |-> 3, src |-> "claimed", dst |-> "claimed", step |-> 7, holds |-> 1, reading |-> 0' in text
    assert text.startswith("---- MODULE StagingTraceData ----") and "EXTENDS Integers" in text
