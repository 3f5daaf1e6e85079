"""Manager behaviour beyond the invariants: threads, waits and shutdown.

A builder thread consumes while the engine thread saves; the eager drain lands writes one thread
at a time, in queue order; an aborted staging claim wakes a save waiting for a page at once (I2,
I11); a save announces each blocking point to the fault hooks with no state lock held (I11);
``shutdown`` reports the unconsumed steps, closes the write queue so a blocking pop returns at
once, and stops the committer thread once the queue is drained (contract 4.6, I9).

The saves still in progress on other threads when ``shutdown`` begins: tests/manager/test_shutdown.py.
Split from tests/manager/test_behaviour.py (what a step is served); deferred writes, the budget and
the stats: tests/manager/test_deferred_budget_and_stats.py.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import pytest
import torch
from cache_helpers import MODES, E, config, manager, save, slots, started, wait_for_waiter
from thread_helpers import Gate

from omni_cache import OmniPrefixCacheUnmatchError, PrefixCacheRequestEvent
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.runtime.staging import StagingPool


@pytest.mark.parametrize("eager", MODES)
def test_builder_thread_consumes_while_engine_saves(eager: bool) -> None:
    m = OmniPrefixCacheManager(config(staging_depth=2, num_blocks=64), eager=eager)
    pending: queue.Queue[tuple[int, str, torch.Tensor] | None] = queue.Queue()
    failures: list[str] = []

    def builder() -> None:
        while (item := pending.get(timeout=10)) is not None:
            step, req, expect = item
            out = m.materialize(step, [req])
            if not torch.equal(out.hidden_states[req], expect):
                failures.append(f"step {step}")

    thread = threading.Thread(target=builder)
    thread.start()
    prompt_rows = None
    for i in range(40):
        req = f"r{i}"
        events = [started(req, hit_end=8, blocks=[0, 1, 2 + i])] if i else [started(req)]
        if i:
            events.insert(0, PrefixCacheRequestEvent(f"r{i - 1}", E.FINISHED))
        m.new_step_starts(events)
        if i == 0:
            step, prompt_rows = save(m, [(req, [0, 1], 0, 8)])
            pending.put((step, req, prompt_rows))
        else:
            step, rows = save(m, [(req, [0, 1, 2 + i], 8, 10)])
            pending.put((step, req, torch.cat([prompt_rows, rows])))
    pending.put(None)
    thread.join(20)
    assert not thread.is_alive() and failures == []
    assert m.stats()["materialized"] == 40 and m.shutdown() == {}


def test_shutdown_reports_unconsumed_steps(caplog: pytest.LogCaptureFixture) -> None:
    m = manager(eager=False)
    m.new_step_starts([started("a")])
    step, _ = save(m, [("a", [0], 0, 4)])
    with caplog.at_level(logging.WARNING, logger="omni_cache.runtime.manager"):
        report = m.shutdown()
    assert list(report) == [step] and "cache_helpers.py" in report[step]
    assert f"step {step} saved at" in caplog.text
    with pytest.raises(OmniPrefixCacheUnmatchError, match="shut down"):
        m.new_step_starts([])
    assert m.shutdown() == report  # idempotent


def test_eager_drain_is_one_thread_at_a_time_in_queue_order() -> None:
    """A second thread's kick never lands a newer write while another thread lands an older one."""
    from omni_cache import PrefixBlockPool, WriteSchedule
    from omni_cache.runtime.copier import Committer, CopyEngine
    from omni_cache.runtime.staging import StagingPool
    from omni_cache.runtime.tenancy import SlotTenancy
    from omni_cache.runtime.writes import WriteBook

    hooks, book = Gate("before_pool_write", lambda write: write.tid == 1, timeout_s=5), WriteBook(5.0)
    pool = PrefixBlockPool(8)
    tenancy = SlotTenancy(pool)
    committer = Committer(book, tenancy, StagingPool(1, 4, 1.0), CopyEngine(use_cuda=False, chunk_bytes=1 << 20),
                          hooks, threaded=False)
    slots_ = torch.tensor([2, 3])
    older = book.register(WriteSchedule.JOIN_ON_FINISH, 1, slots_, {"k": torch.ones(2, 2)})
    newer = book.register(WriteSchedule.JOIN_ON_FINISH, 2, slots_, {"k": torch.full((2, 2), 2.0)})
    for w in (older, newer):
        tenancy.register(["k"], slots_.numpy(), w.tid, step_id=w.step_id)
    book.enqueue([older])
    drainer = threading.Thread(target=committer.kick)
    drainer.start()
    assert hooks.entered.wait(5)
    book.enqueue([newer])
    committer.kick()  # another thread drains: return at once, land nothing out of order
    assert newer.state == "queued" and older.state == "host_ready"
    hooks.release.set()
    drainer.join(5)
    assert older.state == newer.state == "written"  # the drainer re-checked the queue
    assert torch.equal(pool.rows("k", slots_), torch.full((2, 2), 2.0))


# ---- I2: an aborted claim wakes a waiting save --------------------------------------------
def test_abort_wakes_a_save_waiting_for_a_page() -> None:
    """Aborting a staging claim wakes a save waiting for a page at once, not at its timeout (I2, I11).

    Kills the mutant: delete ``notify_all`` in ``StagingPool.abort`` (the waiter would sleep to its
    timeout).

    Aborting a staging claim wakes a save waiting for a page at once, not at its timeout (I2, I11)."""
    pool = StagingPool(1, 4, 5.0)
    slot = pool.claim(1)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(pool.claim(1)))
    waiter.start()
    wait_for_waiter(pool, "the second claim waits for a page")  # the waiter is now in the condition wait
    t0 = time.perf_counter()
    pool.abort(slot)
    waiter.join(4)
    assert not waiter.is_alive() and got and time.perf_counter() - t0 < 2.0, "the waiter was not woken"
    assert pool.slot_states() == ["claimed"] and pool.stats()["claim_waits"] == 1


# ---- the on_blocking seam sees every blocking point of a save ------------------------------
def test_on_blocking_sees_the_claim_and_the_wait_for_the_previous_write() -> None:
    """A save announces each of its blocking points (the staging claim, the wait for the previous write) to
    the fault hooks before it waits (I11).

    Kills the mutant: delete ``faults.on_blocking("save claims a staging slot")`` (an I11 check point
    lost).

    A save announces each of its blocking points (the staging claim, the wait for the previous write) to
    the fault hooks before it waits (I11)."""

    class Seen(FaultHooks):
        def __init__(self) -> None:
            self.points: list[tuple[str, bool]] = []
            self.m: OmniPrefixCacheManager | None = None

        def on_blocking(self, what: str) -> None:
            assert self.m is not None
            self.points.append((what, self.m.state_lock_held_by_current_thread()))

    seen = Seen()
    m = OmniPrefixCacheManager(config(), eager=True, faults=seen)
    seen.m = m
    m.new_step_starts([started("a")])
    step, _ = save(m, [("a", [0], 0, 4)])
    assert ("save claims a staging slot", False) in seen.points
    assert all(not held for _, held in seen.points), seen.points
    m.discard_step(step)
    m.shutdown()


# ---- I9: shutdown closes the copy queue --------------------------------------------------
@pytest.mark.parametrize("eager", MODES)
def test_shutdown_closes_the_queue_so_a_blocking_pop_returns_at_once(eager: bool) -> None:
    """``shutdown`` closes the write queue, so a committer blocked on an empty queue returns at once
    (contract 4.6).

    Kills the mutant: delete ``self.book.close()`` in ``Committer.stop`` (the committer would sleep out
    its poll).

    ``shutdown`` closes the write queue, so a committer blocked on an empty queue returns at once
    (contract 4.6)."""
    m = manager(eager)
    m.shutdown()
    t0 = time.perf_counter()
    assert m.book.start_next(block=True, timeout_s=5.0) is None
    assert time.perf_counter() - t0 < 2.0, "the queue was not closed by shutdown"


# ---- I9: shutdown stops the committer once the queue is drained ---------------------------
def test_shutdown_stops_the_committer_thread_after_draining() -> None:
    """``shutdown`` drains the write queue and then stops the committer thread (contract 4.6, I9).

    Kills the mutant: ``copier:Committer._run:cmp_flip:419aef94`` (``queue_length() == 0`` -> ``!= 0``:
    the closed committer spins on an empty queue forever and ``stop`` gives up after its timeout).

    ``shutdown`` drains the write queue and then stops the committer thread (contract 4.6, I9)."""
    m = manager(False)
    assert m.committer.alive
    m.new_step_starts([started("a")])
    step, rows = save(m, [("a", [0], 0, 4)])
    m.discard_step(step)
    t0 = time.monotonic()
    m.shutdown()
    assert not m.committer.alive, "the committer thread is still running after shutdown (I9)"
    assert time.monotonic() - t0 < 5.0, "shutdown waited out the committer's stop timeout"
    (key,) = m.pool.keys()
    assert torch.equal(m.pool.rows(key, slots([0], 0, 4)), rows), "the queued write did not land"
