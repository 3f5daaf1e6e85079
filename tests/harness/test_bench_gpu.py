"""Protects the GPU bench (``omni-cache bench --device cuda``): refused in one line, exit 2, without
CUDA (before torch where the machine has no NVIDIA driver), its options kept apart from the CPU
bench's, its arithmetic (where a copy ran against the next forward), and its check of every step's
rows, which must fail on a wrong row. The ``cuda``-marked tests run the measurements on a GPU
(tools/device_check.sh runs them there); here they skip.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_cache import ModelCachePolicy, PrefixCacheConfig, PrefixCacheWriteLayout
from omni_cache.cli import bench_gpu, main
from omni_cache.harness.bench import gpu
from omni_cache.runtime.manager import OmniPrefixCacheManager

ROOT = Path(__file__).resolve().parents[2]
NO_DRIVER = pytest.mark.skipif(bench_gpu.no_cuda_before_torch() is None, reason="this machine has an NVIDIA driver")

_RUN = """
import sys
from omni_cache.cli import main
code = main(sys.argv[1:])
print(code, "torch" in sys.modules)
"""


# ---- refusals -------------------------------------------------------------------------------------
@NO_DRIVER
def test_device_cuda_is_refused_in_one_line_before_torch() -> None:
    done = subprocess.run([sys.executable, "-c", _RUN, "bench", "--device", "cuda"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.stdout.split("\n")[0] == "2 False", (done.stdout, done.stderr[-500:])
    assert done.stderr.splitlines() == [
        "omni-cache bench: error: --device cuda: no CUDA device: no NVIDIA driver on this machine "
        "(no /dev/nvidiactl, no nvidia-smi)"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_a_driver_without_a_device_is_refused_once_torch_says_so(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench_gpu, "no_cuda_before_torch", lambda: None)  # as if a driver were here
    assert main(["bench", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"omni-cache bench: error: --device cuda: no CUDA device: torch {torch.__version__} sees none"]


@pytest.mark.parametrize("argv, line", [
    (["--device", "cuda", "--quick"], "--device cuda runs the GPU bench alone; it does not take --quick"),
    (["--device", "cuda", "--async", "--threads", "4"],
     "--device cuda runs the GPU bench alone; it does not take --async, --threads"),
    (["--device", "cuda", "--batch-sizes", "8"], "--device cuda runs the GPU bench alone; it does not take --batch-sizes"),
    (["--hidden-sizes", "2048"], "--hidden-sizes only applies to --device cuda"),
    (["--device", "cpu", "--step-tokens", "512", "--timed-steps", "4"],
     "--step-tokens, --timed-steps only apply to --device cuda"),
    (["--device", "cuda", "--step-tokens", "100,512"], "--step-tokens must be multiples of the block size 16, got [100]"),
])
def test_options_that_do_not_go_together_are_refused_in_one_line(argv: list[str], line: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [f"omni-cache bench: error: {line}"]


# ---- arithmetic -------------------------------------------------------------------------------------
def test_where_a_copy_ran_against_the_next_forward() -> None:
    forward = (10.0, 20.0)
    assert gpu.classify_copy((2.0, 9.0), forward) == "before"
    assert gpu.classify_copy((8.0, 12.0), forward) == "partly"
    assert gpu.classify_copy((11.0, 19.0), forward) == "inside"
    assert gpu.classify_copy((18.0, 25.0), forward) == "after"
    assert gpu.overlap_ms((8.0, 12.0), forward) == 2.0
    assert gpu.overlap_ms((2.0, 9.0), forward) == 0.0
    assert gpu.overlap_ms((11.0, 19.0), forward) == 8.0
    assert gpu.standin_layers(2048) == 36 and gpu.standin_layers(4096) == 32 and gpu.standin_layers(1024) == 32


def test_row_checksums_see_a_changed_moved_or_swapped_value() -> None:
    rows = torch.randn(6, 32).to(torch.bfloat16)
    base = gpu.row_checksums(rows)
    assert base.dtype == torch.int64 and base.shape == (6,)
    changed = rows.clone()
    changed[3, 7] = changed[3, 7] + 1
    moved = rows[[0, 1, 3, 2, 4, 5]]
    swapped = rows[:, [1, 0, *range(2, 32)]]
    for other in (changed, moved, swapped):
        assert not torch.equal(gpu.row_checksums(other), base)
    assert torch.equal(gpu.row_checksums(rows.clone()), base)


def _one_step(m: OmniPrefixCacheManager, rows: torch.Tensor, rid: str) -> int:
    from omni_cache import PrefixCacheEventKind, PrefixCacheRequestEvent

    m.new_step_starts([PrefixCacheRequestEvent(rid, PrefixCacheEventKind.STARTED, scheduled_tokens=rows.shape[0])])
    layout = PrefixCacheWriteLayout.packed([(rid, 0, rows.shape[0])], torch.arange(rows.shape[0]))
    return m.save_outputs(rows, {}, num_tokens_unpadded=rows.shape[0], num_tokens_padded=rows.shape[0],
                          write_layout=layout)


def test_the_builder_fails_the_run_on_a_row_that_is_not_the_forwards() -> None:
    """The bench's check has teeth: materialized rows whose checksum differs raise GpuBenchError
    (and the same rows with the right checksum pass)."""
    m = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=8, block_size=16, staging_depth=2,
                                                 staging_capacity_tokens=32), eager=True)
    m.register_policy(ModelCachePolicy())
    rows = torch.randn(32, 64).to(torch.bfloat16)
    builder = gpu.CheckingBuilder(m)
    builder.jobs.put((_one_step(m, rows, "a"), "a", gpu.row_checksums(rows)))
    wrong = rows.clone()
    wrong[5, 5] += 1
    builder.jobs.put((_one_step(m, rows.clone(), "b"), "b", gpu.row_checksums(wrong)))
    with pytest.raises(gpu.GpuBenchError, match=r"\(b\): materialized rows differ from the forward's output"):
        builder.finish()
    assert builder.rows_checked == 32
    assert m.shutdown() == {}


def test_the_measurements_refuse_to_run_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(gpu.GpuBenchError, match="no CUDA device"):
        gpu.measure_d2h_bandwidth(1 << 20)
    with pytest.raises(gpu.GpuBenchError, match="no CUDA device"):
        gpu.run_case(256, 64)


# ---- on a GPU -------------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [1 << 20, 64 << 20])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_pinned_device_to_host_bandwidth_is_measured(nbytes: int) -> None:
    gbps = gpu.measure_d2h_bandwidth(nbytes, repeats=3, warmup=1)
    assert 0.1 < gbps < 10_000, gbps


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_a_small_case_times_each_save_copy_and_checks_every_row() -> None:
    result = gpu.run_case(256, 64, steps=4, warmup=2, repeats=2, layers=2, d2h_gbps=10.0)
    assert result.rows_checked == 2 * (2 + 4) * 64  # every step of every cache run, warm-up included
    assert result.save_ms is not None and result.save_ms > 0
    assert result.copy_ms is not None and result.copy_ms > 0 and result.copy_vs_floor is not None
    assert sum(result.copy_placement.values()) == 2 * (4 - 1)  # each timed step but the last has a next forward
    assert result.forward_ms_base is not None and result.forward_ms_cache is not None
    assert result.overlap_fraction is not None and 0.0 <= result.overlap_fraction <= 1.0
    doc = result.to_json()
    assert doc["save_share_of_step"] is not None and doc["hidden"] == 256 and doc["tokens"] == 64


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_the_copy_timer_sees_each_side_stream_copy_and_restores_the_method() -> None:
    m = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=8, block_size=16, staging_depth=2,
                                                 staging_capacity_tokens=32), eager=False)
    assert m.use_cuda
    timer = gpu.CopyTimer(m)
    rows = torch.randn(32, 64, device="cuda").to(torch.bfloat16)
    step = _one_step(m, rows, "a")
    out = m.materialize(step, ["a"])
    assert out.hidden_states is not None and torch.equal(out.hidden_states["a"], rows.cpu())
    assert len(timer.records) == 1 and timer.records[0].nbytes == rows.nbytes
    assert timer.records[0].start.elapsed_time(timer.records[0].end) >= 0
    timer.close()
    assert "copy_into" not in vars(m.copies)
    assert m.shutdown() == {}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_bench_device_cuda_runs_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    code = main(["bench", "--device", "cuda", "--hidden-sizes", "256", "--step-tokens", "64", "--timed-steps", "3",
                 "--repeats", "1", "--forward-layers", "2", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["ground_truth"] == "ok"
    assert doc["gpu"]["d2h_gbps_pinned"] > 0 and len(doc["gpu"]["cases"]) == 1
