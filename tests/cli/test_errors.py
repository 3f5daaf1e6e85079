"""A user's mistakes get one clear line and the right exit code, never a traceback.

Each case below is one of the mistakes a new user made: the
command must exit with the documented code (2: bad arguments, with the usage of
the subcommand the flag belongs to; 3: ran clean but did less than asked), name
the flag and what it accepts, and print no traceback. Runs that verified nothing,
or fewer requests than asked, are not OK.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from omni_cache.cli import main
from omni_cache.cli.args import file_write_problem, int_list, int_range, plot_path, seed_int
from omni_cache.harness.sim_engine import SimConfig, Simulation
from omni_cache.harness.sim_engine.workload import PRESETS, Workload

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


USAGE_ERRORS = [
    # (argv, the usage line that must be shown, what the one-line error must say)
    (["--bogus"], "usage: omni-cache [", "unrecognized arguments: --bogus (a COMMAND comes first"),
    ([], "usage: omni-cache [", "a COMMAND is required"),
    (["simulate", "--bogus"], "usage: omni-cache simulate", "omni-cache simulate: error: unrecognized arguments: --bogus"),
    (["verify", "--no-such-flag"], "usage: omni-cache verify", "unrecognized arguments: --no-such-flag"),
    (["simulate", "--requests", "0"], "usage: omni-cache simulate", "argument --requests: wants an integer >= 1, got 0"),
    (["simulate", "--max-batched-tokens", "100000000"], "usage: omni-cache simulate",
     "argument --max-batched-tokens: wants an integer from 1 to 1,048,576"),
    (["simulate", "--builder-delay-ms", "-1"], "usage: omni-cache simulate",
     "argument --builder-delay-ms: wants a number from 0 to 10,000, got -1"),
    (["verify", "--cfg", "README.md"], "usage: omni-cache verify", "argument --cfg: wants a .cfg file, got 'README.md'"),
    (["verify", "--cfg", "tla/staging/MCStaging.cfg", "--spec", "notes.txt"], "usage: omni-cache verify",
     "argument --spec: wants a .tla file, got 'notes.txt'"),
    (["simulate", "--builder-delay-ms", "35000"], "usage: omni-cache simulate",
     "argument --builder-delay-ms: wants a number from 0 to 10,000, got 35000"),
    (["simulate", "--num-blocks", "1"], "usage: omni-cache simulate",
     "cannot run a single chat request: the shortest needs 76 tokens"),
    (["simulate", "--num-blocks", "8"], "usage: omni-cache simulate", "the smallest that can is --num-blocks 10"),
    (["simulate", "--hidden-width", "60000", "--max-batched-tokens", "100000"], "usage: omni-cache simulate",
     "GiB of host memory"),
    (["bench", "--repeats", "0"], "usage: omni-cache bench", "argument --repeats: wants an integer from 1 to 1,000"),
    (["bench", "--decode-steps", "-1"], "usage: omni-cache bench", "argument --decode-steps: wants an integer from 0"),
    (["bench", "--quick", "--batch-sizes", "100000"], "usage: omni-cache bench",
     "argument --batch-sizes: wants comma-separated integers from 1 to 4,096"),
    (["bench", "--quick", "--batch-sizes", "1000"], "usage: omni-cache bench",
     "--batch-sizes 1000: 1000 requests need"),
    (["bench", "--threads", "0"], "usage: omni-cache bench", "argument --threads: wants an integer from 1"),
    # a flag the chosen bench would ignore is refused, naming it
    (["bench", "--machine", "--quick", "--preset", "decode13", "--batch-sizes", "4000", "--async"],
     "usage: omni-cache bench", "--preset, --batch-sizes, --async do not apply to --machine"),
    (["bench", "--memory", "--quick", "--plot", "p.png"], "usage: omni-cache bench",
     "--plot draws the default bench, not --memory"),
    (["bench", "--quick", "--widths", "256", "--dtypes", "float32"], "usage: omni-cache bench",
     "--widths, --dtypes go with --width-sweep"),
    (["bench", "--sweep", "--decode-steps", "1"], "usage: omni-cache bench", "--decode-steps >= 2, got 1"),
    # a flag the chosen run would not use is refused, never silently ignored
    (["bench", "--preset", "decode13", "--batch-sizes", "4"], "usage: omni-cache bench",
     "--batch-sizes does not apply to --preset (its own workloads)"),
    (["bench", "--sweep", "--seed", "3"], "usage: omni-cache bench", "--seed does not apply to --sweep"),
    (["bench", "--sweep", "--no-verify"], "usage: omni-cache bench", "--no-verify does not apply to --sweep"),
    (["bench", "--memory", "--repeats", "9"], "usage: omni-cache bench", "--repeats does not apply to --memory"),
    (["bench", "--machine", "--seed", "5"], "usage: omni-cache bench", "--seed does not apply to --machine"),
    (["bench", "--served", "--quick", "--async", "--seed", "3"], "usage: omni-cache bench",
     "--quick, --async, --seed do not apply to --served (a real vLLM engine's run)"),
    (["bench", "--num-prompts", "4"], "usage: omni-cache bench", "--num-prompts goes with --served"),
    (["bench", "--engine-step", "--width-sweep", "--machine", "--threads", "2"], "usage: omni-cache bench",
     "--machine, --threads do not apply to --engine-step and --width-sweep"),
    (["bench", "--width-sweep", "--widths", "200,256"], "usage: omni-cache bench",
     "--widths must be multiples of 128 (heads of 128), got 200"),
    (["bench", "--preset", "decode13", "--quick"], "usage: omni-cache bench",
     "--preset decode13 runs its own workload against its targets; --quick does not apply"),
    (["bench", "--quick", "--profile", "--decode-steps", "0"], "usage: omni-cache bench", "--decode-steps >= 1, got 0"),
    (["bench", "--plot", "x.txt"], "usage: omni-cache bench", "argument --plot: wants a file ending in .png or .svg"),
    (["bench", "--plot", "no/such/folder/x.png"], "usage: omni-cache bench", "folder 'no/such/folder' does not exist"),
    # a folder that takes no file (procfs: not even root's) is refused before the run, not after it
    (["bench", "--plot", "/proc/x.png"], "usage: omni-cache bench", "argument --plot: cannot write '/proc/x.png'"),
    (["bench", "--sweep", "/proc/x.svg"], "usage: omni-cache bench", "argument --sweep: cannot write '/proc/x.svg'"),
    (["diagram", "--write", "--path", "/proc/x.md"], "usage: omni-cache diagram",
     "argument --path: cannot write '/proc/x.md'"),
    (["diagram", "--write", "--path", "no/such/folder/state_machines.md"], "usage: omni-cache diagram",
     "argument --path: folder 'no/such/folder' does not exist"),
    (["diagram", "--check", "--machine", "write"], "usage: omni-cache diagram",
     "--machine applies to printing; --check covers both machines"),
    (["diagram", "--path", "state_machines.md"], "usage: omni-cache diagram",
     "--path names the spec file of --write/--check; printing takes no file"),
    (["verify", "--tla-dir", "no/such/tla"], "usage: omni-cache verify", "argument --tla-dir: wants an existing folder"),
    (["verify", "--jobs", "0"], "usage: omni-cache verify", "argument --jobs: wants an integer from 1 to 64, got 0"),
    (["verify", "--only", ""], "usage: omni-cache verify", "argument --only: wants a non-empty text, got ''"),
    (["verify", "--timeout", "0"], "usage: omni-cache verify", "argument --timeout: wants a number > 0"),
    (["verify", "--expect", "STARTED"], "usage: omni-cache verify", "argument --expect: wants one of ok, deadlock"),
    # Refused after parsing (they need the preset tables or the file system), with the usage all the same.
    (["simulate", "--engine", "vllm", "--preset", "chat"], "usage: omni-cache simulate",
     "--preset chat is a preset of the simulated engine; --engine vllm takes mixed, pressure"),
    (["simulate", "--engine", "vllm", "--num-blocks", "3"], "usage: omni-cache simulate",
     "--num-blocks must be at least 17"),
    (["simulate", "--preset", "pressure"], "usage: omni-cache simulate", "--preset pressure needs --engine vllm"),
    (["verify", "--only", "no-such-model"], "usage: omni-cache verify", "no manifest entry matches --only"),
    (["verify", "--cfg", "no/such.cfg"], "usage: omni-cache verify", "--cfg no/such.cfg does not exist"),
    (["verify", "--tla-dir", "."], "usage: omni-cache verify", "no manifest at"),
    # a flag of another mode is refused, never ignored; no flag is taken from a prefix of its name
    (["verify", "--all-mutants"], "usage: omni-cache verify", "--all-mutants does not apply to a manifest run"),
    (["verify", "--all", "--mutants"], "usage: omni-cache verify", "unrecognized arguments: --all"),
    (["verify", "--expect", "deadlock", "--spec", "x.tla"], "usage: omni-cache verify",
     "--spec, --expect do not apply to a manifest run"),
    (["verify", "--mutants", "--tier", "nightly", "--cfg", "x.cfg"], "usage: omni-cache verify",
     "--tier, --cfg do not apply with --mutants"),
    (["verify", "--cfg", "x.cfg", "--only", "Staging", "--tier", "all"], "usage: omni-cache verify",
     "--only, --tier do not apply with --cfg"),
    (["verify", "--mutants", "--only", "no-such-mutant"], "usage: omni-cache verify",
     "no generated mutant matches --only 'no-such-mutant': nothing was checked"),
]


@pytest.mark.parametrize(("argv", "usage", "message"), USAGE_ERRORS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_user_mistake_is_one_line_exit_2_with_the_right_usage(
    argv: list[str], usage: str, message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # relative --plot folders are looked up here (and nothing is created)
    code, out, err = _run(argv, capsys)
    assert code == 2, (argv, code, out[-500:], err[-500:])
    assert "Traceback" not in out + err
    assert err.startswith(usage), err[:200]
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and message in errors[0], err
    assert not any(tmp_path.iterdir()), "a refused command created files"


def test_the_installed_entry_point_reports_a_bad_flag_without_a_traceback() -> None:
    done = subprocess.run([sys.executable, "-m", "omni_cache.cli", "simulate", "--num-blocks", "4"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith("omni-cache simulate: error: --num-blocks 4 x --block-size 16")


def test_a_runtime_error_is_one_line_exit_1_and_debug_shows_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import omni_cache.cli.selfcheck as selfcheck

    def boom(args: Any) -> int:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(selfcheck, "run", boom)
    code, _out, err = _run(["selfcheck"], capsys)
    assert code == 1
    assert err.strip() == "omni-cache selfcheck: error: RuntimeError: disk on fire (--debug shows the traceback)"
    for argv in (["--debug", "selfcheck"], ["selfcheck", "--debug"]):
        with pytest.raises(RuntimeError, match="disk on fire"):
            main(argv)


def test_simulate_exits_3_when_requests_were_dropped_and_says_how_many(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["simulate", "--num-blocks", "16", "--json"], capsys)
    summary = json.loads(out)
    assert code == 3 and summary["ok"] and not summary["complete"]
    r = summary["requests"]
    assert r["asked"] == 128 and r["dropped_too_long"] > 0 and r["created"] + r["dropped_too_long"] == 128
    assert f"{r['dropped_too_long']} of 128 requests were dropped" in err and "--allow-incomplete" in err
    code, out, err = _run(["simulate", "--num-blocks", "16", "--allow-incomplete"], capsys)
    assert code == 0 and "result: INCOMPLETE: 128 requests asked, " in out and "dropped (too long)" in out
    assert "note:" in err


def test_a_huge_request_count_is_generated_lazily(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.perf_counter()
    code, out, err = _run(["simulate", "--requests", "100000000", "--steps-limit", "3", "--json"], capsys)
    assert time.perf_counter() - start < 60
    summary = json.loads(out)
    assert code == 3 and summary["requests"]["asked"] == 100_000_000
    assert summary["requests"]["created"] < 100 and summary["requests"]["not_reached"] > 99_999_000
    assert "--steps-limit 3 stopped the run" in err


def test_a_complete_run_says_asked_and_verified(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _err = _run(["simulate", "--requests", "6"], capsys)
    assert code == 0
    assert "result: OK: 6 requests asked, 6 run, " in out and "finished and verified whole" in out


def test_lazy_workload_draws_the_same_first_turns_as_an_eager_plan() -> None:
    # The lazy planner must not change what a seed means for single-turn presets.
    preset = PRESETS["chat"]
    lazy = Workload(preset, 40, seed=3, block_size=16, max_model_len=768)
    got = []
    step = 0
    while lazy.next_arrival_step() is not None:
        got += [(r.req_id, r.arrival_step, len(r.prompt), r.max_tokens) for r in lazy.arrivals(step)]
        step += 1
    assert len(got) == 40 and [a for _i, a, _p, _m in got] == sorted(a for _i, a, _p, _m in got)
    again = Workload(preset, 40, seed=3, block_size=16, max_model_len=768)
    assert [(r.req_id, r.arrival_step, len(r.prompt), r.max_tokens) for r in again.arrivals(10**9)] == got


def test_simulation_counts_every_request_asked() -> None:
    res = Simulation(SimConfig.from_preset("multiturn", requests=30, seed=2)).run()
    assert res.ok and res.complete
    assert res.requests_created + res.requests_skipped_after_abort + res.requests_dropped_too_long == 30
    cut = Simulation(SimConfig.from_preset("chat", requests=30, steps_limit=4)).run()
    assert cut.ok and not cut.complete and cut.incomplete_reasons()


def test_validators_name_the_range() -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="an integer from 1 to 4, got 5"):
        int_range(1, 4)("5")
    with pytest.raises(argparse.ArgumentTypeError, match="got 'x'"):
        int_range(0)("x")
    assert int_list(1, 9)("3,1,3") == [1, 3]
    for text in ("8,,3", "8,", ",", ""):  # a missing number is refused, never skipped
        with pytest.raises(argparse.ArgumentTypeError, match=r"\(an empty item\)"):
            int_list(1, 9)(text)
    with pytest.raises(argparse.ArgumentTypeError, match=r"ending in \.png or \.svg"):
        plot_path("plot.pdf")
    assert seed_int(str(2**32 - 1)) == 2**32 - 1  # a seed every generator the runs seed takes
    with pytest.raises(argparse.ArgumentTypeError, match="an integer from 0 to 4,294,967,295, got 4294967296"):
        seed_int(str(2**32))


def test_a_plot_path_is_tried_and_the_probe_leaves_nothing(tmp_path: Path) -> None:
    """The folder of a new file takes a probe file, removed at once; an existing file is opened for
    writing, never truncated; a file no one may write is refused even for root (sysfs)."""
    path = plot_path(str(tmp_path / "fig.png"))
    assert path == tmp_path / "fig.png" and list(tmp_path.iterdir()) == []
    kept = tmp_path / "kept.svg"
    kept.write_text("<svg/>")
    assert plot_path(str(kept)) == kept and kept.read_text() == "<svg/>"
    if os.path.exists("/sys/kernel/notes"):  # read-only to root as well
        assert file_write_problem(Path("/sys/kernel/notes")) == "Permission denied"


# ---------------------------------------------------------------------------------------------
# Parse first, import torch after: an argument error answers at once
# ---------------------------------------------------------------------------------------------
_PARSE_ONLY = """
import sys
from omni_cache.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    print(exc.code, sorted(m for m in ("torch", "numpy", "rich", "matplotlib", "vllm") if m in sys.modules))
"""


@pytest.mark.parametrize("argv", [["simulate", "--requests", "0"], ["bench", "--repeats", "0"],
                                  ["verify", "--jobs", "0"], ["diagram", "--machine", "nope"], ["--bogus"]])
def test_an_argument_error_is_answered_before_torch_is_imported(argv: list[str]) -> None:
    """The cost of an argument error is Python's start plus argparse: torch (seconds to import) is
    imported only by a command that runs."""
    done = subprocess.run([sys.executable, "-c", _PARSE_ONLY, *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.stdout.split("\n")[0] == "2 []", (done.stdout, done.stderr[-500:])
    assert "usage: omni-cache" in done.stderr


def test_simulate_help_offers_each_engine_its_own_presets(capsys: pytest.CaptureFixture[str]) -> None:
    from omni_cache.harness.vllm_engine.workload import PRESETS as VLLM_PRESETS

    code, out, _err = _run(["simulate", "--help"], capsys)
    assert code == 0
    help_text = " ".join(out.split())
    sim = ", ".join(sorted(PRESETS))
    real = ", ".join(sorted(VLLM_PRESETS))
    assert f"workload: {sim} (default chat); with --engine vllm: {real} (default mixed)" in help_text
    assert "{" + ",".join(sorted(set(PRESETS) | set(VLLM_PRESETS))) + "}" not in out  # no mixed choice list


def test_the_tiny_llama_model_folder_is_removed_when_the_process_exits(tmp_path: Path) -> None:
    """``simulate --engine vllm`` writes its model's config.json into a temporary folder; nothing of
    it stays in the temporary directory after the command."""
    code = ("from omni_cache.harness.vllm_engine.engine import tiny_llama_dir; import os; p = tiny_llama_dir(); "
            "print(p, os.path.isfile(os.path.join(p, 'config.json')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    path, existed = done.stdout.split()
    assert existed == "True" and Path(path).parent == tmp_path, done.stdout
    assert list(tmp_path.iterdir()) == [], "the model folder outlived the process"


def test_bench_sweep_without_a_path_writes_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``--sweep`` alone prints the table; only ``--sweep FILE.png`` writes a file (none into the
    source tree by default)."""
    import omni_cache.harness.bench.sweep as sweep

    calls: list[Any] = []
    monkeypatch.setattr(sweep, "run_sweep", lambda **kw: calls.append(kw) or [])
    monkeypatch.setattr(sweep, "sweep_table", lambda points, **kw: "TABLE")
    monkeypatch.setattr(sweep, "growth_lines", lambda points: [])
    monkeypatch.setattr(sweep, "sweep_summary", lambda points: {})
    written: list[Any] = []
    monkeypatch.setattr(sweep, "write_sweep_plot", lambda points, path, **kw: written.append(path) or Path(path))
    monkeypatch.chdir(tmp_path)
    before = {p: p.stat().st_mtime_ns for p in (ROOT / "docs").glob("*.png")}
    code, out, _err = _run(["bench", "--sweep", "--repeats", "1"], capsys)
    assert code == 0 and calls and written == [], (code, out[-500:])
    assert "no plot written (pass --sweep FILE.png for one)" in out
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "docs").glob("*.png")} == before
    code, out, _err = _run(["bench", "--sweep", "mine.png", "--repeats", "1"], capsys)
    assert code == 0 and written == [Path("mine.png")]


def test_bench_names_its_timing_difference_for_what_it_is() -> None:
    """omni_cache - floor is a difference of two timings (negative when the floor's per-request
    clones cost more than the cache's per-key copies), never called bookkeeping."""
    from omni_cache.harness.bench.report import verdict_lines

    class Result:  # what verdict_lines reads of a BenchResult
        config, results, target_ratio, ground_truth = {"quick": False}, (), 0.5, "OK"
        batch_sizes = (8, 32)
        passed = True

        def overhead_growth_us_per_request(self) -> float:
            return (-150.0 + 108.7) / 24

        def ratio(self, b: int, decode: bool = False) -> float:
            return 0.9

        def overhead_us_per_step(self, b: int) -> float:
            return -108.7 if b == 8 else -150.0

    lines = verdict_lines(Result())  # type: ignore[arg-type]
    text = "\n".join(lines)

    class NoDecode(Result):  # a run of prefill steps only: no decode ratio to print, never "nan%"
        def ratio(self, b: int, decode: bool = False) -> float:
            return float("nan") if decode else 0.9

    no_decode = verdict_lines(NoDecode())  # type: ignore[arg-type]
    assert no_decode[0].endswith("; no decode steps") and "nan" not in "\n".join(no_decode)
    assert "bookkeeping (omni_cache - floor)" not in text and "bookkeeping growth" not in text
    assert "decode step time omni_cache - floor -108.7 µs" in lines[0]
    assert "not the bookkeeping" in text and "--sweep FILE.png" in text


_PARSE_NO_VLLM = """
import sys
if sys.argv[1] == "hide-vllm":
    sys.modules["vllm"] = None  # importlib.util.find_spec("vllm") is None: as if vLLM were not installed
from omni_cache.cli import main
try:
    code = main(sys.argv[2:])
except SystemExit as exc:
    code = exc.code
print(code, "torch" in sys.modules, "vllm" in sys.modules and sys.modules["vllm"] is not None)
"""


@pytest.mark.parametrize("hide", ["hide-vllm", "keep-vllm"])
@pytest.mark.parametrize(("argv", "says"), [
    (["--kv-connector", "example", "--tp", "2"], "--kv-connector runs the thinker in this process: not with --tp 2"),
    (["--model", "hybrid", "--pp", "2"], "--model hybrid runs on one worker: --tp and --pp take the llama model only"),
    (["--kv-connector", "example", "--model", "hybrid"],
     "--kv-connector runs the llama thinker (one KV-cache group): not --model hybrid"),
    (["--speculative", "ngram", "--kv-connector", "example"], "--speculative does not combine with --kv-connector"),
    (["--kv-connector", "example", "--preset", "pressure"], "--kv-connector runs its own two-phase workload"),
])
def test_simulate_vllm_refuses_a_grid_before_torch_and_without_vllm(argv: list[str], says: str, hide: str) -> None:
    """``simulate --engine vllm`` answers a combination the real thinker does not run as ``pipeline``
    does: one line naming the flags, exit 2, before torch is imported, installed vLLM or not."""
    done = subprocess.run([sys.executable, "-c", _PARSE_NO_VLLM, hide, "simulate", "--engine", "vllm", *argv],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stdout.split("\n")[0] == "2 False False", (done.stdout, done.stderr[-800:])
    err = done.stderr.strip().splitlines()
    assert err[0].startswith("usage: omni-cache simulate") and "not installed" not in done.stderr, err
    assert err[-1].startswith("omni-cache simulate: error: ") and says in err[-1], err


def test_the_real_thinker_config_refuses_the_connector_with_another_model() -> None:
    from omni_cache.harness.vllm_engine.engine import VllmSimConfig

    with pytest.raises(ValueError, match="--kv-connector runs the llama thinker"):
        VllmSimConfig(kv_connector="example", model="hybrid")


@pytest.mark.parametrize("allow", [False, True])
def test_an_incomplete_run_exits_3_unless_allowed_and_says_why_either_way(
    allow: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both engines of ``simulate`` end an incomplete clean run here: exit 3 naming the reasons, or,
    with --allow-incomplete, exit 0 with the same reasons as notes (never silently)."""
    from omni_cache.cli.args import incomplete_exit

    code = incomplete_exit("omni-cache simulate", ["the engine got 24 KV blocks, the run asked for 48"],
                           "the run did less than asked", allow=allow)
    err = capsys.readouterr().err
    assert code == (0 if allow else 3)
    assert f"{'note' if allow else 'warning'}: the engine got 24 KV blocks" in err
    assert ("exit 3 (incomplete: the run did less than asked)" in err) is not allow
