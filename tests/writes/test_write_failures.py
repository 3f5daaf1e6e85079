"""I8: a failure inside a save is undone or sticky, and after the failure no copy starts and
every open write ends failed.

A failure inside ``save_outputs`` is either undone entirely (nothing claimed, no write in
flight, no step id burned, no key's width fixed) or, once a pool write is registered, sticky
and chained to its cause. Once the manager has failed, a write queued afterwards (an enqueue
that raced with the committer's failure) must fail instead of being copied,
and a deferred write still pending at the failure (its request never finishes:
every later entry raises) must end failed instead of staying open for ever (a hole the TLA+
Writes model found).
The failure is injected through the documented seam ``FaultHooks``; the
recorded trace is checked against the model with TLC (tla/writes/WritesTrace.tla).

Invariants: I8 (sticky failure: the committer starts no copy once failed),
I9 (nothing is dropped: every registered write ends, written or failed).
"""

from __future__ import annotations

import time

import pytest
import torch
from cache_helpers import manager, save, slots, staging_claims, started, truth
from reference_model import EMBEDS, Engine
from thread_helpers import Gate

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.errors import PHRASE_WRITE_FAILED
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.runtime.trace import TraceEvent, TraceRecorder
from omni_cache.verify.traces import check_writes_trace_tlc, replay

K = "mm.k"  # a per-token key beside hidden
BOUND_S = 5.0


class RaceHooks(Gate):
    """Hold the committer inside a pool write; when the engine flushes a finished
    request's writes, let the held write fail and wait until the manager is failed,
    so the flush's enqueue comes right after the failure (the race, made deterministic)."""

    def __init__(self) -> None:
        super().__init__(None, timeout_s=30)  # holds only while ``holding``
        self.manager: OmniPrefixCacheManager | None = None
        self.holding = False
        self.fail = False

    def before_pool_write(self, write: object, key: str) -> None:
        if self.holding:
            self.hold()
        if self.fail:
            raise OSError("injected: pool write failed")

    def on_blocking(self, what: str) -> None:
        if self.holding and what.startswith("flush: finished"):
            assert self.manager is not None
            self.fail = True
            self.release.set()
            deadline = time.monotonic() + BOUND_S
            while self.manager.book.failure is None:
                assert time.monotonic() < deadline, "the injected pool-write failure never failed the manager"
                time.sleep(0.001)


def _make(eager: bool, hooks: FaultHooks, rec: TraceRecorder) -> tuple[OmniPrefixCacheManager, Engine]:
    cfg = PrefixCacheConfig(num_blocks=16, block_size=4, staging_depth=3, staging_capacity_tokens=16,
                            staging_claim_timeout_s=30.0)
    m = OmniPrefixCacheManager(cfg, eager=eager, faults=hooks, recorder=rec)
    return m, Engine(m, cfg, ModelCachePolicy(deferred_keys=frozenset({EMBEDS})))


def _writes_end(m: OmniPrefixCacheManager) -> None:
    deadline = time.monotonic() + BOUND_S
    while m.book.live():
        assert time.monotonic() < deadline, (
            f"I8/I9: writes still open {BOUND_S}s after the manager failed: {m.book.describe_in_flight()}"
        )
        time.sleep(0.002)


def _check_after_failure(m: OmniPrefixCacheManager, rec: TraceRecorder) -> list[TraceEvent]:
    """No copy starts after the first fail; every registered write ends, the unlanded ones failed."""
    _writes_end(m)
    writes = [e for e in rec.events(notes=True) if e.machine == "pool_write"]
    first_fail = next(i for i, e in enumerate(writes) if e.kind == "fire" and e.trigger == "fail")
    late = [e for e in writes[first_fail:] if e.kind == "fire" and e.trigger == "start_copy"]
    assert not late, f"I8: a copy started after the manager failed: {late}"
    final = {obj: s for (machine, obj), s in replay(writes).items() if machine == "pool_write"}
    registered = {f"write tid {e.get('tid')}" for e in writes if e.kind == "note" and e.trigger == "register"}
    assert registered and registered <= set(final), f"registered writes that never moved: {registered - set(final)}"
    open_ = {obj: s for obj, s in final.items() if s not in ("written", "failed")}
    assert not open_, f"I8/I9: writes left open after the failure: {open_}"
    return writes


@pytest.mark.tlc
def test_I8_write_queued_after_the_failure_fails_instead_of_being_copied() -> None:
    """Async: a finished request's deferred write is flushed right after the committer failed.

    Before the fix, WriteBook.enqueue queued it and pop handed it to the committer
    (a copy started after the failure), or the committer had already exited and the
    write stayed queued for ever. The other request's deferred write, pending at the
    failure, never ended either.
    """
    rec = TraceRecorder()
    hooks = RaceHooks()
    m, eng = _make(False, hooks, rec)
    hooks.manager = m
    try:
        a, b, c = eng.add_request(0, 2, [], 2), eng.add_request(1, 1, [1, 2], 0), eng.add_request(2, 1, [3], 2)
        s1 = eng.step([(0, 8), (1, 6), (2, 5)])  # a and c register deferred writes (still pending)
        assert s1 is not None
        m.materialize(s1.step_id, [a, b, c])
        deadline = time.monotonic() + BOUND_S
        while m.stats()["write_queue"] or any(w.state != "pending" for w in m.book.live()):
            assert time.monotonic() < deadline, m.book.describe_in_flight()
            time.sleep(0.002)
        hooks.holding = True
        s2 = eng.step([(1, 1)])  # b's immediate write: the committer parks inside its pool write
        assert s2 is not None and hooks.entered.wait(BOUND_S)
        eng.end(a, aborted=False)
        with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_WRITE_FAILED):
            eng.step([(1, 1)])  # sends a's FINISHED: the flush races with the failure
        _check_after_failure(m, rec)
    finally:
        hooks.release.set()
        m.shutdown()
    verdict = check_writes_trace_tlc(rec)
    assert verdict.accepted, verdict.explain() + "\n" + verdict.output[-1500:]


def test_I8_deferred_write_pending_at_the_failure_ends_failed() -> None:
    """Eager: an immediate write fails; the deferred writes of live requests end failed."""
    rec = TraceRecorder()
    hooks = RaceHooks()
    m, eng = _make(True, hooks, rec)
    hooks.manager = m
    try:
        a, b = eng.add_request(0, 2, [], 2), eng.add_request(1, 1, [1, 2], 0)
        s1 = eng.step([(0, 8), (1, 6)])
        assert s1 is not None
        m.materialize(s1.step_id, [a, b])
        assert any(w.state == "pending" for w in m.book.live()), "the scenario needs a pending deferred write"
        hooks.fail = True
        with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_WRITE_FAILED):
            eng.step([(1, 1)])
        _check_after_failure(m, rec)
        with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_WRITE_FAILED):
            m.new_step_starts([])
    finally:
        m.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_I8_bookkeeping_memory_error_in_save_is_undone_and_surfaces_itself(eager: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``MemoryError`` from per-slot bookkeeping of a new key (a huge pool) surfaces as itself;
    the save leaves nothing claimed, no write in flight and no step id burned, and the manager
    stays usable. Without the undo: an unrelated "cannot abort staging slot" error, a leaked claimed page
    and a pool write that never lands, with ``failed`` still None."""
    from omni_cache.runtime import tenancy as tenancy_mod

    m = manager(eager=eager)
    real = tenancy_mod._KeyVersions.__init__

    def huge(self, num_slots: int, *table_and_column: object) -> None:  # type: ignore[no-untyped-def]
        raise MemoryError(f"cannot allocate version vectors of {num_slots} slots")

    monkeypatch.setattr(tenancy_mod._KeyVersions, "__init__", huge)
    m.new_step_starts([started("A")])
    claims, issued = staging_claims(m), m._ids_issued
    with pytest.raises(MemoryError, match="version vectors"):
        save(m, [("A", [0, 1], 0, 5)])[0]
    assert staging_claims(m) == claims and m._ids_issued == issued
    assert m.staging.slot_states() == ["free"] * m.config.staging_depth, m.staging.slot_states()
    assert not m.book.live() and m.stats()["failed"] is None, m.stats()
    monkeypatch.setattr(tenancy_mod._KeyVersions, "__init__", real)
    step = save(m, [("A", [0, 1], 0, 5)])[0]
    assert torch.equal(m.materialize(step, ["A"]).hidden_states["A"], truth("A", range(5)))
    m.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
@pytest.mark.parametrize(("owner", "method", "what"), [
    ("tenancy", "register", "per-slot bookkeeping"),  # while registering the write's versions
    ("book", "enqueue", "copy queue"),  # the last part of a save: queuing its registered write
], ids=["registering", "queuing"])
def test_I8_failure_after_a_write_is_registered_is_sticky_and_chained(  # type: ignore[no-untyped-def]
    eager: bool, owner: str, method: str, what: str, monkeypatch,
) -> None:
    """A failure once a pool write is registered cannot be undone: it surfaces as itself and
    fails the manager for good, so every later entry raises at once ("write failed", chained to
    it) instead of waiting for a write nobody queued."""
    m = manager(eager=eager)
    m.new_step_starts([started("A")])

    def boom(*args: object, **kwargs: object) -> object:
        raise MemoryError(what)

    monkeypatch.setattr(getattr(m, owner), method, boom)
    with pytest.raises(MemoryError, match=what):
        save(m, [("A", [0, 1], 0, 5)])
    monkeypatch.undo()
    failed = m.stats()["failed"]
    assert failed is not None and "MemoryError" in failed, m.stats()
    assert all(w.state == "failed" for w in m.book.live()) and not m.book.live(), m.book.describe_in_flight()
    started_at = time.monotonic()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="write failed") as info:
        save(m, [("A", [0, 1], 0, 5)])
    assert isinstance(info.value.__cause__, MemoryError), repr(info.value.__cause__)
    assert time.monotonic() - started_at < BOUND_S
    m.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_I8_an_interrupt_inside_a_landing_fails_the_write_and_goes_on_up(eager: bool) -> None:
    """A ``BaseException`` that is not an ``Exception`` (an interrupt, an exit) raised while a write
    lands is not swallowed: inline it reaches the saver, on the committer thread it ends the thread;
    either way the write it interrupted ends failed (sticky, I8) instead of staying ``copying`` for
    every later wait to time out on."""

    class Interrupt(BaseException):
        pass

    class Hooks(FaultHooks):
        def before_pool_write(self, write: object, key: str) -> None:
            raise Interrupt("interrupted inside the pool write")

    m = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=16, block_size=4, staging_depth=2), eager=eager,
                               faults=Hooks())
    m.new_step_starts([started("A")])
    if eager:
        with pytest.raises(Interrupt):
            save(m, [("A", [0, 1], 0, 5)])
    else:
        save(m, [("A", [0, 1], 0, 5)])
        deadline = time.monotonic() + BOUND_S
        while m.stats()["failed"] is None and time.monotonic() < deadline:
            time.sleep(0.01)
    failed = m.stats()["failed"]
    assert failed is not None and "Interrupt" in failed, m.stats()
    assert not m.book.live(), m.book.describe_in_flight()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="write failed"):
        save(m, [("A", [0, 1], 5, 6)])
    m.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_a_save_refused_for_its_leftovers_adds_no_key_to_the_pools_bookkeeping(eager: bool) -> None:
    """A save refused before its claim (a leftover that cannot be copied) changes nothing, not even
    the per-slot version columns of a key it would have brought."""
    import threading

    m = manager(eager=eager)
    m.new_step_starts([started("A")])
    keys, nbytes = list(m.tenancy._keys), m.tenancy.nbytes()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="cannot be copied faithfully"):
        save(m, [("A", [0, 1], 0, 5)], mm={"lock": threading.Lock()}, mm_keys=["new.key"])
    assert list(m.tenancy._keys) == keys and m.tenancy.nbytes() == nbytes and staging_claims(m) == 0
    m.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_I8_refused_save_does_not_fix_a_keys_row_shape(eager: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A save that fails after its claim (here: the staging copy) is undone, and undone entirely:
    the staging page it allocated for a key no saved step ever carried is dropped, so a later
    save may bring that key with another width. Without the undo the refused save locked the width in."""
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
