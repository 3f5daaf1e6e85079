"""Shared state is read and written only under its lock (I11), and a waiting thread is woken.

Each test holds the lock from another thread and checks that the call waits for it (or
replaces the guarded state with a view that refuses unlocked access): the manager's state lock,
the staging pool's lock, the block pool's and the tenancy's leaf locks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cache_helpers import (
    BS,
    MODES,
    assert_waits_for_lock,
    claimed_and_saved,
    finished,
    manager,
    save,
    settle,
    started,
    truth,
)

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheStagingTimeoutError,
)
from omni_cache.runtime.block_pool import PrefixBlockPool
from omni_cache.runtime.interface import HIDDEN_KEY
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.runtime.tenancy import SlotTenancy


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


_GUARDED = ("_requests", "counters")


@pytest.mark.parametrize("eager", MODES)
def test_manager_bookkeeping_is_only_touched_under_the_state_lock(eager: bool) -> None:
    """The manager's bookkeeping is read and written only under its state lock (I11).

    A workload with hits, deferred writes, budget flushes, finishes, discards and
    stats runs with the manager's dicts replaced by ones that record any access
    from a thread that does not hold the state lock.

    Kills the mutants: ``drop_with`` on any ``with self._lock:`` of the manager (bookkeeping read or
    written bare).

    The manager's bookkeeping is read and written only under its state lock (I11)."""
    m = manager(eager, gpu_staging_bytes=48, staging_depth=4, staging_claim_timeout_s=0.2)
    # Only the claim below must time out quickly; the waits on the committer (a save on the
    # previous step's write, a materialize on its copy) get a bound a loaded machine cannot outlast.
    m.book.wait_timeout_s = 30.0
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"})))
    m.new_step_starts([started(r) for r in "efgh"])
    # The emptiness checks of pending hits and open deferred writes are documented lock-free: only
    # the engine thread (this one) adds to either, so its own "none" needs no lock.
    guarded = {name: _LockedOnly(m, name, getattr(m, name)) for name in _GUARDED}
    for name, d in guarded.items():
        setattr(m, name, d)
    # the write scheduler's open deferred writes share the state lock (its emptiness check is lock-free)
    guarded["scheduling._deferred_open"] = m.scheduling._deferred_open = _LockedOnly(
        m, "scheduling._deferred_open", m.scheduling._deferred_open, lock_free=("__len__",))
    # the saved steps' contexts (the step consumption's) share the state lock too
    guarded["consumption._contexts"] = m.consumption._contexts = _LockedOnly(m, "consumption._contexts",
                                                                             m.consumption._contexts)
    guarded["scheduling._open_of"] = m.scheduling._open_of = _LockedOnly(m, "scheduling._open_of",
                                                                         m.scheduling._open_of)
    guarded["hits._pending"] = m.hits._pending = _LockedOnly(m, "hits._pending", m.hits._pending,
                                                               lock_free=("__len__",))
    m.new_step_starts([started("a"), started("b")])
    s1, rows_a = save(m, [("a", [0, 1], 0, 8)], mm={"audio": torch.ones(8, 3)})
    s2, _ = save(m, [("b", [2], 0, 4)], mm={"audio": torch.ones(4, 3)})
    m.materialize(s1, ["a"])
    m.trim_step(s2, {"b": 2})  # a verdict reads and changes the step's context under the lock too
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


# ---- I11: the manager's scalar state is touched only under its state lock -----------------
_GUARDED_ATTRS = ("_num_saved", "_ids_issued", "_scheduled", "_last_immediate")
_GUARDED_SCHEDULING_ATTRS = ("_deferred_bytes",)  # the write scheduler's, under the manager's state lock


def _guard_attributes(m: OmniPrefixCacheManager) -> list[str]:
    """Swap ``m``'s class (and its write scheduler's) for a subclass whose guarded attributes record
    lockless access."""
    misses: list[str] = []

    def guard(obj: object, names: tuple[str, ...], lock_free_reads: tuple[str, ...] = ()) -> None:
        values = {name: obj.__dict__.pop(name) for name in (*names, *lock_free_reads)}

        def guarded(name: str, check_get: bool = True) -> property:
            def get(self):  # type: ignore[no-untyped-def]
                if check_get and not m.state_lock_held_by_current_thread():
                    misses.append(f"read {name}")
                return values[name]

            def put(self, value):  # type: ignore[no-untyped-def]
                if not m.state_lock_held_by_current_thread():
                    misses.append(f"write {name}")
                values[name] = value

            return property(get, put)

        props = {name: guarded(name) for name in names}
        props.update({name: guarded(name, check_get=False) for name in lock_free_reads})
        obj.__class__ = type(f"LockChecked{type(obj).__name__}", (type(obj),), props)

    # Lockless reads allowed: the shut-down flag (a bool), and the policy, which validate_save reads
    # before the snapshot (it only changes before the first save; writes still need the lock).
    guard(m, _GUARDED_ATTRS, ("_shut_down", "policy"))
    guard(m.scheduling, _GUARDED_SCHEDULING_ATTRS)
    return misses


@pytest.mark.parametrize("eager", MODES)
def test_manager_scalars_are_only_touched_under_the_state_lock(eager: bool) -> None:
    """The manager's scalars (policy, step ids, shutdown flag) are touched only under its state lock (I11).

    Kills the mutants: ``drop_with`` on the state lock in register_policy, save_outputs (step id,
    snapshot) and shutdown.

    The manager's scalars (policy, step ids, shutdown flag) are touched only under its state lock (I11)."""
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


# ---- I11: the block pool's reads take its leaf lock --------------------------------------
@pytest.mark.parametrize("what", ["keys", "has_key", "nbytes", "rows", "write"])
def test_block_pool_calls_wait_for_its_lock(what: str) -> None:
    """The block pool's key queries wait for its lock (I11).

    Kills the mutants: ``drop_with`` on ``PrefixBlockPool.keys`` / ``has_key`` (and siblings).

    The block pool's key queries wait for its lock (I11)."""
    pool = PrefixBlockPool(8)
    pool.write("k", torch.tensor([1, 2]), torch.ones(2, 3))
    calls = {
        "keys": pool.keys,
        "has_key": lambda: pool.has_key("k"),
        "nbytes": pool.nbytes,
        "rows": lambda: pool.rows("k", torch.tensor([1])),
        "write": lambda: pool.write("k", torch.tensor([3]), torch.ones(1, 3)),
    }
    assert_waits_for_lock(pool.lock, calls[what], f"PrefixBlockPool.{what}")


def test_block_pool_scatters_rows_under_its_lock() -> None:
    """The block pool scatters rows under its lock: a reader never sees half a scatter (I11).

    A reader's ``index_select`` must never see half of a scatter (I11).

    Kills the mutant: ``block_pool:PrefixBlockPool.write:drop_with:a4e6786b`` (the scatter itself outside
    the lock: the tensor lookup before it takes the lock anyway, so the test above cannot see it).

    The block pool scatters rows under its lock: a reader never sees half a scatter (I11)."""
    pool = PrefixBlockPool(8)
    pool.write("k", torch.tensor([1, 2]), torch.ones(2, 3))
    real = pool._tensors["k"]
    held: list[bool] = []

    class ScatterProbe:
        """The pool's tensor for ``k``, noting whether the pool's lock is held at the scatter."""

        def index_copy_(self, *args: object) -> object:
            held.append(pool.lock.locked())
            return real.index_copy_(*args)  # type: ignore[arg-type]

    pool._tensors["k"] = ScatterProbe()  # type: ignore[assignment]
    pool.write("k", torch.tensor([3]), torch.full((1, 3), 2.0))
    pool._tensors["k"] = real
    assert held == [True], "the block pool scattered rows without holding its lock"
    assert torch.equal(pool.rows("k", torch.tensor([3])), torch.full((1, 3), 2.0))


# ---- I3/I11: staging pages are read only through a slot in the right state, under the lock -


@pytest.mark.parametrize("what", ["claimed_pages", "pages_rows", "save", "unconsumed", "slot_states", "page_bytes",
                                  "wait_percentiles", "num_claim_waits", "wait_history_footprint"])
def test_staging_calls_wait_for_the_pool_lock(what: str) -> None:
    """The staging pool's calls wait for its lock (I11).

    Kills the mutants: ``drop_with`` on ``StagingPool.claimed_pages`` (the slot's state read bare),
    ``save``, and siblings.

    The staging pool's calls wait for its lock (I11)."""
    pool, claimed, saved = claimed_and_saved()
    calls = {
        "claimed_pages": lambda: pool.claimed_pages(claimed, {"k": torch.ones(2, 3)}),
        "pages_rows": lambda: pool.pages_rows(saved, ("k",), 0, 2),
        "save": lambda: pool.save(claimed, 2, "engine.py:2"),
        "unconsumed": pool.unconsumed,
        "slot_states": pool.slot_states,
        "page_bytes": pool.page_bytes,
        "wait_percentiles": lambda: pool.wait_percentiles((0.5, 0.99)),
        "num_claim_waits": lambda: pool.num_claim_waits,
        "wait_history_footprint": pool.wait_history_footprint,
    }
    assert_waits_for_lock(pool._lock, calls[what], f"StagingPool.{what}")


# ---- I3: a page is read under the pool's lock ----------------------------------------------
def test_page_rows_waits_for_the_staging_lock() -> None:
    """Reading a staging page's rows checks the slot's state under the staging lock (I11).

    Kills the mutant: ``staging:StagingPool.page_rows:drop_with:9d4eea95`` (the state check without the
    lock).

    Reading a staging page's rows checks the slot's state under the staging lock (I11)."""
    m = manager()
    m.new_step_starts([started("A")])
    save(m, [("A", [0], 0, BS)])
    slot = next(s for s in m.staging._slots if s.state == "saved")
    assert_waits_for_lock(m.staging._lock, lambda: m.staging.page_rows(slot, HIDDEN_KEY, 0, BS),
                          "StagingPool.page_rows")
    assert torch.equal(m.staging.page_rows(slot, HIDDEN_KEY, 0, BS), truth("A", range(BS)))
    m.shutdown()


# ---- I7: a planned row overwritten by a newer tenant with no preserved copy ---------------
def _tenancy() -> tuple[SlotTenancy, np.ndarray]:
    return SlotTenancy(PrefixBlockPool(8)), np.array([2, 3], dtype=np.int64)


# ---- I11: tenancy bookkeeping under the pool's leaf lock ----------------------------------
@pytest.mark.parametrize("what", ["unplan", "plan", "register", "read", "land_all", "num_preserved"])
def test_tenancy_bookkeeping_waits_for_the_pool_lock(what: str) -> None:
    """Tenancy bookkeeping (plans, unplans, the preserved-rows count) waits for the block pool's lock (I11).

    Kills the mutants: ``unplan`` (and its siblings, and the stats count) without ``with self.pool.lock``.

    Tenancy bookkeeping (plans, unplans, the preserved-rows count) waits for the block pool's lock (I11)."""
    ten, slots = _tenancy()
    ten.register(["k"], slots, 1, step_id=11)
    ten.land_all({"k": torch.ones(2, 3)}, torch.from_numpy(slots), 1)
    plan = ten.plan(["k"], torch.from_numpy(slots))
    calls = {
        "unplan": lambda: ten.unplan(plan),
        "plan": lambda: ten.plan(["k"], torch.from_numpy(slots)),
        "register": lambda: ten.register(["k"], slots, 2, step_id=12),
        "read": lambda: ten.read("k", plan, what="r"),
        "land_all": lambda: ten.land_all({"k": torch.full((2, 3), 2.0)}, torch.from_numpy(slots), 2),
        "num_preserved": ten.num_preserved,
    }
    assert_waits_for_lock(ten.pool.lock, calls[what], f"SlotTenancy.{what}")
    if what == "unplan":
        assert ten._keys["k"].num_pins == 0 and int(ten._keys["k"].pins.sum()) == 0
