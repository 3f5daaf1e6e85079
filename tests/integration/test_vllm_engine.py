"""The cache inside a real vLLM CPU engine (marker ``vllm``; one engine per module).

A tiny dummy-weight Llama runs in this process with ``OmniCPUWorker``
installed through vLLM's ``worker_cls``; ``VllmSimulation`` drives planned
requests, a consumer thread materializes every step id, and checks (a)
bit-exact served rows, (b) full prompts against a recomputation and (c)
exactly-once step ids. Here: the miss/hit round trip, a mixed workload
(chunked prefill, a repeat, aborts) against the recomputation, preemption and
resume, and that the checks fail when the cache serves a wrong or short
output. Gate refusals on real configs are in ``test_vllm_gate.py``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest
import torch
from vllm_support import require_vllm, shutdown_llm, small_llm

from omni_cache.cli import main
from omni_cache.harness.vllm_engine.engine import DEFAULT_TOLERANCE, VllmSimConfig, VllmSimulation
from omni_cache.harness.vllm_engine.truth import IMMEDIATE_KEY
from omni_cache.harness.vllm_engine.workload import PRESETS, PlannedRequest, plan_requests
from omni_cache.integration.adapter import PrefixCacheSchedulerAdapter
from omni_cache.integration.runner_hooks import PrefixCacheRunnerHooks
from omni_cache.runtime.events import PrefixCacheEventKind

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm():
    require_vllm()
    engine = small_llm(kv_blocks=24)
    yield engine
    shutdown_llm(engine)


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def _run(llm, plan: list[PlannedRequest]) -> tuple[VllmSimulation, object]:
    sim = VllmSimulation(VllmSimConfig(preset="pressure"), plan=plan)
    return sim, sim.run(llm)


def _round_trip_plan() -> list[PlannedRequest]:
    a = _tokens(1, 100)
    b = a[:64] + _tokens(2, 30)
    return [PlannedRequest("A", tuple(a), 4, 0), PlannedRequest("B", tuple(b), 4, 6)]


def test_miss_then_hit_round_trip_is_bit_exact(llm) -> None:
    sim, res = _run(llm, _round_trip_plan())
    assert res.ok, [str(m) for m in res.mismatches]
    assert res.hit_tokens == 64 and res.served_from_cache == 64
    a, b = sim._internal["A"], sim._internal["B"]
    served, computed = sim.capture.prompt_rows, sim.capture.forward_rows
    # B never computed positions [0, 64): the next stage got them from the cache, A's rows bit for bit.
    assert not any(p in computed[b] for p in range(64))
    for p in range(64):
        assert torch.equal(served[b][p], computed[a][p]), p
    for p in range(64, 94):
        assert torch.equal(served[b][p], computed[b][p]), p
    assert res.rows_verified >= (100 + 4 + 94 + 4) * 3  # hidden + 2 per-token keys, both requests
    assert res.published == res.consumed > 0 and res.double_consume_refused and not res.unconsumed


def test_check_a_names_a_wrong_hit_row(llm, monkeypatch) -> None:
    real = PrefixCacheRunnerHooks.materialize

    def corrupt(self, step_id):
        out = real(self, step_id)
        for rid, rows in out.hidden_states.items():
            if rows.shape[0] == 94:  # B's first output: 64 hit rows + 30 computed
                rows = rows.clone()
                rows[5, 0] += 1.0
                out.hidden_states[rid] = rows
        return out

    monkeypatch.setattr(PrefixCacheRunnerHooks, "materialize", corrupt)
    sim, res = _run(llm, _round_trip_plan())
    assert not res.ok
    first = res.mismatches[0]
    assert (first.req_id, first.key, first.position) == (sim._internal["B"], "hidden", 5)
    assert "differs from the forward" in first.detail and first.step is not None


def test_mixed_workload_matches_recomputation(llm) -> None:
    plan = plan_requests(PRESETS["mixed"], seed=3, requests=9)
    sim, res = _run(llm, plan)
    assert res.ok, [str(m) for m in res.mismatches]
    assert res.finished >= 6 and res.aborted == 2
    assert res.hit_tokens > 0 and res.served_from_cache > 0 and res.chunked_prefills > 0
    assert res.recompute_requests == res.finished and res.recompute_rows == sum(
        len(r.prompt) for r in sim._finished)
    assert res.recompute_max_rel_diff <= DEFAULT_TOLERANCE
    assert IMMEDIATE_KEY  # per-token keys are checked with hidden in rows_verified
    assert res.rows_verified > 3 * res.recompute_rows


def _pressure_plan() -> list[PlannedRequest]:
    return plan_requests(PRESETS["pressure"], seed=0, requests=9)


def test_preemption_resume_and_abort(llm) -> None:
    _, res = _run(llm, _pressure_plan())
    assert res.ok, [str(m) for m in res.mismatches]
    assert res.preemptions > 0 and res.aborted == 1
    assert res.served_from_cache > 0 and res.rows_verified > 0
    assert res.published == res.consumed and not res.unconsumed


def test_a_resume_served_without_its_prefix_is_caught(llm, monkeypatch) -> None:
    """The Model Runner V2 failure mode: a resumed request translated as EXTENDED (no hit)."""
    real = PrefixCacheSchedulerAdapter._translate  # what translate_step and translate_scheduler_output share

    def forget_resumes(self, so):
        events, state = real(self, so)
        return tuple(
            dataclasses.replace(e, kind=PrefixCacheEventKind.EXTENDED, hit_end=0)
            if e.kind is PrefixCacheEventKind.RESUMED else e
            for e in events
        ), state

    monkeypatch.setattr(PrefixCacheSchedulerAdapter, "_translate", forget_resumes)
    _, res = _run(llm, _pressure_plan())
    assert not res.ok
    assert any("new or resumed" in m.detail and m.req_id for m in res.mismatches), [str(m) for m in res.mismatches[:3]]


def test_the_cli_reports_json_and_names_a_mismatch(llm, monkeypatch, capsys) -> None:
    real_run = VllmSimulation.run
    monkeypatch.setattr(VllmSimulation, "run", lambda self, _llm=None: real_run(self, llm))
    # --num-blocks 24: this module's engine (a run refuses an engine with other KV blocks than it asks for).
    assert main(["simulate", "--engine", "vllm", "--requests", "4", "--seed", "2", "--num-blocks", "24", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["engine"] == "vllm" and summary["vllm_version"] == "0.32.0"
    assert summary["rows_verified"] > 0 and summary["checks"]["c_step_ids"]["unconsumed_at_shutdown"] == 0
    assert {"hit_tokens", "preemptions", "mismatches", "num_mismatches"} <= set(summary)
    (rank,) = summary["ranks"]  # one worker, the engine in this process: it is the output rank
    assert rank["output_rank"] and rank["holds_cache"] and rank["host_bytes"] == rank["pool_bytes"] + rank["staging_bytes"] > 0

    real = PrefixCacheRunnerHooks.materialize

    def corrupt(self, step_id):
        out = real(self, step_id)
        for rid, rows in out.hidden_states.items():
            out.hidden_states[rid] = rows + 1.0
        return out

    monkeypatch.setattr(PrefixCacheRunnerHooks, "materialize", corrupt)
    assert main(["simulate", "--engine", "vllm", "--requests", "4", "--seed", "2", "--num-blocks", "24"]) == 1
    text = capsys.readouterr().out
    assert "FAILED" in text and "Mismatches" in text
    assert re.search(r"step \d+ \(step id \d+\), request \S+, key hidden, position \d+: row differs", text), text[-800:]


def test_an_engine_with_other_kv_blocks_than_asked_runs_nothing_and_is_incomplete(llm) -> None:
    # This module's engine has 24 KV blocks; the mixed preset asks for 48 (its preemptions depend on them).
    res = VllmSimulation(VllmSimConfig(preset="mixed", requests=2)).run(llm)
    assert res.ok and res.kv_blocks_engine == 24 and res.requests_created == 0 and res.published == 0
    assert len(res.incomplete) == 1 and "got 24 KV blocks, the run asked for 48" in res.incomplete[0]


def test_a_run_cut_by_the_steps_limit_is_incomplete_not_failed(llm, monkeypatch, capsys) -> None:
    """``--steps-limit`` cuts the run: what is still running is aborted (the engine ends idle), the
    finished requests are checked as usual, and the run exits 3 (0 with ``--allow-incomplete``), never
    1 with the cut reported as a mismatch."""
    real_run = VllmSimulation.run
    monkeypatch.setattr(VllmSimulation, "run", lambda self, _llm=None: real_run(self, llm))
    argv = ["simulate", "--engine", "vllm", "--requests", "4", "--seed", "2", "--num-blocks", "24", "--steps-limit", "5"]
    assert main([*argv, "--json"]) == 3
    summary = json.loads(capsys.readouterr().out)
    assert not summary["ok"] and summary["num_mismatches"] == 0, summary["mismatches"]
    assert any(r.startswith("--steps-limit 5 stopped the run after 5 engine steps") for r in summary["incomplete"])
    assert summary["checks"]["c_step_ids"]["unconsumed_at_shutdown"] == 0
    assert not llm.llm_engine.has_unfinished_requests()
    assert main([*argv, "--allow-incomplete"]) == 0
    text = capsys.readouterr().out
    assert "INCOMPLETE" in text and "Mismatches" not in text  # no empty error header under an incomplete run
