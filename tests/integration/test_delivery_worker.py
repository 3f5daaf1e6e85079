"""The worker half of delivery (``RowDelivery``) on a real ``OmniPrefixCacheManager`` (eager).

Protected first: a file holds exactly the rows the cache served for its request, in prompt order
(cached prefix rows then computed rows, over any number of prefill chunks, a preempted request's
recomputed rows winning), its per-token mm key and its token ids, and nothing else; a position no
saved step covered fails the delivery naming the positions -- never a file with zeros there.
Then I1: every step id handed to ``consume`` is consumed exactly once (materialized when a request
still needs rows, discarded otherwise: decode steps of prompt-only requests, steps of requests
without a target), whatever happens to the rows -- a materialize that fails before or after
consuming included (the manager's own counters and its unconsumed ids say so). Then containment:
a failed materialize fails exactly the requests it was for; a write that fails (a full disk) fails
its request with the reason, leaves ``<path>.error`` and releases the lock; a write slower than
``delivery_timeout_s`` fails its request and is never published later; a backlog of abandoned
writes beyond ``delivery_max_pending`` fails new files at once; ``fail_all`` fails every open
delivery and every later one. Finally the directory stays bounded: a failed or dropped delivery
leaves nothing retention does not remove.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from cache_helpers import E, config, save, started, truth, wait_until
from delivery_helpers import JOIN_S, NONCE, FullDisk, HeldDisk, ServedLoop, expected_rows, read

from omni_cache import PrefixCacheRequestEvent
from omni_cache.integration import delivery_files
from omni_cache.integration.delivery import DeliveryPlan, DeliveryTarget, RowDelivery
from omni_cache.integration.delivery_files import CLAIM_NAME, DeliveryStore, claim_holder
from omni_cache.integration.delivery_settings import DeliverySettings
from omni_cache.runtime.manager import OmniPrefixCacheManager

KEY = "audio.codes"


class Worker:
    """A ``RowDelivery`` and the manager it consumes from, driven step by step."""

    def __init__(self, tmp_path: Path, *, store_cls: type | None = None, manager_cls: type = OmniPrefixCacheManager,
                 **settings: Any) -> None:
        settings.setdefault("delivery_timeout_s", 60.0)  # a loaded machine never fails a healthy write
        self.settings = DeliverySettings(delivery_dir=os.path.realpath(tmp_path), nonce=NONCE, **settings)
        store = None
        if store_cls is not None:
            store = store_cls(self.settings.delivery_dir, max_bytes=self.settings.delivery_max_bytes,
                              max_age_s=self.settings.delivery_max_age_s)
        self.delivery = RowDelivery(self.settings, store=store)
        self.store = self.delivery.store
        self.m = manager_cls(config(), eager=True)
        self.saved = 0
        self.ids: dict[str, list[int]] = {}

    def path(self, req: str) -> str:
        return self.settings.paths().default_path(req)

    def admit(self, req: str, num_prompt_tokens: int, *, include: bool = False, embeds: bool = False) -> None:
        """``embeds``: the prompt came as prompt_embeds (vLLM's new request then has no prompt token ids)."""
        self.ids[req] = [1000 + 7 * i + len(req) for i in range(num_prompt_tokens)]
        target = DeliveryTarget(req, self.path(req), None, num_prompt_tokens, include)
        self.delivery.begin_step(DeliveryPlan(targets=(target,)), {req: None if embeds else self.ids[req]})

    def step(self, events: list[Any], spans: list[tuple[str, list[int], int, int]], **kw: Any) -> torch.Tensor:
        """One engine step: events, the save, the delivery's consume, the end of the step."""
        self.m.new_step_starts(events)
        step_id, rows = save(self.m, spans, mm_key=KEY, **kw)
        self.saved += 1
        self.delivery.consume(self.m, step_id, [(r, s, e) for r, _, s, e in spans])
        self.delivery.finish_step()
        return rows

    def results(self) -> dict[str, Any]:
        return {r.req_id: r for r in self.delivery.take_results()}

    def assert_every_step_consumed_once(self) -> None:
        stats = self.m.stats()
        assert stats["unconsumed_step_ids"] == {}
        assert stats["materialized"] + stats["discarded"] == self.saved, stats

    def close(self) -> None:
        self.delivery.shutdown()
        self.m.shutdown()


@pytest.fixture
def worker(tmp_path: Path):
    made: list[Worker] = []

    def make(**kw: Any) -> Worker:
        made.append(Worker(tmp_path, **kw))
        return made[-1]

    yield make
    for w in made:
        w.close()


def _assert_file(path: str, rows: torch.Tensor, ids: list[int]) -> None:
    data = read(path)
    assert set(data) == {"hidden_states", KEY, "token_ids"}
    assert torch.equal(data["hidden_states"], rows)
    assert torch.equal(data[KEY], -rows[:, :2])
    assert data["token_ids"].tolist() == ids


def _lock_is_free(path: str) -> bool:
    fd = os.open(path + ".lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- what a file holds
def test_a_miss_then_a_hit_deliver_the_cached_prefix_and_the_computed_rows(worker) -> None:
    w = worker()
    w.admit("a", 12)
    rows_a = w.step([started("a")], [("a", [4, 5, 6], 0, 12)])
    (result,) = w.results().values()
    assert (result.path, result.error, result.num_tokens, result.cached_tokens) == (w.path("a"), None, 12, 0)
    _assert_file(w.path("a"), rows_a, w.ids["a"])
    w.admit("b", 14)
    rows_b = w.step([started("b", hit_end=8, blocks=[4, 5, 9, 10])], [("b", [4, 5, 9, 10], 8, 14)], tag_of={"b": "b"})
    result = w.results()["b"]
    assert (result.error, result.num_tokens, result.cached_tokens) == (None, 14, 8)
    _assert_file(w.path("b"), torch.cat([rows_a[:8], rows_b]), w.ids["b"])
    assert result.as_params() == {"hidden_states_path": w.path("b"), "hidden_states_num_tokens": 14,
                                  "hidden_states_cached_tokens": 8}
    sizes = [os.path.getsize(w.path(r)) for r in ("a", "b")]
    assert result.nbytes == sizes[1] and w.delivery.counters == {
        "files": 2, "bytes": sum(sizes), "failures": 0, "steps_materialized": 2, "steps_discarded": 0}
    assert len(w.delivery.take_latencies()) == 2 and w.delivery.take_latencies() == (), "each latency handed out once"
    w.assert_every_step_consumed_once()


def test_chunked_prefill_assembles_the_chunks_in_prompt_order(worker) -> None:
    w = worker()
    w.admit("a", 10)
    parts = [w.step([started("a")], [("a", [1, 2, 3], 0, 4)])]
    assert w.results() == {} and not os.path.exists(w.path("a"))
    parts.append(w.step([PrefixCacheRequestEvent("a", E.EXTENDED)], [("a", [1, 2, 3], 4, 8)]))
    assert w.results() == {}
    parts.append(w.step([PrefixCacheRequestEvent("a", E.EXTENDED)], [("a", [1, 2, 3], 8, 10)]))
    assert w.results()["a"].error is None
    _assert_file(w.path("a"), torch.cat(parts), w.ids["a"])
    assert torch.equal(torch.cat(parts), truth("a", range(10)))
    assert w.delivery.counters["steps_materialized"] == 3
    w.assert_every_step_consumed_once()


def test_a_preempted_requests_recomputed_rows_win(worker) -> None:
    w = worker()
    w.admit("a", 8)
    w.step([started("a")], [("a", [1, 2], 0, 4)], tag_of={"a": "first try"})
    # preempted, then recomputed from position 0 on new blocks, with different rows
    new = w.step([PrefixCacheRequestEvent("a", E.RESUMED, 0, 0, ((7, 8),))], [("a", [7, 8], 0, 8)],
                 tag_of={"a": "second try"})
    assert w.results()["a"].error is None
    _assert_file(w.path("a"), new, w.ids["a"])
    w.assert_every_step_consumed_once()


def test_a_preempted_hit_counts_only_the_cached_rows_its_file_holds(tmp_path: Path) -> None:
    """B hits A's 8-token prefix, computes 4 more rows, is preempted and resumes with a 12-token hit
    (its own first chunk is cached now). The file is the 20 prompt rows; 12 of them came from the
    cache -- not 8 + 12 = 20, which would claim every row of the file was a cached copy."""
    loop = ServedLoop(str(tmp_path), max_batched=4)
    prefix = list(range(10, 18))
    loop.add("A", prefix)
    loop.run()
    loop.add("B", prefix + list(range(50, 62)))
    loop.step()  # B: 8 cached rows, 4 computed
    loop.step(preempt=("B",))
    loop.run()
    params = loop.outputs["B"]
    assert (params["hidden_states_num_tokens"], params["hidden_states_cached_tokens"]) == (20, 12)
    data = read(loop.path_of("B"))
    assert torch.equal(data["hidden_states"], expected_rows(loop.prompts["B"], 20))
    assert loop.bridge.preemptions == 1 and loop.close() == {}


def test_a_hit_recomputed_from_scratch_after_a_preemption_counts_no_cached_rows(worker) -> None:
    """B hits A's 8 rows, is preempted, and resumes with no hit (its prefix blocks were evicted):
    every row of its file is recomputed, none is a cached copy any more."""
    w = worker()
    w.admit("a", 8)
    rows_a = w.step([started("a")], [("a", [4, 5], 0, 8)])
    w.admit("b", 12)
    w.step([started("b", hit_end=8, blocks=[4, 5, 9])], [("b", [4, 5, 9], 8, 10)], tag_of={"b": "a"})
    again = w.step([PrefixCacheRequestEvent("b", E.RESUMED, 0, 0, ((11, 12, 13),))], [("b", [11, 12, 13], 0, 12)],
                   tag_of={"b": "b recomputed"})
    result = w.results()["b"]
    assert (result.error, result.num_tokens, result.cached_tokens) == (None, 12, 0)
    _assert_file(w.path("b"), again, w.ids["b"])
    assert not torch.equal(again[:8], rows_a)
    w.assert_every_step_consumed_once()


def test_steps_no_request_needs_rows_for_are_discarded(worker) -> None:
    w = worker()
    w.step([started("x")], [("x", [1], 0, 3)])  # no target: nobody asked for x's rows
    assert w.m.stats()["discarded"] == 1 and w.m.stats()["materialized"] == 0
    w.admit("a", 4)
    w.step([started("a")], [("a", [2], 0, 4)])
    assert w.results()["a"].error is None
    for pos in (4, 5):  # decode steps of a prompt-only request: its file is written already
        w.step([PrefixCacheRequestEvent("a", E.EXTENDED)], [("a", [2, 3], pos, pos + 1)])
    assert w.m.stats()["discarded"] == 3 and w.m.stats()["materialized"] == 1
    assert w.delivery.counters["steps_discarded"] == 3
    assert read(w.path("a"))["hidden_states"].shape[0] == 4
    w.assert_every_step_consumed_once()


def test_include_output_tokens_adds_the_decode_rows_once_the_request_finished(worker) -> None:
    w = worker()
    w.admit("a", 4, include=True)
    parts = [w.step([started("a")], [("a", [1, 2], 0, 4)])]
    for pos in (4, 5):
        parts.append(w.step([PrefixCacheRequestEvent("a", E.EXTENDED)], [("a", [1, 2], pos, pos + 1)]))
    assert w.results() == {} and not os.path.exists(w.path("a"))  # not finished yet: its lock is held
    assert not _lock_is_free(w.path("a"))
    token_ids = [*w.ids["a"], 5, 6]  # all but the last: position 6's token was never an input
    w.delivery.begin_step(DeliveryPlan(finished=(("a", tuple(token_ids)),)), {})
    w.delivery.finish_step()
    assert w.results()["a"].num_tokens == 6
    _assert_file(w.path("a"), torch.cat(parts), token_ids)
    assert _lock_is_free(w.path("a"))
    w.assert_every_step_consumed_once()


def test_positions_no_step_covered_fail_the_delivery_never_zeros(worker) -> None:
    w = worker()
    w.step([started("a")], [("a", [1, 2], 0, 4)])  # a's first chunk, before its target arrived: discarded
    w.admit("a", 8)
    w.step([PrefixCacheRequestEvent("a", E.EXTENDED)], [("a", [1, 2], 4, 8)])
    error = w.results()["a"].error
    assert error is not None and "positions 0..3 (4 of 8)" in error and "never zeros" in error
    assert not os.path.exists(w.path("a")) and "positions 0..3" in Path(w.path("a") + ".error").read_text()
    assert _lock_is_free(w.path("a"))
    w.assert_every_step_consumed_once()


def test_a_per_token_key_named_like_a_file_tensor_fails_the_delivery(worker) -> None:
    w = worker()
    w.admit("a", 4)
    w.m.new_step_starts([started("a")])
    step_id, _ = save(w.m, [("a", [1], 0, 4)], mm_key="token_ids")
    w.saved += 1
    w.delivery.consume(w.m, step_id, [("a", 0, 4)])
    assert "named like a file tensor" in w.results()["a"].error
    w.assert_every_step_consumed_once()


# ------------------------------------------------------------------------------- containment
def test_a_failed_materialize_fails_exactly_its_requests(worker) -> None:
    w = worker()
    for req, n in (("c", 3), ("b", 8), ("d", 4)):
        w.admit(req, n)
    # b "hits" blocks 20, 21, which this cache never saw written: the materialize raises (I6)
    w.step([started("c"), started("b", hit_end=4, blocks=[20, 21])], [("c", [12], 0, 3), ("b", [20, 21], 4, 8)])
    results = w.results()
    assert set(results) == {"b", "c"}
    for req in ("b", "c"):
        assert "materialize of step" in results[req].error and "is not readable" in results[req].error
        assert not os.path.exists(w.path(req)) and os.path.exists(w.path(req) + ".error") and _lock_is_free(w.path(req))
    rows_d = w.step([started("d")], [("d", [14], 0, 4)])  # d was not in that step: it is delivered
    assert w.results()["d"].error is None
    _assert_file(w.path("d"), rows_d, w.ids["d"])
    w.assert_every_step_consumed_once()


class _MaterializeRaisesFirst(OmniPrefixCacheManager):
    """A manager whose materialize fails before it consumes anything (as a builder that crashes)."""

    def materialize(self, step_id: Any, req_ids: Any) -> Any:
        raise RuntimeError("the builder crashed before reading")


def test_a_materialize_that_fails_before_consuming_still_consumes_the_step(worker) -> None:
    w = worker(manager_cls=_MaterializeRaisesFirst)
    w.admit("a", 4)
    w.step([started("a")], [("a", [1], 0, 4)])
    assert "the builder crashed" in w.results()["a"].error
    w.assert_every_step_consumed_once()  # its staging slot is not pinned (the save path of issue: a stuck slot)


def test_a_write_error_fails_the_request_notes_it_and_releases_the_lock(worker) -> None:
    w = worker(store_cls=FullDisk)
    w.admit("a", 4)
    w.step([started("a")], [("a", [1], 0, 4)])
    error = w.results()["a"].error
    assert "writing the file failed" in error and "No space left on device" in error
    assert not os.path.exists(w.path("a")) and _lock_is_free(w.path("a"))
    assert "No space left on device" in Path(w.path("a") + ".error").read_text()
    assert w.delivery.counters["failures"] == 1 and w.delivery.counters["files"] == 0
    w.assert_every_step_consumed_once()


def test_a_write_slower_than_the_timeout_fails_and_is_never_published(worker) -> None:
    w = worker(store_cls=HeldDisk, delivery_timeout_s=0.05)
    w.admit("a", 4)
    w.step([started("a")], [("a", [1], 0, 4)])  # finish_step gives up after 0.05 s
    error = w.results()["a"].error
    assert "not written within delivery_timeout_s=0.05s" in error
    w.store.gate.set()  # the disk catches up: the file must still not appear
    wait_until(lambda: w.store.done == 1, "the late write returned")
    wait_until(lambda: _lock_is_free(w.path("a")), "the late writer released the lock")
    assert not os.path.exists(w.path("a"))
    assert [n for n in os.listdir(w.settings.delivery_dir) if ".omni-tmp-" in n] == []
    assert "abandoned" in Path(w.path("a") + ".error").read_text()
    w.delivery.finish_step()
    assert w.results() == {} and w.delivery.counters["files"] == 0
    w.assert_every_step_consumed_once()


def test_a_write_abandoned_before_it_starts_writes_nothing(worker) -> None:
    """Two files hold both writing slots on a stuck disk; the third waits behind them (a thread of
    its own, no slot). All three time out: once the disk frees, the abandoned files are neither
    serialized nor written (the waiting one never reaches the disk, though the late ones gave their
    slots up), and each leaves only its error note, its lock released."""
    w = worker(store_cls=HeldDisk, delivery_timeout_s=0.05, delivery_max_pending=8)
    for r in "abc":
        w.admit(r, 4)
    w.step([started(r) for r in "abc"], [(r, [i + 1], 0, 4) for i, r in enumerate("abc")])
    results = w.results()
    assert all("not written within delivery_timeout_s" in results[r].error for r in "abc")
    w.store.gate.set()
    wait_until(lambda: all(j.future.done() for j in w.delivery._abandoned), "the abandoned writes ended")
    assert w.store.waiting == 2, "a write abandoned while waiting for a slot still went to the disk"
    for r in "abc":
        assert not os.path.exists(w.path(r)) and _lock_is_free(w.path(r))
        assert "abandoned before its file was written" in Path(w.path(r) + ".error").read_text()
    assert [n for n in os.listdir(w.settings.delivery_dir) if ".omni-tmp-" in n] == []
    w.assert_every_step_consumed_once()


class _StuckFor(DeliveryStore):
    """Writes of the paths in ``stuck`` wait until ``gate`` is set (a slow disk for those files
    only); every other write goes straight to the disk."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stuck: set[str] = set()
        self.gate = threading.Event()

    def write(self, path: str, payload: bytes, *, publish: Any = None) -> int:
        if path in self.stuck:
            assert self.gate.wait(JOIN_S), "the test never freed the stuck writes"
        return super().write(path, payload, publish=publish)


def test_writes_given_up_on_never_hold_a_later_file_back(worker) -> None:
    """Two writes stuck on the disk past the timeout (given up on, still running) leave the writers
    free for later files: each later request's file is written at once, not failed behind them."""
    w = worker(store_cls=_StuckFor, delivery_timeout_s=1.0)  # a later file never needs that long
    w.store.stuck = {w.path("s1"), w.path("s2")}
    for i, r in enumerate(("s1", "s2")):
        w.admit(r, 4)
        w.step([started(r)], [(r, [i + 1], 0, 4)])
        assert "not written within delivery_timeout_s" in w.results()[r].error
    try:
        for i, r in enumerate(("f1", "f2", "f3")):
            w.admit(r, 4)
            rows = w.step([started(r)], [(r, [i + 3], 0, 4)])
            result = w.results()[r]
            assert result.error is None, result.error
            _assert_file(w.path(r), rows, w.ids[r])
    finally:
        w.store.gate.set()
    wait_until(lambda: all(j.future.done() for j in w.delivery._abandoned), "the stuck writes ended")
    w.assert_every_step_consumed_once()


class _StallsAfterPublishing(DeliveryStore):
    """Links the file, then stalls before returning (retention unlinking on a slow disk)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.published, self.gate = threading.Event(), threading.Event()

    def write(self, path: str, payload: bytes, *, publish: Any = None) -> int:
        nbytes = super().write(path, payload, publish=publish)
        self.published.set()
        assert self.gate.wait(JOIN_S), "the test never let the write return"
        return nbytes


def test_a_file_published_in_time_is_delivered_without_waiting_for_the_writer(worker) -> None:
    """The file was linked before the deadline; what the writer does after the link (its retention)
    must not hold the engine thread past ``delivery_timeout_s``."""
    w = worker(store_cls=_StallsAfterPublishing, delivery_timeout_s=0.2)
    w.admit("a", 4)
    w.m.new_step_starts([started("a")])
    step_id, rows = save(w.m, [("a", [1], 0, 4)], mm_key=KEY)
    w.saved += 1
    w.delivery.consume(w.m, step_id, [("a", 0, 4)])
    assert w.store.published.wait(JOIN_S)
    ended = threading.Thread(target=w.delivery.finish_step, daemon=True)
    ended.start()
    ended.join(JOIN_S / 2)
    stuck = ended.is_alive()
    w.store.gate.set()
    ended.join(JOIN_S)
    assert not stuck, "the engine thread waited for a writer whose file was already published"
    result = w.results()["a"]
    assert result.error is None and result.nbytes == os.path.getsize(w.path("a"))
    wait_until(lambda: _lock_is_free(w.path("a")), "the writer released the lock")
    _assert_file(w.path("a"), rows, w.ids["a"])
    w.assert_every_step_consumed_once()


def test_a_backlog_beyond_max_pending_fails_new_files_at_once(worker) -> None:
    w = worker(store_cls=HeldDisk, delivery_timeout_s=0.05, delivery_max_pending=1)
    w.admit("a", 4)
    w.step([started("a")], [("a", [1], 0, 4)])
    assert "delivery_timeout_s" in w.results()["a"].error
    w.admit("b", 4)
    w.step([started("b")], [("b", [2], 0, 4)])
    error = w.results()["b"].error
    assert "1 earlier files are still being written (delivery_max_pending=1)" in error
    assert w.store.waiting == 1, "b's file never reached the stuck disk"
    assert _lock_is_free(w.path("b")) and os.path.exists(w.path("b") + ".error")
    w.store.gate.set()
    # NOTE: the backlog counts writes whose future is not done; the future completes just after the
    # write returns, so wait for that (a state another thread reaches), as settle() waits for pages
    wait_until(lambda: all(job.future.done() for job in w.delivery._abandoned), "the stuck write finished")
    w.admit("c", 4)
    rows_c = w.step([started("c")], [("c", [3], 0, 4)])
    assert w.results()["c"].error is None
    _assert_file(w.path("c"), rows_c, w.ids["c"])
    w.assert_every_step_consumed_once()


def test_shutdown_lets_a_write_in_flight_finish_within_its_bound(worker) -> None:
    w = worker(store_cls=HeldDisk, delivery_timeout_s=0.05)
    w.admit("a", 4)
    w.step([started("a")], [("a", [1], 0, 4)])  # abandoned, still on the disk
    w.admit("b", 8)  # open: its lock is held
    stopped = threading.Thread(target=w.delivery.shutdown, daemon=True)
    stopped.start()
    stopped.join(0.3)
    assert stopped.is_alive(), "shutdown must wait for the write still on the disk"
    w.store.gate.set()
    stopped.join(JOIN_S)
    assert not stopped.is_alive()
    assert _lock_is_free(w.path("a")) and os.path.exists(w.path("a") + ".error") and _lock_is_free(w.path("b"))
    assert claim_holder(w.settings.delivery_dir) is None, "every write is done: the directory is given up"
    w.assert_every_step_consumed_once()


def test_shutdown_on_a_stuck_disk_gives_up_after_its_bound(worker) -> None:
    w = worker(store_cls=HeldDisk, delivery_timeout_s=0.05)
    w.admit("a", 4)
    w.step([started("a")], [("a", [1], 0, 4)])
    stopped = threading.Thread(target=lambda: w.delivery.shutdown(timeout_s=0.1), daemon=True)
    stopped.start()
    stopped.join(JOIN_S / 2)
    stuck = stopped.is_alive()
    still_claimed = claim_holder(w.settings.delivery_dir)
    w.store.gate.set()  # let the writer go, whatever happened
    assert not stuck, "shutdown waited past its bound for a stuck disk"
    # the stuck write may still publish into the directory: no other server may take it meanwhile
    assert still_claimed == str(os.getpid()), "a write still running, yet the directory was given up"


def test_fail_all_fails_every_open_delivery_and_every_later_one(worker) -> None:
    w = worker()
    w.admit("a", 8)
    w.admit("b", 8)
    w.step([started("a"), started("b")], [("a", [1, 2], 0, 4), ("b", [3, 4], 0, 4)])
    w.delivery.fail_all("the cache failed for good: a save failed")
    results = w.results()
    assert set(results) == {"a", "b"}
    for req in ("a", "b"):
        assert "the cache failed for good" in results[req].error and _lock_is_free(w.path(req))
    w.admit("c", 4)
    assert "the cache failed for good" in w.results()["c"].error
    assert not os.path.exists(w.path("c") + ".lock")  # no lock taken for a delivery that cannot happen
    for i in range(5):  # nothing is kept for a refused delivery: the worker holds no request
        w.admit(f"later-{i}", 4)
    assert w.delivery.num_open == 0
    w.assert_every_step_consumed_once()


def test_two_requests_given_one_path_never_block_the_engine_thread(worker) -> None:
    """Two clients ask for the same custom path in one step (both pass the scheduler's check: no
    lock exists yet). The worker must not wait on the first one's lock -- it is released only when
    that file is written, by this same thread: the engine would hang for good."""
    w = worker()
    path = os.path.join(w.settings.delivery_dir, "shared.safetensors")
    targets = tuple(DeliveryTarget(req, path, None, 4, False) for req in ("a", "b"))
    admitted = threading.Thread(
        target=lambda: w.delivery.begin_step(DeliveryPlan(targets=targets), {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}),
        daemon=True)
    admitted.start()
    admitted.join(5)
    assert not admitted.is_alive(), "the engine thread is stuck on another request's lock file"
    assert "cannot create the lock file" in w.results()["b"].error
    rows = w.step([started("a")], [("a", [1], 0, 4)])
    _assert_file(path, rows, [1, 2, 3, 4])
    assert w.results()["a"].error is None


# --------------------------------------------------------------------------- bounded directory
def test_a_prompt_only_file_is_held_from_retention_until_its_request_ended(worker) -> None:
    """Written when its prompt completes, named to its client when the request ends: its file is held
    (``DeliveryStore.hold``) until the scheduler's plan says the request ended (``told``); a failed
    write holds nothing, and an include_output_tokens file (written after its output) is never held."""
    w = worker()
    w.admit("a", 4)
    w.step([started("a")], [("a", [1], 0, 4)])
    assert w.results()["a"].path == w.path("a") and w.store.num_held == 1
    w.delivery.begin_step(DeliveryPlan(told=("a",)), {})
    assert w.store.num_held == 0 and os.path.exists(w.path("a"))
    w.admit("b", 4, include=True)
    w.step([started("b")], [("b", [2], 0, 4)])
    w.delivery.begin_step(DeliveryPlan(finished=(("b", tuple(w.ids["b"])),)), {})
    w.delivery.finish_step()
    assert w.results()["b"].path == w.path("b") and w.store.num_held == 0


def test_a_failed_write_holds_nothing(worker) -> None:
    w = worker(store_cls=FullDisk)
    w.admit("failed", 4)
    w.step([started("failed")], [("failed", [1], 0, 4)])
    assert w.results()["failed"].error and w.store.num_held == 0


def test_failed_and_dropped_deliveries_leave_nothing_retention_does_not_remove(worker, monkeypatch) -> None:
    clock = SimpleNamespace(now=1_000_000.0)
    monkeypatch.setattr(delivery_files, "time", SimpleNamespace(time=lambda: clock.now))
    w = worker(store_cls=FullDisk, delivery_max_age_s=60)
    w.admit("failed", 4)
    w.step([started("failed")], [("failed", [1], 0, 4)])
    assert w.results()["failed"].error
    w.admit("dropped", 8)  # e.g. aborted after its first chunk
    w.step([started("dropped")], [("dropped", [2, 3], 0, 4)])
    assert not _lock_is_free(w.path("dropped"))
    w.delivery.begin_step(DeliveryPlan(dropped=("dropped",)), {})
    assert not os.path.lexists(w.path("dropped") + ".lock"), "no client was told this path: its lock goes at once"
    assert os.listdir(w.settings.delivery_dir), "the failures left their notes (for a while)"
    clock.now += 61
    w.store.enforce()
    assert os.listdir(w.settings.delivery_dir) == [CLAIM_NAME]  # the store's own claim on it stays
    w.assert_every_step_consumed_once()
