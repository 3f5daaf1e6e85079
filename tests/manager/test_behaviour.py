"""Manager behaviour beyond the invariants: merges, write paths, policies, resume, threads, errors.

Also: a zero-row write next to other requests' rows leaves a request's hit for the first step
that schedules it (contract section 4.4).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import pytest
import torch
from cache_helpers import (
    BS,
    MODES,
    WIDTH,
    E,
    config,
    finished,
    manager,
    save,
    settle,
    slots,
    started,
    truth,
    wait_for_waiter,
)
from thread_helpers import Gate

from omni_cache import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.errors import PHRASE_SLOT_MAPPING
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.runtime.staging import StagingPool


@pytest.mark.parametrize("eager", MODES)
def test_miss_returns_just_this_steps_rows(eager: bool) -> None:
    m = manager(eager)
    m.new_step_starts([started("a"), started("b")])
    step, rows = save(m, [("a", [0, 1], 0, 6), ("b", [2], 0, 3)], padded=12)
    out = m.materialize(step, ["b", "a"])
    assert torch.equal(out.hidden_states["a"], rows[:6]) and torch.equal(out.hidden_states["b"], rows[6:])
    assert out.mm_outputs == {} and out.mm_for("a") == {}
    assert m.stats()["misses"] == 2 and m.stats()["hits"] == 0
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_hit_merges_prefix_then_step_rows_for_hidden_and_mm(eager: bool) -> None:
    m = manager(eager)
    m.new_step_starts([started("a")])
    s1, rows_a = save(m, [("a", [4, 5, 6], 0, 12)], mm_key="audio.codes")
    m.materialize(s1, ["a"])
    # chunked prefill of "b": first chunk serves the 8-token hit, the second is plain
    m.new_step_starts([started("b", hit_end=8, blocks=[4, 5, 9, 10])])
    s2, rows_b1 = save(m, [("b", [4, 5, 9, 10], 8, 12)], mm_key="audio.codes")
    out = m.materialize(s2, ["b"])
    merged = torch.cat([rows_a[:8], rows_b1])
    assert torch.equal(out.hidden_states["b"], merged)
    assert torch.equal(out.mm_outputs["audio.codes"]["b"], -merged[:, :2])
    m.new_step_starts([PrefixCacheRequestEvent("b", E.EXTENDED)])
    s3, rows_b2 = save(m, [("b", [4, 5, 9, 10], 12, 16)], mm_key="audio.codes")
    assert torch.equal(m.materialize(s3, ["b"]).hidden_states["b"], rows_b2)
    assert m.stats()["hits"] == 1 and m.stats()["hit_tokens"] == 8
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_same_step_hit_on_rows_this_save_writes(eager: bool) -> None:
    m = manager(eager)
    # vLLM publishes block hashes at allocation: "b" hits the block "a" computes in this very step
    m.new_step_starts([started("a"), started("b", hit_end=4, blocks=[0, 2])])
    step, rows = save(m, [("a", [0, 1], 0, 6), ("b", [0, 2], 4, 7)], tag_of={"b": "a"})
    out = m.materialize(step, ["a", "b"])
    assert torch.equal(out.hidden_states["a"], rows[:6])
    assert torch.equal(out.hidden_states["b"], torch.cat([rows[:4], rows[6:]]))
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_deferred_keys_stay_open_until_finish_then_serve_hits(eager: bool) -> None:
    m = manager(eager)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio.embeds"})))
    m.new_step_starts([started("a")])
    hidden = truth("a", range(8))
    layout = PrefixCacheWriteLayout.packed([("a", 0, 8)], slots([1, 2], 0, 8))
    s1 = m.save_outputs(hidden, {"audio.embeds": hidden * 2}, num_tokens_unpadded=8, num_tokens_padded=8,
                        write_layout=layout)
    assert torch.equal(m.materialize(s1, ["a"]).mm_outputs["audio.embeds"]["a"], hidden * 2)
    assert m.stats()["deferred_open"] == 1
    assert not m.pool.has_key("audio.embeds")  # not landed while the request runs
    # a hit while "a" still runs needs a's deferred rows: the save pushes them out
    m.new_step_starts([started("b", hit_end=8, blocks=[1, 2, 3])])
    rows_b = truth("b", range(8, 12))
    layout = PrefixCacheWriteLayout.packed([("b", 8, 12)], slots([1, 2, 3], 8, 12))
    s2 = m.save_outputs(rows_b, {"audio.embeds": rows_b * 2}, num_tokens_unpadded=4, num_tokens_padded=4,
                        write_layout=layout)
    out = m.materialize(s2, ["b"])
    assert torch.equal(out.mm_outputs["audio.embeds"]["b"], torch.cat([hidden, rows_b]) * 2)
    m.new_step_starts([PrefixCacheRequestEvent("a", E.FINISHED), PrefixCacheRequestEvent("b", E.FINISHED)])
    settle(m)
    assert m.stats()["deferred_open"] == 0
    assert torch.equal(m.pool.rows("audio.embeds", slots([1, 2, 3], 8, 12)), rows_b * 2)
    m.shutdown()


def test_gpu_budget_forces_the_oldest_deferred_writes_out() -> None:
    m = manager(gpu_staging_bytes=100)  # one 4x2 float32 step (32 bytes) fits, four do not
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio.embeds"})))
    m.new_step_starts([started("a")])
    for i in range(4):
        rows = truth("a", range(4 * i, 4 * i + 4))
        layout = PrefixCacheWriteLayout.packed([("a", 4 * i, 4 * i + 4)], slots([0, 1, 2, 3], 4 * i, 4 * i + 4))
        m.discard_step(m.save_outputs(rows, {"audio.embeds": rows[:, :2].clone()}, num_tokens_unpadded=4,
                                      num_tokens_padded=4, write_layout=layout))
    stats = m.stats()
    assert stats["budget_flushes"] >= 1 and stats["deferred_bytes_on_device"] <= 100
    assert torch.equal(m.pool.rows("audio.embeds", slots([0], 0, 4)), truth("a", range(4))[:, :2])


def test_a_request_holds_only_its_open_deferred_writes_as_the_budget_flushes_older_ones() -> None:
    """A long generation's budget-flushed deferred writes leave the request's open set at once (it never
    grows with the generation), and its end pushes exactly the ones still open (I9)."""
    m = manager(num_blocks=64, gpu_staging_bytes=100)  # three 4x2 float32 steps (32 bytes each) fit, a fourth does not
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio.embeds"})))
    m.new_step_starts([started("a")])
    for i in range(40):
        rows = truth("a", range(4 * i, 4 * i + 4))
        blocks = list(range(i + 1))
        layout = PrefixCacheWriteLayout.packed([("a", 4 * i, 4 * i + 4)], slots(blocks, 4 * i, 4 * i + 4))
        m.discard_step(m.save_outputs(rows, {"audio.embeds": rows[:, :2].clone()}, num_tokens_unpadded=4,
                                      num_tokens_padded=4, write_layout=layout))
        assert m.scheduling.num_open_of("a") == m.stats()["deferred_open"] <= 3
    assert m.stats()["budget_flushes"] >= 37
    m.new_step_starts([PrefixCacheRequestEvent("a", E.FINISHED)])
    settle(m)
    assert m.scheduling.num_open_of("a") == 0 and m.stats()["deferred_open"] == 0
    assert torch.equal(m.pool.rows("audio.embeds", slots(list(range(40)), 156, 160)), truth("a", range(156, 160))[:, :2])
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_one_requests_end_pushes_a_deferred_write_it_shares_and_the_other_forgets_it(eager: bool) -> None:
    m = manager(eager)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio.embeds"})))
    m.new_step_starts([started("a"), started("b")])
    step, _ = save(m, [("a", [0, 1], 0, 6), ("b", [2, 3], 0, 5)], mm_key="audio.embeds")
    m.discard_step(step)
    assert m.scheduling.num_open_of("a") == m.scheduling.num_open_of("b") == 1
    m.new_step_starts([PrefixCacheRequestEvent("a", E.FINISHED)])  # "b" still runs: the write lands all the same
    settle(m)
    assert m.scheduling.num_open_of("b") == 0 and m.stats()["deferred_open"] == 0
    assert m.pool.has_key("audio.embeds")
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_leftover_shapes_are_preserved_per_request(eager: bool) -> None:
    m = manager(eager)
    m.new_step_starts([started("a"), started("b")])
    per_request = torch.arange(6.0).reshape(2, 3)  # dim 0 is not a token count
    scalar = torch.tensor(5.0)
    one_d = torch.arange(7.0)  # 1-D tensors are never per-token
    step, _ = save(m, [("a", [0], 0, 4), ("b", [1], 0, 3)],
                   mm={"codes.list": [[1, 2], [3]], "pooled": per_request, "scalar": scalar, "vec": one_d})
    out = m.materialize(step, ["a", "b"])
    for req in ("a", "b"):
        got = out.mm_for(req)
        assert got["codes.list"] == [[1, 2], [3]]
        assert got["pooled"].shape == (2, 3) and torch.equal(got["pooled"], per_request)
        assert got["scalar"].shape == () and got["vec"].shape == (7,)
        assert got["pooled"].data_ptr() != per_request.data_ptr()  # a host copy, not the live buffer
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_padded_token_major_mm_is_sliced_to_unpadded(eager: bool) -> None:
    m = manager(eager)
    m.new_step_starts([started("a")])
    padded_mm = torch.arange(16.0 * 3).reshape(16, 3)  # dim 0 == padded count
    step, rows = save(m, [("a", [0, 1, 2], 0, 10)], padded=16, mm={"audio.codes": padded_mm})
    out = m.materialize(step, ["a"])
    assert torch.equal(out.hidden_states["a"], rows)
    assert torch.equal(out.mm_outputs["audio.codes"]["a"], padded_mm[:10])
    m.shutdown()


def test_newest_tenant_wins_after_block_reuse() -> None:
    m = manager()
    m.new_step_starts([started("a")])
    m.discard_step(save(m, [("a", [7], 0, 4)])[0])
    m.new_step_starts([PrefixCacheRequestEvent("a", E.ABORTED), started("c")])
    rows_c = save(m, [("c", [7], 0, 4)])
    m.discard_step(rows_c[0])
    m.new_step_starts([PrefixCacheRequestEvent("c", E.FINISHED), started("d", hit_end=4, blocks=[7, 8])])
    step, rows_d = save(m, [("d", [7, 8], 4, 6)])
    assert torch.equal(m.materialize(step, ["d"]).hidden_states["d"], torch.cat([rows_c[1], rows_d]))


@pytest.mark.parametrize("eager", MODES)
def test_hidden_opt_out_still_serves_mm(eager: bool) -> None:
    m = manager(eager)
    m.register_policy(ModelCachePolicy(needs_full_hidden_states=False))
    m.new_step_starts([started("a")])
    codes = truth("a", range(8))[:, :3]
    layout = PrefixCacheWriteLayout.packed([("a", 0, 8)], slots([0, 1], 0, 8))
    s1 = m.save_outputs(None, {"audio.codes": codes}, num_tokens_unpadded=8, num_tokens_padded=8,
                        write_layout=layout)
    out = m.materialize(s1, ["a"])
    assert out.hidden_states is None and torch.equal(out.mm_outputs["audio.codes"]["a"], codes)
    m.new_step_starts([started("b", hit_end=8, blocks=[0, 1, 2])])
    more = truth("b", range(8, 10))[:, :3]
    layout = PrefixCacheWriteLayout.packed([("b", 8, 10)], slots([0, 1, 2], 8, 10))
    s2 = m.save_outputs(torch.zeros(2, WIDTH), {"audio.codes": more}, num_tokens_unpadded=2,
                        num_tokens_padded=2, write_layout=layout)
    out = m.materialize(s2, ["b"])
    assert out.hidden_states is None and torch.equal(out.mm_outputs["audio.codes"]["b"], torch.cat([codes, more]))
    assert not m.pool.has_key(HIDDEN_KEY)
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_resume_after_preemption_serves_the_full_prefix(eager: bool) -> None:
    m = manager(eager)
    m.new_step_starts([started("a")])
    s1, prompt = save(m, [("a", [2, 3], 0, 8)])
    m.materialize(s1, ["a"])
    # "a" is preempted (blocks freed, no event), then resumed: the allocator re-finds 8 tokens
    m.new_step_starts(PrefixCacheStep([PrefixCacheRequestEvent("a", E.RESUMED, 0, 8, ((2, 3, 6),), 3)], {"a": 3}))
    s2, rest = save(m, [("a", [2, 3, 6], 8, 11)])
    assert torch.equal(m.materialize(s2, ["a"]).hidden_states["a"], torch.cat([prompt, rest]))
    # a resume with no hit recomputes from 0 and returns just those rows
    m.new_step_starts([PrefixCacheRequestEvent("a", E.RESUMED, 0, 0, (), 4)])
    s3, again = save(m, [("a", [9], 0, 4)])
    assert torch.equal(m.materialize(s3, ["a"]).hidden_states["a"], again)
    m.shutdown()


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


def test_stats_fields() -> None:
    m = manager()
    m.new_step_starts([started("a")])
    step, _ = save(m, [("a", [0], 0, 4)], mm_key="audio.codes")
    stats = m.stats()
    assert stats["unconsumed_step_ids"].keys() == {step}
    assert stats["pool_bytes"] == {"hidden": 32 * 4 * WIDTH * 4, "audio.codes": 32 * 4 * 2 * 4}
    assert stats["staging"]["slots"] == {"free": 2, "claimed": 0, "saved": 1, "materialized": 0}
    for field in ("staging_wait_s_p50", "staging_wait_s_p99", "writes_in_flight", "hits", "misses", "failed"):
        assert field in stats


def test_contract_errors_on_bad_input_change_nothing() -> None:
    m = manager()
    m.new_step_starts([started("a")])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="still live"):
        m.new_step_starts([started("a")])
    layout = PrefixCacheWriteLayout.packed([("a", 0, 4)], torch.arange(3))
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_SLOT_MAPPING):
        m.save_outputs(truth("a", range(4)), {}, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)
    layout = PrefixCacheWriteLayout.packed([("a", 0, 4)], torch.arange(4))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="hidden_states has 2 rows"):
        m.save_outputs(truth("a", range(2)), {}, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="reserved key"):
        m.save_outputs(truth("a", range(4)), {HIDDEN_KEY: 1}, num_tokens_unpadded=4, num_tokens_padded=4,
                       write_layout=layout)
    m.new_step_starts(PrefixCacheStep([], {"a": 3}))
    for _ in range(2):  # the failed save kept the scheduled counts: a retry is checked again
        with pytest.raises(OmniPrefixCacheUnmatchError, match="scheduled 3 tokens"):
            save(m, [("a", [0], 0, 4)])
    first, _ = save(m, [("a", [0], 0, 3)])
    m.discard_step(first)
    m.new_step_starts([PrefixCacheRequestEvent("b", E.STARTED, 0, 4, ((1,),))])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="must continue the hit"):
        save(m, [("b", [1, 2], 0, 6)])
    assert m.staging.slot_states() == ["free"] * 3 and m.stats()["unconsumed_step_ids"] == {}
    step, _ = save(m, [("b", [1, 2], 4, 6)], tag_of={"b": "x"})  # the pending hit survived the failed save
    assert step == first + 1  # refused saves burned no step id
    with pytest.raises(OmniPrefixCacheUnmatchError, match="is not readable"):
        m.materialize(step, ["b"])  # block 1 was never written
    m.register_policy(ModelCachePolicy())
    with pytest.raises(OmniPrefixCacheUnmatchError, match="register it before the first save"):
        m.register_policy(ModelCachePolicy(needs_full_hidden_states=False))


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


# ---- budget_flushes is an exact count -----------------------------------------------------
@pytest.mark.parametrize("eager", MODES)
def test_budget_flushes_counts_each_flush_exactly_once(eager: bool) -> None:
    """The GPU staging budget flushes exactly the oldest open deferred write per save over it, and
    ``budget_flushes`` counts each flush once.

    The budget is exactly one step's deferred bytes: the first save fits, and
    every later save pushes the total one write over, so exactly the oldest open
    write is flushed per save.

    Kills the mutants: ``counters["budget_flushes"] += 1`` deleted or off by one; the budget loop's
    bounds.

    The GPU staging budget flushes exactly the oldest open deferred write per save over it, and
    ``budget_flushes`` counts each flush once."""
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
    """A deferred write one byte over the GPU staging budget is flushed; it never stays on the device.

    Kills the mutant: ``if over <= 0`` -> ``if over <= 1`` (a write one byte over the budget stays on
    device).

    A deferred write one byte over the GPU staging budget is flushed; it never stays on the device."""
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


# ---- stats() counters are exact -----------------------------------------------------------
@pytest.mark.parametrize("eager", MODES)
def test_stats_counters_count_each_event_once(eager: bool) -> None:
    """The manager's stats count each save, materialize, discard and hit exactly once.

    Kills the mutants: any counter increment deleted or off by one (saved, materialized, discarded,
    hits...).

    The manager's stats count each save, materialize, discard and hit exactly once."""
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


# ---- a hit of one block when a block is one token ------------------------------------------
@pytest.mark.parametrize("eager", MODES)
def test_a_one_token_hit_with_block_size_one_is_served(eager: bool) -> None:
    """With ``block_size=1`` a one-token hit is aligned and real: it is served and counted, never dropped as
    a miss (I5).

    With ``block_size=1`` a hit of one token is aligned and real: b must be served a's
    row at KV slot 5 before its own, and counted as one hit of one token.

    Kills the mutant: ``if event.hit_end > 0`` -> ``> 1`` in ``_install_lookup`` (the hit dropped as a
    miss).

    With ``block_size=1`` a one-token hit is aligned and real: it is served and counted, never dropped as
    a miss (I5)."""
    m = OmniPrefixCacheManager(config(block_size=1), eager=eager)
    m.new_step_starts([started("a")])
    rows_a = torch.arange(16, dtype=torch.float32).reshape(2, 8) + 1
    layout = PrefixCacheWriteLayout.packed([("a", 0, 2)], torch.tensor([5, 6]))
    s1 = m.save_outputs(rows_a, {}, num_tokens_unpadded=2, num_tokens_padded=2, write_layout=layout)
    m.discard_step(s1)
    m.new_step_starts([PrefixCacheRequestEvent("a", PrefixCacheEventKind.FINISHED),
                       started("b", hit_end=1, blocks=[5, 9])])
    rows_b = torch.full((1, 8), -3.0)
    layout = PrefixCacheWriteLayout.packed([("b", 1, 2)], torch.tensor([9]))
    s2 = m.save_outputs(rows_b, {}, num_tokens_unpadded=1, num_tokens_padded=1, write_layout=layout)
    out = m.materialize(s2, ["b"])
    assert torch.equal(out.hidden_states["b"], torch.cat([rows_a[:1], rows_b])), out.hidden_states["b"]
    stats = m.stats()
    assert (stats["hits"], stats["hit_tokens"]) == (1, 1), stats
    m.shutdown()


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


# ---- I5/I12: an ended request's untaken hit is dropped ------------------------------------
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_an_ended_requests_untaken_hit_is_never_served(eager: bool) -> None:
    """A request that ends (FINISHED or ABORTED) before its hit is read drops that hit: it is never served to
    a later step (I12).

    Kills the mutant: ``manager:OmniPrefixCacheManager.new_step_starts:del_call:9103d72c`` (the ``end``
    op's ``self.hits.drop(req_id)`` deleted: the hit stays pending after FINISHED).

    A request that ends (FINISHED or ABORTED) before its hit is read drops that hit: it is never served to
    a later step (I12)."""
    m = manager(eager)
    try:
        m.new_step_starts([started("x")])
        step, _ = save(m, [("x", [0, 1], 0, 8)])
        m.discard_step(step)
        m.new_step_starts([started("a", 8, [0, 1], 4)])  # a hit of 8, never taken by a save
        m.new_step_starts([PrefixCacheRequestEvent("a", PrefixCacheEventKind.FINISHED)])
        # The id's next rows start afresh at 0: no hit of the ended request continues into them.
        step, rows = save(m, [("a", [2], 0, 4)])
        out = m.materialize(step, ["a"])
        assert torch.equal(out.hidden_states["a"], rows), "an ended request's pending hit was served"
    finally:
        m.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_a_zero_row_write_leaves_its_hit_for_the_first_step_that_schedules_it(eager: bool) -> None:
    """B starts with a 4-token hit on A's block, but its first step schedules nothing for it (a
    zero-row write next to C's rows): B gets ``(0, width)`` rows there, and the step that does
    schedule B serves ``[0, token_end)``, the hit then its rows (contract section 4.4). Found by an
    independent attack: the zero-row write took the hit, so B got the prefix in a step that
    scheduled none of its tokens and only its new rows in the next."""
    from omni_cache.runtime.events import PrefixCacheWrite

    m = manager(eager=eager)
    m.new_step_starts([started("A")])
    m.materialize(save(m, [("A", [0, 1], 0, BS)])[0], ["A"])
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED), started("B", BS, [0, 2]), started("C")])
    settle(m)
    rows_c = truth("C", range(3))
    layout = PrefixCacheWriteLayout([PrefixCacheWrite("C", 0, 3, 0, 3), PrefixCacheWrite("B", 3, 3, BS, BS)], 3,
                                    slots([3], 0, 3))
    step = m.save_outputs(rows_c, {}, num_tokens_unpadded=3, num_tokens_padded=3, write_layout=layout)
    out = m.materialize(step, ["C", "B"])
    assert torch.equal(out.hidden_states["C"], rows_c)
    assert out.hidden_states["B"].shape == (0, truth("B", range(1)).shape[1]), out.hidden_states["B"].shape
    step = save(m, [("B", [0, 2], BS, BS + 2)], tag_of={"B": "A"})[0]
    assert torch.equal(m.materialize(step, ["B"]).hidden_states["B"], truth("A", range(BS + 2)))
    m.shutdown()
