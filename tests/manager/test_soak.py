"""Soak: thousands of steps with an engine thread and a builder thread, every output checked.

Owns the two-thread soak of the manager. The engine thread drives the reference
engine (tests/reference_model.py) with a seeded ``random.Random``: arrivals with
shared prefixes, finish/abort/preempt/resume, padded steps, leftover mm, hits the
cache cannot serve (I6). It hands every step id to the builder thread, which
keeps a small buffer, consumes the ids out of order (materialize a random subset,
or discard, sometimes a second time to check I1) and checks each output against
the ground truth (I4, I6, I7). Saves block on a full staging pool while the
builder lags (I2); in async mode a committer thread lands the writes as well.

Time is bounded: once it has saved ``MIN_STEPS`` steps (what the assertions
need, on any machine) the engine stops starting steps at a soft deadline; both
threads are joined while they make progress, and a thread still alive once
none was made for ``JOIN_S`` fails the test with a report (progress, errors,
manager stats and every thread's stack) instead of hanging. Sizes follow the Hypothesis profile (tests/conftest.py);
``OMNI_SOAK_STEPS`` overrides the number of steps per mode.
"""

from __future__ import annotations

import os
import queue
import random
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from reference_model import EMBEDS, Engine, StepExpect, check_outputs

from omni_cache import ModelCachePolicy, OmniPrefixCacheUnmatchError, PrefixCacheConfig
from omni_cache.runtime.errors import PHRASE_NOT_READABLE, PHRASE_NOT_SAVED
from omni_cache.runtime.manager import OmniPrefixCacheManager

# profile -> (steps per mode, soft deadline in seconds per mode)
SIZES = {"ci": (10000, 8.0), "mutation": (3000, 8.0), "dev": (10000, 15.0), "nightly": (200000, 300.0)}
JOIN_S = 30.0
# Steps every soak saves before the soft deadline may stop it: what the test asserts of a run
# (hits checked, budget flushes) is reached by this many steps of the seeded engine, however
# loaded the machine (a slow run takes longer; it does not stop short of them).
MIN_STEPS = 1000  # at 1000 the seeded engines had 143-162 hits and 3-4 budget flushes (docs/testing-determinism.md)


@dataclass
class Soak:
    steps_target: int
    soft_deadline: float
    saved: int = 0
    consumed: int = 0
    checked: int = 0
    hits_checked: int = 0
    raised_as_expected: int = 0
    stopped_early: bool = False
    errors: list[str] = field(default_factory=list)

    def report(self, m: OmniPrefixCacheManager, what: str) -> str:
        stacks = []
        for ident, frame in sys._current_frames().items():
            name = next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))
            stacks.append(f"--- thread {name}\n{''.join(traceback.format_stack(frame)[-8:])}")
        return (f"soak {what}: saved {self.saved}/{self.steps_target}, consumed {self.consumed}, "
                f"checked {self.checked} outputs\nerrors:\n" + "\n".join(self.errors[:5]) +
                f"\nmanager stats: {m.stats()}\n" + "\n".join(stacks))


def _sizes() -> tuple[int, float]:
    steps, soft = SIZES.get(settings.get_current_profile_name(), SIZES["dev"])
    return int(os.environ.get("OMNI_SOAK_STEPS", steps)), soft


def builder(m: OmniPrefixCacheManager, q: queue.Queue[tuple[StepExpect, float] | None], soak: Soak,
            rng: random.Random) -> None:
    """Consume out of order, never waiting for more work while holding some (no deadlock)."""
    buffer: list[tuple[StepExpect, float]] = []
    closed = False
    try:
        while not closed or buffer:
            if not buffer:
                item = q.get(timeout=JOIN_S)
                if item is None:
                    closed = True
                    continue
                buffer.append(item)
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    closed = True
                else:
                    buffer.append(item)
            exp, roll = buffer.pop(rng.randrange(len(buffer)))
            rids = sorted(exp.spans)
            if roll < 0.1:
                m.discard_step(exp.step_id)
            else:
                subset = rng.sample(rids, rng.randint(1, len(rids)))
                if exp.must_raise(subset):
                    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_READABLE):
                        m.materialize(exp.step_id, subset)
                    soak.raised_as_expected += 1
                else:
                    check_outputs(exp, subset, m.materialize(exp.step_id, subset))
                    soak.checked += 1
                    soak.hits_checked += sum(exp.spans[r].out_start < exp.spans[r].start for r in subset)
            soak.consumed += 1
            if roll > 0.97:  # I1: a second consume raises and changes nothing
                with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED):
                    m.materialize(exp.step_id, [])
    except BaseException:
        soak.errors.append("builder: " + traceback.format_exc())


def engine_loop(eng: Engine, q: queue.Queue[tuple[StepExpect, float] | None], soak: Soak,
                rng: random.Random) -> None:
    start = time.monotonic()
    try:
        while soak.saved < soak.steps_target and not soak.errors:
            if soak.saved >= min(soak.steps_target, MIN_STEPS) and time.monotonic() - start > soak.soft_deadline:
                soak.stopped_early = True
                break
            if (rng.random() < 0.35 and len(eng.active) < 12) or not eng.active:
                eng.add_request(rng.randrange(3), rng.randrange(5), [rng.randrange(3) for _ in range(rng.randrange(10))],
                                rng.randrange(7))
            eng.finish_done()
            roll = rng.random()
            running = eng.live("running")
            if roll < 0.06 and running:
                eng.preempt(rng.choice(running))
            elif roll < 0.16:
                live = eng.live("waiting", "running", "preempted")
                if live:
                    eng.end(rng.choice(live), aborted=rng.random() < 0.4)
            if rng.random() < 0.05 and eng.unwritten_free_block() is not None:
                exp = eng.diverged_step(rng.randint(1, 6))
            else:
                picks = [(rng.randrange(32), rng.randint(1, 9)) for _ in range(rng.randint(1, 4))]
                exp = eng.step(picks, pad=rng.choice((0, 0, 1, 3)), leftover=rng.random() < 0.3,
                               padded_mm=rng.random() < 0.3, order=rng.randrange(4))
            if exp is not None:
                soak.saved += 1
                q.put((exp, rng.random()))
        eng.end_all()
    except BaseException:
        soak.errors.append("engine: " + traceback.format_exc())
    finally:
        q.put(None)


def _join_while_progressing(threads: list[threading.Thread], soak: Soak) -> list[str]:
    """Join ``threads``; the names of those still alive once no step was saved or consumed for
    ``JOIN_S`` (a hang), never after a fixed time (a loaded machine is slow, not hung)."""
    progress, since = (-1, -1), time.monotonic()
    while any(t.is_alive() for t in threads) and time.monotonic() - since < JOIN_S:
        for t in threads:
            t.join(0.5)
        if (now := (soak.saved, soak.consumed)) != progress:
            progress, since = now, time.monotonic()
    return [t.name for t in threads if t.is_alive()]


@pytest.mark.parametrize("eager", [False, True], ids=["async", "eager"])
def test_soak_engine_and_builder_threads(eager: bool) -> None:
    steps, soft = _sizes()
    cfg = PrefixCacheConfig(num_blocks=24, block_size=4, staging_depth=3, staging_capacity_tokens=24,
                            gpu_staging_bytes=600, staging_claim_timeout_s=JOIN_S)
    m = OmniPrefixCacheManager(cfg, eager=eager)
    seed = 20260 + int(eager)
    eng = Engine(m, cfg, ModelCachePolicy(deferred_keys=frozenset({EMBEDS})), mru=True)
    soak = Soak(steps, soft)
    q: queue.Queue[tuple[StepExpect, float] | None] = queue.Queue()
    threads = [threading.Thread(target=engine_loop, args=(eng, q, soak, random.Random(seed)), name="soak-engine",
                                daemon=True),
               threading.Thread(target=builder, args=(m, q, soak, random.Random(seed + 7)), name="soak-builder",
                                daemon=True)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    hung = _join_while_progressing(threads, soak)
    if hung:
        pytest.fail(soak.report(m, f"HUNG ({', '.join(hung)} still alive, no step saved or consumed for {JOIN_S:.0f}s)"))
    elapsed = time.perf_counter() - t0
    if soak.errors:
        pytest.fail(soak.report(m, "FAILED"))
    assert soak.consumed == soak.saved, soak.report(m, "lost step ids")
    assert m.shutdown() == {}, soak.report(m, "left step ids unconsumed")
    stats = m.stats()
    assert stats["failed"] is None and stats["writes_in_flight"] == 0, stats
    assert stats["staging"]["slots"]["free"] == cfg.staging_depth, stats["staging"]
    assert soak.saved >= min(steps, MIN_STEPS), soak.report(m, "stopped before its floor of steps")
    assert soak.hits_checked > 0 and stats["budget_flushes"] > 0, stats
    print(f"\nsoak {'eager' if eager else 'async'}: {soak.saved} steps in {elapsed:.1f}s "
          f"({soak.checked} outputs checked, {soak.hits_checked} hits, {soak.raised_as_expected} expected raises, "
          f"{m.tenancy.num_preserved_total} rows preserved for delayed reads, {stats['budget_flushes']} budget flushes, "
          f"claim waits {stats['staging']['claim_waits']}"
          f"{', stopped at the soft deadline' if soak.stopped_early else ''})")


def test_a_long_decode_keeps_every_deferred_write_and_lands_them_at_finish() -> None:
    """One request decodes 100 steps with a deferred key: 101 open writes, all landed at FINISHED (I9),
    and a second request with the same tokens then hits 26 blocks of them."""
    cfg = PrefixCacheConfig(num_blocks=40, block_size=4, staging_depth=2, staging_capacity_tokens=16,
                            staging_claim_timeout_s=5.0)
    m = OmniPrefixCacheManager(cfg, eager=True)
    eng = Engine(m, cfg, ModelCachePolicy(deferred_keys=frozenset({EMBEDS})))
    r = eng.add_request(0, 1, [1], 100)
    for picks in [[(0, 5)]] + [[(0, 1)]] * 100:
        exp = eng.step(picks)
        assert exp is not None
        check_outputs(exp, [r], m.materialize(exp.step_id, [r]))
    assert m.stats()["deferred_open"] == 101 and eng.reqs[r].left == 0
    eng.finish_done()
    again = eng.add_request(0, 1, eng.reqs[r].tokens[4:], 0)  # its prompt is r's whole sequence
    exp = eng.step([(0, 8)])  # FINISHED r first: its writes land; then the hit plans on them
    assert exp is not None and exp.spans[again].start == 104 and exp.spans[again].out_start == 0
    check_outputs(exp, [again], m.materialize(exp.step_id, [again]))
    eng.end_all()
    assert m.shutdown() == {}
    assert m.stats()["deferred_open"] == 0 and m.stats()["writes_in_flight"] == 0
