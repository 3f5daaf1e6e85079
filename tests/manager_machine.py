"""The manager's model-based machine, shared by the stateful tests that run it.

Owns: ``ManagerMachine`` (a Hypothesis ``RuleBasedStateMachine`` that plays the engine of
tests/reference_model.py against the real ``OmniPrefixCacheManager``; its rules and teardown are
described in tests/manager/test_manager_stateful.py), its ``async``, ``threaded`` and TLC-traced
variants, the ``SETUP`` strategies and ``_scaled`` (a machine's share of the loaded Hypothesis
profile). tests/manager/test_manager_stateful.py runs the machines; tests/adapter/test_adapter_stateful.py
drives the same machine through the adapter, tests/project/test_machine_device.py checks where
its tensors live.

Invariants touched: I1..I14 (checked by the machine's rules and teardown).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import hypothesis.strategies as st
import torch
from cache_helpers import machine_device
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)
from manager_rare_rules import RareStateRules
from manager_verify_rules import VerifyStepRules
from reference_model import CODES, EMBEDS, E, Engine, StepExpect, check_outputs
from thread_helpers import Builder, SlowCommitter, expect_error

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheStagingTimeoutError,
    PrefixCacheConfig,
    PrefixCacheRequestEvent,
    PrefixCacheWriteLayout,
    TraceRecorder,
)
from omni_cache.runtime.errors import (
    PHRASE_CAPACITY,
    PHRASE_NO_BLOCK_IDS,
    PHRASE_NOT_ALIGNED,
    PHRASE_NOT_READABLE,
    PHRASE_NOT_SAVED,
    PHRASE_OUTSIDE_SNAPSHOT,
    PHRASE_UNCONSUMED,
)
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.verify.traces import TraceCheck, validate_trace

BS = 4
CAPACITY = 16

# A request: (shared-prefix base, shared full blocks of it, extra prompt tokens, decode tokens).
ARRIVAL = st.tuples(st.integers(0, 2), st.integers(0, 4), st.lists(st.integers(0, 2), max_size=9), st.integers(0, 6))
# One scheduler step: arrivals, (candidate index, token count) picks, padding and output shapes.
STEP = dict(arrivals=st.lists(ARRIVAL, max_size=2),
            picks=st.lists(st.tuples(st.integers(0, 31), st.integers(1, 9)), min_size=1, max_size=4),
            pad=st.sampled_from([0, 0, 1, 3]), leftover=st.booleans(), padded_mm=st.booleans(),
            order=st.integers(0, 3), omit=st.sampled_from([0, 0, 0, 1, 2, 3]))


PENDING = Bundle("pending")  # saved step ids not yet consumed (nor handed to the builder)
CONSUMED = Bundle("consumed")  # step ids handed to materialize/discard


def _step_rule(name: str) -> Callable[..., object]:
    """A rule named ``name`` that runs ``ManagerMachine._step``."""

    def step_rule(self: ManagerMachine, **kwargs: object) -> object:
        return self._step(**kwargs)  # type: ignore[arg-type]

    step_rule.__name__ = step_rule.__qualname__ = name
    return precondition(lambda self: self._can_save())(rule(target=PENDING, **STEP)(step_rule))


# The set-up's strategies (a subclass may narrow one: DeferredTLCMachine).
SETUP = dict(hidden=st.booleans(), defer=st.sampled_from([(), (EMBEDS,), (EMBEDS, CODES)]),
             pass_hidden=st.booleans(), depth=st.sampled_from([2, 3]),
             budget=st.sampled_from([1 << 30, 200]), num_blocks=st.integers(8, 16),
             arrivals=st.lists(ARRIVAL, min_size=1, max_size=4), mru=st.booleans(), slow=st.booleans())


class ManagerMachine(RareStateRules, VerifyStepRules, RuleBasedStateMachine):
    MODE = "eager"
    ADAPTER = False  # steps reach the manager through the adapter (tests/adapter/test_adapter_stateful.py)
    CHECK_WITH_TLC = False  # the Python replay always runs; TLC only in TestManagerTracesWithTLC
    TLC_VERDICTS: ClassVar[list[TraceCheck] | None] = None  # with TLC: every verdict of every example
    pending = PENDING
    consumed = CONSUMED

    def __init__(self) -> None:
        super().__init__()
        self.ok = False
        self.m: OmniPrefixCacheManager | None = None
        self.builder = Builder(self.MODE == "threaded")
        self.cfg: PrefixCacheConfig | None = None
        # step id -> its pinned rows, for steps handed to the builder and not yet read (the builder
        # thread pops them once materialize/discard returned, i.e. after their plans were dropped).
        self.reading: dict[int, int] = {}

    @initialize(**SETUP)
    def setup(self, hidden: bool, defer: tuple[str, ...], pass_hidden: bool, depth: int, budget: int,
              num_blocks: int, arrivals: list[tuple[int, int, list[int], int]], mru: bool, slow: bool) -> None:
        eager = self.MODE == "eager"
        self.cfg = PrefixCacheConfig(num_blocks=num_blocks, block_size=BS, staging_depth=depth,
                                     staging_capacity_tokens=CAPACITY, gpu_staging_bytes=budget,
                                     staging_claim_timeout_s=0.05 if eager else 10.0)
        self.policy = ModelCachePolicy(needs_full_hidden_states=hidden, deferred_keys=frozenset(defer))
        self._start(pass_hidden=pass_hidden, mru=mru, slow=slow)
        for arrival in arrivals:
            self.engine.add_request(*arrival)
        self.n_bad = 0
        self.ok = True

    def _start(self, *, pass_hidden: bool, mru: bool, slow: bool) -> None:
        """A manager (and the engine around it) with this run's configuration and policy."""
        eager = self.MODE == "eager"
        self.started_with = dict(pass_hidden=pass_hidden, mru=mru, slow=slow)
        self.recorder = TraceRecorder()
        self.m = OmniPrefixCacheManager(self.cfg, eager=eager, recorder=self.recorder,
                                        faults=SlowCommitter() if slow and not eager else None)
        self.engine = Engine(self.m, self.cfg, self.policy, pass_hidden_when_opted_out=pass_hidden, mru=mru,
                             device=machine_device())
        self.expect: dict[int, StepExpect] = {}  # saved, not yet handed to the builder

    # ---- guard: teardown verifies only if every rule so far passed ----------
    def _rule(self, fn: Callable[[], object]) -> object:
        self.ok = False
        result = fn()
        self.builder.check()
        self.ok = True
        return result

    def _can_save(self) -> bool:
        return self.m is not None and len(self.expect) < self.cfg.staging_depth

    def _saved(self, exp: object) -> object:
        if exp is None:
            return multiple()
        assert isinstance(exp, StepExpect)
        self.expect[exp.step_id] = exp
        hits = [sp for sp in exp.spans.values() if sp.out_start < sp.start]
        event(f"step: {min(len(exp.spans), 3)}+ requests, {min(len(hits), 2)}+ hits")
        if any(sp.resumed for sp in hits):
            event("step: a resumed request's hit")
        if exp.stale_absent:
            event("step: a hit needs a key its slots' tenant did not write but an older one did (I7)")
        return exp.step_id

    # ---- the engine ----------------------------------------------------------
    def _step(self, arrivals: list[tuple[int, int, list[int], int]], picks: list[tuple[int, int]], pad: int,
              leftover: bool, padded_mm: bool, order: int, omit: int) -> object:
        """New requests arrive, then one scheduler step runs (new_step_starts + save_outputs).

        ``omit`` leaves one per-token key (3: every per-token mm key) out of the step: later hits
        that need it on the slots this step wrote must raise "is not readable" (I7: one tenant for
        all keys, also when the step writes no key at all).
        """
        for arrival in arrivals:
            self.engine.add_request(*arrival)
        return self._saved(self._rule(lambda: self.engine.step(
            picks, pad=pad, leftover=leftover, padded_mm=padded_mm, order=order, omit=omit)))

    # Three differently named rules run the step: steps are drawn about three times as often as
    # anything else, and Hypothesis' swarm testing (which disables rules by name) rarely drops all.
    step = _step_rule("step")
    step_b = _step_rule("step_b")
    step_c = _step_rule("step_c")

    @rule(kind=st.sampled_from(["preempt", "finish", "abort", "preempt", "finish_done"]), i=st.integers(0, 63))
    def lifecycle(self, kind: str, i: int) -> None:
        if kind == "finish_done":
            self.engine.finish_done()
            return
        rids = self.engine.live("running") if kind == "preempt" else self.engine.live("waiting", "running", "preempted")
        if not rids:
            return
        if kind == "preempt":
            self.engine.preempt(rids[i % len(rids)])
        else:
            self.engine.end(rids[i % len(rids)], aborted=kind == "abort")

    @rule(live=st.booleans(), i=st.integers(0, 63), arrival=ARRIVAL, stale_terminal=st.booleans(),
          control=st.sampled_from(["pending", "held_complete", "held_default"]))
    def reuse_id(self, live: bool, i: int, arrival: tuple[int, int, list[int], int], stale_terminal: bool,
                 control: str) -> None:
        """A new admission takes a live (REPLACED) or finished request's id (I12). The REPLACED
        control goes out at once with its lookup pending, or with the new admission's first
        scheduled step carrying that step's lookup -- or, through the adapter only, built with
        the defaults (a complete miss: the adapter's new request must carry the hit)."""
        if control == "held_default" and not self.ADAPTER:
            control = "held_complete"  # the manager refuses a second lookup of the same owner
        rid = self._rule(lambda: self.engine.reuse_id(live, i, arrival, stale_terminal, control))
        if rid is not None:
            event(f"reuse: a {'live id replaced (' + control + ')' if live else 'finished id'}"
                  + (" + stale terminal" if stale_terminal and not live else ""))

    @rule(arrival=ARRIVAL, replace=st.booleans(), i=st.integers(0, 63), terminal_first=st.booleans(),
          lookup_complete=st.booleans())
    def start_and_abort(self, arrival: tuple[int, int, list[int], int], replace: bool, i: int,
                        terminal_first: bool, lookup_complete: bool) -> None:
        """An admission begins (STARTED, or REPLACED over a live id) and is aborted in the same step,
        in either order: nothing of it stays live (I12; checked by live_requests_follow_admissions)."""
        rid = self._rule(lambda: self.engine.start_and_abort(arrival, replace, i, terminal_first, lookup_complete))
        if rid is not None:
            event(f"identity: {'REPLACED' if replace else 'STARTED'} + ABORTED of one owner in one step")

    @rule()
    def replay_step(self) -> None:
        """The last scheduler step arrives again (same sequence): the manager changes nothing (I13)."""
        m = self.m
        assert m is not None
        keys = ("live_requests", "hits", "misses", "hit_tokens", "stale_events")
        before = m.stats()
        if self._rule(self.engine.replay_last_step):
            after = m.stats()
            assert {k: after[k] for k in keys} == {k: before[k] for k in keys}, (before, after)
            assert after["replayed_steps"] == before["replayed_steps"] + 1
            event("replay: a step was delivered twice")

    @precondition(_can_save)
    @rule(target=pending, n=st.integers(1, 6))
    def diverged_hit(self, n: int) -> object:
        """A hit on a block no write ever filled must raise at materialize, never zeros (I6)."""
        return self._saved(self._rule(lambda: self.engine.diverged_step(n)))

    # ---- the consumer (materialize or discard; any order) ---------------------
    def _stale(self, step_id: int, via: str) -> bool:
        """A step id saved by a manager that was shut down since: this manager never issued it."""
        if step_id in self.expect:
            return False
        self._misuse_step_id(step_id, via)
        return True

    def _reading(self, exp: StepExpect) -> Callable[[], None]:
        """Count ``exp``'s pins until the builder has consumed it; return the callback that ends it."""
        self.reading[exp.step_id] = exp.pinned_rows
        return lambda: self.reading.pop(exp.step_id, None)  # type: ignore[func-returns-value]

    @rule(target=consumed, step_id=consumes(pending), data=st.data())
    def materialize(self, step_id: int, data: st.DataObject) -> int:
        if self._stale(step_id, "materialize"):
            return step_id
        exp = self.expect.pop(step_id)
        done = self._reading(exp)
        rids = sorted(exp.spans)
        subset = data.draw(st.lists(st.sampled_from(rids), unique=True, max_size=len(rids)) if rids else st.just([]))
        m = self.m
        assert m is not None
        if any(exp.spans[r].out_start < exp.spans[r].start for r in subset):
            event("materialize: serves a hit" + (" with preserved rows" if m.stats()["preserved_rows"] else ""))

        def task() -> None:
            try:
                if exp.must_raise(subset):
                    expect_error(PHRASE_NOT_READABLE, lambda: m.materialize(step_id, subset))
                else:
                    check_outputs(exp, subset, m.materialize(step_id, subset))
            finally:
                done()

        self._rule(lambda: self.builder.submit(task))
        return step_id

    @rule(target=consumed, step_id=consumes(pending))
    def discard(self, step_id: int) -> int:
        if self._stale(step_id, "discard"):
            return step_id
        done = self._reading(self.expect.pop(step_id))
        m = self.m
        assert m is not None

        def task() -> None:
            try:
                m.discard_step(step_id)
            finally:
                done()

        self._rule(lambda: self.builder.submit(task))
        return step_id

    # ---- misuse: each raises its phrase and changes nothing -----------------
    @rule(step_id=consumed, via=st.sampled_from(["materialize", "discard"]))
    def double_consume(self, step_id: int, via: str) -> None:
        self._misuse_step_id(step_id, via)

    def _misuse_step_id(self, step_id: int, via: str) -> None:
        m = self.m
        assert m is not None
        call = (lambda: m.materialize(step_id, [])) if via == "materialize" else (lambda: m.discard_step(step_id))
        self._rule(lambda: self.builder.submit(lambda: expect_error(PHRASE_NOT_SAVED, call)))

    @rule(step_id=pending, ghost=st.sampled_from(["ghost", "r9999"]))
    def outside_snapshot(self, step_id: int, ghost: str) -> None:
        exp = self.expect.get(step_id)
        if exp is None:  # saved by a manager shut down since (a later rule consumes it as stale)
            return
        m = self.m
        assert m is not None
        rids = [*sorted(exp.spans)[:1], ghost]
        # On the engine thread even in threaded mode: the step stays pending (nothing consumed).
        self._rule(lambda: expect_error(PHRASE_OUTSIDE_SNAPSHOT, lambda: m.materialize(step_id, rids)))

    @rule(kind=st.sampled_from(["unknown_id", "unaligned", "no_blocks", "oversized", "save_when_full"]),
          via=st.sampled_from(["materialize", "discard"]), resumed=st.booleans(), k=st.integers(1, 3))
    def misuse(self, kind: str, via: str, resumed: bool, k: int) -> None:
        m = self.m
        assert m is not None
        if kind == "unknown_id":
            self._misuse_step_id(-k, via)  # never issued (ids are positive)
        elif kind in ("unaligned", "no_blocks"):  # I5
            self.n_bad += 1
            rid = f"bad{self.n_bad}"
            if resumed and self.engine.live("running"):
                rid = self.engine.live("running")[0]  # a RESUMED event on a live request
            kind_e = E.RESUMED if resumed else E.STARTED
            if kind == "unaligned":
                ev = PrefixCacheRequestEvent(rid, kind_e, 0, k * BS + 1, (tuple(range(k + 1)),), 1)
                phrase = PHRASE_NOT_ALIGNED
            else:
                ev = PrefixCacheRequestEvent(rid, kind_e, 0, k * BS, (), 1)
                phrase = PHRASE_NO_BLOCK_IDS
            self._rule(lambda: expect_error(phrase, lambda: m.new_step_starts([ev])))
        elif kind == "oversized":  # I10
            n = CAPACITY + k
            layout = PrefixCacheWriteLayout.packed([("huge", 0, n)], torch.arange(n, dtype=torch.int64))
            self._rule(lambda: expect_error(PHRASE_CAPACITY, lambda: m.save_outputs(
                torch.zeros(n, 4, device=self.engine.device), {}, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)))
        elif self.MODE == "eager" and not self._can_save():  # I2: staging full, the save times out
            layout = PrefixCacheWriteLayout.packed([("probe", 0, 1)], torch.zeros(1, dtype=torch.int64))
            msg = self._rule(lambda: expect_error(PHRASE_UNCONSUMED, lambda: m.save_outputs(
                torch.zeros(1, 4, device=self.engine.device), {}, num_tokens_unpadded=1, num_tokens_padded=1, write_layout=layout),
                OmniPrefixCacheStagingTimeoutError))
            for step_id in self.expect:
                assert f"step {step_id} saved at " in str(msg), msg
            event("misuse: save with staging full timed out")

    # ---- invariants -------------------------------------------------------------
    @invariant()
    def bounded_staging(self) -> None:
        if self.m is None:
            return
        self.ok = False
        self.builder.check()
        unconsumed = set(self.m.stats()["unconsumed_step_ids"])
        assert len(unconsumed) <= self.cfg.staging_depth  # I2
        if self.MODE != "threaded":
            assert unconsumed == set(self.expect), (unconsumed, sorted(self.expect))
        else:
            assert set(self.expect) <= unconsumed
        self.ok = True

    @invariant()
    def live_requests_follow_admissions(self) -> None:
        """I12: the manager holds exactly the admissions the events leave live (stale ones change nothing)."""
        if self.m is None:
            return
        assert self.m.stats()["live_requests"] == len(self.engine.admitted), (
            self.m.stats()["live_requests"], sorted(self.engine.admitted))

    @invariant()
    def page_held_while_write_reads_it(self) -> None:
        """I3, observed from outside: a page some live pool write still reads is never free.

        Race-free: the committer clears ``write.staging_slot`` before it unholds the
        page, so seeing the page free and *then* the write still holding it is a bug.
        """
        if self.m is None:
            return
        for write in self.m.book.live():
            slot = write.staging_slot
            if slot is not None and slot.state == "free" and write.staging_slot is slot:
                raise AssertionError(f"{slot.describe()} is free while {write.describe()} still reads it (I3)")

    def teardown(self) -> None:
        m, verify = self.m, self.ok
        try:
            if m is not None and verify:
                self._finish(m)
        finally:
            self.builder.stop()
            if m is not None:
                m.shutdown()

    def _finish(self, m: OmniPrefixCacheManager) -> None:
        saved = m.stats()["saved"]
        event(f"run: {'0' if not saved else '1-4' if saved < 5 else '5-14' if saved < 15 else '15+'} steps saved")
        self.engine.end_all()  # FINISHED/ABORTED for every request: their open writes land (I9)
        for step_id, exp in sorted(self.expect.items()):
            rids = sorted(exp.spans)
            if exp.must_raise(rids):
                expect_error(PHRASE_NOT_READABLE, lambda s=step_id, r=rids: m.materialize(s, r))
            else:
                check_outputs(exp, rids, m.materialize(step_id, rids))
        self.expect.clear()
        self.builder.drain()
        assert m.shutdown() == {}, "steps left unconsumed"
        stats = m.stats()
        assert stats["failed"] is None
        assert stats["staging"]["slots"]["free"] == self.cfg.staging_depth, stats["staging"]  # I3: all released
        assert stats["writes_in_flight"] == 0 and stats["deferred_open"] == 0, stats  # I9: nothing dropped
        # Trace validation: every recorded transition is a legal edge of omni_cache.runtime.states, step ids
        # are issued and consumed once (I1); at the end every page is free and every write landed.
        final = validate_trace(self.recorder, tlc=self.CHECK_WITH_TLC, verdicts=self.TLC_VERDICTS)
        assert {s for (machine, _), s in final.items() if machine == "staging_slot"} <= {"free"}, final
        assert {s for (machine, _), s in final.items() if machine == "pool_write"} <= {"written"}, final


class AsyncMachine(ManagerMachine):
    MODE = "async"


class TLCTracedMachine(ManagerMachine):
    """The async machine whose traces are also replayed against the TLA+ model by TLC."""

    MODE = "async"
    CHECK_WITH_TLC = True
    TLC_VERDICTS: ClassVar[list[TraceCheck] | None] = []


class DeferredTLCMachine(TLCTracedMachine):
    """The TLC-traced machine with deferred keys always on and full hidden states cached: every
    step with rows registers an immediate (hidden) and a deferred write on its KV slots (one
    tenant, two writes in transit).

    Every program opens, whatever the draw, on such a step, a finish that lands its deferred
    write, and a second request that hits its blocks (a planned read of a split tenant); the
    random rules follow. So each example's tenancy trace has split writes for TLC to check: the
    test below does not hope a seed schedules a step before the program ends.
    """

    TLC_VERDICTS: ClassVar[list[TraceCheck] | None] = []

    @initialize(**{**SETUP, "hidden": st.just(True), "defer": st.sampled_from([(EMBEDS,), (EMBEDS, CODES)])})
    def setup(self, **kwargs: object) -> None:  # type: ignore[override]
        super().setup(**kwargs)  # type: ignore[arg-type]
        writer = self.engine.add_request(0, 2, [1], 0)  # 9 prompt tokens: two full blocks and one more
        self._opening_step(writer)
        self.engine.end(writer, aborted=False)  # its FINISHED (next step) lands the deferred write
        self._opening_step(self.engine.add_request(0, 2, [2], 0))  # hits the writer's two blocks

    def _opening_step(self, rid: str) -> None:
        """One step that schedules only ``rid``'s whole prompt, materialized at once."""
        cands = [q.rid for q in self.engine.active.values() if q.left > 0]
        exp = self.engine.step([(cands.index(rid), CAPACITY)])
        assert exp is not None and sorted(exp.spans) == [rid], exp
        assert self.m is not None
        check_outputs(exp, [rid], self.m.materialize(exp.step_id, [rid]))


class ThreadedMachine(ManagerMachine):
    MODE = "threaded"


def _scaled(examples: float, steps: float) -> settings:
    """This machine's share of the loaded profile (tests/conftest.py: ci, dev, nightly)."""
    base = settings.default
    return settings(base, max_examples=max(3, int(base.max_examples * examples)),
                    stateful_step_count=max(10, int(base.stateful_step_count * steps)),
                    deadline=None, suppress_health_check=list(HealthCheck))
