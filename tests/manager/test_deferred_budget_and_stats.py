"""Manager behaviour beyond the invariants: deferred writes, the GPU staging budget, the stats counters.

A deferred key stays open while its request runs (a hit that needs its rows pushes them out
first) and lands when the request ends; a request holds only its still-open deferred writes, and
its end pushes exactly those (I9), also a write it shares with a request that still runs. The GPU staging budget flushes the oldest open deferred write per
save over it (one byte over is over, under it nothing is flushed) and ``budget_flushes`` counts
each flush once; ``stats()`` carries its documented fields and counts each save, materialize,
discard and hit exactly once.

Split from tests/manager/test_behaviour.py (what a step is served); the threads and shutdown:
tests/manager/test_threads_and_shutdown.py.
"""

from __future__ import annotations

import pytest
import torch
from cache_helpers import MODES, WIDTH, E, finished, manager, save, settle, slots, started, truth

from omni_cache import ModelCachePolicy, PrefixCacheRequestEvent, PrefixCacheWriteLayout


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
