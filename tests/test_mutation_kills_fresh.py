"""Tests that kill survivors of a fresh sample (tools/ast_mutants.py --seed 12).

The seed-11 sample's survivors are killed in tests/test_mutation_kills.py and
tests/test_mutation_kills_tenancy.py; these were written against the survivors
of a second, independent sample, each checked by applying its mutant to a copy
(``tools/ast_mutants.py --only ID --tests FILE``) and seeing it fail.

Invariants touched: I8 (a save failing after registration is sticky or fully
undone, never half), I9 (shutdown closes the queue), I11 (the block pool's
leaf lock), memory held by landed writes, and the adapter's reading of a new
request without ``num_computed_tokens``.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from cache_helpers import MODES, assert_waits_for_lock, config, manager, save, started

from omni_cache import (
    ModelCachePolicy,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheSchedulerAdapter,
    PrefixCacheWriteLayout,
)
from omni_cache.block_pool import PrefixBlockPool
from omni_cache.errors import OmniPrefixCacheUnmatchError
from omni_cache.faults import FaultHooks
from omni_cache.manager import OmniPrefixCacheManager
from omni_cache.staging import StagingPool
from omni_cache.writes import PoolWrite


# ---- I11: the block pool's reads take its leaf lock --------------------------------------
@pytest.mark.parametrize("what", ["keys", "has_key", "nbytes", "rows", "write"])
def test_block_pool_calls_wait_for_its_lock(what: str) -> None:
    """Mutants: ``drop_with`` on ``PrefixBlockPool.keys`` / ``has_key`` (and siblings)."""
    pool = PrefixBlockPool(8)
    pool.write("k", torch.tensor([1, 2]), torch.ones(2, 3))
    calls = {
        "keys": pool.keys,
        "has_key": lambda: pool.has_key("k"),
        "nbytes": pool.nbytes,
        "rows": lambda: pool.rows("k", torch.tensor([1])),
        "write": lambda: pool.write("k", torch.tensor([3]), torch.ones(1, 3)),
    }
    assert_waits_for_lock(pool.lock, calls[what], f"PrefixBlockPool.{what}")


# ---- a landed write keeps no rows --------------------------------------------------------
@pytest.mark.parametrize("eager", MODES)
def test_a_written_write_drops_its_rows(eager: bool) -> None:
    """Mutants: delete ``write.host = None`` / ``write.source = {}`` after commit (rows kept per write)."""
    seen: list[PoolWrite] = []

    class Keep(FaultHooks):
        def before_pool_write(self, write, key) -> None:  # type: ignore[no-untyped-def]
            seen.append(write)

    m = OmniPrefixCacheManager(config(), eager=eager, faults=Keep())
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"})))
    m.new_step_starts([started("a")])
    step, _ = save(m, [("a", [0], 0, 4)], mm={"audio": torch.ones(4, 3)})
    m.discard_step(step)
    m.new_step_starts([PrefixCacheRequestEvent("a", PrefixCacheEventKind.FINISHED)])
    m.shutdown()  # drains the queue
    assert len({w.tid for w in seen}) == 2  # the immediate and the deferred write
    for write in seen:
        assert write.state == "written" and write.host is None and write.source == {}, write.describe()


# ---- I9: shutdown closes the copy queue --------------------------------------------------
@pytest.mark.parametrize("eager", MODES)
def test_shutdown_closes_the_queue_so_a_blocking_pop_returns_at_once(eager: bool) -> None:
    """Mutant: delete ``self.book.close()`` in ``Committer.stop`` (the committer would sleep out its poll)."""
    m = manager(eager)
    m.shutdown()
    t0 = time.perf_counter()
    assert m.book.start_next(block=True, timeout_s=5.0) is None
    assert time.perf_counter() - t0 < 2.0, "the queue was not closed by shutdown"


# ---- I8: a save that fails after registering its writes ----------------------------------
@pytest.mark.parametrize("keys", ["hidden", "hidden+audio", "audio"])
@pytest.mark.parametrize("eager", MODES)
def test_a_failure_after_registration_surfaces_as_itself_and_leaves_no_half_state(
    eager: bool, keys: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutants: delete ``registered.append(imm)`` / ``registered.append(deferred)`` in ``save_outputs``,
    or the ``book.fail`` of the writes after the first (hidden+audio: the deferred one stays live).

    A failure after the writes are registered (planning the hit runs out of memory)
    must raise that error (or one chained from it) and leave either the sticky
    failure set, or nothing behind: no claimed page, no live write. ``audio`` is a
    deferred key; "hidden" alone has only an immediate write, "audio" only a deferred one.
    """
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


# ---- the adapter: a new request without num_computed_tokens is a miss --------------------
def test_a_new_request_without_num_computed_tokens_is_a_miss() -> None:
    """Mutant: ``getattr(new_req, "num_computed_tokens", 0)`` -> default 1."""

    bare = SimpleNamespace(req_id="r", block_ids=([3, 4],))  # no num_computed_tokens at all
    output = SimpleNamespace(scheduled_new_reqs=[bare], scheduled_cached_reqs=None,
                             num_scheduled_tokens={"r": 8}, finished_req_ids=set())
    (event,) = PrefixCacheSchedulerAdapter().translate_scheduler_output(output)
    assert (event.kind, event.hit_start, event.hit_end) == (PrefixCacheEventKind.STARTED, 0, 0)
    assert event.group0_block_ids == (3, 4)


# ---- I3/I11: staging pages are read only through a slot in the right state, under the lock -
def _claimed_and_saved() -> tuple[StagingPool, object, object]:
    pool = StagingPool(3, 4, 0.05)
    saved = pool.claim(2)
    pool.claimed_pages(saved, {"k": torch.ones(2, 3)})["k"].copy_(torch.ones(2, 3))
    pool.save(saved, 1, "engine.py:1")
    return pool, pool.claim(2), saved


@pytest.mark.parametrize("read", ["pages_rows", "page_rows"])
def test_reading_a_page_through_a_claimed_or_free_slot_is_refused(read: str) -> None:
    """Mutant: delete the ``_require`` state check of ``StagingPool.pages_rows`` (or ``page_rows``)."""
    pool, claimed, saved = _claimed_and_saved()
    calls = {
        "pages_rows": lambda slot: pool.pages_rows(slot, ("k",), 0, 2)["k"],
        "page_rows": lambda slot: pool.page_rows(slot, "k", 0, 2),
    }
    assert torch.equal(calls[read](saved), torch.ones(2, 3))
    free = next(s for s in pool._slots if s.state == "free")
    for slot in (claimed, free):
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"allows it only in states \('saved', 'materialized'\)"):
            calls[read](slot)


@pytest.mark.parametrize("what", ["claimed_pages", "pages_rows", "save", "unconsumed", "slot_states", "page_bytes"])
def test_staging_calls_wait_for_the_pool_lock(what: str) -> None:
    """Mutants: ``drop_with`` on ``StagingPool.claimed_pages`` (the slot's state read bare), ``save``, and siblings."""
    pool, claimed, saved = _claimed_and_saved()
    calls = {
        "claimed_pages": lambda: pool.claimed_pages(claimed, {"k": torch.ones(2, 3)}),
        "pages_rows": lambda: pool.pages_rows(saved, ("k",), 0, 2),
        "save": lambda: pool.save(claimed, 2, "engine.py:2"),
        "unconsumed": pool.unconsumed,
        "slot_states": pool.slot_states,
        "page_bytes": pool.page_bytes,
    }
    assert_waits_for_lock(pool._lock, calls[what], f"StagingPool.{what}")


# ---- a hit of one block when a block is one token ------------------------------------------
@pytest.mark.parametrize("eager", MODES)
def test_a_one_token_hit_with_block_size_one_is_served(eager: bool) -> None:
    """Mutant: ``if event.hit_end > 0`` -> ``> 1`` in ``_install_lookup`` (the hit dropped as a miss).

    With ``block_size=1`` a hit of one token is aligned and real: b must be served a's
    row at KV slot 5 before its own, and counted as one hit of one token.
    """
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


# ---- I3: an aborted claim forgets the pages it created --------------------------------------
def test_an_aborted_slot_does_not_drop_a_page_that_a_later_saved_step_holds() -> None:
    """Mutant: delete ``slot.new_keys = []`` in ``StagingPool.abort``.

    The slot would remember "a" from its first, aborted claim; its second abort would
    then drop the page "a" that another slot's saved step created and still holds.
    """
    pool = StagingPool(2, 4, 0.05)
    first = pool.claim(2)
    pool.claimed_pages(first, {"a": torch.ones(2, 3)})
    pool.abort(first)  # a refused save: its new page "a" is given back
    assert "a" not in pool.page_bytes()
    again, other = pool.claim(2), pool.claim(2)
    assert again.index == first.index != other.index
    pool.claimed_pages(other, {"a": torch.ones(2, 3)})["a"].copy_(torch.full((2, 3), 7.0))
    pool.save(other, 1, "engine.py:1")
    pool.claimed_pages(again, {"b": torch.ones(2, 5)})
    pool.abort(again)  # drops only its own new page "b"
    assert set(pool.page_bytes()) == {"a"}, pool.page_bytes()
    assert torch.equal(pool.page_rows(other, "a", 0, 2), torch.full((2, 3), 7.0))
