"""Model-based test of the whole manager: a random engine against a reference model.

Runs ``ManagerMachine`` (tests/manager_machine.py), a Hypothesis ``RuleBasedStateMachine`` that plays the
engine of tests/reference_model.py against the real ``OmniPrefixCacheManager``
and checks every materialize against the ground truth, in three variants:

  eager     inline copies; consumes on the engine thread; tiny claim timeout,
            so a save with ``staging_depth`` unconsumed steps must time out (I2)
  async     ``eager=False``: a committer thread lands the pool writes
  threaded  async, and materialize/discard run on a second (builder) thread
            that drains a queue of step ids while the engine keeps saving

Rules: arrivals with shared block-aligned prefixes (hits), blocks freed and
reused (new tenants, I7), prefill/decode steps with several requests (some omitting a per-token key: a
hit that needs it from a slot whose tenant did not write it raises), padded
steps and padded mm, finish/abort/preempt/resume, deferred and leftover mm, the
hidden opt-out policy, request ids reused by new admissions (a live one REPLACED,
its control sent at once or with the new admission's first step; a finished one
followed by a stale terminal of its old owner: I12), admissions started or
replaced-to and aborted in one step (nothing of them stays live: I12), and replayed
scheduler steps (same sequence: nothing changes, I13), materialize of any pending step in any order (or
discard), a hit the cache cannot serve (I6), and misuse: double consume and
unknown ids (I1), requests outside the snapshot (I4), unaligned or blockless
hits (I5), an oversized step (I10), a save with staging full (I2). Each misuse
raises the documented phrase and later steps still verify. Verify steps of speculative decoding
(tests/manager_verify_rules.py, I14): decoding requests scheduled with draft tokens, some
rejected, the verdict (``trim_step``) before the step is handed on; a hit on a vacated slot
before the request rewrote it raises "is not readable"; bad verdicts raise and change nothing.
Two rules drive rare
states on purpose: new tenants rewrite the blocks of an unconsumed step's planned
hit (after every rule the manager keeps at most one preserved row per planned
(KV slot, key) pin, I7's bound), and, with a committer thread, ``shutdown`` while a
save waits for a staging page (the save is refused, nothing is left queued,
contract 4.6; the run goes on with a fresh manager, an old step id is another
manager's: "already consumed or never saved"). Teardown ends every
request, consumes every step, shuts down, and checks: nothing unconsumed, all
staging slots free (I2/I3), no write left in flight (I9), and the recorded
transition trace passes ``omni_cache.verify.traces.validate_trace`` (legal edges
of omni_cache.runtime.states, step ids issued and consumed once) ending with every page
free and every write written.

The engine builds every tensor it hands the manager on ``machine_device()``
(tests/cache_helpers.py: ``$OMNI_CACHE_TEST_DEVICE``, CPU by default). With cuda the async and
threaded machines run the manager's CUDA path (pinned pages, copies on a side stream ordered by
events, deferred keys held on the device) and the eager one copies inline from the device.

Two deterministic scenarios sit beside the machine: the I7 delayed read across
a block's reuse, and a newer tenant's write pushed to the queue's front ahead
of an older queued write that a pending hit planned -- the bug the threaded
machine found (fixed: the late write's rows are preserved for the pinned read).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from cache_helpers import event, slots
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from manager_machine import (
    BS,
    CAPACITY,
    AsyncMachine,
    DeferredTLCMachine,
    ManagerMachine,
    ThreadedMachine,
    TLCTracedMachine,
    _scaled,
)
from reference_model import CODES, EMBEDS, E, Engine, check_outputs, prefix_hashes, truth_rows
from thread_helpers import HoldStep

from omni_cache import (
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheWriteLayout,
    TraceRecorder,
)
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.verify.tenancy_trace import TenancyTraceCheck
from omni_cache.verify.testing import require_tlc

TestEagerManager = ManagerMachine.TestCase
TestEagerManager.settings = _scaled(6, 2)
TestAsyncManager = AsyncMachine.TestCase
TestAsyncManager.settings = _scaled(4, 2)
TestThreadedManager = ThreadedMachine.TestCase
TestThreadedManager.settings = _scaled(4, 2)


class TestManagerTracesWithTLC(TLCTracedMachine.TestCase):  # type: ignore[name-defined,misc]
    """Trace validation by TLC: each run's staging, write and (when every step registers one
    write: no deferred keys) tenancy traces, as generated TLA+ modules, must be accepted by the
    trace specs extending Staging, Writes and Tenancy (TLC runs per example, so only a few)."""

    # No shrink phase: each shrink step would run TLC again (a failure is reported as found).
    settings = settings(settings.default, max_examples=3, stateful_step_count=30, deadline=None,
                        phases=(Phase.explicit, Phase.reuse, Phase.generate),
                        suppress_health_check=list(HealthCheck))

    def setUp(self) -> None:
        require_tlc()  # skips only where java is missing; fails instead under CI=true


def test_tlc_validates_tenancy_traces_with_immediate_and_deferred_writes() -> None:
    """Every stateful trace's tenancy notes go to TLC, steps with an immediate and a deferred
    write on a KV slot included: counted from the verdicts validate_trace really returned (the
    tenancy check used to be skipped for such traces; this fails if it is again)."""
    require_tlc()
    DeferredTLCMachine.TLC_VERDICTS = verdicts = []
    run_state_machine_as_test(DeferredTLCMachine, settings=settings(
        settings.default, max_examples=2, stateful_step_count=25, deadline=None,
        phases=(Phase.explicit, Phase.reuse, Phase.generate), suppress_health_check=list(HealthCheck)))
    tenancy = [v for v in verdicts if isinstance(v, TenancyTraceCheck)]
    split = [v for v in tenancy if v.split_writes > 0]
    assert all(v.accepted for v in verdicts), [v.explain() for v in verdicts]
    assert split, f"no tenancy trace with an immediate + deferred write reached TLC ({len(tenancy)} tenancy checks)"
    assert sum(v.num_events for v in split) > 20, [v.explain() for v in split]


@pytest.mark.parametrize("mode", ["eager", "async"])
def test_delayed_hit_read_survives_block_reuse(mode: str) -> None:
    """A deterministic run of the I7 scenario the machine finds at random.

    r1 computes two blocks; r2 hits them; r2 aborts before its step is
    materialized; r3 takes the freed blocks (new tenant) and lands new rows.
    The delayed materialize of r2's step must still return r1's prefix rows.
    """
    cfg = PrefixCacheConfig(num_blocks=3, block_size=BS, staging_depth=3, staging_capacity_tokens=CAPACITY,
                            staging_claim_timeout_s=5.0)
    m = OmniPrefixCacheManager(cfg, eager=mode == "eager", recorder=TraceRecorder())
    eng = Engine(m, cfg, ModelCachePolicy(deferred_keys=frozenset({EMBEDS})))
    r1 = eng.add_request(0, 2, [], 0)
    s1 = eng.step([(0, 8)])
    assert s1 is not None and eng.reqs[r1].computed == 8
    check_outputs(s1, [r1], m.materialize(s1.step_id, [r1]))
    eng.end(r1, aborted=False)
    r2 = eng.add_request(0, 2, [3], 0)
    s2 = eng.step([(0, 9)])
    assert s2 is not None and s2.spans[r2].out_start == 0 and eng.reqs[r2].computed == 9  # an 8-token hit
    eng.end(r2, aborted=True)
    r3 = eng.add_request(1, 0, [4] * 12, 0)  # needs all three blocks: r1's are reused
    s3 = eng.step([(1, 12)])
    assert s3 is not None and eng.reqs[r3].computed == 12
    check_outputs(s3, [r3], m.materialize(s3.step_id, [r3]))
    eng.end(r3, aborted=False)
    eng.end_all()  # r3's deferred rows land over r1's too
    for _ in range(1000):  # async: let the committer land everything before the delayed read
        if m.stats()["writes_in_flight"] == 0:
            break
        threading.Event().wait(0.005)
    assert m.stats()["writes_in_flight"] == 0
    assert m.stats()["preserved_rows"] > 0  # r1's rows were kept for the pending read
    check_outputs(s2, [r2], m.materialize(s2.step_id, [r2]))  # r1's rows, not r3's (I7)
    assert m.stats()["preserved_rows"] == 0  # the read unpinned them
    assert m.shutdown() == {}


@pytest.mark.parametrize("read", ["after_all_landed", "while_the_late_write_is_in_flight"])
def test_newer_tenant_pushed_to_the_front_does_not_strand_a_planned_read(read: str) -> None:
    """A newer tenant's write pushed to the queue's front ahead of an older queued write on the same
    KV slots never strands a pending hit that planned the older version (I7): the late rows are kept
    for the pinned read, and a read that comes while the late write is in flight waits for it.

    The threaded machine (nightly) found the case: the read raised I7 "no preserved copy"."""
    hooks = HoldStep()
    cfg = PrefixCacheConfig(num_blocks=8, block_size=BS, staging_depth=4, staging_capacity_tokens=CAPACITY,
                            staging_claim_timeout_s=5.0)
    m = OmniPrefixCacheManager(cfg, eager=False, faults=hooks)
    m.register_policy(ModelCachePolicy(needs_full_hidden_states=False, deferred_keys=frozenset({CODES, EMBEDS})))
    a, c, z = (truth_rows(prefix_hashes(t)) for t in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [4] * 8, [7] * 4))

    def save(rid: str, rows: dict[str, torch.Tensor], blocks: tuple[int, ...], s: int, e: int) -> int:
        slot_ids = slots(blocks, s, e)
        return m.save_outputs(None, {k: rows[k][s:e].clone() for k in (CODES, EMBEDS)}, num_tokens_unpadded=e - s,
                              num_tokens_padded=e - s, write_layout=PrefixCacheWriteLayout.packed([(rid, s, e)], slot_ids))

    def settle() -> None:
        for _ in range(500):
            if m.stats()["writes_in_flight"] == 0:
                return
            time.sleep(0.01)
        raise AssertionError(f"writes never landed: {m.stats()}")

    m.new_step_starts([event("r0", E.STARTED)])
    s0 = save("r0", z, (3,), 0, 4)  # r0's write W0 stays pending (deferred)
    m.materialize(s0, ["r0"])
    m.new_step_starts([event("r1", E.STARTED)])
    s1 = save("r1", a, (0, 1), 0, 8)  # r1's write D1 on blocks 0, 1 stays pending
    m.materialize(s1, ["r1"])
    hooks.hold(s0)
    hooks.hold(s1)
    m.new_step_starts([event("r0", E.FINISHED), event("r2", E.STARTED, hit=8, blocks=(0, 1, 2))])
    assert hooks.entered[s0].wait(5)  # the committer is busy with W0 from here on
    s2 = save("r2", a, (0, 1, 2), 8, 9)  # r2 hits r1's blocks: its read plans D1, which is queued
    m.new_step_starts([event("r1", E.FINISHED), event("r2", E.FINISHED), event("r3", E.STARTED)])
    m.materialize(save("r3", c, (0, 1), 0, 8), ["r3"])  # r3: the new tenant of blocks 0, 1 (write D3)
    m.new_step_starts([event("r3", E.FINISHED)])  # D3 goes to the queue's front, ahead of D1
    hooks.release(s0)
    assert hooks.entered[s1].wait(5)  # D3 landed over blocks 0, 1; D1 is being copied, late
    if read == "after_all_landed":
        hooks.release(s1)
        settle()
        out = m.materialize(s2, ["r2"])
    else:
        box: dict[str, object] = {}
        reader = threading.Thread(target=lambda: box.update(out=m.materialize(s2, ["r2"])), daemon=True)
        reader.start()
        reader.join(0.2)
        assert reader.is_alive(), f"the read did not wait for the late write: {box}"
        hooks.release(s1)
        reader.join(5)
        assert not reader.is_alive() and "out" in box, f"the read failed or hung: {box}"
        out = box["out"]  # type: ignore[assignment]
    # the delayed hit read: r1's rows for [0, 8), then r2's row 8
    assert torch.equal(out.mm_outputs[CODES]["r2"], a[CODES][:9])  # type: ignore[union-attr]
    assert torch.equal(out.mm_outputs[EMBEDS]["r2"], a[EMBEDS][:9])  # type: ignore[union-attr]
    settle()
    assert m.stats()["preserved_rows"] == 0
    m.shutdown()
