"""Run the suite's seed- and timing-sensitive tests many times: every run must pass.

Owns the dynamic check of docs/testing-determinism.md (tests/project/test_determinism_guard.py is
the static one). Two parts, each optional:

  --seeds N     the reachability tests (SEEDED below) once per Hypothesis seed 1..N plus a few
                large ones, in the default (randomized) profile, each in its own pytest run;
  --jitter K    the files that start threads (THREADED below) K times under
                tools/jitter_plugin.py, which delays threads, committer writes and page releases.

Prints one line per run and a summary; exit 0 when every run passed, 1 otherwise, 2 on bad
arguments. Run from the repository root:

    PYTHONPATH=$PWD .venv/bin/python tools/determinism_check.py --seeds 20 --jitter 3

It takes minutes (one pytest start per seed); it is a tool for a change to these tests or to
the committer, not part of the CI command. Touches no invariant itself.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

# Tests that assert a state was reached (or reached enough of it) after a random run.
SEEDED = (
    "tests/staging/test_staging_stateful.py",
    "tests/manager/test_manager_stateful.py::test_tlc_validates_tenancy_traces_with_immediate_and_deferred_writes",
)
LARGE_SEEDS = (987654321, 2147483647, 4242424242)
TESTS = Path(__file__).resolve().parent.parent / "tests"
# What marks a test file as racing the committer, a builder or a waiter thread against the
# engine thread: it runs the async manager (``MODES`` / ``eager=False``) or starts threads.
THREAD_MARKS = re.compile(
    r"MODES|eager=False|eager = False|\[True, False\], ids=\[\"eager\", \"async\"\]|MODE = \"(async|threaded)\""
    r"|threading|Thread\(|AsyncMachine|MachineAsync|ThreadedMachine")


def threaded_files(tests: Path = TESTS) -> list[str]:
    """The test files the jitter runs cover, derived from their source (never a list that a new
    file is forgotten in); the ``vllm``/``cuda`` ones are deselected by the run's marker filter."""
    return [str(p.relative_to(tests.parent)) for p in sorted(tests.rglob("test_*.py"))
            if THREAD_MARKS.search(p.read_text())]



def _pytest(args: list[str], timeout_s: float) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not vllm and not cuda", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout_s:.0f}s"
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    return done.returncode == 0, "; ".join([*failed, lines[-1] if lines else done.stderr.strip()[-200:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=0, help="Hypothesis seeds 1..N (plus large ones) per test")
    parser.add_argument("--jitter", type=int, default=0, help="runs of the threaded files under jitter")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    args = parser.parse_args(argv)
    if args.seeds < 0 or args.jitter < 0 or (args.seeds == 0 and args.jitter == 0):
        parser.error("give --seeds N and/or --jitter K (positive)")
    env_note = f"CI={os.environ.get('CI', '')!r} HYPOTHESIS_PROFILE={os.environ.get('HYPOTHESIS_PROFILE', '')!r}"
    print(f"determinism check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {env_note}")
    runs = passed = 0
    seeds = [*range(1, args.seeds + 1), *LARGE_SEEDS] if args.seeds else []
    for target in SEEDED if seeds else ():
        for seed in seeds:
            ok, tail = _pytest([f"--hypothesis-seed={seed}", target], args.timeout)
            runs, passed = runs + 1, passed + ok
            print(f"{'ok  ' if ok else 'FAIL'} seed {seed:>10} {target}: {tail}", flush=True)
    threaded = threaded_files()
    for i in range(args.jitter):
        ok, tail = _pytest(["-p", "tools.jitter_plugin", *threaded], args.timeout)
        runs, passed = runs + 1, passed + ok
        print(f"{'ok  ' if ok else 'FAIL'} jitter run {i + 1} ({len(threaded)} files): {tail}", flush=True)
    print(f"{passed}/{runs} runs passed")
    return 0 if passed == runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
