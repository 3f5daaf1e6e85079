"""What the manager accepts at its door, and what it keeps: a refused call changes nothing.

  I4  no autograd through the cache: inputs that require grad are stored detached;
      outputs never require grad nor keep an earlier step's graph alive.
  I4  leftovers round-trip by type (named tuples, dataclasses, dicts, lists, tuples);
      a leftover that cannot be copied faithfully is refused before a step id is issued.
  I2  the claim-wait history behind ``stats()`` percentiles is a fixed-size histogram:
      bounded however long the run, and ``stats()`` costs the same after any run.
  I1  step ids are ints issued by this manager: a bool, a float or another manager's id
      is "already consumed or never saved"; ``PrefixCacheWrite`` bounds are ints;
      ``from_vllm_config`` refuses a non-positive ``max_num_batched_tokens``.
  --  the slot mapping covers the step's rows exactly, as a 1-D integer CPU mapping: a layout
      whose writes leave rows to no request, or a malformed ``slots_cpu``, is refused before
      anything is claimed; a scheduled request missing from the layout is refused too.
  I5  a negative or start-only hit span is refused.
  --  a key's width and dtype never change: a save that brings another width (immediate or
      deferred, also while the first width's deferred write is pending) is refused at the
      door and burns no step id.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import threading
import time
import weakref
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch
from cache_helpers import (
    BS,
    MODES,
    WIDTH,
    config,
    finished,
    manager,
    save,
    settle,
    slots,
    staging_claims,
    started,
    truth,
    wait_for_waiter,
)
from thread_helpers import Gate

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    PrefixCacheRequestEvent,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.block_pool import PrefixBlockPool
from omni_cache.runtime.errors import PHRASE_NOT_SAVED
from omni_cache.runtime.events import PrefixCacheEventKind as E
from omni_cache.runtime.events import PrefixCacheWrite
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.runtime.staging import StagingPool

K = "mm.k"  # a per-token key beside hidden

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


# ---- item 8: types checked at the door -----------------------------------------------------


@pytest.mark.parametrize("field", ["row_start", "row_end", "token_start", "token_end"])
@pytest.mark.parametrize("bad", [1.0, True, "1", None])
def test_write_bounds_must_be_ints(field: str, bad: object) -> None:
    bounds = dict(row_start=0, row_end=1, token_start=0, token_end=1)
    bounds[field] = bad  # type: ignore[assignment]
    with pytest.raises((TypeError, ValueError), match="int"):
        PrefixCacheWrite("r", **bounds)  # type: ignore[arg-type]


def test_write_bounds_accept_integer_likes_as_ints() -> None:
    import numpy as np

    w = PrefixCacheWrite("r", np.int64(0), np.int32(2), torch.tensor(4), 6)  # type: ignore[arg-type]
    assert (w.row_start, w.row_end, w.token_start, w.token_end) == (0, 2, 4, 6)
    assert all(type(v) is int for v in (w.row_start, w.row_end, w.token_start, w.token_end))


@pytest.mark.parametrize("via", ["materialize", "discard_step"])
@pytest.mark.parametrize("bad", ["bool", "float", "other manager"])
def test_I1_step_id_must_be_an_int_issued_by_this_manager(via: str, bad: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import itertools

    from omni_cache.runtime import manager as manager_mod

    monkeypatch.setattr(manager_mod, "_STEP_IDS", itertools.count(1))  # this manager's first id is 1
    m, other = manager(), manager()
    m.new_step_starts([started("a")])
    other.new_step_starts([started("a")])
    mine, _ = save(m, [("a", [0], 0, 3)])
    theirs, _ = save(other, [("a", [0], 0, 3)])
    # True == 1 and 1.0 == 1 hash alike: unchecked, both consumed a manager's first step
    assert mine == 1
    forged = {"bool": True, "float": float(mine), "other manager": theirs}[bad]
    call = m.materialize if via == "materialize" else m.discard_step
    args = (forged, ["a"]) if via == "materialize" else (forged,)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED):
        call(*args)  # type: ignore[operator]
    assert m.stats()["unconsumed_step_ids"].keys() == {mine}, "a forged id consumed a step"
    assert torch.equal(m.materialize(mine, ["a"]).hidden_states["a"], truth("a", range(3)))
    other.discard_step(theirs)
    m.shutdown()
    other.shutdown()


def test_I1_two_managers_never_issue_the_same_step_id() -> None:
    a, b = manager(), manager()
    a.new_step_starts([started("x")])
    b.new_step_starts([started("x")])
    ids_a = {save(a, [("x", [0], 0, 1)])[0]}
    ids_b = {save(b, [("x", [0], 0, 1)])[0]}
    assert not ids_a & ids_b, (ids_a, ids_b)
    assert all(type(i) is int for i in ids_a | ids_b)
    a.shutdown()
    b.shutdown()


@pytest.mark.parametrize("value", [0, -5])
def test_from_vllm_config_refuses_non_positive_max_num_batched_tokens(value: int) -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        PrefixCacheConfig.from_vllm_config(num_blocks=8, block_size=16,
                                           scheduler_config=SimpleNamespace(max_num_batched_tokens=value))


@pytest.mark.parametrize("total", [5.0, True])
def test_layout_total_rows_must_be_an_int(total: object) -> None:
    """``total_rows`` 5.0 (== 5) used to pass the coverage check; it is refused at save, before a claim."""
    from cache_helpers import slots as kv_slots

    from omni_cache import PrefixCacheWriteLayout

    m = manager()
    m.new_step_starts([started("a")])
    n = 5 if total == 5.0 else 1
    layout = PrefixCacheWriteLayout(PrefixCacheWriteLayout.packed([("a", 0, n)], None).writes, total,  # type: ignore[arg-type]
                                    kv_slots([0, 1], 0, n))
    claims = m.stats()["staging"]["claims"]
    with pytest.raises(OmniPrefixCacheUnmatchError, match="slot mapping covers"):
        m.save_outputs(truth("a", range(n)), {}, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)
    assert m.stats()["staging"]["claims"] == claims and m._ids_issued == 0
    m.shutdown()


@pytest.mark.parametrize("via", ["materialize", "discard_step"])
def test_I1_an_int_subclass_step_id_is_the_same_id(via: str) -> None:
    """An id held as an int subclass (an engine's own id type) is the id: the step is consumed once
    and its staging slot is given back. Found by an independent attack: materialize looked the
    context up only for ``type(id) is int`` while the consume took any int, so it consumed the step,
    then failed its context assertion and left the slot 'materialized' for good."""

    class EngineStepId(int):
        pass

    m = manager(staging_depth=1)
    m.new_step_starts([started("a")])
    step, rows = save(m, [("a", [0], 0, 3)])
    if via == "materialize":
        assert torch.equal(m.materialize(EngineStepId(step), ["a"]).hidden_states["a"], rows)
    else:
        m.discard_step(EngineStepId(step))
    assert m.staging.slot_states() == ["free"], "the slot was not given back"
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED):
        m.materialize(step, ["a"])  # consumed exactly once (I1)
    m.new_step_starts([started("b")])
    again, rows_b = save(m, [("b", [1], 0, 2)])  # depth 1: only a freed slot lets this save claim
    assert torch.equal(m.materialize(again, ["b"]).hidden_states["b"], rows_b)
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


# ---- I10/I11: a key's width/dtype is checked before the claim -----------------------------
def _wrong_width_save(m, deferred: bool) -> None:  # type: ignore[no-untyped-def]
    layout = PrefixCacheWriteLayout.packed([("z", 0, 4)], torch.arange(60, 64))
    hidden = truth("z", range(4)) if deferred else truth("z", range(4), width=WIDTH + 2)
    mm = {"audio": torch.ones(4, 5)} if deferred else {}
    m.save_outputs(hidden, mm, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)


@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("eager", MODES)
def test_width_change_is_refused_before_the_claim_even_when_staging_is_full(eager: bool, deferred: bool) -> None:
    """A key whose width changes is refused at the save door before any claim, even with staging full: no
    wait, no timeout, no later failure.

    With every page held by an unconsumed step, a save that brings a key with a new
    width must be refused at once with the shape error -- not wait for a page and
    time out (the claim comes after the check), and not fail the manager later.

    Kills the mutant: delete the pre-claim ``check_sigs`` calls in ``save_outputs``.

    A key whose width changes is refused at the save door before any claim, even with staging full: no
    wait, no timeout, no later failure."""
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


def test_width_change_is_refused_by_the_staging_page_before_waiting_for_the_previous_write() -> None:
    """A key whose width changes is refused by the staging page's shape before the save waits for the
    previous write (async) or claims a page.

    The first step's write is held in the committer, so only the staging page knows
    hidden's width. A save with another width must be refused at once, not wait for
    that write (and time out) or claim a page.

    Kills the mutant: delete the pre-claim ``staging.check_sigs`` call (async: the pool has no tensor
    yet).

    A key whose width changes is refused by the staging page's shape before the save waits for the
    previous write (async) or claims a page."""
    hold = Gate("before_device_to_host")  # every device->host copy waits here until released
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


# ---- slot range: the first and last legal KV slot, and one past each ----------------------
def test_check_slots_accepts_exactly_zero_to_num_slots_minus_one() -> None:
    """The block pool accepts exactly the KV slots ``0 .. num_slots - 1`` and refuses the rest.

    Kills the mutants: ``low < 0`` -> ``low < -1`` / ``low < 1`` in ``PrefixBlockPool.check_slots``.

    The block pool accepts exactly the KV slots ``0 .. num_slots - 1`` and refuses the rest."""
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
    """A hit on a block outside ``[0, num_blocks)`` is refused at the door and changes nothing (I5).

    Kills the mutants: the "outside [0, num_blocks)" raise of ``validate_hit`` and its bounds (num_blocks
    32).

    A hit on a block outside ``[0, num_blocks)`` is refused at the door and changes nothing (I5)."""
    m = manager(True)
    before = m.stats()
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"are outside \[0, 32\) \(I5\)"):
        m.new_step_starts([started("a", hit_end=4 * len(blocks), blocks=blocks)])
    after = m.stats()
    assert (after["hits"], after["live_requests"]) == (before["hits"], before["live_requests"]) == (0, 0)
    m.new_step_starts([started("a", hit_end=8, blocks=[0, 31])])  # the first and last block are fine
    assert m.stats()["hits"] == 1
    m.shutdown()


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "immediate"])
def test_width_change_is_refused_at_save_and_burns_no_step_id(deferred: bool) -> None:
    m = manager()
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"} if deferred else ())))
    m.new_step_starts([started("A")])
    s1, _ = save(m, [("A", [0], 0, 4)], mm_keys=("audio",))
    m.discard_step(s1)
    m.new_step_starts([finished("A"), started("B")])
    layout = PrefixCacheWriteLayout.packed([("B", 0, 4)], slots([1], 0, 4))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="width and dtype never change"):
        m.save_outputs(truth("B", range(0, 4)), {"audio": torch.ones(4, 6)}, num_tokens_unpadded=4,
                       num_tokens_padded=4, write_layout=layout)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="width and dtype never change"):
        save(m, [("B", [1], 0, 4)], width=6)  # hidden: the staging page and the pool refuse it
    m.new_step_starts([finished("B"), started("C")])
    s2, _ = save(m, [("C", [2], 0, 4)], mm_keys=("audio",))
    assert s2 == s1 + 1 and m.stats()["failed"] is None
    m.discard_step(s2)


def test_scheduled_request_missing_from_layout() -> None:
    m = manager()
    m.new_step_starts([started("A"), started("B")], num_scheduled_tokens={"A": 4, "B": 4})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="slot mapping covers"):
        save(m, [("A", [0], 0, 4)])


@pytest.mark.parametrize(("hit_start", "hit_end"), [(0, -4), (4, 0)])
def test_malformed_hit_spans_are_rejected(hit_start: int, hit_end: int) -> None:
    m = manager()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="I5"):
        m.new_step_starts([PrefixCacheRequestEvent("A", E.STARTED, hit_start, hit_end, ((0,),))])
    assert m.stats()["live_requests"] == 0


def _assert_refused_and_usable(m, call, eager: bool) -> None:  # type: ignore[no-untyped-def]
    """``call`` raises "slot mapping covers", claims nothing, burns no step id, fails nothing;
    the manager then saves and serves the next step exactly."""
    claims, issued = staging_claims(m), m._ids_issued
    with pytest.raises(OmniPrefixCacheUnmatchError, match="slot mapping covers"):
        call()
    settle(m)
    assert staging_claims(m) == claims and m._ids_issued == issued, "a refused save claimed a page or an id"
    assert m.stats()["failed"] is None and not m.book.live(), m.stats()
    m.new_step_starts([started("ok")])
    step = save(m, [("ok", [5], 0, 3)])[0]
    assert m._ids_issued == issued + 1
    assert torch.equal(m.materialize(step, ["ok"]).hidden_states["ok"], truth("ok", range(3)))


@pytest.mark.parametrize("gap", ["middle", "tail", "head"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_slot_mapping_covers_layout_gap_refused(eager: bool, gap: str) -> None:
    """Rows of the step that belong to no request are refused ("slot mapping covers"); unchecked, they
    were scattered into the pool over another request's cached block (X's block 1)."""
    from omni_cache.runtime.events import PrefixCacheWrite

    m = manager(eager=eager)
    m.new_step_starts([started("X")])
    m.materialize(save(m, [("X", [1, 2], 0, 5)])[0], ["X"])
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
    out = m.materialize(save(m, [("Y", [1, 3], BS, BS + 1)], tag_of={"Y": "X"})[0], ["Y"])
    assert torch.equal(out.hidden_states["Y"], truth("X", range(BS + 1)))
    m.shutdown()


@pytest.mark.parametrize("bad", ["2-D", "float", "bool", "short", "meta device"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_slot_mapping_covers_malformed_slots_refused_before_claim(eager: bool, bad: str) -> None:
    """A 2-D, non-integer, too short or non-CPU ``slots_cpu`` is a precondition error raised before
    anything is claimed; unchecked, a 2-D mapping passed validation, its scatter failed and the manager
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
