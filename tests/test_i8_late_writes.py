"""I8 after the failure: no copy starts, and every open write ends failed.

Owns the regression tests of the late-write hole the TLA+ Writes model found:
once the manager has failed, a write queued afterwards (an enqueue
that raced with the committer's failure) must fail instead of being copied,
and a deferred write still pending at the failure (its request never finishes:
every later entry raises) must end failed instead of staying open for ever.
The failure is injected through the documented seam ``FaultHooks``; the
recorded trace is checked against the model with TLC (tla/writes/WritesTrace.tla).

Invariants: I8 (sticky failure: the committer starts no copy once failed),
I9 (nothing is dropped: every registered write ends, written or failed).
"""

from __future__ import annotations

import threading
import time

import pytest
from reference_model import EMBEDS, Engine

from omni_cache import ModelCachePolicy, OmniPrefixCacheUnmatchError, PrefixCacheConfig
from omni_cache.runtime.errors import PHRASE_WRITE_FAILED
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.runtime.trace import TraceEvent, TraceRecorder
from omni_cache.verify.traces import check_writes_trace_tlc, replay

BOUND_S = 5.0


class RaceHooks(FaultHooks):
    """Hold the committer inside a pool write; when the engine flushes a finished
    request's writes, let the held write fail and wait until the manager is failed,
    so the flush's enqueue comes right after the failure (the race, made deterministic)."""

    def __init__(self) -> None:
        self.manager: OmniPrefixCacheManager | None = None
        self.hold = False
        self.fail = False
        self.entered = threading.Event()
        self.gate = threading.Event()

    def before_pool_write(self, write: object, key: str) -> None:
        if self.hold:
            self.entered.set()
            assert self.gate.wait(30), "test gate never opened"
        if self.fail:
            raise OSError("injected: pool write failed")

    def on_blocking(self, what: str) -> None:
        if self.hold and what.startswith("flush: finished"):
            assert self.manager is not None
            self.fail = True
            self.gate.set()
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
        hooks.hold = True
        s2 = eng.step([(1, 1)])  # b's immediate write: the committer parks inside its pool write
        assert s2 is not None and hooks.entered.wait(BOUND_S)
        eng.end(a, aborted=False)
        with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_WRITE_FAILED):
            eng.step([(1, 1)])  # sends a's FINISHED: the flush races with the failure
        _check_after_failure(m, rec)
    finally:
        hooks.gate.set()
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
