"""One test per contract invariant of the manager's core, I1 through I11 (I12 and I13: tests/request_identity/test_identity_and_replay.py); spec/invariants.md traces to these names."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from cache_helpers import MODES, E, config, manager, save, settle, slots, started, truth
from thread_helpers import Gate

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheManager,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheRequestEvent,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.errors import (
    PHRASE_CAPACITY,
    PHRASE_NO_BLOCK_IDS,
    PHRASE_NOT_ALIGNED,
    PHRASE_NOT_READABLE,
    PHRASE_NOT_SAVED,
    PHRASE_OUTSIDE_SNAPSHOT,
    PHRASE_UNCONSUMED,
    PHRASE_WRITE_FAILED,
)
from omni_cache.runtime.faults import FaultHooks


@pytest.mark.parametrize("eager", MODES)
def test_I1_double_consume_and_unknown_id_raise_and_change_nothing(eager: bool) -> None:
    m = manager(eager)
    m.new_step_starts([started("a"), started("b")])
    s1, rows_a = save(m, [("a", [0, 1], 0, 8)])
    s2, rows_b = save(m, [("b", [2, 3], 0, 8)])
    assert torch.equal(m.materialize(s1, ["a"]).hidden_states["a"], rows_a)
    before = m.stats()
    for call in (lambda: m.materialize(s1, ["a"]), lambda: m.discard_step(s1), lambda: m.materialize(999, [])):
        with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED):
            call()
    after = m.stats()
    assert after["unconsumed_step_ids"] == before["unconsumed_step_ids"] == {s2: after["unconsumed_step_ids"][s2]}
    assert after["materialized"] == before["materialized"] and after["staging"]["slots"] == before["staging"]["slots"]
    # the other pending step is untouched and still exactly-once
    assert torch.equal(m.materialize(s2, ["b"]).hidden_states["b"], rows_b)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED):
        m.discard_step(s2)
    m.shutdown()


def test_I2_full_staging_times_out_naming_unconsumed_steps() -> None:
    m = manager(staging_depth=2, staging_claim_timeout_s=0.2)
    m.new_step_starts([started("a"), started("b"), started("c")])
    s1, _ = save(m, [("a", [0], 0, 4)])
    s2, _ = save(m, [("b", [1], 0, 4)])
    assert len(m.stats()["unconsumed_step_ids"]) == 2
    t0 = time.perf_counter()
    with pytest.raises(OmniPrefixCacheStagingTimeoutError) as info:
        save(m, [("c", [2], 0, 4)])
    assert time.perf_counter() - t0 >= 0.19
    msg = str(info.value)
    assert PHRASE_UNCONSUMED in msg and f"step {s1}" in msg and f"step {s2}" in msg
    assert "cache_helpers.py" in msg or "test_invariants.py" in msg  # where each was saved
    assert "in-flight writes" in msg
    # the failed save changed nothing: still two unconsumed, and a consume frees a page
    assert set(m.stats()["unconsumed_step_ids"]) == {s1, s2}
    m.discard_step(s1)
    s3, rows_c = save(m, [("c", [2], 0, 4)])
    assert torch.equal(m.materialize(s3, ["c"]).hidden_states["c"], rows_c)


def test_I3_page_not_reused_while_write_holds_it() -> None:
    hooks = Gate("before_pool_write")  # holds the committer inside each pool write until released
    from cache_helpers import config

    from omni_cache.runtime.manager import OmniPrefixCacheManager

    m = OmniPrefixCacheManager(config(staging_depth=1, staging_claim_timeout_s=0.3), eager=False, faults=hooks)
    m.new_step_starts([started("a"), started("b")])
    s1, rows = save(m, [("a", [0, 1], 0, 8)])
    assert hooks.entered.wait(5)
    assert torch.equal(m.materialize(s1, ["a"]).hidden_states["a"], rows)
    # consumed, but the pool write still reads the page: it must not be free
    assert m.staging.slot_states() == ["materialized"]
    with pytest.raises(OmniPrefixCacheUnmatchError):
        save(m, [("b", [2], 0, 4)])  # cannot claim (or wait for the write) while the page is held
    hooks.release.set()
    deadline = time.monotonic() + 5
    while m.staging.slot_states() != ["free"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m.staging.slot_states() == ["free"]
    s2, rows_b = save(m, [("b", [2], 0, 4)])
    assert torch.equal(m.materialize(s2, ["b"]).hidden_states["b"], rows_b)
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
@pytest.mark.parametrize("requests", [1, 2])
def test_I4_materialized_rows_are_the_callers_own_after_the_page_is_reused(eager: bool, requests: int) -> None:
    """What materialize returned stays as it was when the staging page it was read from is reused
    (staging_depth 1: the next step's save writes the same page). One request per step (its output
    is the page's whole row range, the case a view of the page would be cheapest) and two."""
    m = manager(eager, staging_depth=1)
    m.register_policy(ModelCachePolicy())
    kept = []
    for i in range(3):
        reqs = [f"r{i}.{k}" for k in range(requests)]
        m.new_step_starts([started(r) for r in reqs])
        spans = [(r, [2 * (i * requests + k), 2 * (i * requests + k) + 1], 0, 8) for k, r in enumerate(reqs)]
        step, rows = save(m, spans)
        out = m.materialize(step, reqs)
        kept.append((out, rows.clone(), reqs))
    for out, rows, reqs in kept:
        assert torch.equal(torch.cat([out.hidden_states[r] for r in reqs]), rows)  # never a later step's rows
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_I4_materialize_reads_save_snapshot(eager: bool) -> None:
    m = manager(eager)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio.embeds"})))
    m.new_step_starts([started("a"), started("b")])
    hidden = truth("a", range(8))
    codes = -hidden[:, :2].clone()
    embeds = hidden[:, :3].clone() * 2
    leftover = [torch.ones(3), "text"]
    from omni_cache import PrefixCacheWriteLayout

    layout = PrefixCacheWriteLayout.packed([("a", 0, 8)], slots([0, 1], 0, 8))
    step = m.save_outputs(hidden, {"audio.codes": codes, "audio.embeds": embeds, "meta": leftover},
                          num_tokens_unpadded=8, num_tokens_padded=8, write_layout=layout)
    expect_hidden, expect_codes, expect_embeds = hidden.clone(), codes.clone(), embeds.clone()
    for t in (hidden, codes, embeds, leftover[0]):
        t.fill_(-1.0)  # the next forward reuses the live buffers
    leftover.append("junk")
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_OUTSIDE_SNAPSHOT):
        m.materialize(step, ["a", "b"])
    out = m.materialize(step, ["a"])  # the failed call consumed nothing
    assert torch.equal(out.hidden_states["a"], expect_hidden)
    assert torch.equal(out.mm_outputs["audio.codes"]["a"], expect_codes)
    assert torch.equal(out.mm_outputs["audio.embeds"]["a"], expect_embeds)
    meta = out.mm_outputs["meta"]["a"]
    assert len(meta) == 2 and torch.equal(meta[0], torch.ones(3)) and meta[1] == "text"
    m.shutdown()


def test_I5_unaligned_or_blockless_hit_raises() -> None:
    m = manager()
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_ALIGNED):
        m.new_step_starts([started("a", hit_end=6, blocks=[0, 1])])
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NO_BLOCK_IDS):
        m.new_step_starts([started("a", hit_end=8)])
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_ALIGNED):
        m.new_step_starts([PrefixCacheRequestEvent("a", E.RESUMED, 0, 5, ((0, 1),))])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="carries 1 block ids for a hit of 2 blocks"):
        m.new_step_starts([started("a", hit_end=8, blocks=[0])])
    # nothing was registered: "a" is not live and can start cleanly as a miss
    assert m.stats()["live_requests"] == 0 and m.stats()["hits"] == 0
    m.new_step_starts([started("a")])
    step, rows = save(m, [("a", [0], 0, 4)])
    assert torch.equal(m.materialize(step, ["a"]).hidden_states["a"], rows)


@pytest.mark.parametrize("eager", MODES)
def test_I6_absent_hit_rows_raise_never_zeros(eager: bool) -> None:
    m = manager(eager)
    # "b" claims a hit on blocks 5,6 that nothing ever wrote: the omni cache diverged from KV
    m.new_step_starts([started("b", hit_end=8, blocks=[5, 6, 7])])
    step, _ = save(m, [("b", [5, 6, 7], 8, 12)])
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_READABLE):
        m.materialize(step, ["b"])
    # the step was consumed and its page released; the cache stays usable
    assert m.stats()["unconsumed_step_ids"] == {}
    m.new_step_starts([started("c")])
    s2, rows = save(m, [("c", [8], 0, 4)])
    assert torch.equal(m.materialize(s2, ["c"]).hidden_states["c"], rows)
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_I6_a_hit_on_a_block_a_newer_tenant_wrote_only_in_part_is_not_readable(eager: bool) -> None:
    """A block is written in token order, each write newer than the last. A hit whose block holds a
    newer tenant's rows in its first slots and an older tenant's after them (the KV cache gave the block
    to another request, yet the hit names it: the caches diverged) is refused, never served as half of
    one tenant's block and half of another's; the block, once its new tenant wrote all of it over two
    steps, is served as that tenant's."""
    m = manager(eager)
    m.new_step_starts([started("a")])
    step, rows_a = save(m, [("a", [1, 2], 0, 8)])
    m.materialize(step, ["a"])
    m.new_step_starts([PrefixCacheRequestEvent("a", E.FINISHED), started("c")])
    step, rows_c = save(m, [("c", [2], 0, 2)])  # c, block 2's new tenant, writes its slots 8 and 9 only
    m.materialize(step, ["c"])
    m.new_step_starts([started("b", hit_end=8, blocks=[1, 2, 3])])
    step, _ = save(m, [("b", [1, 2, 3], 8, 9)])
    with pytest.raises(OmniPrefixCacheUnmatchError, match=f"at KV slot 10 {PHRASE_NOT_READABLE}: 2 of 8 hit rows "
                       "are absent .*an earlier slot of its block holds a newer tenant's row"):
        m.materialize(step, ["b"])
    step, rows_c2 = save(m, [("c", [2], 2, 4)])  # c completes block 2 a step later
    m.materialize(step, ["c"])
    m.new_step_starts([PrefixCacheRequestEvent("b", E.FINISHED), started("d", hit_end=8, blocks=[1, 2, 4])])
    step, rows_d = save(m, [("d", [1, 2, 4], 8, 9)])
    served = m.materialize(step, ["d"]).hidden_states["d"]
    assert torch.equal(served, torch.cat([rows_a[:4], rows_c, rows_c2, rows_d]))
    assert m.stats()["failed"] is None and m.stats()["unconsumed_step_ids"] == {}
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_I7_delayed_read_never_returns_newer_tenant(eager: bool) -> None:
    m = manager(eager, staging_depth=4)
    m.new_step_starts([started("a")])
    s1, rows_a = save(m, [("a", [1, 2], 0, 8)], mm_key="audio.codes")
    m.materialize(s1, ["a"])
    # "b" hits a's blocks; its step is saved but materialized late (async builder)
    m.new_step_starts([PrefixCacheRequestEvent("a", E.FINISHED), started("b", hit_end=8, blocks=[1, 2, 3])])
    s2, rows_b = save(m, [("b", [1, 2, 3], 8, 12)], mm_key="audio.codes")
    # b finishes, blocks 1 and 2 are reused by a new tenant "c" whose rows land first
    m.new_step_starts([PrefixCacheRequestEvent("b", E.FINISHED), started("c")])
    s3, rows_c = save(m, [("c", [2, 1], 0, 8)], mm_key="audio.codes")
    m.materialize(s3, ["c"])
    settle(m)  # every queued write has landed: c's rows are in the pool
    out = m.materialize(s2, ["b"])
    assert torch.equal(out.hidden_states["b"], torch.cat([rows_a, rows_b]))
    assert torch.equal(out.mm_outputs["audio.codes"]["b"], -torch.cat([rows_a, rows_b])[:, :2])
    assert m.stats()["preserved_rows"] == 0  # dropped once no planned read needs them
    # the newest tenant wins for later hits
    if eager:
        m.new_step_starts([PrefixCacheRequestEvent("c", E.FINISHED), started("d", hit_end=8, blocks=[2, 1, 4])])
        s4, rows_d = save(m, [("d", [2, 1, 4], 8, 12)])
        assert torch.equal(m.materialize(s4, ["d"]).hidden_states["d"], torch.cat([rows_c, rows_d]))


class _FailPoolWrite(FaultHooks):
    def __init__(self) -> None:
        self.armed = False

    def before_pool_write(self, write: object, key: str) -> None:
        if self.armed:
            raise OSError("injected: host memory write failed")


@pytest.mark.parametrize("eager", MODES)
def test_I8_failed_write_is_sticky(eager: bool) -> None:
    from cache_helpers import config

    from omni_cache.runtime.manager import OmniPrefixCacheManager

    hooks = _FailPoolWrite()
    m = OmniPrefixCacheManager(config(staging_claim_timeout_s=1.0), eager=eager, faults=hooks)
    m.new_step_starts([started("a"), started("b")])
    s1, _ = save(m, [("a", [0], 0, 4)])
    settle(m)
    hooks.armed = True
    if eager:  # the inline landing fails inside save, which raises
        with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_WRITE_FAILED):
            save(m, [("b", [1], 0, 4)])
    else:  # the committer fails later; the save itself returned a step id
        save(m, [("b", [1], 0, 4)])
    deadline = time.monotonic() + 5
    while m.stats()["failed"] is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "injected: host memory write failed" in m.stats()["failed"]
    calls = [
        lambda: m.new_step_starts([started("c")]),
        lambda: save(m, [("a", [0, 2], 4, 8)]),
        lambda: m.materialize(s1, ["a"]),
        lambda: m.discard_step(s1),
    ]
    for call in calls:
        with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_WRITE_FAILED):
            call()
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_I9_aborted_request_rows_land(eager: bool) -> None:
    m = manager(eager)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio.embeds"})))
    m.new_step_starts([started("a")])
    hidden = truth("a", range(8))
    layout = PrefixCacheWriteLayout.packed([("a", 0, 8)], slots([3, 4], 0, 8))
    s1 = m.save_outputs(hidden, {"audio.embeds": hidden * 3}, num_tokens_unpadded=8, num_tokens_padded=8,
                        write_layout=layout)
    m.materialize(s1, ["a"])
    key_slots = slots([3, 4], 0, 8)
    assert m.stats()["deferred_open"] == 1  # deferred rows still on the device clone
    m.new_step_starts([PrefixCacheRequestEvent("a", E.ABORTED)])
    m.shutdown()  # drains the queue in async mode
    assert m.stats()["deferred_open"] == 0
    assert torch.equal(m.pool.rows("audio.embeds", key_slots), hidden * 3)
    assert torch.equal(m.pool.rows("hidden", key_slots), hidden)


@pytest.mark.parametrize("eager", MODES)
@pytest.mark.parametrize("end", [E.FINISHED, E.ABORTED])
def test_I9_an_ended_requests_open_writes_go_to_the_front_of_the_queue(eager: bool, end: E) -> None:
    """I9's other half: the open (deferred) writes of a request that ends are pushed to the copy queue's
    *front*, ahead of writes queued before, so its rows land first; read off the write book's queue
    notes (what TLA+ trace validation reads), each write's registration naming its tid."""
    from omni_cache.runtime.trace import TraceRecorder

    rec = TraceRecorder()
    m = OmniPrefixCacheManager(config(), eager=eager, recorder=rec)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio.embeds"})))
    m.new_step_starts([started("a"), started("b")])
    hidden = truth("a", range(8))
    layout = PrefixCacheWriteLayout.packed([("a", 0, 8)], slots([3, 4], 0, 8))
    step = m.save_outputs(hidden, {"audio.embeds": hidden * 3}, num_tokens_unpadded=8, num_tokens_padded=8,
                          write_layout=layout)
    m.materialize(step, ["a"])
    m.new_step_starts([PrefixCacheRequestEvent("a", end)])
    m.shutdown()
    notes = [e for e in rec.events(notes=True) if e.kind == "note"]
    deferred = [e.get("tid") for e in notes if e.trigger == "register" and e.machine == "pool_write" and e.get("deferred")]
    queued = [(e.trigger, e.get("tids")) for e in notes if e.obj == "queue"]
    assert len(deferred) == 1 and ("enqueue_front", tuple(deferred)) in queued, (deferred, queued)
    assert ("enqueue_back", tuple(deferred)) not in queued, queued


def test_I10_step_larger_than_capacity_raises() -> None:
    m = manager(staging_capacity_tokens=8)
    m.new_step_starts([started("a")])
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_CAPACITY):
        save(m, [("a", [0, 1, 2], 0, 12)])
    assert m.staging.slot_states() == ["free"] * 3  # nothing claimed, nothing clamped
    step, rows = save(m, [("a", [0, 1], 0, 8)])
    assert torch.equal(m.materialize(step, ["a"]).hidden_states["a"], rows)


class _LockProbe(FaultHooks):
    """Records every blocking point and whether the state lock was held there."""

    def __init__(self) -> None:
        self.manager: object = None
        self.seen: list[str] = []
        self.violations: list[str] = []

    def on_blocking(self, what: str) -> None:
        self.seen.append(what)
        if self.manager is not None and self.manager.state_lock_held_by_current_thread():  # type: ignore[attr-defined]
            self.violations.append(what)


@pytest.mark.parametrize("eager", MODES)
def test_I11_no_state_lock_over_waits(eager: bool) -> None:
    from cache_helpers import config

    from omni_cache.runtime.manager import OmniPrefixCacheManager

    probe = _LockProbe()
    m = OmniPrefixCacheManager(config(staging_depth=1, gpu_staging_bytes=64), eager=eager, faults=probe)
    probe.manager = m
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio.embeds"})))
    from omni_cache import PrefixCacheWriteLayout

    # engine thread saves while a builder thread materializes: depth 1 forces the engine to wait
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    steps: list[tuple[int, str]] = []
    cv = threading.Condition()

    def builder() -> None:
        try:
            for _ in range(12):
                with cv:
                    while not steps:
                        assert cv.wait(10), "engine stalled"
                    step, req = steps.pop(0)
                results[step] = m.materialize(step, [req]).hidden_states[req]
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=builder)
    thread.start()
    expected: dict[int, torch.Tensor] = {}
    for i in range(12):
        req = f"r{i}"
        k = i % 8
        blocks = [3 * k, 3 * k + 1, 3 * k + 2]
        events = [started(req, hit_end=8, blocks=blocks)] if i >= 8 else [started(req)]
        if i >= 1:
            events.insert(0, PrefixCacheRequestEvent(f"r{i - 1}", E.FINISHED))
        m.new_step_starts(events)
        start, end = (8, 12) if i >= 8 else (0, 8)
        rows = truth(req, range(start, end))
        layout = PrefixCacheWriteLayout.packed([(req, start, end)], slots(blocks, start, end))
        step = m.save_outputs(rows, {"audio.embeds": rows[:, :1].clone()}, num_tokens_unpadded=end - start,
                              num_tokens_padded=end - start, write_layout=layout)
        expected[step] = torch.cat([truth(f"r{i - 8}", range(8)), rows]) if i >= 8 else rows
        with cv:
            steps.append((step, req))
            cv.notify_all()
    thread.join(20)
    assert not thread.is_alive(), "builder deadlocked"
    assert not errors, errors
    assert len(results) == 12
    for step, rows in expected.items():
        assert torch.equal(results[step], rows), f"step {step}"
    assert probe.violations == [], f"state lock held across: {probe.violations}"
    kinds = {w.split(":")[0].split(" waits")[0] for w in probe.seen}
    assert any("flush" in k for k in kinds) and any("claims a staging slot" in k for k in kinds), kinds
    m.shutdown()
