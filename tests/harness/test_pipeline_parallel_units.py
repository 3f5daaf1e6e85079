"""The driver half of ``pipeline --tp/--pp`` and the workers' tap, on stand-in workers (no vLLM).

``ParallelThinkerStage`` is driven here through a stand-in ``LLM`` whose
``collective_rpc`` answers as the worker functions would on each rank: what the
output rank served becomes the next stage's rows and goes through check (a); a
materialize error on any rank, a step id consumed twice or never, a cache on a
rank that is not the output rank, or a count the workers disagree on is a
finding, never a silent pass. ``worker_stage``'s tap reads prompt rows from the
forward on the output rank only and gives the runner its own methods back. The
real worker processes run in ``tests/integration/test_vllm_pipeline_parallel.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omni_cache.harness.pipeline import worker_stage
from omni_cache.harness.pipeline.parallel import ParallelThinkerStage
from omni_cache.harness.vllm_engine import worker_probe

TP, PP = 2, 1
OUTPUT = 0  # TP rank 0 of the last (only) stage


class StubCapture:
    """Check (a)'s stand-in: notes what it was given."""

    def __init__(self) -> None:
        self.observed: list[Any] = []
        self.checked: list[tuple[int, int]] = []
        self.mismatches: list[Any] = []

    def observe(self, rec: Any) -> None:
        self.observed.append(rec)

    def check_step(self, engine_step: int, step_id: int, spans: Any, served: Any) -> None:
        self.checked.append((engine_step, step_id))


class StubLLM:
    """``collective_rpc(fn)`` -> ``replies[fn]``: one reply per rank."""

    def __init__(self, replies: dict[Any, list[Any]]) -> None:
        self.replies = replies
        self.calls: list[str] = []
        self.llm_engine = SimpleNamespace(reset_prefix_cache=lambda: True)

    def collective_rpc(self, fn: Any) -> list[Any]:
        self.calls.append(fn.__name__)
        return self.replies[fn]


def _drained(served: list[Any] = (), errors: list[Any] = (), records: list[Any] = ()) -> dict[str, Any]:
    return {"served": list(served), "errors": list(errors), "records": list(records)}


def _final(published: list[int], consumed: dict[int, int], *, holds: bool, refused: bool = True) -> dict[str, Any]:
    return {**_drained(), "published": published, "consumed": consumed, "double_consume_refused": refused,
            "unconsumed": {}, "rank": {"holds_cache": holds, "host_bytes": 100 if holds else 0}}


def _stage(replies: dict[Any, list[Any]]) -> tuple[ParallelThinkerStage, StubLLM]:
    llm = StubLLM({worker_stage.attach: [{"kv_groups": 1, "num_blocks": 48}] * TP, **replies})
    stage = ParallelThinkerStage(llm, cached=True, tp=TP, pp=PP)
    stage.capture = StubCapture()  # type: ignore[assignment]
    stage.prompt_len = {"r": 3}
    return stage, llm


def _served_step(step_id: int, rows: torch.Tensor) -> tuple[int, int, tuple[tuple[str, int, int], ...], Any]:
    return (step_id, step_id, (("r", 0, rows.shape[0]),), SimpleNamespace(hidden_states={"r": rows}))


def test_the_output_ranks_served_rows_become_the_prompt_rows_and_are_checked() -> None:
    rows = torch.arange(9, dtype=torch.float32).reshape(3, 3)
    rec = SimpleNamespace(spans=(("r", 0, 3),))
    stage, llm = _stage({worker_probe.settle: [_drained([_served_step(7, rows)], records=[rec]), _drained()],
                         worker_stage.detach: [{"forward_s": 0.5, "steps": 1}, {}],
                         worker_probe.finish: [_final([7], {7: 1}, holds=True), _final([], {}, holds=False)]})
    stage.internal = {"n": "r"}
    stage._handoff()
    assert torch.equal(stage.prompt_rows("n"), rows) and stage.prefill_tokens == 3
    assert stage.capture.checked == [(7, 7)] and stage.capture.observed == [rec]  # type: ignore[attr-defined]
    stage.finish()
    assert stage.mismatches == [] and stage.double_materialize_refused and stage.kv_blocks_engine == 48
    assert stage.timers.forward_s == 0.5 and stage.timers.steps == 1
    assert llm.calls[-2:] == ["finish", "detach"]  # the runner's own forward back after each run
    assert [r["holds_cache"] for r in stage.ranks] == [True, False]


@pytest.mark.parametrize(("finals", "says"), [
    ([_final([7], {7: 2}, holds=True), _final([], {}, holds=False)], "step ids consumed twice: [7]"),
    ([_final([7, 8], {7: 1}, holds=True), _final([], {}, holds=False)], "step ids never consumed: [8]"),
    ([_final([7], {7: 1}, holds=True, refused=False), _final([], {}, holds=False)],
     "a second materialize of a consumed step id was not refused"),
    ([_final([7], {7: 1}, holds=True), _final([], {}, holds=True)],
     "the cache must live on the output rank 0 only; ranks that held one: [0, 1]"),
    ([_final([7, 9], {7: 1, 9: 1}, holds=True), _final([], {}, holds=False)],
     "the output rank published 2 step ids, 1 were served here"),
])
def test_what_the_workers_final_reports_break_is_a_finding(finals: list[Any], says: str) -> None:
    stage, _ = _stage({worker_probe.settle: [_drained([_served_step(7, torch.ones(3, 3))]), _drained()],
                       worker_stage.detach: [{}, {}], worker_probe.finish: finals})
    stage._handoff()
    stage.finish()
    assert any(says in str(m) for m in stage.mismatches), [str(m) for m in stage.mismatches]


def test_a_materialize_error_on_any_rank_is_a_finding_and_its_rows_are_never_received() -> None:
    stage, _ = _stage({worker_probe.settle: [_drained(errors=[(3, 7, "OmniPrefixCacheUnmatchError: not readable")]),
                                             _drained(errors=[(3, 7, "RuntimeError: boom")])]})
    stage.internal = {"n": "r"}
    stage._handoff()
    assert [str(m) for m in stage.mismatches] and all("materialize raised" in str(m) for m in stage.mismatches)
    assert {"rank 0" in str(stage.mismatches[0]), "rank 1" in str(stage.mismatches[1])} == {True}
    assert stage.published == 1 and stage.materialized == 0
    with pytest.raises(Exception, match="never received prompt rows"):
        stage.prompt_rows("n")


def test_the_workers_gone_at_the_end_is_a_finding() -> None:
    stage, llm = _stage({})

    def gone(fn: Any) -> list[Any]:
        raise ConnectionError("worker died")

    llm.collective_rpc = gone  # type: ignore[method-assign]
    stage.finish()
    assert any("the workers' final report failed (ConnectionError: worker died)" in str(m) for m in stage.mismatches)


# ---- the truth thinker: the tap on the output rank ------------------------------------------
class StubRunner:
    """What ``ForwardTap`` wraps and reads: ``execute_model``, ``_model_forward``, the input batch."""

    def __init__(self) -> None:
        self.requests = {"r": SimpleNamespace(num_prompt_tokens=3)}
        self.input_batch = SimpleNamespace(req_ids=["r"], num_computed_tokens_cpu=torch.tensor([0]))

    def execute_model(self, scheduler_output: Any, *args: Any) -> Any:
        return self._model_forward()

    def _model_forward(self) -> torch.Tensor:
        return torch.arange(12, dtype=torch.float32).reshape(4, 3)


def test_the_tap_reads_prompt_rows_on_the_output_rank_only_and_gives_the_methods_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import omni_cache.integration.vllm_worker as vllm_worker
    from omni_cache.integration.block_table import BlockTableView
    from omni_cache.integration.ranks import WorkerRank

    monkeypatch.setattr(vllm_worker, "allocate_intermediate_tensors", lambda runner: False)
    monkeypatch.setattr(BlockTableView, "from_input_batch",
                        staticmethod(lambda batch, block_size: SimpleNamespace(req_ids=batch.req_ids,
                                                                               num_computed_tokens=[0])))
    other = SimpleNamespace(model_runner=StubRunner())
    monkeypatch.setattr(worker_stage, "vllm_worker_rank", lambda: WorkerRank(1, 2, 0, 1))
    assert worker_stage.install_tap(other)["output_rank"] is False
    assert worker_stage.drain_tap(other) == {"rows": {}, "computed": 0}

    monkeypatch.setattr(worker_stage, "vllm_worker_rank", lambda: WorkerRank(0, 2, 0, 1))
    out = SimpleNamespace(model_runner=StubRunner())
    assert worker_stage.install_tap(out)["output_rank"] is True
    with pytest.raises(RuntimeError, match="already installed"):
        worker_stage.install_tap(out)
    out.model_runner.execute_model(SimpleNamespace(num_scheduled_tokens={"r": 4}))  # 3 prompt + 1 decode row
    drained = worker_stage.drain_tap(out)
    assert drained["computed"] == 3 and sorted(drained["rows"]["r"]) == [0, 1, 2]
    assert torch.equal(drained["rows"]["r"][2], torch.tensor([6.0, 7.0, 8.0]))
    assert worker_stage.drain_tap(out)["rows"] == {}  # handed over once
    final = worker_stage.remove_tap(out)
    assert final["timers"]["steps"] == 1 and "execute_model" not in vars(out.model_runner)
    assert "_model_forward" not in vars(out.model_runner) and worker_stage.drain_tap(out)["computed"] == 0


def test_the_driver_merges_the_tapped_rows_and_takes_the_computed_count() -> None:
    llm = StubLLM({worker_stage.install_tap: [{"output_rank": True}, {"output_rank": False}]})
    stage = ParallelThinkerStage(llm, cached=False, tp=TP, pp=PP)
    stage.internal, stage.prompt_len = {"n": "r"}, {"r": 2}
    stage._take_tapped({"rows": {"r": {0: torch.zeros(3)}}, "computed": 1})
    stage._take_tapped({"rows": {"r": {1: torch.ones(3)}}, "computed": 2})
    assert torch.equal(stage.prompt_rows("n"), torch.stack([torch.zeros(3), torch.ones(3)]))
    assert stage.prefill_tokens == 2
