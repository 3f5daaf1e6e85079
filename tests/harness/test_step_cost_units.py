"""The speed machinery without vLLM: the fast layout path gives the same layout as the reference
path, the block-table view's vectorized slots equal its per-span slots, the step-cost fit, the
width sweep's arithmetic and plot, the pipeline's speed targets and exit code, and the
real-engine bench options' refusals.

Protects: I4's and I5's inputs on the engine's fast path (the layout the bridge builds is the
layout the reference protocol builds, slot for slot; a stale or negative count is refused as
before) and the honesty of the speed verdicts (a judged target that is missed exits 3; an
unjudged one never decides the exit code).
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from omni_cache import PrefixCacheSchedulerAdapter, PrefixCacheWriteLayout
from omni_cache.cli import main
from omni_cache.cli.args import EXIT_INCOMPLETE, EXIT_OK, EXIT_USAGE
from omni_cache.integration import BlockTableView
from omni_cache.runtime.events import layout_rows


def _random_view(rng: random.Random, n: int, bs: int) -> tuple[BlockTableView, list[int]]:
    ids = [f"r{i}" for i in range(n)]
    blocks = [rng.sample(range(1, 500), 6) for _ in range(n)]
    computed = [rng.randint(0, 3 * bs) for _ in range(n)]
    table = torch.zeros(n + 3, 8, dtype=torch.int32)
    for i, b in enumerate(blocks):
        table[i, :6] = torch.tensor(b)
    per_row = np.zeros(n + 3, dtype=np.int32)
    per_row[:n] = 6
    view = BlockTableView(ids, np.array([*computed, 0, 0, 0], dtype=np.int32), table, block_size=bs,
                          num_blocks_per_row=per_row)
    return view, computed


class _ReferenceProtocol:
    """The same view through the reference's protocol only (the adapter's generic path)."""

    def __init__(self, view: BlockTableView) -> None:
        self._view = view

    def batch_req_ids(self) -> list[str]:
        return list(self._view.req_ids)

    def token_range(self, req_id: str, n: int) -> tuple[int, int]:
        start = self._view.num_computed_tokens[self._view.row_of(req_id)]
        return start, start + n

    def step_slots_cpu(self, req_ids: list[str], counts: Any) -> torch.Tensor:
        return self._view.slots_for_spans([(r, *self.token_range(r, counts.get(r, 0))) for r in req_ids
                                           if counts.get(r, 0)])


def test_the_block_table_views_layout_equals_the_reference_protocols_on_random_batches() -> None:
    rng = random.Random(3)
    adapter = PrefixCacheSchedulerAdapter()
    for _ in range(60):
        bs = rng.choice([1, 4, 16])
        n = rng.randint(1, 9)
        view, _ = _random_view(rng, n, bs)
        counts = {f"r{i}": rng.choice([0, 1, 1, 2, bs]) for i in range(n) if rng.random() < 0.9}
        fast = adapter.build_write_layout(view, num_scheduled_tokens=counts)
        slow = adapter.build_write_layout(_ReferenceProtocol(view), num_scheduled_tokens=counts)
        assert fast.writes == slow.writes and fast.total_rows == slow.total_rows
        assert torch.equal(fast.slots_cpu, slow.slots_cpu) and fast.slots_cpu.dtype == torch.int64
        rows, reference = layout_rows(fast), layout_rows(slow)
        assert rows is not None and reference is not None and rows.tiles == reference.tiles


def test_the_fast_layout_refuses_what_the_reference_path_refuses() -> None:
    view, _ = _random_view(random.Random(1), 3, 4)
    adapter = PrefixCacheSchedulerAdapter()
    with pytest.raises(ValueError, match=r"requests \['zz'\] are scheduled but not in the block-table view"):
        adapter.build_write_layout(view, num_scheduled_tokens={"r0": 1, "zz": 2})
    with pytest.raises(ValueError, match="negative token count -1 for 'r1'"):
        adapter.build_write_layout(view, num_scheduled_tokens={"r0": 1, "r1": -1})
    with pytest.raises(ValueError, match="4 per-row counts for a batch of 3"):
        adapter.build_write_layout(view, num_scheduled_tokens=[1, 1, 1, 1])
    with pytest.raises(ValueError, match="needs block index 6 but its row holds 6"):
        adapter.build_write_layout(view, num_scheduled_tokens={"r2": 6 * 4})  # past the row's blocks: stale view
    layout = adapter.build_write_layout(view, num_scheduled_tokens=[2])  # a short per-row list: the rest are 0
    assert [w.num_rows for w in layout.writes] == [2, 0, 0] and layout.total_rows == 2


def test_slots_for_counts_equal_slots_for_spans() -> None:
    rng = random.Random(5)
    for _ in range(40):
        bs = rng.choice([1, 2, 16])
        n = rng.randint(1, 7)
        view, computed = _random_view(rng, n, bs)
        counts = [rng.choice([0, 1, 3]) for _ in range(n)]
        spans = [(f"r{i}", computed[i], computed[i] + c) for i, c in enumerate(counts)]
        assert view.slots_for_counts(counts).tolist() == view.slots_for_spans(spans).tolist()
    with pytest.raises(ValueError, match="2 counts for a batch of 3"):
        _random_view(rng, 3, 4)[0].slots_for_counts([1, 1])


def test_a_taken_layout_keeps_the_tensor_it_was_given_and_its_facts() -> None:
    adapter = PrefixCacheSchedulerAdapter()
    view, _ = _random_view(random.Random(2), 2, 4)
    layout = adapter.build_write_layout(view, num_scheduled_tokens={"r0": 1, "r1": 1})
    slots = layout.slots_cpu
    again = PrefixCacheWriteLayout.taking(layout.writes, layout.total_rows, slots)
    copied = PrefixCacheWriteLayout(layout.writes, layout.total_rows, slots)
    assert again.slots_cpu is slots and copied.slots_cpu is not slots  # the constructor copies, taking does not
    assert again.writes == copied.writes and again.total_rows == copied.total_rows
    assert again.req_ids == ("r0", "r1") and layout_rows(again).tiles  # type: ignore[union-attr]


def test_the_step_cost_fit_recovers_a_linear_cost() -> None:
    from omni_cache.harness.vllm_engine.step_cost import ConfigResult, fit_cost

    configs = [ConfigResult("hidden", "decode", b, b, 10, 100 + 3 * b + 0.5 * b, 1000, 400) for b in (1, 2, 8, 32)]
    configs += [ConfigResult("hidden", "prefill", 1, t, 10, 100 + 3 + 0.5 * t, 1000, 400) for t in (32, 512)]
    fit = fit_cost(configs)
    assert fit["intercept_us"] == pytest.approx(100) and fit["per_request_us"] == pytest.approx(3)
    assert fit["per_row_us"] == pytest.approx(0.5)


def test_the_width_sweeps_models_and_arithmetic(tmp_path: Any) -> None:
    from omni_cache.harness.vllm_engine.width_sweep import (
        SweepPoint,
        sweep_config,
        sweep_rows,
        write_sweep_plot,
    )

    c = sweep_config(2048, 2, "bfloat16")
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (2048, 16, 4, 128)
    assert c["intermediate_size"] == 4096 and c["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="multiple of 128"):
        sweep_config(100)
    p = SweepPoint(1024, "float32", 2, 8, 256, cache_us_decode=200, forward_us_decode=2000, cache_us_prefill=300,
                   forward_us_prefill=30000, cache_us_one_token=150)
    assert p.fraction("decode") == pytest.approx(0.1) and p.fraction("decode", 20) == pytest.approx(0.01)
    row = sweep_rows([p], model_layers=(20,))[0]
    assert row["20 layers: decode / prefill"] == "1.00% / 0.10%" and row["fwd µs/layer decode"] == "1,000"
    out = write_sweep_plot([p, SweepPoint(2048, "float32", 2, 8, 256, 220, 6000, 350, 90000, 160)],
                           str(tmp_path / "sweep.png"), title="t", footnote="f")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.endswith("sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    write_sweep_plot([p], str(tmp_path / "sweep.svg"), title="t", footnote="f")
    assert "<svg" in (tmp_path / "sweep.svg").read_text()


# ---------------------------------------------------------------------- pipeline speed targets
def _result(model: str, *, alone_s: float, apc_s: float, forward_s: float, cache_s: float) -> Any:
    from omni_cache.harness.pipeline.checks import Comparison, Verdict
    from omni_cache.harness.pipeline.drive import RunStats
    from omni_cache.harness.pipeline.run import PipelineConfig, PipelineResult
    from omni_cache.harness.pipeline.stages import StageTimers

    same = [Comparison(f"r{i}", True, 0.0, 1e-4) for i in range(2)]
    differ = [Comparison("r0", False, 1.0, 1e-4, "tokens differ")]
    timers = StageTimers(forward_s=forward_s, begin_s=cache_s / 4, save_s=cache_s / 2, materialize_s=cache_s / 4,
                         steps=10)
    return PipelineResult(PipelineConfig(preset="mix", requests=2, repeats=1, model=model), requests=2,
                          with_apc=RunStats(hit_tokens=64, prefill_tokens=10, thinker_s=apc_s, end_to_end_s=apc_s + 1),
                          without_apc=RunStats(prefill_tokens=74, thinker_s=2.0, end_to_end_s=3.0),
                          apc_alone=RunStats(hit_tokens=64, prefill_tokens=10, thinker_s=alone_s,
                                             end_to_end_s=alone_s + 1),
                          identity=Verdict(list(same)), thinker_answers_equal=2, cache_timers=[timers],
                          control_computed=Verdict(list(differ)), control_perturbed=Verdict(list(differ)))


@pytest.mark.parametrize(("model", "apc_s", "cache_s", "code"), [
    ("wide", 1.02, 0.1, EXIT_OK),  # keeps 98% of what prefix caching buys, 1% of the forward
    ("wide", 1.2, 0.1, EXIT_INCOMPLETE),  # keeps 83%
    ("wide", 1.02, 0.3, EXIT_INCOMPLETE),  # 3% of the forward
    ("llama", 1.2, 0.3, EXIT_OK),  # reported, not judged: a tiny forward
])
def test_the_speed_targets_decide_the_exit_code_for_the_wide_model_only(model: str, apc_s: float, cache_s: float,
                                                                         code: int) -> None:
    from omni_cache.harness.pipeline.report import exit_code, summarize

    res = _result(model, alone_s=1.0, apc_s=apc_s, forward_s=10.0, cache_s=cache_s)
    s = summarize(res)
    assert exit_code(res) == code and s["exit_code"] == code
    assert s["apc_alone_speedup"] == 2.0 and s["thinker_speedup"] == round(2.0 / apc_s, 3)
    assert s["cache_cost"]["fraction_of_forward"] == pytest.approx(cache_s / 10.0)
    t = s["targets"]
    assert t["judged"] is (model == "wide") and t["kept_of_apc_alone"] == pytest.approx(1.0 / apc_s, abs=1e-3)
    assert t["met"] is (None if model != "wide" else code == EXIT_OK)


def test_a_run_without_the_third_thinker_judges_nothing() -> None:
    from omni_cache.harness.pipeline.report import exit_code, summarize

    res = _result("wide", alone_s=1.0, apc_s=1.5, forward_s=10.0, cache_s=0.5)
    res.apc_alone = None  # e.g. --tp 2: the upper bound is not measured
    s = summarize(res)
    assert s["apc_alone_speedup"] is None and s["targets"]["judged"] is False and exit_code(res) == EXIT_OK


# ---------------------------------------------------------------------- bench's real-engine options
def test_the_real_engine_bench_options_refuse_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--width-sweep", "--widths", "200"])
    assert exc.value.code == EXIT_USAGE and "multiples of 128" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--width-sweep", "--widths", "100"])
    assert exc.value.code == EXIT_USAGE
    capsys.readouterr()
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert main(["bench", "--engine-step"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vLLM is not installed" in err[0]
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--engine-step", "gpt"])
    assert exc.value.code == EXIT_USAGE


def test_the_probe_restores_every_method_it_wrapped() -> None:
    from omni_cache.harness.vllm_engine.step_cost import StepCostProbe

    def fn(*_: Any) -> None:
        return None

    manager = SimpleNamespace(new_step_starts=fn, save_outputs=fn)
    hooks = SimpleNamespace(manager=manager, materialize=fn, adapter=SimpleNamespace(translate_step=fn,
                                                                                   build_write_layout=fn))

    class Bridge:
        def begin_step(self, so: Any) -> None:
            return None

        def after_forward_v1(self, *a: Any) -> None:
            return None

        def view_v1(self, *a: Any) -> None:
            return None

    bridge, runner = Bridge(), SimpleNamespace(_model_forward=fn)
    bridge.hooks, bridge.mm_outputs_fn = hooks, fn  # type: ignore[attr-defined]
    probe = StepCostProbe(bridge, runner, parts=True)
    assert bridge.mm_outputs_fn is not fn and "begin_step" in vars(bridge)  # type: ignore[attr-defined]
    bridge.begin_step(SimpleNamespace(num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1))
    bridge.after_forward_v1()
    sample = probe.take(step_ns=10)
    assert sample is not None and (sample.requests, sample.rows) == (1, 1) and sample.ns["after_forward"] >= 0
    probe.remove()
    assert bridge.mm_outputs_fn is fn and runner._model_forward is fn and manager.save_outputs is fn  # type: ignore[attr-defined]
    assert "begin_step" not in vars(bridge) and hooks.adapter.translate_step is fn
