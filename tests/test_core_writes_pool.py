"""WriteBook (write lifecycle, waits, sticky failure) and PrefixBlockPool."""

from __future__ import annotations

import threading

import pytest
import torch

from omni_cache import OmniPrefixCacheUnmatchError, PrefixBlockPool, WriteSchedule
from omni_cache.writes import WriteBook


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
