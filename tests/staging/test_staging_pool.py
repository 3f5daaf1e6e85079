"""StagingPool: the slot machine is the only door to the pages (I1, I2, I3, I10, I11)."""

from __future__ import annotations

import ast
import pathlib
import threading

import pytest
import torch
from cache_helpers import BS, claimed_and_saved, manager, save, started, wait_for_waiter

import omni_cache
from omni_cache import (
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    TraceRecorder,
)
from omni_cache.runtime.errors import (
    PHRASE_CAPACITY,
    PHRASE_NOT_SAVED,
    PHRASE_UNCONSUMED,
)
from omni_cache.runtime.staging import StagingPool


def test_lifecycle_and_lazy_pages() -> None:
    recorder = TraceRecorder()
    pool = StagingPool(2, 8, 1.0, recorder=recorder)
    assert pool.page_bytes() == {}
    slot = pool.claim(3)
    rows = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    pool.claimed_page(slot, "hidden", rows).copy_(rows)
    # allocated lazily per key at depth x capacity x width x dtype
    assert pool.page_bytes() == {"hidden": 2 * 8 * 4 * 2}
    with pytest.raises(OmniPrefixCacheUnmatchError, match="only in states"):
        pool.page_rows(slot, "hidden", 0, 3)  # claimed pages are not readable yet
    pool.save(slot, 5, "here:1")
    with pytest.raises(OmniPrefixCacheUnmatchError, match="only in states"):
        pool.claimed_page(slot, "hidden", rows)  # saved pages are not writable
    assert torch.equal(pool.page_rows(slot, "hidden", 0, 3), rows)
    assert pool.unconsumed() == {5: "here:1"}
    pool.hold(slot)
    taken = pool.consume(5, caller="t")
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED):
        pool.consume(5, caller="t")
    pool.done_reading(taken)
    assert pool.slot_states() == ["materialized", "free"]  # the write still reads the page (I3)
    pool.unhold(slot)
    assert pool.slot_states() == ["free", "free"]
    assert [e.trigger for e in recorder.events()] == ["claim", "save", "consume", "release"]
    with pytest.raises(OmniPrefixCacheUnmatchError, match="holds rows of shape"):
        s2 = pool.claim(1)
        pool.claimed_page(s2, "hidden", torch.zeros(1, 5))


def test_abort_and_capacity() -> None:
    pool = StagingPool(1, 4, 0.05)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_CAPACITY):
        pool.claim(5)
    slot = pool.claim(4)
    pool.abort(slot)
    assert pool.slot_states() == ["free"]
    with pytest.raises(OmniPrefixCacheUnmatchError, match="illegal staging_slot trigger 'abort'"):
        pool.abort(slot)


def test_timeout_names_unconsumed_and_in_flight() -> None:
    pool = StagingPool(1, 4, 0.05, describe_in_flight=lambda: "write tid 9 (copying)")
    slot = pool.claim(1)
    pool.save(slot, 3, "engine.py:77")
    with pytest.raises(OmniPrefixCacheStagingTimeoutError) as info:
        pool.claim(1)
    msg = str(info.value)
    assert PHRASE_UNCONSUMED in msg and "step 3 saved at engine.py:77" in msg and "write tid 9" in msg


def test_waiter_wakes_when_a_page_is_released() -> None:
    pool = StagingPool(1, 4, 5.0)
    slot = pool.claim(1)
    pool.save(slot, 1, "x:1")
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(pool.claim(1)))
    waiter.start()
    wait_for_waiter(pool, "the second claim waits for a page")
    assert not got
    pool.done_reading(pool.consume(1, caller="t"))
    waiter.join(5)
    assert got and pool.slot_states() == ["claimed"] and pool.num_claim_waits == 1


def test_failed_pool_releases_waiters() -> None:
    pool = StagingPool(1, 4, 5.0)
    pool.claim(1)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            pool.claim(1)
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_for_waiter(pool, "the second claim waits for a page")
    pool.set_failed("write failed: boom")
    waiter.join(2)
    assert not waiter.is_alive() and "write failed: boom" in str(errors[0])


def test_no_other_module_touches_the_page_storage() -> None:
    """The staging machine is the only door: the page storage (``_pages``, its per-slot
    views ``_slot_pages`` and the cached head views ``_head_views``) is referenced in staging.py alone."""
    storage = {"_pages", "_slot_pages", "_head_views"}
    package = pathlib.Path(omni_cache.__file__).parent
    offenders = []
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in storage and path.name != "staging.py":
                offenders.append(f"{path}:{node.lineno}")
            if isinstance(node, ast.Constant) and node.value in storage and path.name != "staging.py":
                offenders.append(f"{path}:{node.lineno}")
    assert offenders == []
    staging_src = (package / "runtime" / "staging.py").read_text()
    tree = ast.parse(staging_src)
    # inside staging.py, only the allocator, the state-checked accessors and ``abort`` (which
    # drops the pages its own claimed slot allocated, so a refused save fixes no row shape) touch it
    users = {
        fn.name
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef)
        and any(isinstance(n, ast.Attribute) and n.attr in storage for n in ast.walk(fn))
    }
    assert users == {"__init__", "_page", "_head_view", "page_rows", "pages_rows", "page_bytes", "abort"}


# ---- I3/I11: staging pages are read only through a slot in the right state, under the lock -


@pytest.mark.parametrize("read", ["pages_rows", "page_rows"])
def test_reading_a_page_through_a_claimed_or_free_slot_is_refused(read: str) -> None:
    """A staging page is read only through a saved (or materializing) slot; a claimed or free slot's read is
    refused (I1, I3).

    Kills the mutant: delete the ``_require`` state check of ``StagingPool.pages_rows`` (or
    ``page_rows``).

    A staging page is read only through a saved (or materializing) slot; a claimed or free slot's read is
    refused (I1, I3)."""
    pool, claimed, saved = claimed_and_saved()
    calls = {
        "pages_rows": lambda slot: pool.pages_rows(slot, ("k",), 0, 2)["k"],
        "page_rows": lambda slot: pool.page_rows(slot, "k", 0, 2),
    }
    assert torch.equal(calls[read](saved), torch.ones(2, 3))
    free = next(s for s in pool._slots if s.state == "free")
    for slot in (claimed, free):
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"allows it only in states \('saved', 'materialized'\)"):
            calls[read](slot)


# ---- I3: an aborted claim forgets the pages it created --------------------------------------
def test_an_aborted_slot_does_not_drop_a_page_that_a_later_saved_step_holds() -> None:
    """Aborting a staging claim drops only the pages that claim created, never a page another saved step
    holds (I3).

    The slot would remember "a" from its first, aborted claim; its second abort would
    then drop the page "a" that another slot's saved step created and still holds.

    Kills the mutant: delete ``slot.new_keys = []`` in ``StagingPool.abort``.

    Aborting a staging claim drops only the pages that claim created, never a page another saved step
    holds (I3)."""
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


# ---- I3: a refused save gives back only its own pages --------------------------------------
def test_a_refused_save_on_a_reused_staging_slot_keeps_the_saved_steps_pages(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A refused save on a reused staging slot drops only its own new pages, never one a saved step still
    reads (I3).

    Kills the mutant: ``staging:StagingPool.save:del_assign:7c518066`` (a saved slot kept the list of keys
    whose pages its claim allocated, so a later refused save on that slot dropped those pages: another
    saved step then read a page that no longer existed).

    A refused save on a reused staging slot drops only its own new pages, never one a saved step still
    reads (I3)."""
    m = manager(staging_depth=2)
    m.new_step_starts([started("A"), started("B")])
    step_a, _ = save(m, [("A", [0], 0, BS)], mm_key="codes")  # slot 0: allocates the pages
    step_b, rows_b = save(m, [("B", [1], 0, BS)], mm_key="codes")  # slot 1, left unconsumed
    m.materialize(step_a, ["A"])  # slot 0 is free again
    real = m.copies.copy_all

    def refused(*args: object, **kwargs: object) -> object:
        raise MemoryError("staging copy refused")

    monkeypatch.setattr(m.copies, "copy_all", refused)
    m.new_step_starts([started("C")])
    with pytest.raises(MemoryError):
        save(m, [("C", [2], 0, BS)], mm_key="codes")  # claims slot 0, fails, aborts
    monkeypatch.setattr(m.copies, "copy_all", real)
    out = m.materialize(step_b, ["B"])
    assert torch.equal(out.hidden_states["B"], rows_b)
    assert torch.equal(out.mm_outputs["codes"]["B"], -rows_b[:, :2])
    m.shutdown()
