"""The simulated scheduler: token budget, chunked prefill, preemption/resume, finish, abort."""

from __future__ import annotations

from omni_cache.harness.sim_engine.allocator import BlockAllocator
from omni_cache.harness.sim_engine.request import RequestStatus, SimRequest
from omni_cache.harness.sim_engine.scheduler import Scheduler, SchedulerOutput
from omni_cache.runtime.events import PrefixCacheEventKind as K


def _sched(num_blocks: int = 64, bs: int = 4, budget: int = 8, publish: str = "schedule") -> Scheduler:
    return Scheduler(BlockAllocator(num_blocks, bs), max_num_batched_tokens=budget, publish=publish)


def _req(rid: str, prompt: list[int], max_tokens: int, bs: int = 4, abort_at: int | None = None) -> SimRequest:
    return SimRequest(rid, prompt, max_tokens=max_tokens, block_size=bs, abort_at_step=abort_at)


def _step(s: Scheduler, step: int) -> SchedulerOutput:
    out = s.schedule(step)
    s.update_from_output(out)
    s.allocator.check()
    return out


def _spans(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.req.req_id, c.token_start, c.token_end) for c in out.chunks]


def test_budget_chunks_long_prefills_and_mixes_decodes() -> None:
    s = _sched(budget=8)
    a = _req("a", list(range(100, 120)), 3)
    s.add_request(a)
    assert _spans(_step(s, 0)) == [("a", 0, 8)]  # chunked prefill
    assert a.output == []  # nothing sampled mid-prefill
    s.add_request(_req("b", list(range(200, 206)), 2))
    out = _step(s, 1)
    assert _spans(out) == [("a", 8, 16)]  # running first, the budget is spent
    out = _step(s, 2)
    assert _spans(out) == [("a", 16, 20), ("b", 0, 4)]  # the prefill's tail + a new prefill chunk
    assert len(a.output) == 1  # the last prefill chunk samples the first token
    out = _step(s, 3)
    assert _spans(out) == [("a", 20, 21), ("b", 4, 6)]  # a decode beside b's last chunk
    for step in range(4, 12):
        out = _step(s, step)
        assert out.num_tokens <= 8
    assert s.stats.chunked_prefills >= 3
    assert not s.has_unfinished


def test_finish_is_reported_next_step_before_new_starts_and_frees_blocks() -> None:
    s = _sched(budget=16)
    s.add_request(_req("a", [1, 2, 3, 4, 5], 1))
    out0 = _step(s, 0)
    assert [(r.req_id, k) for r, k, _ in out0.started] == [("a", K.STARTED)]
    assert s.requests["a"].status == RequestStatus.FINISHED
    assert s.allocator.num_free_blocks == 64
    s.add_request(_req("b", [1, 2, 3, 4, 9], 1))
    out1 = _step(s, 1)
    assert [(r.req_id, k) for r, k in out1.terminal] == [("a", K.FINISHED)]
    # b hits a's first block: freed, but still cached.
    assert [(r.req_id, k, hit) for r, k, hit in out1.started] == [("b", K.STARTED, 4)]
    assert _spans(out1) == [("b", 4, 5)]
    assert s.allocator.stats.hits == 4


def test_same_step_hit_only_when_blocks_publish_at_schedule() -> None:
    for publish, hit in (("schedule", 8), ("forward", 0)):
        s = _sched(budget=32, publish=publish)
        prompt = list(range(10, 18))
        s.add_request(_req("a", [*prompt, 1], 2))
        s.add_request(_req("b", [*prompt, 2], 2))
        out = _step(s, 0)
        assert [(r.req_id, h) for r, _, h in out.started] == [("a", 0), ("b", hit)]
        assert s.stats.same_step_hits == (1 if hit else 0)
        assert _spans(out) == [("a", 0, 9), ("b", hit, 9)]


def test_preemption_under_block_pressure_then_resume_with_the_hit_found_again() -> None:
    s = _sched(num_blocks=6, bs=4, budget=32)
    a = _req("a", list(range(100, 108)), 10)
    b = _req("b", list(range(200, 208)), 10)
    s.add_request(a)
    s.add_request(b)
    _step(s, 0)  # both prefilled: 2 blocks each, 2 free
    preempted_at = None
    resumed = None
    for step in range(1, 40):
        out = _step(s, step)
        if out.preempted and preempted_at is None:
            preempted_at = step
            assert out.preempted == [b]  # the last running request is the victim
            assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and not b.block_ids
            assert all(c.req is not b for c in out.chunks)
            assert not out.started  # nothing new starts in a step that preempted
        for r, kind, hit in out.started:
            if r is b:
                resumed = (kind, hit, _spans(out))
        if not s.has_unfinished:
            break
    assert preempted_at is not None and resumed is not None
    kind, hit, spans = resumed
    assert kind == K.RESUMED
    assert hit > 0 and hit % 4 == 0  # its own published blocks are found again
    assert next(sp for sp in spans if sp[0] == "b")[1] == hit  # the resumed step continues the hit
    assert s.stats.preemptions >= 1 and s.stats.resumes >= 1
    assert a.status == b.status == RequestStatus.FINISHED
    assert len(a.output) == len(b.output) == 10


def test_aborts_end_running_and_waiting_requests() -> None:
    s = _sched(budget=8)
    a = _req("a", list(range(30)), 5, abort_at=2)
    w = _req("w", list(range(50, 60)), 5, abort_at=1)
    s.add_request(a)
    s.add_request(w)
    _step(s, 0)
    out1 = _step(s, 1)  # w never started: no event for the cache
    assert out1.terminal == [] and w.status == RequestStatus.ABORTED
    out2 = _step(s, 2)
    assert [(r.req_id, k) for r, k in out2.terminal] == [("a", K.ABORTED)]
    assert a.status == RequestStatus.ABORTED and not a.block_ids
    assert s.allocator.num_free_blocks == 64
    assert s.stats.aborted == 2 and s.stats.aborted_unseen == 1
