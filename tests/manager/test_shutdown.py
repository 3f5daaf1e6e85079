"""Contract 4.6: ``shutdown`` and the saves in progress on other threads.

Owns the deterministic tests (thread gates and bounded waits on conditions, no sleeps for
luck) that a save still waiting for a staging page when ``shutdown`` begins is refused with
the contract error and changes nothing, and that a save that already claimed its page lands
before ``shutdown`` returns: no write is ever left queued without a committer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from cache_helpers import MODES, manager, save, started, wait_until
from thread_helpers import JOIN_S, Gate, hold_first_copy

from omni_cache import OmniPrefixCacheUnmatchError
from omni_cache.runtime.errors import PHRASE_SHUT_DOWN


class _Call:
    """Runs ``call`` on its own thread; keeps its result or error."""

    def __init__(self, call: Callable[[], object]) -> None:
        self.result: object = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call: Callable[[], object]) -> None:
        try:
            self.result = call()
        except BaseException as exc:
            self.error = exc
        self.done.set()


def _assert_no_write_left(m: object) -> None:
    stats = m.stats()  # type: ignore[attr-defined]
    assert stats["write_queue"] == 0 and stats["writes_in_flight"] == 0, (
        f"a write stayed queued after shutdown: queue {stats['write_queue']}, in flight "
        f"{stats['writes_in_flight']}")


@pytest.mark.parametrize("eager", MODES)
def test_a_save_waiting_for_a_page_when_shutdown_begins_is_refused(eager: bool) -> None:
    m = manager(eager=eager, staging_depth=1, staging_claim_timeout_s=JOIN_S)
    m.new_step_starts([started("a", scheduled=4)])
    first, _ = save(m, [("a", [0], 0, 4)])  # unconsumed: it keeps the only page
    m.new_step_starts([started("b", scheduled=4)])
    waiting = _Call(lambda: save(m, [("b", [1], 0, 4)]))
    wait_until(lambda: m.staging._num_waiting == 1, "the second save waits for the staging page", JOIN_S)
    shutting = _Call(m.shutdown)
    assert waiting.done.wait(JOIN_S / 2), "the waiting save was not refused when shutdown began"
    assert isinstance(waiting.error, OmniPrefixCacheUnmatchError), waiting.error or waiting.result
    message = str(waiting.error)
    assert "the manager was shut down" in message and "before this save claimed a staging slot" in message
    assert "it was waiting for one" in message
    assert "staging slot 0 (state 'saved', step id " + str(first) in message, message
    assert shutting.done.wait(JOIN_S) and shutting.error is None, shutting.error
    assert set(shutting.result) == {first}  # type: ignore[arg-type]
    _assert_no_write_left(m)
    assert m.counters["saved"] == 1 and m._ids_issued == 1, "the refused save issued a step id"


def test_a_save_waiting_for_the_previous_write_when_shutdown_begins_is_refused() -> None:
    """Async: step 1 is discarded while the committer is held inside its write; the next save
    waits for that write, then would claim the page it frees -- after shutdown began."""
    hold = hold_first_copy()
    m = manager(eager=False, staging_depth=1, staging_claim_timeout_s=JOIN_S)
    m.faults = m.committer.faults = hold
    m.new_step_starts([started("a", scheduled=4)])
    first, _ = save(m, [("a", [0], 0, 4)])
    assert hold.entered.wait(JOIN_S), "the committer never started step 1's write"
    m.discard_step(first)  # consumed; its page stays held by its write until that lands
    m.new_step_starts([started("b", scheduled=4)])
    waiting = _Call(lambda: save(m, [("b", [1], 0, 4)]))
    wait_until(lambda: m.book._num_waiting == 1, "the second save waits for step 1's write", JOIN_S)
    shutting = _Call(m.shutdown)
    wait_until(lambda: getattr(m.staging, "_closed", False), "shutdown closed the staging pool to new claims", JOIN_S)
    hold.release.set()  # step 1's write lands and frees the page; the save may not claim it now
    assert waiting.done.wait(JOIN_S) and shutting.done.wait(JOIN_S), "the save or shutdown hangs"
    assert shutting.error is None, shutting.error
    assert isinstance(waiting.error, OmniPrefixCacheUnmatchError), waiting.error or waiting.result
    assert "the manager was shut down" in str(waiting.error), waiting.error
    assert shutting.result == {}
    _assert_no_write_left(m)
    assert m.staging.slot_states() == ["free"]


@pytest.mark.parametrize("eager", MODES)
def test_a_save_that_claimed_its_page_lands_before_shutdown_returns(eager: bool) -> None:
    hold = Gate("after_claim", first_only=True)  # the first save, right after it claimed its page
    m = manager(eager=eager, staging_depth=1)
    m.faults = hold
    m.new_step_starts([started("a", scheduled=4)])
    saving = _Call(lambda: save(m, [("a", [2], 0, 4)]))
    assert hold.entered.wait(JOIN_S), "the save never claimed its page"
    shutting = _Call(m.shutdown)
    wait_until(lambda: m._shut_down, "shutdown began", JOIN_S)
    assert not shutting.done.wait(0.2), "shutdown returned while a save that claimed its page was still running"
    hold.release.set()
    assert saving.done.wait(JOIN_S) and saving.error is None, saving.error
    step_id, rows = saving.result  # type: ignore[misc]
    assert shutting.done.wait(JOIN_S) and shutting.error is None, shutting.error
    assert step_id in shutting.result  # type: ignore[operator]
    _assert_no_write_left(m)
    assert torch.equal(m.pool.rows("hidden", torch.arange(8, 12)), rows), "the claimed save's rows never landed"


@pytest.mark.parametrize("eager", MODES)
def test_a_save_past_the_usable_check_when_shutdown_begins_is_refused_at_the_door(eager: bool) -> None:
    """A save that passed the usable check before ``shutdown`` began is refused at the save door, before any
    claim or step id (contract 4.6).

    The save passed
    ``check_usable`` before ``shutdown`` began and reaches the save door after it closed: it is
    refused there, before it claims anything or issues a step id (a save without a staging page,
    e.g. only deferred keys, would otherwise register a write no committer lands).

    Kills the mutant: ``manager:OmniPrefixCacheManager.save_outputs:del_raise:43130aa8``.

    A save that passed the usable check before ``shutdown`` began is refused at the save door, before any
    claim or step id (contract 4.6)."""
    m = manager(eager=eager)
    m.new_step_starts([started("a", scheduled=4)])
    real, passed, go = m.check_usable, threading.Event(), threading.Event()

    def check_then_pause(what: str) -> None:
        real(what)
        if what == "save_outputs":
            passed.set()
            assert go.wait(JOIN_S), "the test never let the save go on"

    m.check_usable = check_then_pause  # type: ignore[method-assign]
    saving = _Call(lambda: save(m, [("a", [0], 0, 4)]))
    assert passed.wait(JOIN_S), "the save never reached the usable check"
    shutting = _Call(m.shutdown)
    wait_until(lambda: m._saves._closed, "shutdown closes the save door", JOIN_S)
    go.set()
    assert saving.done.wait(JOIN_S) and isinstance(saving.error, OmniPrefixCacheUnmatchError), (
        saving.error or saving.result)
    assert str(saving.error) == f"cannot save_outputs: {PHRASE_SHUT_DOWN}", saving.error
    assert shutting.done.wait(JOIN_S) and shutting.error is None and shutting.result == {}
    assert m._ids_issued == 0 and m.counters["saved"] == 0 and m.stats()["staging"]["claims"] == 0
    _assert_no_write_left(m)

