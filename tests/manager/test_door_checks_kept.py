"""What the manager keeps: no autograd, leftovers by type, a bounded history, a page under its write.

  I4  no autograd through the cache: inputs that require grad are stored detached;
      outputs never require grad nor keep an earlier step's graph alive.
  I4  leftovers round-trip by type (named tuples, dataclasses, dicts, lists, tuples);
      a leftover that cannot be copied faithfully is refused before a step id is issued.
  I2  the claim-wait history behind ``stats()`` percentiles is a fixed-size histogram:
      bounded however long the run, and ``stats()`` costs the same after any run.
  I3  a staging page a pool write still reads cannot be aborted: the abort raises and
      changes nothing.

What the manager accepts at its door is in test_door_checks.py and test_door_checks_types.py.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import threading
import time
import weakref
from typing import Any, NamedTuple

import pytest
import torch
from cache_helpers import BS, MODES, manager, save, settle, started, truth, wait_for_waiter

from omni_cache import ModelCachePolicy, OmniPrefixCacheUnmatchError, PrefixCacheRequestEvent
from omni_cache.runtime.events import PrefixCacheEventKind as E
from omni_cache.runtime.staging import StagingPool

# ---- item 5: no autograd through the cache -----------------------------------------------


@pytest.mark.parametrize("eager", MODES)
def test_I4_no_autograd_through_the_cache(eager: bool) -> None:
    """hidden, an immediate and a deferred per-token key and a leftover, all built from a leaf that
    requires grad: outputs (this step's and a later hit's) never require grad, the pool does not,
    and once the caller drops its tensors the leaf (the earlier step's graph) is freed."""
    m = manager(eager=eager)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"mm.def"})))
    m.new_step_starts([started("a")])
    leaf = torch.ones(1, requires_grad=True)
    alive = weakref.ref(leaf)
    rows = truth("a", range(8)) * leaf  # has a grad_fn that holds ``leaf``
    mm: dict[str, Any] = {"mm.imm": rows[:, :2] * 2, "mm.def": rows[:, :3] * 3, "left": rows[0] * leaf}
    step, _ = save(m, [("a", [0, 1, 2], 0, 8)], mm=mm, tag_of={})
    del rows, mm, leaf
    out = m.materialize(step, ["a"])
    m.new_step_starts([PrefixCacheRequestEvent("a", E.FINISHED), started("b", 2 * BS, [0, 1, 3])])
    settle(m)
    hit_rows = truth("b", range(8, 9)).requires_grad_(True)
    layout_step, _ = save(m, [("b", [0, 1, 3], 8, 9)], mm={"mm.imm": hit_rows[:, :2] * 1, "mm.def": hit_rows[:, :3] * 1})
    hit = m.materialize(layout_step, ["b"])
    values = [out.hidden_states["a"], *out.mm_for("a").values(), hit.hidden_states["b"],
              *hit.mm_for("b").values()]
    assert not [v for v in values if v.requires_grad or v.grad_fn is not None], "an output requires grad"
    for key in m.pool.keys():  # noqa: SIM118 (PrefixBlockPool.keys, not a dict)
        assert not m.pool.rows(key, torch.arange(4)).requires_grad, key
    m.shutdown()
    del m, out, hit, values
    gc.collect()
    assert alive() is None, "the cache keeps an earlier step's autograd graph alive"


# ---- item 6: leftovers round-trip by type ------------------------------------------------


class Pair(NamedTuple):
    codes: torch.Tensor
    note: str


class Single(NamedTuple):
    only: torch.Tensor


@dataclasses.dataclass
class Meta:
    lens: torch.Tensor
    name: str
    extra: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class FrozenMeta:
    grid: torch.Tensor


class Tagged(list):  # type: ignore[type-arg]
    pass


LEFTOVERS = {
    "namedtuple": lambda: Pair(torch.arange(3), "x"),
    "namedtuple of one field": lambda: Single(torch.arange(2)),
    "dataclass": lambda: Meta(torch.arange(4), "m", [1, 2]),
    "frozen dataclass": lambda: FrozenMeta(torch.ones(2, 2)),
    "dict": lambda: {"a": torch.arange(2), "b": (1, "z")},
    "OrderedDict": lambda: collections.OrderedDict(b=torch.zeros(1), a=2),
    "defaultdict": lambda: collections.defaultdict(list, {"k": [torch.ones(1)]}),
    "list": lambda: [torch.arange(2), [3, 4]],
    "list subclass": lambda: Tagged([torch.arange(2), 5]),
    "tuple": lambda: (torch.arange(2), ("n", 1)),
    "nested": lambda: {"p": [Pair(torch.arange(1), "y")], "m": Meta(torch.zeros(1), "q")},
}


def _same(a: Any, b: Any, where: str = "") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} came back as {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), f"{where}: tensor differs or is shared"
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        if isinstance(a, collections.defaultdict):
            assert a.default_factory is b.default_factory, where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        if hasattr(a, "_fields"):
            assert a._fields == b._fields, where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("kind", list(LEFTOVERS))
def test_I4_leftover_round_trips_by_type(kind: str) -> None:
    m = manager()
    m.new_step_starts([started("a")])
    value = LEFTOVERS[kind]()
    step, _ = save(m, [("a", [0], 0, 3)], mm={"left": value})
    got = m.materialize(step, ["a"]).mm_outputs["left"]["a"]
    _same(value, got, kind)
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_I4_uncopyable_leftover_refused_before_a_step_id(eager: bool) -> None:
    """A leftover that cannot be copied faithfully (a lock) is refused at save with nothing
    claimed and no step id issued; unchecked, the id was issued and the claim aborted after it."""
    m = manager(eager=eager)
    m.new_step_starts([started("a")])
    issued, claims = m._ids_issued, m.stats()["staging"]["claims"]
    with pytest.raises(OmniPrefixCacheUnmatchError, match="cannot be copied faithfully") as info:
        save(m, [("a", [0], 0, 3)], mm={"left": [threading.Lock()]})
    assert "'left'" in str(info.value) and "lock" in str(info.value)
    assert m._ids_issued == issued and m.stats()["staging"]["claims"] == claims
    assert m.stats()["failed"] is None
    m.shutdown()


# ---- item 7: bounded claim-wait history ------------------------------------------------


def _real_waits(pool: StagingPool, n: int) -> None:
    """``n`` claims that each wait (depth 1: a helper releases the held page)."""
    slot = pool.claim(1)
    for _ in range(n):
        ready = threading.Event()

        def release(s: Any = slot, ready: threading.Event = ready) -> None:
            ready.wait(5)
            wait_for_waiter(pool, "the claim waits for the held page")  # so each claim really waits
            pool.abort(s)

        t = threading.Thread(target=release)
        t.start()
        ready.set()
        slot = pool.claim(1)
        t.join()
    pool.abort(slot)


def test_I2_claim_wait_history_is_bounded_and_stats_cost_is_constant() -> None:
    pool = StagingPool(1, 4, 5.0)
    _real_waits(pool, 50)
    stats = pool.stats()
    assert stats["claim_waits"] == 50 and 0 < stats["claim_wait_s_max"] < 5
    footprint = pool.wait_history_footprint()
    for _ in range(200_000):  # a long run's worth of waits through the same recording path
        pool.record_claim_wait(0.003)
    assert pool.wait_history_footprint() == footprint, "the claim-wait history grows with the run"
    assert pool.stats()["claim_waits"] == 200_050
    p50, p99 = pool.wait_percentiles((0.5, 0.99))
    assert 0.003 <= p50 <= 0.003 * 1.2 and 0.003 <= p99 <= 0.003 * 1.2, (p50, p99)
    fresh = StagingPool(1, 4, 5.0)
    fresh.record_claim_wait(0.003)
    base, per_call = _stats_cost(fresh), _stats_cost(pool)  # a ratio, not an absolute time
    assert per_call < 20 * base, f"stats() took {per_call * 1e6:.1f} us after a long run, {base * 1e6:.1f} us fresh"


def _stats_cost(pool: StagingPool) -> float:
    """Seconds per ``stats()`` call: the best of five batches (a descheduled batch does not count)."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            pool.stats()
        best = min(best, (time.perf_counter() - start) / 200)
    return best


def test_I2_manager_stats_percentiles_come_from_the_histogram() -> None:
    m = manager()
    for s in (0.001, 0.002, 0.004, 0.008, 0.5):
        m.staging.record_claim_wait(s)
    stats = m.stats()
    assert 0.004 <= stats["staging_wait_s_p50"] <= 0.004 * 1.2, stats["staging_wait_s_p50"]
    assert 0.5 <= stats["staging_wait_s_p99"] <= 0.5 * 1.2, stats["staging_wait_s_p99"]
    assert stats["staging"]["claim_wait_s_max"] == 0.5
    m.shutdown()


# ---- I3: abort refuses while a pool write holds the page ---------------------------------
def test_abort_while_a_pool_write_holds_the_page_raises_and_changes_nothing() -> None:
    """A staging page a pool write still reads cannot be aborted: the abort raises and changes nothing (I3).

    Kills the mutant: delete the raise in ``StagingPool.abort`` (the page would be freed under a write).

    A staging page a pool write still reads cannot be aborted: the abort raises and changes nothing (I3)."""
    pool = StagingPool(2, 4, 0.05)
    slot = pool.claim(2)
    pool.hold(slot)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"cannot abort staging slot 0 .*1 pool write\(s\) still read"):
        pool.abort(slot)
    assert pool.slot_states() == ["claimed", "free"] and slot.num_write_holds == 1 and slot.num_rows == 2
    pool.unhold(slot)  # the write lands: the claimed page is still claimed, and now aborts cleanly
    pool.abort(slot)
    assert pool.slot_states() == ["free", "free"]
