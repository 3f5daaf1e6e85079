"""End to end: a miniature vLLM engine drives PrefixCacheRunnerHooks over many steps.

A prefix-caching scheduler (``fakes_vllm_engine.FakeScheduler``) and a model
runner that calls the hooks where vLLM's GPU model runner would run a scripted
workload with prefix hits, chunked prefill, decode, finish, abort, preemption
and resume, and KV block reuse (few blocks, LRU). Every materialized output is
checked against ground truth -- hidden rows and per-token mm rows are a
deterministic function of (the request's prompt, position):

* the first step that schedules a request with a hit returns rows ``[0, end)``
  (cached prefix then this step's rows: I6, I7, I9 when the prefix came from an
  aborted or finished request whose blocks were reused since);
* every other step returns exactly its rows ``[start, end)`` (I4);
* leftover mm comes back as-is to every request of its step.

Run eagerly and with the committer thread, with the output path consuming each
step right away or one step late (an async output builder), and with the mm key
written on the next step or deferred to finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from fakes_vllm import SchedulerConfig, SchedulerOutput, VllmConfig, kv_cache_config, truth_codes, truth_rows
from fakes_vllm_engine import FakeModelRunner, FakeScheduler

from omni_cache import StageCacheOutputs
from omni_cache.integration import PrefixCacheRunnerHooks

BS = 4
MM = "audio.codes"
SHARED = list(range(100, 113))  # 13 tokens: 3 full blocks shared


class Model:
    def __init__(self, deferred: bool) -> None:
        self.requires_full_prefix_cached_hidden_states = True
        self.deferred_prefix_cache_mm_keys = {MM} if deferred else set()


@dataclass
class Expect:
    prompt: list[int]
    start: int  # first position returned by materialize
    end: int


@dataclass
class Engine:
    sched: FakeScheduler
    runner: FakeModelRunner
    hooks: PrefixCacheRunnerHooks
    lag: int
    prompts: dict[str, list[int]] = field(default_factory=dict)
    pending: list[tuple[int, dict[str, Expect], tuple[str, ...]]] = field(default_factory=list)
    checked_rows: int = 0
    prefix_rows: int = 0

    def expectations(self, so: SchedulerOutput) -> dict[str, Expect]:
        out: dict[str, Expect] = {}
        for new in so.scheduled_new_reqs:
            c = new.num_computed_tokens
            out[new.req_id] = Expect(self.prompts[new.req_id], 0, c + so.num_scheduled_tokens[new.req_id])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            c = cached.num_computed_tokens[i]
            first = 0 if req_id in cached.resumed_req_ids else c
            out[req_id] = Expect(self.prompts[req_id], first, c + so.num_scheduled_tokens[req_id])
        return out

    def step(self, *, add=(), abort=(), preempt=()) -> SchedulerOutput:
        for req_id, prompt, max_tokens in add:
            self.prompts[req_id] = prompt
            self.sched.add_request(req_id, prompt, max_tokens)
        for req_id in abort:
            self.sched.abort(req_id)
        so = self.sched.schedule(preempt=preempt)
        expect = self.expectations(so)
        step_id = self.runner.execute_model(so)
        if step_id is not None:
            batch = self.runner.input_batch.req_ids[: self.runner.input_batch.num_reqs]
            self.pending.append((step_id, expect, tuple(r for r in batch if so.num_scheduled_tokens.get(r))))
        while len(self.pending) > self.lag:
            self.consume(*self.pending.pop(0))
        self.sched.update_from_output(so)
        return so

    def drain(self) -> None:
        while self.pending:
            self.consume(*self.pending.pop(0))

    def consume(self, step_id: int, expect: dict[str, Expect], order: tuple[str, ...]) -> None:
        assert self.hooks.save_time_req_ids(step_id) == order  # batch order, not scheduler order
        out = self.hooks.materialize(step_id)
        assert self.hooks.save_time_req_ids(step_id) is None
        assert isinstance(out, StageCacheOutputs) and out.hidden_states is not None
        assert set(out.hidden_states) == set(expect) == set(out.mm_outputs[MM])
        for req_id, e in expect.items():
            torch.testing.assert_close(out.hidden_states[req_id], truth_rows(e.prompt, e.start, e.end))
            torch.testing.assert_close(out.mm_outputs[MM][req_id], truth_codes(e.prompt, e.start, e.end))
            assert out.mm_outputs["meta.batch_size"][req_id] == [len(order)]
            self.checked_rows += e.end - e.start


def make_engine(
    *, eager: bool, lag: int, deferred: bool, num_blocks: int = 24, budget: int = 16, report_aborts: bool = True
) -> Engine:
    sched = FakeScheduler(
        num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=budget, report_aborts=report_aborts
    )
    hooks = PrefixCacheRunnerHooks(is_last_pp_rank=True, eager=eager)
    hooks.on_model_loaded(Model(deferred))
    vllm_config = VllmConfig(scheduler_config=SchedulerConfig(max_num_batched_tokens=budget))
    cfg = hooks.on_kv_cache_initialized(vllm_config, kv_cache_config(num_blocks, BS))
    assert cfg is not None and (cfg.num_slots, cfg.staging_capacity_tokens) == (num_blocks * BS, budget)
    runner = FakeModelRunner(hooks, block_size=BS, mm_key=MM)
    return Engine(sched, runner, hooks, lag)


def _hits(so: SchedulerOutput) -> dict[str, int]:
    cached = so.scheduled_cached_reqs
    hits = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
    hits.update(
        {r: cached.num_computed_tokens[i] for i, r in enumerate(cached.req_ids) if r in cached.resumed_req_ids}
    )
    return hits


@pytest.mark.parametrize(
    ("eager", "lag", "deferred", "report_aborts"),
    [(True, 0, False, True), (True, 1, True, True), (False, 1, False, False), (False, 0, True, True)],
    ids=["eager-now", "eager-late-deferred", "async-late-vanilla-so", "async-now-deferred"],
)
def test_hooks_drive_many_steps_against_ground_truth(
    eager: bool, lag: int, deferred: bool, report_aborts: bool
) -> None:
    eng = make_engine(eager=eager, lag=lag, deferred=deferred, report_aborts=report_aborts)
    sched = eng.sched
    # A: 20-token prompt (3 full blocks of SHARED), prefilled in two chunks; B joins in step 2
    assert _hits(eng.step(add=[("A", [*SHARED, 1, 2, 3, 4, 5, 6, 7], 6), ("B", [7] * 9, 8)])) == {"A": 0}
    assert _hits(eng.step()) == {"B": 0}
    # C shares A's 3 full blocks: a 12-token hit on rows A wrote in steps 1-2
    assert _hits(eng.step(add=[("C", [*SHARED, 9, 9, 9, 9, 9, 9], 2)])) == {"C": 12}
    # D shares B's first 2 blocks (B still running), then B is aborted mid-decode
    assert _hits(eng.step(add=[("D", [7] * 9 + [8, 8], 2)])) == {"D": 8}
    so = eng.step(abort=["B"])
    assert "B" in so.finished_req_ids
    assert getattr(so, "aborted_req_ids", None) == ({"B"} if report_aborts else None)
    # A is preempted (not scheduled this step) and resumes with a hit on its own cached blocks
    so = eng.step(preempt=["A"])
    assert "A" not in so.num_scheduled_tokens
    assert _hits(eng.step()) == {"A": 20}
    # E reuses the aborted B's prefix: its rows still landed (I9)
    assert _hits(eng.step(add=[("E", [7] * 9 + [5], 1)])) == {"E": 8}
    for _ in range(3):
        eng.step()
    # churn: unrelated requests reuse the free cached blocks (slot reuse is the eviction) ...
    for i in range(3):
        eng.step(add=[(f"F{i}", [200 + i] * 23, 1)])
    for _ in range(4):
        eng.step()
    # ... so SHARED now only hits its first 2 blocks: the third was reused by F2 (I7)
    assert _hits(eng.step(add=[("G", [*SHARED, 4, 4, 4], 1)])) == {"G": 8}
    for _ in range(2):
        eng.step()
    eng.drain()
    assert not sched.requests, f"requests left running: {sorted(sched.requests)}"
    stats = eng.hooks.manager.stats()
    assert (stats["hits"], stats["hit_tokens"]) == (5, 56)
    assert stats["materialized"] == stats["saved"] >= 12
    assert eng.hooks.shutdown() == {}
    assert eng.checked_rows >= 180


@pytest.mark.parametrize(("eager", "lag", "deferred"), [(True, 0, False), (False, 1, True)], ids=["eager", "async-late"])
def test_same_step_hit_on_blocks_written_by_another_request_of_the_step(
    eager: bool, lag: int, deferred: bool
) -> None:
    # vLLM publishes block hashes at allocation, so two requests sharing a prefix admitted in
    # one step (e.g. n>1 sampling) give the second a hit on blocks the first computes in the
    # same forward. Found by this test; the manager now plans hits after the step's writes.
    eng = make_engine(eager=eager, lag=lag, deferred=deferred, budget=40)
    so = eng.step(add=[("A", [*SHARED, 1, 2], 2), ("B", [*SHARED, 3, 3], 2)])
    assert _hits(so) == {"A": 0, "B": 12}
    for _ in range(2):
        eng.step()
    eng.drain()
    assert eng.checked_rows == 15 + 15 + 1 + 1  # B's first step: 12 prefix rows + 3 of its own
    assert eng.hooks.shutdown() == {}
