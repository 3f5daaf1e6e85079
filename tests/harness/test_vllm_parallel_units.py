"""Pieces of the worker-process ``simulate --engine vllm`` run that need no vLLM:
the rank-agreement comparison of ``--check-ranks``, the per-worker KV bytes,
the grid checks, the KV-block and preemption promises and their exit codes.

The comparison is fed replies shaped as ``worker_probe.drain`` returns them
(served outputs per rank); a TP rank that serves one different bit, a missing
key or a step the output rank never served is named with step, request and key.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from omni_cache.cli import main
from omni_cache.harness.vllm_engine import promises
from omni_cache.harness.vllm_engine.engine import KV_BLOCK_BYTES, VllmSimConfig, VllmSimResult
from omni_cache.harness.vllm_engine.parallel import (
    ParallelVllmSimulation,
    make_simulation,
    parallel_engine_kwargs,
)
from omni_cache.harness.vllm_engine.truth import DEFERRED_KEY, IMMEDIATE_KEY
from omni_cache.runtime.interface import StageCacheOutputs

SPANS = (("a", 0, 3),)


def _served(hidden: torch.Tensor) -> StageCacheOutputs:
    return StageCacheOutputs({"a": hidden}, {IMMEDIATE_KEY: {"a": hidden[:, :2] * 2}, DEFERRED_KEY: {"a": -hidden}})


def _reply(*served: tuple[int, StageCacheOutputs]) -> dict[str, Any]:
    return {"records": [], "errors": [], "served": [(step, step, SPANS, out) for step, out in served]}


class _NoCheckA(ParallelVllmSimulation):
    """Check (a) needs the output rank's forward records; here only the rank comparison is under test."""

    def __init__(self, cfg: VllmSimConfig) -> None:
        super().__init__(cfg)
        self.capture.check_step = lambda *a, **k: None  # type: ignore[method-assign]


def _sim() -> tuple[ParallelVllmSimulation, VllmSimResult]:
    cfg = VllmSimConfig(tp=2, check_ranks=True, requests=2)
    return _NoCheckA(cfg), VllmSimResult(cfg)


def test_equal_ranks_agree_and_every_row_is_compared() -> None:
    sim, res = _sim()
    rows = torch.randn(3, 8)
    # The output rank (0) serves step 2 in a later gather than rank 1: still compared once.
    sim._absorb([_reply((1, _served(rows))), _reply((1, _served(rows.clone())), (2, _served(rows + 1)))], res)
    sim._absorb([_reply((2, _served(rows + 1))), _reply()], res)
    sim._close_ranks(res)
    assert res.ok, [str(m) for m in res.mismatches]
    assert res.rank_rows_compared == 2 * 3 * 3  # 2 steps x 3 rows x (hidden + 2 per-token keys)


def test_one_different_bit_on_a_tp_rank_is_named() -> None:
    sim, res = _sim()
    rows = torch.randn(3, 8)
    other = rows.clone()
    other[1, 4] = torch.nextafter(other[1, 4], torch.tensor(float("inf")))
    sim._absorb([_reply((1, _served(rows))), _reply((1, _served(other)))], res)
    sim._close_ranks(res)
    keys = {(m.step, m.req_id, m.key) for m in res.mismatches}
    assert (1, "a", "hidden") in keys and (1, "a", DEFERRED_KEY) in keys
    assert all("TP rank 1" in m.detail and "values differ" in m.detail for m in res.mismatches)


def test_a_missing_key_or_an_unmatched_step_is_a_finding() -> None:
    sim, res = _sim()
    rows = torch.randn(3, 8)
    short = StageCacheOutputs({"a": rows}, {IMMEDIATE_KEY: {"a": rows[:, :2] * 2}})
    sim._absorb([_reply((1, _served(rows)), (2, _served(rows))), _reply((1, short), (3, _served(rows)))], res)
    sim._close_ranks(res)
    details = [str(m) for m in res.mismatches]
    assert any(DEFERRED_KEY in d and "missing" in d for d in details), details
    assert any(d.startswith("step 2") and "not every other TP rank" in d for d in details), details
    assert any(d.startswith("step 3") for d in details), details


def test_check_ranks_with_nothing_compared_is_not_ok() -> None:
    sim, res = _sim()
    sim._close_ranks(res)
    assert not res.ok and "no rank besides the output rank" in res.mismatches[0].detail


def test_per_worker_kv_bytes_give_the_asked_blocks_per_stage() -> None:
    tp2 = parallel_engine_kwargs(VllmSimConfig(tp=2), "/m", kv_blocks=48, max_batched_tokens=256, max_model_len=512)
    pp2 = parallel_engine_kwargs(VllmSimConfig(pp=2), "/m", kv_blocks=48, max_batched_tokens=256, max_model_len=512)
    # One KV head, replicated over TP ranks: a TP worker holds whole blocks; a PP stage holds half the layers.
    assert tp2["kv_cache_memory_bytes"] == 48 * KV_BLOCK_BYTES and tp2["tensor_parallel_size"] == 2
    assert pp2["kv_cache_memory_bytes"] == 48 * KV_BLOCK_BYTES // 2 and pp2["pipeline_parallel_size"] == 2
    assert tp2["distributed_executor_backend"] == "mp" and "all_tp_ranks" not in tp2["additional_config"]["omni_cache"]
    checked = parallel_engine_kwargs(VllmSimConfig(tp=2, check_ranks=True), "/m", kv_blocks=48,
                                     max_batched_tokens=256, max_model_len=512)
    assert checked["additional_config"]["omni_cache"]["all_tp_ranks"] is True
    assert isinstance(make_simulation(VllmSimConfig(pp=2)), ParallelVllmSimulation)
    assert not isinstance(make_simulation(VllmSimConfig()), ParallelVllmSimulation)


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"tp": 3}, "does not divide"), ({"pp": 3}, "exceeds"), ({"check_ranks": True}, "needs --tp 2"),
    ({"tp": 2, "pp": 0}, "at least 1"),
])
def test_grids_the_model_cannot_run_are_refused(kwargs: dict[str, Any], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        VllmSimConfig(**kwargs)


def test_an_engine_with_other_kv_blocks_is_incomplete() -> None:
    cfg = VllmSimConfig(preset="mixed")
    res = VllmSimResult(cfg)
    assert not promises.kv_block_problem(cfg, 48, res) and res.incomplete == []
    assert promises.kv_block_problem(cfg, 32768, res)
    assert "got 32768 KV blocks" in res.incomplete[0] and "asked for 48" in res.incomplete[0]


@pytest.mark.parametrize("preset", ["mixed", "pressure"])
def test_a_preset_promising_preemptions_is_incomplete_without_them(preset: str) -> None:
    cfg = VllmSimConfig(preset=preset)
    res = VllmSimResult(cfg)
    assert promises.preemption_problem(cfg, res) and "preempted none" in res.incomplete[0]
    res = VllmSimResult(cfg)
    res.preemptions = 1
    assert not promises.preemption_problem(cfg, res) and not res.incomplete
    # Not the preset as promised: other KV blocks, fewer requests, another plan.
    for other in (VllmSimConfig(preset=preset, kv_blocks=200), VllmSimConfig(preset=preset, requests=2)):
        assert not promises.preemption_problem(other, VllmSimResult(other))
    assert not promises.preemption_problem(cfg, VllmSimResult(cfg), preset_plan=False)


def test_the_kv_space_override_is_one_line() -> None:
    assert promises.kv_space_override({}) is None and promises.kv_space_override({"VLLM_CPU_KVCACHE_SPACE": ""}) is None
    line = promises.kv_space_override({"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert line is not None and "\n" not in line and "unset it" in line


class _FakeSim:
    def __init__(self, result: VllmSimResult) -> None:
        self.result = result

    def run(self) -> VllmSimResult:
        return self.result


def _cli_with(monkeypatch: pytest.MonkeyPatch, result_of: Any, argv: list[str]) -> int:
    import importlib.util

    import omni_cache.harness.vllm_engine.parallel as parallel

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a))
    monkeypatch.setattr(parallel, "make_simulation", lambda cfg: _FakeSim(result_of(cfg)))
    return main(["simulate", "--engine", "vllm", *argv])


def test_the_cli_exits_3_for_an_incomplete_run_and_0_only_when_complete(monkeypatch, capsys) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)

    def incomplete(cfg: VllmSimConfig) -> VllmSimResult:
        res = VllmSimResult(cfg)
        promises.preemption_problem(cfg, res)
        return res

    assert _cli_with(monkeypatch, incomplete, ["--json"]) == 3
    captured = capsys.readouterr()
    assert '"ok": false' in captured.out and "preempted none" in captured.err
    assert _cli_with(monkeypatch, lambda cfg: VllmSimResult(cfg, preemptions=2), ["--json"]) == 0
    assert '"ok": true' in capsys.readouterr().out


def test_the_cli_refuses_a_kv_space_override_in_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    ran: list[bool] = []
    assert _cli_with(monkeypatch, lambda cfg: ran.append(True), ["--tp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert ran == [] and len(err.splitlines()) == 1 and "VLLM_CPU_KVCACHE_SPACE=1" in err
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_parallel_options_need_the_vllm_engine(capsys) -> None:
    for flag in (["--tp", "2"], ["--pp", "2"], ["--check-ranks"], ["--tolerance", "0.1"]):
        with pytest.raises(SystemExit) as exc:
            main(["simulate", *flag])
        assert exc.value.code == 2 and "only applies to --engine vllm" in capsys.readouterr().err


def test_the_in_process_run_refuses_a_parallel_config() -> None:
    from omni_cache.harness.vllm_engine.engine import VllmSimulation

    with pytest.raises(ValueError, match="make_simulation"):
        VllmSimulation(VllmSimConfig(tp=2)).run()
    with pytest.raises(ValueError, match="builds its own engine"):
        ParallelVllmSimulation(VllmSimConfig(tp=2)).run(object())


def test_a_grid_the_model_cannot_run_is_one_line_exit_2(monkeypatch, capsys) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    ran: list[bool] = []
    with pytest.raises(SystemExit) as exc:  # an argument error: the subcommand's usage, then one line
        _cli_with(monkeypatch, lambda cfg: ran.append(True), ["--tp", "3"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and ran == []
    assert err.splitlines()[0].startswith("usage:") and "--tp 3 does not divide" in err.splitlines()[-1]
