"""WriteBook (write lifecycle, waits, sticky failure) and PrefixBlockPool."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from cache_helpers import (
    MODES,
    config,
    save,
    started,
)

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    PrefixBlockPool,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    WriteSchedule,
)
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.runtime.staging import StagingPool
from omni_cache.runtime.writes import PoolWrite, WriteBook


def _write(book: WriteBook, n: int = 2):  # type: ignore[no-untyped-def]
    return book.register(WriteSchedule.JOIN_NEXT_STEP, 1, torch.arange(n), {"hidden": torch.zeros(n, 2)})


def test_write_lifecycle_queue_and_front_push() -> None:
    book = WriteBook(1.0)
    a, b, c = _write(book), _write(book), _write(book)
    assert [w.tid for w in (a, b, c)] == [1, 2, 3]
    book.enqueue([a, b])
    book.enqueue([c], front=True)  # finished/aborted requests jump the queue (I9)
    assert [book.start_next(block=False).tid for _ in range(3)] == [3, 1, 2]  # type: ignore[union-attr]
    for trigger in ("finish_copy", "commit"):
        book.fire(a, trigger)
    assert a.state == "written" and book.get(a.tid) is None and book.num_written == 1
    with pytest.raises(OmniPrefixCacheUnmatchError, match="illegal pool_write trigger 'commit'"):
        book.fire(a, "commit")


def test_wait_times_out_naming_the_state() -> None:
    book = WriteBook(0.05)
    w = _write(book)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="stuck in state 'pending'"):
        book.wait(w, ("written",), why="test")


def test_failure_is_sticky_and_releases_waiters() -> None:
    book = WriteBook(5.0)
    w, queued = _write(book), _write(book)
    book.enqueue([queued])
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            book.wait(w, ("written",), why="waiting")
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    book.fail(w, OSError("disk"), where="test")
    t.join(2)
    assert not t.is_alive() and "write failed" in str(errors[0])
    assert queued.state == "failed" and w.state == "failed"
    with pytest.raises(OmniPrefixCacheUnmatchError, match="write failed"):
        _write(book)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="write failed"):
        book.check_failed("anything")


def test_block_pool_rows_and_shapes() -> None:
    pool = PrefixBlockPool(8)
    assert pool.keys() == [] and not pool.has_key("hidden")
    pool.write("hidden", torch.tensor([1, 5]), torch.ones(2, 3))
    assert pool.has_key("hidden") and pool.nbytes() == {"hidden": 8 * 3 * 4}
    assert torch.equal(pool.rows("hidden", torch.tensor([5, 0, 1])), torch.tensor([[1.0] * 3, [0.0] * 3, [1.0] * 3]))
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"\(3,\) torch.float32.*\(4,\) torch.float32"):
        pool.write("hidden", torch.tensor([0]), torch.ones(1, 4))
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"torch\.bfloat16"):
        pool.write("hidden", torch.tensor([0]), torch.ones(1, 3, dtype=torch.bfloat16))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="out of range"):
        pool.rows("hidden", torch.tensor([8]))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="no key"):
        pool.rows("audio", torch.tensor([0]))
    assert pool.keys() == ["hidden"]  # keys are never dropped


def test_a_row_shape_fixed_at_registration_holds_before_the_key_is_published() -> None:
    """A key's signature is fixed by its first registered write, before its rows land: a landing of
    another shape or dtype is refused, nothing is published and the fixed signature stays."""
    pool = PrefixBlockPool(8)
    fixed = (torch.float32, torch.Size([3]))
    pool.fix_sigs({"k": None}.keys(), {"k": fixed})
    assert pool.sigs() == {"k": fixed} and pool.keys() == []
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"holds rows of shape \(3,\) torch.float32; this step brought "
                       r"rows of shape \(5,\) torch.float64"):
        pool.write("k", torch.tensor([0]), torch.ones(1, 5, dtype=torch.float64))
    assert pool.sigs() == {"k": fixed} and pool.keys() == []
    pool.write("k", torch.tensor([2]), torch.ones(1, 3))
    assert pool.keys() == ["k"] and torch.equal(pool.rows("k", torch.tensor([2])), torch.ones(1, 3))


def test_a_registration_that_fails_before_the_write_is_recorded_fixes_no_row_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The write book refusing the write (nothing registered, the save changes nothing) leaves no
    key's row shape fixed: the keys are saved later at other widths."""
    m = OmniPrefixCacheManager(config(), eager=True)
    m.new_step_starts([started("a")])

    def refuse(*args: object, **kwargs: object) -> PoolWrite:
        raise RuntimeError("the book refused the write")

    with monkeypatch.context() as patch:
        patch.setattr(m.book, "register", refuse)
        with pytest.raises(RuntimeError, match="the book refused the write"):
            save(m, [("a", [0], 0, 4)], mm={"audio": torch.ones(4, 2)})
    assert m.pool.sigs() == {} and m.stats()["failed"] is None
    step, rows = save(m, [("a", [0], 0, 4)], mm={"audio": torch.ones(4, 6)}, width=16)
    out = m.materialize(step, ["a"])
    assert torch.equal(out.hidden_states["a"], rows) and out.mm_outputs["audio"]["a"].shape == (4, 6)
    assert m.shutdown() == {}


# ---- I2: the timeout message's in-flight-writes list --------------------------------------
def _book_with(n: int) -> WriteBook:
    book = WriteBook(1.0)
    for i in range(n):
        book.register(WriteSchedule.JOIN_ON_FINISH, i + 1, torch.tensor([i]), {"k": torch.zeros(1, 2)})
    return book


def test_in_flight_list_says_none_when_no_write_is_live() -> None:
    """The in-flight description says "none" when no write is live.

    Kills the mutant: negate ``if not live`` in ``describe_in_flight`` (or drop its return).

    The in-flight description says "none" when no write is live."""
    assert _book_with(0).describe_in_flight() == "none"
    pool = StagingPool(1, 4, 0.05, describe_in_flight=_book_with(0).describe_in_flight)
    pool.save(pool.claim(1), 1, "engine.py:1")
    with pytest.raises(OmniPrefixCacheStagingTimeoutError, match=r"in-flight writes: none\. Every step id"):
        pool.claim(1)


@pytest.mark.parametrize(("n", "listed", "more"), [(1, 1, None), (16, 16, None), (17, 16, 1), (40, 16, 24)])
def test_in_flight_list_names_at_most_16_writes_then_counts_the_rest(n: int, listed: int, more: int | None) -> None:
    """The in-flight description names at most 16 writes, then counts the rest.

    Kills the mutants: the cap of 16 off by one, its comparison flipped, the "... N more" count wrong.

    The in-flight description names at most 16 writes, then counts the rest."""
    text = _book_with(n).describe_in_flight()
    assert text.count("write tid ") == listed, text
    assert [int(t) for t in re.findall(r"write tid (\d+)", text)] == list(range(1, listed + 1))
    if more is None:
        assert "more" not in text
    else:
        assert text.endswith(f"; ... {more} more"), text


# ---- a landed write keeps no rows --------------------------------------------------------
@pytest.mark.parametrize("eager", MODES)
def test_a_written_write_drops_its_rows(eager: bool) -> None:
    """A written write drops its host rows and sources: rows are not kept per write after the commit.

    Kills the mutants: delete ``write.host = None`` / ``write.source = {}`` after commit (rows kept per
    write).

    A written write drops its host rows and sources: rows are not kept per write after the commit."""
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
