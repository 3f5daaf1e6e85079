"""Manager behaviour beyond the invariants: merges, write paths, policies, resume, threads, errors."""

from __future__ import annotations

import logging
import queue
import threading

import pytest
import torch
from cache_helpers import MODES, WIDTH, E, config, manager, save, settle, slots, started, truth

from omni_cache import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
)
from omni_cache.errors import PHRASE_SLOT_MAPPING
from omni_cache.manager import OmniPrefixCacheManager


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
    with caplog.at_level(logging.WARNING, logger="omni_cache.manager"):
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
    from omni_cache.copier import Committer, CopyEngine
    from omni_cache.faults import FaultHooks
    from omni_cache.staging import StagingPool
    from omni_cache.tenancy import SlotTenancy
    from omni_cache.writes import WriteBook

    class Gate(FaultHooks):
        def __init__(self) -> None:
            self.entered, self.gate = threading.Event(), threading.Event()

        def before_pool_write(self, write, key) -> None:  # type: ignore[no-untyped-def]
            if write.tid == 1:
                self.entered.set()
                assert self.gate.wait(5)

    hooks, book = Gate(), WriteBook(5.0)
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
    hooks.gate.set()
    drainer.join(5)
    assert older.state == newer.state == "written"  # the drainer re-checked the queue
    assert torch.equal(pool.rows("k", slots_), torch.full((2, 2), 2.0))
