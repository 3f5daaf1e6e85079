"""Tests that kill mutants which survived the rest of the suite (issue 11 item 9, tools/ast_mutants.py).

Each test names the mutant it was written against; each was checked by applying
that mutant to a copy (``tools/ast_mutants.py --only ID --tests FILE``) and seeing it fail.

Invariants touched: I2 (timeout message, waking a waiter), I3 (abort while a
write holds the page), I5 (hit block range), I10/I11 (checks before the claim,
the state lock), the KV slot range and the counters of ``stats()``. The read-path
ones (tenancy, reader, copier) are in tests/test_mutation_kills_tenancy.py.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
from cache_helpers import (
    MODES,
    WIDTH,
    config,
    finished,
    manager,
    save,
    settle,
    started,
    truth,
    wait_for_waiter,
)

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheWriteLayout,
    WriteSchedule,
)
from omni_cache.block_pool import PrefixBlockPool
from omni_cache.faults import FaultHooks
from omni_cache.manager import OmniPrefixCacheManager
from omni_cache.staging import StagingPool
from omni_cache.writes import WriteBook


# ---- I3: abort refuses while a pool write holds the page ---------------------------------
def test_abort_while_a_pool_write_holds_the_page_raises_and_changes_nothing() -> None:
    """Mutant: delete the raise in ``StagingPool.abort`` (the page would be freed under a write)."""
    pool = StagingPool(2, 4, 0.05)
    slot = pool.claim(2)
    pool.hold(slot)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"cannot abort staging slot 0 .*1 pool write\(s\) still read"):
        pool.abort(slot)
    assert pool.slot_states() == ["claimed", "free"] and slot.num_write_holds == 1 and slot.num_rows == 2
    pool.unhold(slot)  # the write lands: the claimed page is still claimed, and now aborts cleanly
    pool.abort(slot)
    assert pool.slot_states() == ["free", "free"]


# ---- I10/I11: a key's width/dtype is checked before the claim -----------------------------
def _wrong_width_save(m, deferred: bool) -> None:  # type: ignore[no-untyped-def]
    layout = PrefixCacheWriteLayout.packed([("z", 0, 4)], torch.arange(60, 64))
    hidden = truth("z", range(4)) if deferred else truth("z", range(4), width=WIDTH + 2)
    mm = {"audio": torch.ones(4, 5)} if deferred else {}
    m.save_outputs(hidden, mm, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)


@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("eager", MODES)
def test_width_change_is_refused_before_the_claim_even_when_staging_is_full(eager: bool, deferred: bool) -> None:
    """Mutant: delete the pre-claim ``check_sigs`` calls in ``save_outputs``.

    With every page held by an unconsumed step, a save that brings a key with a new
    width must be refused at once with the shape error -- not wait for a page and
    time out (the claim comes after the check), and not fail the manager later.
    """
    m = manager(eager, staging_depth=2, staging_claim_timeout_s=1.5)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"})))
    m.new_step_starts([started("x")])
    s0, _ = save(m, [("x", [3], 0, 4)], mm={"audio": torch.ones(4, 3)})
    m.discard_step(s0)
    m.new_step_starts([finished("x"), started("a"), started("b"), started("z")])  # x's audio lands
    settle(m)
    s1, _ = save(m, [("a", [0], 0, 4)], mm={"audio": torch.ones(4, 3)})
    s2, _ = save(m, [("b", [1], 0, 4)], mm={"audio": torch.ones(4, 3)})
    claims = m.stats()["staging"]["claims"]
    assert m.pool.has_key("audio") and m.staging.slot_states() == ["saved", "saved"]
    t0 = time.perf_counter()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="width and dtype never change") as info:
        _wrong_width_save(m, deferred)
    assert not isinstance(info.value, OmniPrefixCacheStagingTimeoutError)
    assert time.perf_counter() - t0 < 1.0, "the shape check ran only after waiting for a page"
    assert m.stats()["failed"] is None
    assert m.stats()["staging"]["claims"] == claims  # nothing was claimed for the refused save
    m.discard_step(s1)
    s3, _ = save(m, [("z", [15], 0, 4)], mm={"audio": torch.ones(4, 3)})
    assert s3 == s2 + 1  # the refused save burned no step id
    m.discard_step(s2)
    m.discard_step(s3)
    assert m.stats()["failed"] is None
    m.shutdown()


class _HoldCopies(FaultHooks):
    """Holds every device->host copy until released (the committer thread waits here)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def before_device_to_host(self, write) -> None:  # type: ignore[no-untyped-def]
        self.entered.set()
        assert self.release.wait(10)


def test_width_change_is_refused_by_the_staging_page_before_waiting_for_the_previous_write() -> None:
    """Mutant: delete the pre-claim ``staging.check_sigs`` call (async: the pool has no tensor yet).

    The first step's write is held in the committer, so only the staging page knows
    hidden's width. A save with another width must be refused at once, not wait for
    that write (and time out) or claim a page.
    """
    hold = _HoldCopies()
    m = OmniPrefixCacheManager(config(staging_claim_timeout_s=1.5), eager=False, faults=hold)
    try:
        m.new_step_starts([started("a"), started("z")])
        s1, _ = save(m, [("a", [0], 0, 4)])
        assert hold.entered.wait(5) and not m.pool.has_key("hidden")
        t0 = time.perf_counter()
        with pytest.raises(OmniPrefixCacheUnmatchError, match="width and dtype never change"):
            _wrong_width_save(m, deferred=False)
        assert time.perf_counter() - t0 < 1.0, "the shape check ran only after waiting for the previous write"
        assert m.stats()["staging"]["claims"] == 1
        hold.release.set()
        m.discard_step(s1)
        s2, _ = save(m, [("z", [15], 0, 4)])
        assert s2 == s1 + 1 and m.stats()["failed"] is None
        m.discard_step(s2)
    finally:
        hold.release.set()
        m.shutdown()


# ---- budget_flushes is an exact count -----------------------------------------------------
@pytest.mark.parametrize("eager", MODES)
def test_budget_flushes_counts_each_flush_exactly_once(eager: bool) -> None:
    """Mutants: ``counters["budget_flushes"] += 1`` deleted or off by one; the budget loop's bounds.

    The budget is exactly one step's deferred bytes: the first save fits, and
    every later save pushes the total one write over, so exactly the oldest open
    write is flushed per save.
    """
    per_step = 4 * 3 * 4  # 4 rows x 3 float32 columns
    m = manager(eager, gpu_staging_bytes=per_step, staging_depth=8)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"})))
    m.new_step_starts([started("a")])
    ids = []
    for i in range(5):
        step, _ = save(m, [("a", range(5), 4 * i, 4 * i + 4)], mm={"audio": torch.full((4, 3), float(i + 1))})
        ids.append(step)
        stats = m.stats()
        assert stats["budget_flushes"] == i, stats
        assert stats["deferred_open"] == 1 and stats["deferred_bytes_on_device"] == per_step, stats
    for step in ids:
        m.discard_step(step)
    m.shutdown()


def test_one_byte_over_the_budget_flushes() -> None:
    """Mutant: ``if over <= 0`` -> ``if over <= 1`` (a write one byte over the budget stays on device)."""
    per_step = 4 * 3 * 4
    m = manager(True, gpu_staging_bytes=2 * per_step - 1, staging_depth=8)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"})))
    m.new_step_starts([started("a")])
    step, _ = save(m, [("a", range(2), 0, 4)], mm={"audio": torch.ones(4, 3)})
    assert m.stats()["budget_flushes"] == 0 and m.stats()["deferred_bytes_on_device"] == per_step
    step2, _ = save(m, [("a", range(2), 4, 8)], mm={"audio": torch.ones(4, 3)})
    stats = m.stats()
    assert stats["budget_flushes"] == 1 and stats["deferred_bytes_on_device"] == per_step, stats
    m.discard_step(step)
    m.discard_step(step2)
    m.shutdown()


def test_no_budget_flush_while_under_budget() -> None:
    m = manager(True, gpu_staging_bytes=10 * 4 * 3 * 4, staging_depth=8)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"})))
    m.new_step_starts([started("a")])
    for i in range(5):
        step, _ = save(m, [("a", range(5), 4 * i, 4 * i + 4)], mm={"audio": torch.ones(4, 3)})
        m.discard_step(step)
    stats = m.stats()
    assert stats["budget_flushes"] == 0 and stats["deferred_open"] == 5, stats
    m.shutdown()


# ---- I2: the timeout message's in-flight-writes list --------------------------------------
def _book_with(n: int) -> WriteBook:
    book = WriteBook(1.0)
    for i in range(n):
        book.register(WriteSchedule.JOIN_ON_FINISH, i + 1, torch.tensor([i]), {"k": torch.zeros(1, 2)})
    return book


def test_in_flight_list_says_none_when_no_write_is_live() -> None:
    """Mutant: negate ``if not live`` in ``describe_in_flight`` (or drop its return)."""
    assert _book_with(0).describe_in_flight() == "none"
    pool = StagingPool(1, 4, 0.05, describe_in_flight=_book_with(0).describe_in_flight)
    pool.save(pool.claim(1), 1, "engine.py:1")
    with pytest.raises(OmniPrefixCacheStagingTimeoutError, match=r"in-flight writes: none\. Every step id"):
        pool.claim(1)


@pytest.mark.parametrize(("n", "listed", "more"), [(1, 1, None), (16, 16, None), (17, 16, 1), (40, 16, 24)])
def test_in_flight_list_names_at_most_16_writes_then_counts_the_rest(n: int, listed: int, more: int | None) -> None:
    """Mutants: the cap of 16 off by one, its comparison flipped, the "... N more" count wrong."""
    text = _book_with(n).describe_in_flight()
    assert text.count("write tid ") == listed, text
    assert [int(t) for t in re.findall(r"write tid (\d+)", text)] == list(range(1, listed + 1))
    if more is None:
        assert "more" not in text
    else:
        assert text.endswith(f"; ... {more} more"), text


# ---- I11: the manager's bookkeeping is touched only under its state lock ------------------
class _LockedOnly(dict):  # type: ignore[type-arg]
    """A dict that fails any access from a thread not holding the manager's state lock."""

    def __init__(self, owner: OmniPrefixCacheManager, name: str, data: dict,  # type: ignore[type-arg]
                 lock_free: tuple[str, ...] = ()) -> None:
        super().__init__(data)
        self._owner, self._name, self._lock_free = owner, name, lock_free
        self.misses: list[str] = []

    def _check(self, op: str) -> None:
        if op not in self._lock_free and not self._owner.state_lock_held_by_current_thread():
            self.misses.append(f"{self._name}.{op}")


for _op in ("__getitem__", "__setitem__", "__delitem__", "__contains__", "__iter__", "__len__", "get", "pop",
            "values", "items", "keys", "update", "setdefault", "clear", "copy"):
    def _guarded(self, *args, _op=_op, **kwargs):  # type: ignore[no-untyped-def]
        self._check(_op)
        return getattr(dict, _op)(self, *args, **kwargs)

    setattr(_LockedOnly, _op, _guarded)

_GUARDED = ("_requests", "_contexts", "_deferred_open", "counters")


@pytest.mark.parametrize("eager", MODES)
def test_manager_bookkeeping_is_only_touched_under_the_state_lock(eager: bool) -> None:
    """Mutants: ``drop_with`` on any ``with self._lock:`` of the manager (bookkeeping read or written bare).

    A workload with hits, deferred writes, budget flushes, finishes, discards and
    stats runs with the manager's dicts replaced by ones that record any access
    from a thread that does not hold the state lock.
    """
    m = manager(eager, gpu_staging_bytes=48, staging_depth=4, staging_claim_timeout_s=0.2)
    # Only the claim below must time out quickly; the waits on the committer (a save on the
    # previous step's write, a materialize on its copy) get a bound a loaded machine cannot outlast.
    m.book.wait_timeout_s = 30.0
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"})))
    m.new_step_starts([started(r) for r in "efgh"])
    # The emptiness checks of pending hits and open deferred writes are documented lock-free: only
    # the engine thread (this one) adds to either, so its own "none" needs no lock.
    lock_free = {"_deferred_open": ("__len__",)}
    guarded = {name: _LockedOnly(m, name, getattr(m, name), lock_free.get(name, ())) for name in _GUARDED}
    for name, d in guarded.items():
        setattr(m, name, d)
    guarded["_hits._pending"] = m._hits._pending = _LockedOnly(m, "_hits._pending", m._hits._pending,
                                                               lock_free=("__len__",))
    m.new_step_starts([started("a"), started("b")])
    s1, rows_a = save(m, [("a", [0, 1], 0, 8)], mm={"audio": torch.ones(8, 3)})
    s2, _ = save(m, [("b", [2], 0, 4)], mm={"audio": torch.ones(4, 3)})
    m.materialize(s1, ["a"])
    m.discard_step(s2)
    m.new_step_starts([finished("a"), finished("b"), started("c", hit_end=8, blocks=[0, 1, 3])])
    s3, rows_c = save(m, [("c", [0, 1, 3], 8, 12)], mm={"audio": torch.ones(4, 3)})
    out = m.materialize(s3, ["c"])
    assert torch.equal(out.hidden_states["c"], torch.cat([rows_a, rows_c]))
    # a save that times out on the claim restores its hit under the lock (the except path)
    m.new_step_starts([finished("c"), started("d", hit_end=4, blocks=[0, 5])])
    settle(m)  # async: every page is given back before the four claims that must not wait
    held = [save(m, [(r, [6 + i], 0, 4)])[0] for i, r in enumerate("efgh")]
    with pytest.raises(OmniPrefixCacheStagingTimeoutError):
        save(m, [("d", [0, 5], 4, 8)])
    for step in held:
        m.discard_step(step)
    step, _ = save(m, [("d", [0, 5], 4, 8)])
    assert m.materialize(step, ["d"]).hidden_states["d"].shape[0] == 8
    m.stats()
    m.shutdown()
    misses = [miss for d in guarded.values() for miss in d.misses]
    assert not misses, f"manager state touched without the state lock (I11): {sorted(set(misses))}"
    assert m.counters["budget_flushes"] >= 1 and m.counters["hits"] == 2


# ---- slot range: the first and last legal KV slot, and one past each ----------------------
def test_check_slots_accepts_exactly_zero_to_num_slots_minus_one() -> None:
    """Mutants: ``low < 0`` -> ``low < -1`` / ``low < 1`` in ``PrefixBlockPool.check_slots``."""
    pool = PrefixBlockPool(8)
    pool.check_slots(torch.tensor([0, 7]))
    pool.check_slots(torch.tensor([], dtype=torch.int64))
    for bad in ([-1, 3], [3, 8]):
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"KV slots out of range \[0, 8\)"):
            pool.check_slots(torch.tensor(bad))


@pytest.mark.parametrize("eager", MODES)
def test_a_negative_slot_is_refused_at_save_and_changes_nothing(eager: bool) -> None:
    m = manager(eager)
    m.new_step_starts([started("a")])
    layout = PrefixCacheWriteLayout.packed([("a", 0, 4)], torch.tensor([-1, 0, 1, 2]))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="KV slots out of range"):
        m.save_outputs(truth("a", range(4)), {}, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)
    stats = m.stats()
    assert stats["failed"] is None and stats["staging"]["claims"] == 0 and stats["writes_in_flight"] == 0
    step, rows = save(m, [("a", [0], 0, 4)])
    assert torch.equal(m.materialize(step, ["a"]).hidden_states["a"], rows)
    m.shutdown()


# ---- I5: hit block ids inside [0, num_blocks) ---------------------------------------------
@pytest.mark.parametrize("blocks", [[31, 32], [-1, 0], [0, 32, 1]], ids=["past-end", "negative", "middle"])
def test_a_hit_on_a_block_outside_the_pool_is_refused_and_changes_nothing(blocks: list[int]) -> None:
    """Mutants: the "outside [0, num_blocks)" raise of ``validate_hit`` and its bounds (num_blocks 32)."""
    m = manager(True)
    before = m.stats()
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"are outside \[0, 32\) \(I5\)"):
        m.new_step_starts([started("a", hit_end=4 * len(blocks), blocks=blocks)])
    after = m.stats()
    assert (after["hits"], after["live_requests"]) == (before["hits"], before["live_requests"]) == (0, 0)
    m.new_step_starts([started("a", hit_end=8, blocks=[0, 31])])  # the first and last block are fine
    assert m.stats()["hits"] == 1
    m.shutdown()


# ---- stats() counters are exact -----------------------------------------------------------
@pytest.mark.parametrize("eager", MODES)
def test_stats_counters_count_each_event_once(eager: bool) -> None:
    """Mutants: any counter increment deleted or off by one (saved, materialized, discarded, hits...)."""
    m = manager(eager)
    m.new_step_starts([started("a"), started("b")])
    s1, _ = save(m, [("a", [0, 1], 0, 8)])
    s2, _ = save(m, [("b", [2], 0, 4)])
    m.materialize(s1, ["a"])
    m.discard_step(s2)
    m.new_step_starts([finished("a"), finished("b"), started("c", hit_end=8, blocks=[0, 1, 4]), started("d")])
    s3, _ = save(m, [("c", [0, 1, 4], 8, 12), ("d", [5], 0, 4)])
    m.materialize(s3, ["c", "d"])
    stats = m.stats()
    got = {k: stats[k] for k in ("saved", "materialized", "discarded", "hits", "hit_tokens", "misses", "budget_flushes")}
    assert got == {"saved": 3, "materialized": 2, "discarded": 1, "hits": 1, "hit_tokens": 8, "misses": 3,
                   "budget_flushes": 0}, got
    assert stats["staging"]["claims"] == 3 and stats["live_requests"] == 2
    m.shutdown()


# ---- I2: an aborted claim wakes a waiting save --------------------------------------------
def test_abort_wakes_a_save_waiting_for_a_page() -> None:
    """Mutant: delete ``notify_all`` in ``StagingPool.abort`` (the waiter would sleep to its timeout)."""
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
    """Mutant: delete ``faults.on_blocking("save claims a staging slot")`` (an I11 check point lost)."""

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


# ---- I11: the manager's scalar state is touched only under its state lock -----------------
_GUARDED_ATTRS = ("_num_saved", "_ids_issued", "_scheduled", "_last_immediate", "_deferred_bytes")


def _guard_attributes(m: OmniPrefixCacheManager) -> list[str]:
    """Swap ``m``'s class for a subclass whose guarded attributes record lockless access."""
    values = {name: m.__dict__.pop(name) for name in (*_GUARDED_ATTRS, "_shut_down", "policy")}
    misses: list[str] = []

    def guarded(name: str, check_get: bool = True) -> property:
        def get(self):  # type: ignore[no-untyped-def]
            if check_get and not self.state_lock_held_by_current_thread():
                misses.append(f"read {name}")
            return values[name]

        def put(self, value):  # type: ignore[no-untyped-def]
            if not self.state_lock_held_by_current_thread():
                misses.append(f"write {name}")
            values[name] = value

        return property(get, put)

    props = {name: guarded(name) for name in _GUARDED_ATTRS}
    # Lockless reads allowed: the shut-down flag (a bool), and the policy, which validate_save reads
    # before the snapshot (it only changes before the first save; writes still need the lock).
    props["_shut_down"] = guarded("_shut_down", check_get=False)
    props["policy"] = guarded("policy", check_get=False)
    m.__class__ = type("LockCheckedManager", (OmniPrefixCacheManager,), props)
    return misses


@pytest.mark.parametrize("eager", MODES)
def test_manager_scalars_are_only_touched_under_the_state_lock(eager: bool) -> None:
    """Mutants: ``drop_with`` on the state lock in register_policy, save_outputs (step id, snapshot) and shutdown."""
    m = manager(eager, gpu_staging_bytes=48)
    misses = _guard_attributes(m)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"})))
    m.new_step_starts([started("a")], num_scheduled_tokens={"a": 8})
    s1, rows = save(m, [("a", [0, 1], 0, 8)], mm={"audio": torch.ones(8, 3)})
    s2, _ = save(m, [("a", [0, 1, 2], 8, 12)], mm={"audio": torch.ones(4, 3)})
    assert torch.equal(m.materialize(s1, ["a"]).hidden_states["a"], rows)
    m.discard_step(s2)
    m.new_step_starts([finished("a")])
    m.stats()
    m.shutdown()
    m.shutdown()
    assert not misses, f"manager state touched without the state lock (I11): {sorted(set(misses))}"
    assert s2 == s1 + 1


