"""Tests of ``omni-cache bench`` (omni_cache/bench, omni_cache/cli/bench.py).

Structure and correctness only -- never timings (CI machines are noisy): the
quick preset runs end to end with every materialized row checked against the
ground truth (I4, I6, I7; I1/I2 at shutdown), the JSON carries its fields, the
plot is a PNG, and the checker catches a corrupted row, a zeroed hit prefix
and a corrupting manager.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from omni_cache.cli import main
from omni_cache.cli.bench import QUICK
from omni_cache.harness.bench.floor import RawCopyFloor
from omni_cache.harness.bench.machine import DictTablePool, run_machine_bench
from omni_cache.harness.bench.profiling import profile_manager, section_times
from omni_cache.harness.bench.runner import FLOOR, OMNI, BenchResult, default_manager_factory, run_bench
from omni_cache.harness.bench.workload import (
    MM_KEY,
    GroundTruthError,
    WorkloadSpec,
    build_workload,
    check_outputs,
)
from omni_cache.runtime.interface import HIDDEN_KEY, StageCacheOutputs

SMALL = {k: v for k, v in QUICK.items() if k not in ("batch_sizes", "repeats")}


def _rows_per_pass(spec: WorkloadSpec) -> int:
    workload = build_workload(spec)
    return sum(e - s for step in workload.steps for _r, s, e in step.expect.values()) * len(spec.keys)


def test_quick_cli_end_to_end_json_and_png(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "bench.png"
    rc = main(["bench", "--quick", "--json", "--plot", str(plot), "--repeats", "2"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert doc["ground_truth"] == "ok"
    assert doc["config"]["batch_sizes"] == [2, 4]
    assert doc["config"]["mode"] == "eager" and doc["config"]["repeats"] == 2
    assert set(doc["ratios"]) == set(doc["decode_ratios"]) == {"2", "4"}
    assert doc["pass"] is None and doc["target_ratio"] == 0.5  # --quick gives no verdict
    assert "decode_overhead_growth_us_per_request" in doc
    by = {(r["impl"], r["batch_size"]): r for r in doc["results"]}
    assert set(by) == {(OMNI, 2), (FLOOR, 2), (OMNI, 4), (FLOOR, 4)}
    for (impl, b), r in by.items():
        spec = WorkloadSpec(batch_size=b, **SMALL)
        assert r["tokens"] == spec.total_tokens and r["steps"] == 2 + spec.decode_steps
        # Every row of every key of every step of every timed repeat was checked.
        assert r["rows_checked"] == 2 * _rows_per_pass(spec)
        assert r["tokens_per_s"] > 0 and r["us_per_step"] > 0 and len(r["repeats_tokens_per_s"]) == 2
        assert set(r["us_per_call"]) == {"new_step_starts", "save", "materialize"}
        assert (r["us_per_call"]["new_step_starts"] is None) == (impl == FLOOR)
        assert doc["ratios"][str(b)] == pytest.approx(by[(OMNI, b)]["tokens_per_s"] / by[(FLOOR, b)]["tokens_per_s"])
    stats = doc["manager_stats"]["4"]
    assert stats["unconsumed_step_ids"] == {} and stats["hits"] == 3 * 2  # 2 hits per pass, warm-up + 2
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_explains_floor_target_and_load(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "bench.svg"
    assert main(["bench", "--quick", "--batch-sizes", "2", "--plot", str(plot)]) == 0
    capsys.readouterr()
    svg = plot.read_text()
    for text in ("floor = the same tensor copies with no bookkeeping", "target = omni_cache reaches at least 50%",
                 "target: 50% of the floor", "as % of the floor", "1-min load average", "machine: ",
                 "no verdict (--quick smoke run)"):
        assert text in svg.replace("&gt;", ">").replace("&amp;", "&"), text


def test_quick_cli_tables_and_async(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--quick", "--async", "--batch-sizes", "3"]) == 0
    out = capsys.readouterr().out
    assert "omni_cache/floor tokens/s" in out and "ground truth: ok" in out
    assert "(async" in out
    assert "PASS" not in out and "FAIL" not in out and "overall" not in out  # --quick prints no verdict


def _tiny_full_run(*extra: str) -> list[str]:
    """A non-quick run (so a verdict is given) small enough for a test: batch 2, one decode step."""
    return ["bench", "--batch-sizes", "2", "--decode-steps", "1", "--repeats", "1", *extra]


def test_fail_verdict_exits_3_naming_the_ratio(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import omni_cache.harness.bench.runner as runner

    real_run_bench = runner.run_bench
    target = {"ratio": 10.0}

    def run_bench_with_target(*args: Any, **kwargs: Any) -> BenchResult:
        result = real_run_bench(*args, **kwargs)
        result.target_ratio = target["ratio"]
        return result

    monkeypatch.setattr(runner, "run_bench", run_bench_with_target)
    # A target no implementation can meet: the verdict is FAIL and the exit code says so.
    assert main(_tiny_full_run()) == 3
    captured = capsys.readouterr()
    assert "overall: FAIL" in captured.out
    assert "omni-cache bench: FAIL: batch 2: omni_cache/floor tokens/s" in captured.err
    assert "< target 1000%" in captured.err
    # ... and a target every run meets passes with exit 0.
    target["ratio"] = 0.0
    assert main(_tiny_full_run()) == 0
    out = capsys.readouterr().out
    assert "overall: PASS\n" in out and "ground truth: ok (" in out
    # without the ground truth the verdict says it judged the speed alone
    assert main(_tiny_full_run("--no-verify")) == 0
    out = capsys.readouterr().out
    assert "overall: PASS (the speed target only: no row was checked against the ground truth)" in out
    assert "ground truth: not checked (--no-verify)" in out


def test_workload_shape() -> None:
    spec = WorkloadSpec(batch_size=4, **SMALL)
    w = build_workload(spec)
    misses, hits = w.steps[0], w.steps[1]
    assert [s.phase for s in w.steps] == ["prefill", "prefill"] + ["decode"] * spec.decode_steps
    assert misses.num_tokens == 2 * spec.prompt_tokens and hits.num_tokens == 2 * (spec.prompt_tokens - spec.hit_tokens)
    # A hit request shares its donor's first blocks and rows, and must get [0, prompt) back.
    assert w.block_tables[2][: spec.hit_tokens // spec.block_size] == w.block_tables[0][: spec.hit_tokens // spec.block_size]
    assert torch.equal(w.truth[HIDDEN_KEY][2, : spec.hit_tokens], w.truth[HIDDEN_KEY][0, : spec.hit_tokens])
    assert not torch.equal(w.truth[HIDDEN_KEY][2, spec.hit_tokens :], w.truth[HIDDEN_KEY][0, spec.hit_tokens :])
    assert hits.expect["req-2"] == (2, 0, spec.prompt_tokens)
    assert all(e.hit_end == spec.hit_tokens for e in hits.events)
    assert w.num_tokens == spec.total_tokens
    with pytest.raises(ValueError, match="KV blocks"):
        WorkloadSpec(batch_size=64, **SMALL)


def _floor_outputs(spec: WorkloadSpec) -> tuple[Any, list[StageCacheOutputs]]:
    w = build_workload(spec)
    floor = RawCopyFloor(spec)
    outs = []
    for step in w.steps:
        floor.save(step)
        outs.append(floor.materialize(step))
    return w, outs


def test_checker_catches_a_corrupted_row() -> None:
    spec = WorkloadSpec(batch_size=4, **SMALL)
    w, outs = _floor_outputs(spec)
    for step, out in zip(w.steps, outs, strict=True):
        assert check_outputs(w, step, out) > 0
    step, out = w.steps[0], outs[0]
    out.hidden_states["req-1"][7, 3] += 1
    with pytest.raises(GroundTruthError, match=r"step 0 .*'req-1' key 'hidden': row 7 \(position 7\)"):
        check_outputs(w, step, out)
    step, out = w.steps[-1], outs[-1]
    out.mm_outputs[MM_KEY]["req-3"][0, 0] = -out.mm_outputs[MM_KEY]["req-3"][0, 0] - 1
    with pytest.raises(GroundTruthError, match=r"'req-3' key 'mm.codes': row 0"):
        check_outputs(w, step, out)


def test_checker_catches_zeroed_hit_prefix_and_missing_rows() -> None:
    spec = WorkloadSpec(batch_size=4, **SMALL)
    w, outs = _floor_outputs(spec)
    step, out = w.steps[1], outs[1]
    out.hidden_states["req-2"][: spec.hit_tokens] = 0  # a hit served as zeros (I6)
    with pytest.raises(GroundTruthError, match=r"'req-2' key 'hidden': row 0"):
        check_outputs(w, step, out)
    short = StageCacheOutputs({**outs[1].hidden_states, "req-3": outs[1].hidden_states["req-3"][spec.hit_tokens:]},
                              outs[1].mm_outputs)
    with pytest.raises(GroundTruthError, match=r"expected positions \[0, 64\)"):
        check_outputs(w, step, short)
    missing = StageCacheOutputs(outs[2].hidden_states, {})
    with pytest.raises(GroundTruthError, match="missing"):
        check_outputs(w, w.steps[2], missing)


class _CorruptingManager:
    """The real manager, except one row of one hit comes back wrong."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def materialize(self, step_id: int, req_ids: Any) -> StageCacheOutputs:
        out = self.inner.materialize(step_id, req_ids)
        if "req-1" in out.hidden_states and out.hidden_states["req-1"].shape[0] > 1:
            out.hidden_states["req-1"][1] = 0
        return out


def test_bench_fails_on_a_corrupting_manager(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def factory(config: Any, eager: bool) -> Any:
        return _CorruptingManager(default_manager_factory(config, eager))

    with pytest.raises(GroundTruthError, match=r"omni_cache: step \d .*'req-1' key 'hidden': row 1"):
        run_bench([2], repeats=1, manager_factory=factory, **SMALL)
    # The CLI exits 1 (a failed check) on a ground-truth failure, even with --quick.
    monkeypatch.setattr("omni_cache.harness.bench.runner.default_manager_factory", factory)
    assert main(["bench", "--quick", "--batch-sizes", "2"]) == 1
    assert "GROUND TRUTH FAILURE" in capsys.readouterr().out


def test_machine_bench_structure(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_machine_bench(cycles=50, triggers=100, repeats=1, add_model_sizes=(20,))
    names = [r.name for r in result.rows]
    assert names[:2] == ["staging_pool_cycle", "dict_table_cycle"]
    assert {"trigger_model_none", "trigger_table_machine", "trigger_add_model", "trigger_locked",
            "trigger_dict", "add_model_20"} <= set(names)
    assert all(r.us > 0 for r in result.rows) and result.cycle_ratio > 0
    assert main(["bench", "--machine", "--quick", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["machine"]
    assert doc["cycle_ratio"] > 0 and {r["unit"] for r in doc["rows"]} == {"µs/cycle", "µs/trigger", "µs/model"}


def test_dict_table_baseline_refuses_illegal_triggers() -> None:
    pool = DictTablePool(1)
    slot = pool.claim()
    with pytest.raises(RuntimeError, match="no free slot"):
        pool.claim()
    with pytest.raises(RuntimeError, match="illegal trigger 'release' in state 'claimed'"):
        pool.release(slot)
    pool.save(slot, 1)
    pool.release(pool.consume(1))
    assert slot.state == "free" and pool.claim() is slot


def test_profiling_names_manager_functions() -> None:
    spec = WorkloadSpec(batch_size=2, **SMALL)
    _by_own, by_cum, meta = profile_manager(spec, top=200)
    assert meta["steps"] == spec.decode_steps
    assert any("manager.py" in r.function and "save_outputs" in r.function for r in by_cum)
    sections, smeta = section_times(spec)
    names = {r.section for r in sections}
    assert {"manager.save_outputs", "manager.materialize", "staging.machine.fire"} <= names
    assert all(r.calls_per_step > 0 for r in sections) and smeta["steps"] == spec.decode_steps
