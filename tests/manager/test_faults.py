"""Fault injection through the documented seam ``omni_cache.runtime.faults.FaultHooks``.

Owns the fault tests of the manager; nothing here patches a private name. Each
test drives the reference engine (tests/reference_model.py), injects one fault
through a hook, and checks the contract:

  I8   a failed pool write or a failed device->host copy fails the manager for
       good: every later entry (new_step_starts, save_outputs, materialize,
       discard_step) raises "write failed", and a thread waiting on the failed
       write wakes with that error (never a hang);
  I2   a save that cannot claim a page raises the timeout error naming every
       unconsumed step id with the file:line where it was saved;
  I3   a page is not released while its pool write still reads it;
  I11  a committer thread that dies (``committer_tick`` raising a
       BaseException) releases every waiter -- a save waiting for a page, a save
       waiting for the previous step's write, a materialize waiting for its
       step's copy -- with an error within a bound;
  I4/I5/I10 and input validation: a save interrupted at its claim
       (``on_blocking`` raising) or failing on an uncopyable leftover is rolled
       back (no step id, the page freed, the hit kept for the retry), and every
       malformed input raises before any state changes, after which the run
       goes on and verifies.

Every blocking call runs on a helper thread joined with a timeout, so a
regression fails with a message instead of hanging the suite.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cache_helpers import MODES, manager, save, settle, started, wait_for_waiter, wait_until
from reference_model import EMBEDS, Engine, check_outputs
from thread_helpers import JOIN_S, Gate

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.errors import (
    PHRASE_NOT_SAVED,
    PHRASE_SLOT_MAPPING,
    PHRASE_UNCONSUMED,
    PHRASE_WRITE_FAILED,
)
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.manager import OmniPrefixCacheManager

BOUND_S = 5.0  # a released waiter must return within this


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


def make(eager: bool, hooks: FaultHooks, *, depth: int = 3, timeout_s: float = 30.0,
         deferred: bool = False) -> tuple[OmniPrefixCacheManager, Engine]:
    cfg = PrefixCacheConfig(num_blocks=16, block_size=4, staging_depth=depth, staging_capacity_tokens=16,
                            staging_claim_timeout_s=timeout_s)
    m = OmniPrefixCacheManager(cfg, eager=eager, faults=hooks)
    policy = ModelCachePolicy(deferred_keys=frozenset({EMBEDS} if deferred else ()))
    return m, Engine(m, cfg, policy)


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


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_save_without_a_free_page_times_out_naming_unconsumed_steps(eager: bool) -> None:
    m, eng = make(eager, FaultHooks(), depth=2, timeout_s=0.2)
    for i in range(3):
        eng.add_request(i, 1, [i], 0)
    s1, s2 = eng.step([(0, 5)]), eng.step([(0, 5)])
    assert s1 is not None and s2 is not None
    settle(m)
    t0 = time.perf_counter()
    with pytest.raises(OmniPrefixCacheStagingTimeoutError) as info:
        eng.step([(0, 5)])
    waited = time.perf_counter() - t0
    assert 0.19 <= waited < 0.2 + BOUND_S
    msg = str(info.value)
    assert PHRASE_UNCONSUMED in msg and "in-flight writes" in msg
    source = Path(__file__).parents[1] / "reference_model.py"
    lines = source.read_text().splitlines()
    for step in (s1, s2):
        found = re.search(rf"step {step.step_id} saved at (\S+):(\d+)", msg)
        assert found, f"step {step.step_id} is not named with file:line in: {msg}"
        assert Path(found.group(1)) == source and "save_outputs(" in lines[int(found.group(2)) - 1], found
    # The timed-out save changed nothing: consuming one step frees a page for the retry.
    check_outputs(s1, list(s1.spans), m.materialize(s1.step_id, list(s1.spans)))
    m.discard_step(s2.step_id)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED):
        m.discard_step(s2.step_id)
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


class InterruptAt(FaultHooks):
    """An interrupt (KeyboardInterrupt) at the first blocking point whose description starts with ``what``."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.armed = False
        self.fired = 0

    def on_blocking(self, what: str) -> None:
        if self.armed and what.startswith(self.what):
            self.armed = False
            self.fired += 1
            raise KeyboardInterrupt(f"injected at: {what}")


def _hit_step_prepared(eng: Engine, m: OmniPrefixCacheManager) -> tuple[str, object]:
    """r0 computes two blocks and finishes; r1 arrives and hits them: its step is prepared, not saved."""
    r0 = eng.add_request(0, 2, [], 0)
    s0 = eng.step([(0, 8)])
    assert s0 is not None
    check_outputs(s0, [r0], m.materialize(s0.step_id, [r0]))
    eng.end(r0, aborted=False)
    r1 = eng.add_request(0, 2, [2, 2], 0)
    prepared = eng.prepare([(0, 9)])
    assert prepared is not None and prepared.sched[0][1] == 8  # an 8-token hit
    return r1, prepared


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
@pytest.mark.parametrize("fault", ["interrupt_at_claim", "leftover_not_copyable"])
def test_a_save_that_fails_before_registering_changes_nothing(eager: bool, fault: str) -> None:
    """A save that raises before its writes are registered is rolled back: no step id is
    issued, the page is given back, and the request's pending hit is kept for the retry."""
    hooks = InterruptAt("save claims a staging slot")
    m, eng = make(eager, hooks, deferred=True)
    r1, prepared = _hit_step_prepared(eng, m)
    before = m.stats()
    if fault == "interrupt_at_claim":
        hooks.armed = True
        with pytest.raises(KeyboardInterrupt):
            eng.save(prepared)
        assert hooks.fired == 1
    else:
        prepared.mm["mm.lock"] = [threading.Lock()]  # a leftover value that cannot be copied
        with pytest.raises(OmniPrefixCacheUnmatchError, match="cannot be copied faithfully") as info:
            eng.save(prepared)  # refused before the claim, chained to the copy's error
        assert isinstance(info.value.__cause__, TypeError), repr(info.value.__cause__)
        del prepared.mm["mm.lock"]
    settle(m)  # async: step 0's pool write may still read its page; it lands and frees the page
    deadline = time.monotonic() + BOUND_S
    while m.stats()["staging"]["slots"]["free"] < m.config.staging_depth:  # the unhold follows the landing
        assert time.monotonic() < deadline, f"a staging page was never given back: {m.stats()['staging']}"
        time.sleep(0.002)
    after = m.stats()
    assert after["saved"] == before["saved"] and after["unconsumed_step_ids"] == before["unconsumed_step_ids"]
    assert after["staging"]["slots"]["free"] == m.config.staging_depth, after["staging"]
    assert after["failed"] is None and after["preserved_rows"] == 0
    s1 = eng.save(prepared)  # the retry serves the hit: positions [0, 9) of r1
    assert s1.spans[r1].out_start == 0
    check_outputs(s1, [r1], m.materialize(s1.step_id, [r1]))
    eng.end_all()
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


# ---- malformed inputs: refused before anything changes; the cache stays usable ----------
def _layout(spans: list[tuple[str, int, int, int]], slots: list[int]) -> PrefixCacheWriteLayout:
    """(req, row_start, row_end, token_start) writes and explicit slots."""
    writes = tuple(PrefixCacheWrite(r, a, b, t, t + b - a) for r, a, b, t in spans)
    return PrefixCacheWriteLayout(writes, max((w.row_end for w in writes), default=0),
                                  torch.tensor(slots, dtype=torch.int64))


def _save(m: OmniPrefixCacheManager, layout: PrefixCacheWriteLayout, *, n: object = None, padded: object = None,
          hidden: object = "rows", mm: dict[str, object] | None = None) -> object:
    rows = layout.total_rows
    n = rows if n is None else n
    return m.save_outputs(torch.ones(max(rows, 1), 4) if hidden == "rows" else hidden, mm or {},
                          num_tokens_unpadded=n, num_tokens_padded=n if padded is None else padded,  # type: ignore[arg-type]
                          write_layout=layout)


def _started(rid: str, hit_start: int, hit_end: int, blocks: tuple[int, ...]) -> PrefixCacheRequestEvent:
    return PrefixCacheRequestEvent(rid, PrefixCacheEventKind.STARTED, hit_start, hit_end, (blocks,), 4)


BAD_INPUTS: dict[str, tuple[Callable[[OmniPrefixCacheManager], object], type[Exception], str]] = {
    "hit not starting at 0": (lambda m: m.new_step_starts([_started("x", 4, 8, (1, 2))]),
                              OmniPrefixCacheUnmatchError, "must start at position 0"),
    "hit on a block id out of range": (lambda m: m.new_step_starts([_started("x", 0, 4, (999,))]),
                                       OmniPrefixCacheUnmatchError, "outside"),
    "STARTED for a live request": (lambda m: m.new_step_starts([_started("r0", 0, 0, ())]),
                                   OmniPrefixCacheUnmatchError, "still live"),
    "zero tokens": (lambda m: _save(m, _layout([], []), n=0), OmniPrefixCacheUnmatchError, "positive int"),
    "a bool token count": (lambda m: _save(m, _layout([("x", 0, 1, 0)], [60]), n=True),
                           OmniPrefixCacheUnmatchError, "positive int"),
    "padded below unpadded": (lambda m: _save(m, _layout([("x", 0, 2, 0)], [60, 61]), padded=1),
                              OmniPrefixCacheUnmatchError, "positive int"),
    "not a layout": (lambda m: m.save_outputs(torch.ones(1, 4), {}, num_tokens_unpadded=1, num_tokens_padded=1,
                                              write_layout=object()),  # type: ignore[arg-type]
                     TypeError, "PrefixCacheWriteLayout"),
    "slot mapping too short": (lambda m: _save(m, _layout([("x", 0, 2, 0)], [60])),
                               OmniPrefixCacheUnmatchError, PHRASE_SLOT_MAPPING),
    "slot out of range": (lambda m: _save(m, _layout([("x", 0, 1, 0)], [64])),
                          OmniPrefixCacheUnmatchError, "save_outputs: the slot mapping covers KV slots out of range"),
    "overlapping rows": (lambda m: _save(m, _layout([("x", 0, 2, 0), ("y", 1, 3, 0)], [60, 61, 62])),
                         OmniPrefixCacheUnmatchError, "overlaps another"),
    "a request twice": (lambda m: _save(m, _layout([("x", 0, 1, 0), ("x", 1, 2, 1)], [60, 61])),
                        OmniPrefixCacheUnmatchError, "repeats a request"),
    "hidden missing": (lambda m: _save(m, _layout([("x", 0, 1, 0)], [60]), hidden=None),
                       OmniPrefixCacheUnmatchError, "not a 2-D+ tensor"),
    "hidden too short": (lambda m: _save(m, _layout([("x", 0, 2, 0)], [60, 61]), hidden=torch.ones(1, 4)),
                         OmniPrefixCacheUnmatchError, "hidden_states has 1 rows"),
    "mm under the hidden key": (lambda m: _save(m, _layout([("x", 0, 1, 0)], [60]), mm={"hidden": torch.ones(1, 4)}),
                                OmniPrefixCacheUnmatchError, "reserved key"),
    "a policy change after saving": (lambda m: m.register_policy(ModelCachePolicy(needs_full_hidden_states=False)),
                                     OmniPrefixCacheUnmatchError, "register it before the first save"),
    "not a policy": (lambda m: m.register_policy("audio"), TypeError, "ModelCachePolicy"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_malformed_input_raises_and_changes_nothing(case: str) -> None:
    call, exc, phrase = BAD_INPUTS[case]
    m, eng = make(True, FaultHooks())
    r0 = eng.add_request(0, 1, [1, 1], 3)
    s0 = eng.step([(0, 4)])
    assert s0 is not None and r0 in s0.spans
    before = m.stats()
    with pytest.raises(exc, match=re.escape(phrase)):
        call(m)
    after = m.stats()
    for key in ("saved", "unconsumed_step_ids", "writes_written", "live_requests", "hits", "failed"):
        assert after[key] == before[key], (key, before[key], after[key])
    assert after["staging"]["slots"] == before["staging"]["slots"]
    check_outputs(s0, [r0], m.materialize(s0.step_id, [r0]))  # still usable: the run goes on
    s1 = eng.step([(0, 4)])
    assert s1 is not None
    check_outputs(s1, [r0], m.materialize(s1.step_id, [r0]))
    assert m.shutdown() == {}


def test_a_save_that_breaks_the_schedule_is_refused() -> None:
    """The rows of a request must match new_step_starts: its scheduled count, and its hit's end."""
    m, eng = make(True, FaultHooks())
    r0 = eng.add_request(0, 2, [], 0)
    s0 = eng.step([(0, 8)])
    assert s0 is not None
    m.new_step_starts(PrefixCacheStep((_started("y", 0, 8, tuple(eng.reqs[r0].blocks)),), {"y": 2}))
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_SLOT_MAPPING):
        _save(m, _layout([("y", 0, 3, 8)], [40, 41, 42]))  # scheduled 2 tokens, 3 rows
    with pytest.raises(OmniPrefixCacheUnmatchError, match="must continue the hit"):
        _save(m, _layout([("y", 0, 2, 0)], [40, 41]))  # the hit ends at 8; rows start at 0
    assert m.stats()["saved"] == 1 and set(m.stats()["unconsumed_step_ids"]) == {s0.step_id}


def test_manager_refuses_a_config_that_is_not_one() -> None:
    with pytest.raises(TypeError, match="PrefixCacheConfig"):
        OmniPrefixCacheManager({"num_blocks": 4})  # type: ignore[arg-type]


def test_rows_of_an_unannounced_request_still_land() -> None:
    """A save for a request no event announced is kept (not an error); its FINISHED lands its rows."""
    m, _ = make(True, FaultHooks(), deferred=True)
    rows = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    step = _save(m, _layout([("ghost", 0, 2, 0)], [8, 9]), mm={EMBEDS: rows[:, :3].clone()})
    out = m.materialize(step, ["ghost"])  # type: ignore[arg-type]
    assert torch.equal(out.mm_outputs[EMBEDS]["ghost"], rows[:, :3])
    assert m.stats()["deferred_open"] == 1
    m.new_step_starts([PrefixCacheRequestEvent("ghost", PrefixCacheEventKind.FINISHED)])
    assert m.stats()["deferred_open"] == 0 and m.stats()["writes_in_flight"] == 0
    m.shutdown()


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
