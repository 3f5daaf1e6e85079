"""Fault injection through the documented seam ``omni_cache.runtime.faults.FaultHooks``: the write path.

Owns the fault tests of the manager's writes and committer; nothing here patches a private
name. Each test drives the reference engine (tests/reference_model.py) or a bare manager
(tests/cache_helpers.py), injects one fault, and checks the contract:

  I8   a failed pool write or a failed device->host copy fails the manager for
       good: every later entry (new_step_starts, save_outputs, materialize,
       discard_step) raises "write failed", and a thread waiting on the failed
       write wakes with that error (never a hang); a save that fails after its
       writes are registered surfaces as itself and leaves the sticky failure or
       nothing behind, never half;
  I3   a page is not released while its pool write still reads it;
  I11  a committer thread that dies (``committer_tick`` raising a
       BaseException) releases every waiter -- a save waiting for a page, a save
       waiting for the previous step's write, a materialize waiting for its
       step's copy -- with an error within a bound; a materialize that waits for
       its step's copy announces the wait to the fault hooks first (contract 4.6).

The refused saves (timeout, interrupt, malformed input) are in test_faults_rollback.py.
Every blocking call runs on a helper thread joined with a timeout, so a
regression fails with a message instead of hanging the suite.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from cache_helpers import MODES, manager, save, settle, started, wait_for_waiter, wait_until
from fault_helpers import BOUND_S, make
from reference_model import Engine, check_outputs
from thread_helpers import JOIN_S, Gate

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
)
from omni_cache.runtime.errors import PHRASE_WRITE_FAILED
from omni_cache.runtime.manager import OmniPrefixCacheManager


class CommitterKilled(BaseException):
    """Not an Exception: the committer thread itself dies."""


class Hooks(Gate):
    """Arm one fault; optionally hold the committer at the hook until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__(None, timeout_s=30)  # holds only where a fault below is armed to
        self.fail_pool_write = False
        self.fail_copy = False
        self.hold_pool_write = False
        self.park_committer = False
        self.kill_committer = False

    def before_device_to_host(self, write: object) -> None:
        if self.fail_copy:
            raise OSError("injected: device->host copy failed")

    def before_pool_write(self, write: object, key: str) -> None:
        if self.hold_pool_write:
            self.hold()
        if self.fail_pool_write:
            raise OSError("injected: pool write failed")

    def committer_tick(self) -> None:
        if self.park_committer:
            self.hold()
            if self.kill_committer:
                raise CommitterKilled("injected: the committer thread died")


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def released_with_error(t: threading.Thread, box: dict[str, object], what: str) -> str:
    t.join(BOUND_S)
    assert not t.is_alive(), f"{what} still blocked {BOUND_S}s after the fault: a hang"
    err = box.get("error")
    assert isinstance(err, OmniPrefixCacheUnmatchError), f"{what} returned {box!r} instead of raising"
    return str(err)


def assert_sticky(m: OmniPrefixCacheManager, eng: Engine, pending: list[int]) -> None:
    """I8: every entry raises 'write failed'; shutdown neither hangs nor forgets the pending ids."""
    rid = eng.add_request(1, 1, [2], 0)
    calls = {
        "new_step_starts": lambda: m.new_step_starts([]),
        "save_outputs (a whole step)": lambda: eng.step([(eng.n_reqs - 1, 4)]),
        "materialize": lambda: m.materialize(pending[0], []),
        "discard_step": lambda: m.discard_step(pending[-1]),
        "materialize of an unknown id": lambda: m.materialize(10**6, []),
    }
    for name, call in calls.items():
        with pytest.raises(OmniPrefixCacheUnmatchError) as info:
            call()
        assert PHRASE_WRITE_FAILED in str(info.value), f"{name}: {info.value}"
    assert "injected" in (m.stats()["failed"] or "")
    assert rid in eng.reqs
    t0 = time.perf_counter()
    unconsumed = m.shutdown()
    assert time.perf_counter() - t0 < BOUND_S
    assert set(pending) <= set(unconsumed)


def wait_failed(m: OmniPrefixCacheManager) -> None:
    deadline = time.monotonic() + BOUND_S
    while m.stats()["failed"] is None:
        assert time.monotonic() < deadline, "the injected fault never failed the manager"
        time.sleep(0.002)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
@pytest.mark.parametrize("fault", ["pool_write", "device_to_host"])
@pytest.mark.parametrize("when", ["save", "finish"])
def test_failed_write_is_sticky(eager: bool, fault: str, when: str) -> None:
    hooks = Hooks()
    m, eng = make(eager, hooks, deferred=True)
    a, b = eng.add_request(0, 2, [], 2), eng.add_request(1, 1, [1, 2], 0)
    s1 = eng.step([(0, 8), (1, 6)])
    assert s1 is not None
    check_outputs(s1, [a, b], m.materialize(s1.step_id, [a, b]))
    s2 = eng.step([(0, 1)])
    assert s2 is not None
    settle(m)
    setattr(hooks, "fail_pool_write" if fault == "pool_write" else "fail_copy", True)
    if when == "save":  # the step's immediate write fails
        action: Callable[[], object] = lambda: eng.step([(1, 1)])  # noqa: E731
    else:  # the finished request's deferred write fails (pushed to the front, I9)
        eng.end(a, aborted=False)
        action = lambda: eng.step([(1, 1)])  # noqa: E731
    if eager:  # inline landing: the failing call itself raises
        with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_WRITE_FAILED):
            action()
    else:
        try:
            action()
        except OmniPrefixCacheUnmatchError as exc:  # the committer may fail it before save returns
            assert PHRASE_WRITE_FAILED in str(exc)
    wait_failed(m)
    assert_sticky(m, eng, [s2.step_id])


@pytest.mark.parametrize("fault", ["pool_write", "device_to_host"])
def test_failed_write_wakes_its_waiter(fault: str) -> None:
    """Async: a thread blocked on the write that fails wakes with 'write failed'.

    A failed copy is awaited by the step's materialize (it waits for host_ready);
    a failed pool write (after host_ready) by the next save, which waits for the
    previous step's rows to land.
    """
    hooks = Hooks()
    hooks.park_committer = True  # hold the committer before it takes the write
    m, eng = make(False, hooks)
    assert hooks.entered.wait(BOUND_S)
    eng.add_request(0, 1, [1], 0)
    eng.add_request(1, 1, [1], 0)
    s1 = eng.step([(0, 5)])
    assert s1 is not None
    waiting = m.book._num_waiting  # the parked committer waits on its gate, not on the book
    if fault == "device_to_host":
        t, box = in_thread(lambda: m.materialize(s1.step_id, list(s1.spans)))
    else:
        t, box = in_thread(lambda: eng.step([(0, 5)]))
    wait_for_waiter(m.book, "the waiter blocks on the parked write", waiting)
    assert t.is_alive(), f"the waiter returned before the write was done: {box}"
    setattr(hooks, "fail_pool_write" if fault == "pool_write" else "fail_copy", True)
    hooks.park_committer = False
    hooks.release.set()
    assert PHRASE_WRITE_FAILED in released_with_error(t, box, "the waiter")
    wait_failed(m)
    m.shutdown()


def test_page_stays_held_while_its_pool_write_reads_it() -> None:
    """I3: materialize may finish before the write lands; the page is released only after it."""
    hooks = Hooks()
    hooks.hold_pool_write = True
    m, eng = make(False, hooks, depth=2)
    eng.add_request(0, 2, [], 0)
    s1 = eng.step([(0, 8)])
    assert s1 is not None and hooks.entered.wait(BOUND_S)
    check_outputs(s1, list(s1.spans), m.materialize(s1.step_id, list(s1.spans)))
    slots = m.stats()["staging"]["slots"]
    assert slots["materialized"] == 1 and slots["free"] == 1, f"page released under a pool write: {slots}"
    hooks.release.set()
    settle(m)
    assert m.stats()["staging"]["slots"]["free"] == 2
    assert m.shutdown() == {}


class TestCommitterDeath:
    """I8/I11: a committer that dies releases every waiter with an error, never a hang."""

    def _dying(self, depth: int) -> tuple[Hooks, OmniPrefixCacheManager, Engine]:
        hooks = Hooks()
        m, eng = make(False, hooks, depth=depth)
        for i in range(3):
            eng.add_request(i, 1, [i], 0)
        return hooks, m, eng

    def _kill(self, hooks: Hooks) -> None:
        hooks.kill_committer = True
        hooks.release.set()

    def _after(self, m: OmniPrefixCacheManager, msg: str) -> None:
        assert PHRASE_WRITE_FAILED in msg and "died" in msg, msg
        for call in (lambda: m.new_step_starts([]), lambda: m.discard_step(1)):
            with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_WRITE_FAILED):
                call()
        t0 = time.perf_counter()
        m.shutdown()
        assert time.perf_counter() - t0 < BOUND_S

    def test_save_waiting_for_a_page(self) -> None:
        hooks, m, eng = self._dying(depth=1)
        s1 = eng.step([(0, 5)])
        assert s1 is not None
        settle(m)  # s1's write landed: the next save waits only for the page s1 holds
        hooks.park_committer = True
        assert hooks.entered.wait(BOUND_S)
        t, box = in_thread(lambda: eng.step([(1, 5)]))
        wait_for_waiter(m.staging, "the save waits for a staging page")
        assert t.is_alive(), f"the save did not wait for a page: {box}"
        self._kill(hooks)
        self._after(m, released_with_error(t, box, "save waiting for a staging page"))

    def test_save_waiting_for_the_previous_write(self) -> None:
        hooks, m, eng = self._dying(depth=3)
        hooks.park_committer = True
        assert hooks.entered.wait(BOUND_S)
        assert eng.step([(0, 5)]) is not None  # its write stays queued: the committer is parked
        waiting = m.book._num_waiting
        t, box = in_thread(lambda: eng.step([(1, 5)]))
        wait_for_waiter(m.book, "the save waits for the previous step's write", waiting)
        assert t.is_alive(), f"the save did not wait for the previous step's write: {box}"
        self._kill(hooks)
        self._after(m, released_with_error(t, box, "save waiting for the previous write"))

    def test_materialize_waiting_for_its_copy(self) -> None:
        hooks, m, eng = self._dying(depth=3)
        hooks.park_committer = True
        assert hooks.entered.wait(BOUND_S)
        s1 = eng.step([(0, 5)])
        assert s1 is not None
        waiting = m.book._num_waiting
        t, box = in_thread(lambda: m.materialize(s1.step_id, list(s1.spans)))
        wait_for_waiter(m.book, "materialize waits for its step's copy", waiting)
        assert t.is_alive(), f"materialize did not wait for the copy: {box}"
        self._kill(hooks)
        self._after(m, released_with_error(t, box, "materialize waiting for its copy"))


# ---- I8: a save that fails after registering its writes ----------------------------------
@pytest.mark.parametrize("keys", ["hidden", "hidden+audio", "audio"])
@pytest.mark.parametrize("eager", MODES)
def test_a_failure_after_registration_surfaces_as_itself_and_leaves_no_half_state(
    eager: bool, keys: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure inside a save after its writes are registered surfaces as itself and leaves the sticky
    failure or nothing behind, never half (I8).

    A failure after the writes are registered (planning the hit runs out of memory)
    must raise that error (or one chained from it) and leave either the sticky
    failure set, or nothing behind: no claimed page, no live write. ``audio`` is a
    deferred key; "hidden" alone has only an immediate write, "audio" only a deferred one.

    Kills the mutants: delete ``registered.append(imm)`` / ``registered.append(deferred)`` in
    ``save_outputs``, or the ``book.fail`` of the writes after the first (hidden+audio: the deferred one
    stays live).

    A failure inside a save after its writes are registered surfaces as itself and leaves the sticky
    failure or nothing behind, never half (I8)."""
    m = manager(eager)
    m.register_policy(ModelCachePolicy(needs_full_hidden_states="hidden" in keys, deferred_keys=frozenset({"audio"})))
    mm = (lambda n: {"audio": torch.ones(n, 3)}) if "audio" in keys else (lambda n: {})
    m.new_step_starts([started("a")])
    s1, _ = save(m, [("a", [0, 1], 0, 8)], mm=mm(8))
    m.discard_step(s1)
    m.new_step_starts([PrefixCacheRequestEvent("a", PrefixCacheEventKind.FINISHED),
                       started("b", hit_end=8, blocks=[0, 1, 2])])

    def out_of_memory(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise MemoryError("no memory for the planned read")

    monkeypatch.setattr(m.tenancy, "plan", out_of_memory)
    with pytest.raises(BaseException) as info:
        save(m, [("b", [0, 1, 2], 8, 12)], mm=mm(4))
    err = info.value
    assert isinstance(err, MemoryError) or isinstance(err.__cause__, MemoryError), repr(err)
    stats = m.stats()
    clean = stats["staging"]["slots"]["claimed"] == 0 and stats["writes_in_flight"] == 0
    assert stats["failed"] is not None or clean, stats
    left = [w.describe() for w in m.book.live() if "b" in w.req_ids]
    assert not left, f"the failed save left its registered writes live, not failed (I8): {left}"
    m.shutdown()


class _HoldAndNoteWaits(Gate):
    """Holds the first device->host copy; notes every blocking point the manager announces."""

    def __init__(self) -> None:
        super().__init__("before_device_to_host", first_only=True)
        self.blocking: list[str] = []

    def on_blocking(self, what: str) -> None:
        self.blocking.append(what)


def test_a_materialize_that_waits_for_its_copy_announces_the_wait_first() -> None:
    """A materialize that must wait for its step's device->host copy announces the wait to the fault hooks
    first, then returns the rows (I11, contract 4.6).

    Async: the committer is held
    inside the step's device->host copy, so ``materialize`` must wait for it; it calls the fault
    hooks' ``on_blocking`` first (where an injected interrupt or a test's gate acts, contract 4.6's
    shutdown and the fault tests rely on every wait being announced), then returns the rows.

    Kills the mutant: ``reader:StepReader.build_outputs:del_call:4f7a216a``.

    A materialize that must wait for its step's device->host copy announces the wait to the fault hooks
    first, then returns the rows (I11, contract 4.6)."""
    hold = _HoldAndNoteWaits()
    m = manager(eager=False)
    m.faults = m.committer.faults = m.reader.faults = hold
    m.new_step_starts([started("a", scheduled=4)])
    step, rows = save(m, [("a", [0], 0, 4)])
    assert hold.entered.wait(JOIN_S), "the committer never started the step's copy"
    result: list[object] = []
    reading = threading.Thread(target=lambda: result.append(m.materialize(step, ["a"])), daemon=True)
    reading.start()
    wanted = "materialize waits for the step's device->host copy"
    wait_until(lambda: wanted in hold.blocking, "materialize announces its wait for the copy", JOIN_S)
    assert reading.is_alive(), "materialize returned while the step's copy was held"
    hold.release.set()
    reading.join(JOIN_S)
    assert len(result) == 1, "materialize did not return once the copy landed"
    assert torch.equal(result[0].hidden_states["a"], rows)  # type: ignore[attr-defined]
    m.shutdown()
