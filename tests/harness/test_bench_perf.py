"""Tests of the bench's workload machinery: the decode13 preset, the breakdown, the sweep, memory.

Structure and correctness only -- never timings (CI machines are noisy): the
preset is the decode-heavy workload, the staggered workload is checked row by row
against the ground truth, the per-category breakdown restores everything it
instrumented and its *call counts* per decode step do not grow with the number
of requests (the bookkeeping is O(1) calls per step), the sweep covers its grid
and plots it, and the memory report's measured bytes equal the formula.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

import omni_cache.runtime.manager as manager_module
from omni_cache.cli import main
from omni_cache.harness.bench import preset as preset_module
from omni_cache.harness.bench.breakdown import CATEGORIES, step_breakdown
from omni_cache.harness.bench.floor import RawCopyFloor
from omni_cache.harness.bench.memory import formula, memory_report
from omni_cache.harness.bench.narrow import NARROW_WIDTH, OutputFloor, narrow_bookkeeping, narrow_spec
from omni_cache.harness.bench.preset import PRESETS, PresetCase
from omni_cache.harness.bench.sweep import (
    SweepPoint,
    growth_lines,
    growth_per_request,
    pool_spread_us,
    run_sweep,
    sweep_summary,
    write_sweep_plot,
)
from omni_cache.harness.bench.workload import GroundTruthError, WorkloadSpec, build_workload, check_outputs
from omni_cache.runtime.interface import HIDDEN_KEY

TINY = {"hidden_width": 32, "mm_width": 8, "num_blocks": 64, "prompt_tokens": 32, "hit_tokens": 16,
        "decode_steps": 3, "staggered": True}


def test_decode13_preset_is_the_issue_workload() -> None:
    cases = {c.name: c for c in PRESETS["decode13"]}
    assert [(c.spec["batch_size"], c.spec["hit_tokens"], c.target) for c in cases.values()] == [
        (8, 256, 0.8), (32, 256, 0.9), (8, 0, 0.8)]
    for case in cases.values():
        spec = WorkloadSpec(**case.spec)
        assert (spec.hidden_width, spec.mm_width, spec.dtype, spec.block_size, spec.num_blocks) == (
            2048, 512, torch.bfloat16, 16, 4096)
        assert (spec.prompt_tokens, spec.decode_steps, spec.staggered) == (512, 200, True)


def test_staggered_workload_one_prefill_per_request_and_hits_on_the_previous_request() -> None:
    spec = WorkloadSpec(batch_size=5, **TINY)
    w = build_workload(spec)
    prefill = [s for s in w.steps if s.phase == "prefill"]
    assert len(prefill) == 5 and len(w.steps) == 5 + spec.decode_steps
    shared = spec.hit_tokens // spec.block_size
    for r, step in enumerate(prefill):
        (event,) = step.events.events
        assert step.req_ids == (w.req_ids[r],)
        if r % 2:  # never the first; every odd request hits its predecessor's first blocks
            assert event.hit_end == spec.hit_tokens and step.num_tokens == spec.prompt_tokens - spec.hit_tokens
            assert w.block_tables[r][:shared] == w.block_tables[r - 1][:shared]
            assert torch.equal(w.truth[HIDDEN_KEY][r, : spec.hit_tokens], w.truth[HIDDEN_KEY][r - 1, : spec.hit_tokens])
        else:
            assert event.hit_end == 0 and step.num_tokens == spec.prompt_tokens
    floor = RawCopyFloor(spec)
    for step in w.steps:  # the floor serves it, checked row by row
        floor.save(step)
        assert check_outputs(w, step, floor.materialize(step), who="floor") > 0


def test_staggered_workload_without_hits() -> None:
    w = build_workload(WorkloadSpec(batch_size=4, **{**TINY, "hit_tokens": 0}))
    assert all(e.hit_end == 0 for s in w.steps for e in s.events.events)
    assert all(not s.hit_slots for s in w.steps)


def test_preset_cli_json_with_a_tiny_preset(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    tiny = (PresetCase("2 requests", {**TINY, "batch_size": 2}, 0.0),
            PresetCase("3 requests, no hits", {**TINY, "batch_size": 3, "hit_tokens": 0}, 99.0))
    monkeypatch.setitem(PRESETS, "decode13", tiny)
    monkeypatch.setattr(preset_module, "PRESETS", PRESETS)
    rc = main(["bench", "--preset", "decode13", "--repeats", "2", "--json"])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)["preset"]
    assert rc == 3 and doc["pass"] is False  # the second case's target (99x the floor) cannot be met
    assert "FAIL: decode13 3 requests, no hits" in captured.err  # names the case that missed
    assert [c["case"] for c in doc["cases"]] == ["2 requests", "3 requests, no hits"]
    first, second = doc["cases"]
    assert first["pass"] is True and second["pass"] is False
    for case in doc["cases"]:
        assert case["ratio"] == pytest.approx(case["omni_cache"]["tokens_per_s"] / case["floor"]["tokens_per_s"])
        assert case["omni_cache"]["rows_checked"] > 0 and len(case["omni_cache"]["repeats_tokens_per_s"]) == 2
    assert doc["rows_checked"] == sum(c["omni_cache"]["rows_checked"] + c["floor"]["rows_checked"] for c in doc["cases"])


def test_the_preset_table_says_what_it_verified(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The preset's text output names the rows checked against the ground truth, or that none were."""
    monkeypatch.setitem(PRESETS, "decode13", (PresetCase("2 requests", {**TINY, "batch_size": 2}, 0.0),))
    monkeypatch.setattr(preset_module, "PRESETS", PRESETS)
    assert main(["bench", "--preset", "decode13", "--repeats", "1"]) == 0
    checked = re.search(r"ground truth: ok \(([\d,]+) materialized rows checked, every key\)", capsys.readouterr().out)
    assert checked and int(checked[1].replace(",", "")) > 0
    assert main(["bench", "--preset", "decode13", "--repeats", "1", "--no-verify"]) == 0
    assert "ground truth: not checked (--no-verify): no materialized row was compared" in capsys.readouterr().out


def test_breakdown_restores_what_it_instruments_and_its_calls_do_not_grow_with_requests() -> None:
    originals = (torch.Tensor.clone, torch.Tensor.index_copy_, torch.cat, manager_module.validate_save)
    small = step_breakdown(WorkloadSpec(batch_size=2, **{**TINY, "decode_steps": 4}), passes=1)
    large = step_breakdown(WorkloadSpec(batch_size=8, **{**TINY, "num_blocks": 128, "decode_steps": 4}), passes=1)
    assert (torch.Tensor.clone, torch.Tensor.index_copy_, torch.cat, manager_module.validate_save) == originals
    for b in (small, large):
        assert [r.category for r in b.rows] == list(CATEGORIES)
        assert all(r.us_per_step >= 0 for r in b.rows) and b.measured_us_per_step > 0
        by = {r.category: r for r in b.rows}
        # a decode step: one staging copy and one pool scatter per key (``scatter_rows``, with the
        # ``index_copy_`` it takes for so few rows counted too), one clone per key, and the save's
        # private clone of the slot mapping
        assert by["copies"].calls_per_step == 9
        assert by["state machine"].calls_per_step == 8  # 4 staging + 4 write triggers
    # O(1) timed calls per decode step: 8 requests make exactly as many as 2
    assert [r.calls_per_step for r in small.rows] == [r.calls_per_step for r in large.rows]


def test_sweep_covers_its_grid_and_plots(tmp_path: Any) -> None:
    points = run_sweep(requests=(1, 3), num_blocks=(64, 128), repeats=1, decode_steps=2)
    assert [(p.requests, p.num_blocks) for p in points] == [(1, 64), (3, 64), (1, 128), (3, 128)]
    assert all(p.omni_decode_us > 0 and p.floor_decode_us > 0 for p in points)
    assert all(p.narrow_omni_us > 0 and p.narrow_outputs_us > 0 for p in points)
    assert all(p.bookkeeping_us == p.narrow_omni_us - p.narrow_outputs_us for p in points)
    # The load-independent count: a decode step of several requests runs as many runtime Python
    # lines at every pool size; a one-request step takes the reader's shorter path (no split).
    several = {p.python_lines for p in points if p.requests > 1}
    assert len(several) == 1 and min(several) > 300
    assert all(p.python_lines <= min(several) for p in points if p.requests == 1)
    path = write_sweep_plot(points, tmp_path / "sweep.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = write_sweep_plot(points, tmp_path / "sweep.svg", title="t")  # the suffix names the format
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()
    assert [g.num_blocks for g in growth_per_request(points)] == [64, 128]


def _point(requests: int, num_blocks: int, book: float, outputs: float, copies: float) -> SweepPoint:
    return SweepPoint(requests, num_blocks, 0.0, 0.0, copies, 1.0, narrow_omni_us=outputs + book,
                      narrow_outputs_us=outputs, python_lines=1)


def test_sweep_growth_is_the_least_squares_slope_per_pool_size() -> None:
    """Bookkeeping 40 + 0.1/request, outputs 20 + 0.5/request, copies 10 + 3/request (+1 µs of
    views) at 1k blocks; 2 µs more bookkeeping at 4k: slopes, share and spread read back exactly."""
    points = [_point(r, nb, 40 + 0.1 * r + (2 if nb == 4096 else 0), 20 + 0.5 * r, 10 + 3 * r)
              for nb in (1024, 4096) for r in (1, 8, 32, 128)]
    growth = growth_per_request(points)
    assert [g.num_blocks for g in growth] == [1024, 4096]
    for g in growth:
        assert g.bookkeeping_us_per_request == pytest.approx(0.1)
        assert g.narrow_outputs_us_per_request == pytest.approx(0.5)
        assert g.copies_and_views_us_per_request == pytest.approx(3.0)
        assert g.share_of_outputs == pytest.approx(0.2)
    assert pool_spread_us(points) == pytest.approx(2.0)
    summary = sweep_summary(points)
    assert summary["bookkeeping_pool_spread_us"] == pytest.approx(2.0)
    assert summary["growth_per_request"][0]["share_of_outputs"] == pytest.approx(0.2)
    lines = growth_lines(points)
    assert "bookkeeping +0.100 µs" in lines[0] and "(bookkeeping 20% of it)" in lines[0]
    assert lines[-1] == "pool size: bookkeeping within 2.0 µs across num_blocks at every number of requests"
    # a single number of requests has no slope
    assert growth_per_request([_point(8, 64, 1, 1, 1)]) == []


def test_memory_report_measured_bytes_equal_the_formula() -> None:
    spec = WorkloadSpec(batch_size=2, **TINY)
    report = memory_report(spec)
    want = formula(spec)
    assert (report.pool_bytes, report.staging_bytes, report.tenancy_bytes) == (
        want["pool"], want["staging"], want["tenancy"])
    assert report.peak_rss >= report.baseline_rss > 0


def test_output_floor_returns_private_rows_that_later_steps_cannot_change() -> None:
    """The sweep's direct bookkeeping subtracts ``OutputFloor`` from the manager: the floor must
    return what materialize returns (every row right, each a private copy). Every step's outputs
    are kept and checked only after the whole run has reused the staging buffer."""
    spec = narrow_spec(WorkloadSpec(batch_size=3, **{**TINY, "decode_steps": 4}))
    assert spec.hidden_width == spec.mm_width == NARROW_WIDTH
    workload = build_workload(spec)
    floor = OutputFloor(spec)
    kept = []
    for step in workload.steps:
        floor.save(step)
        kept.append((step, floor.materialize(step)))
    assert any(not step.hit_slots and step.phase == "decode" for step, _ in kept)
    assert sum(check_outputs(workload, step, out, who="output floor") for step, out in kept) > 0


@pytest.mark.parametrize("warm_inputs", [False, True], ids=["cold-inputs", "warm-inputs"])
def test_narrow_bookkeeping_reads_both_sides_of_the_same_passes(warm_inputs: bool) -> None:
    result = narrow_bookkeeping(WorkloadSpec(batch_size=2, **TINY), passes=1, warm_inputs=warm_inputs)
    assert result.omni_us > 0 and result.floor_us > 0
    assert result.bookkeeping_us == result.omni_us - result.floor_us
    with pytest.raises(ValueError, match="passes"):
        narrow_bookkeeping(WorkloadSpec(batch_size=2, **TINY), passes=0)


class _StaleMaterialize:
    """Wraps a manager; from the second decode step on, materialize returns the rows of the
    previous step for every request (what a staging page reused too early would serve)."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._last: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def materialize(self, step_id: int, req_ids: Any) -> Any:
        out = self._manager.materialize(step_id, req_ids)
        stale, self._last = self._last, out
        if stale is not None and set(stale.hidden_states) == set(out.hidden_states):
            return stale
        return out


@pytest.mark.parametrize("between", [False, True], ids=["checked-at-pass-end", "checked-between-steps"])
def test_narrow_bookkeeping_checks_every_output_either_way(between: bool) -> None:
    """The timed steps are checked against the ground truth whether the check runs after the
    pass or between steps: a manager serving a previous step's rows is caught in both modes."""
    spec = WorkloadSpec(batch_size=2, **TINY)
    narrow_bookkeeping(spec, passes=1, check_between_steps=between)  # the real manager passes
    with pytest.raises(GroundTruthError):
        narrow_bookkeeping(spec, passes=1, check_between_steps=between,
                           manager_factory=lambda config, eager: _StaleMaterialize(
                               manager_module.OmniPrefixCacheManager(config, eager=eager)))
