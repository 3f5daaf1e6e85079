#!/usr/bin/env python3
"""Mutation check: deliberate bugs in the runtime must be killed by the test suite.

Owns: the list of mutants (one per contract invariant it breaks) and the loop
that applies each one, alone, to a temporary copy of the repository's package
and tests (never to the working tree), runs the tests that guard that
invariant against the copy, and reports killed/survived in a Markdown table.

Each mutant is an exact text replacement; the script asserts that the original
text occurs exactly once, so it fails loudly (exit 2) when the code moves and
the mutant no longer applies, instead of silently testing nothing. An unmutated
baseline copy must pass the same tests first.

Exit status: 0 every mutant killed; 1 a mutant survived; 2 a mutant no longer
applies, the baseline failed, or the tests could not run.

Usage:  python tools/mutation_check.py [--only I7 ...] [--timeout 300] [--keep]
Stdlib only. Runs pytest with CI=true and the Hypothesis ``mutation`` profile
(tests/conftest.py: the derandomized ci profile without shrinking).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MINE = ("tests/manager/test_manager_stateful.py", "tests/manager/test_faults.py",
        "tests/manager/test_faults_rollback.py")
LEAD_INVARIANTS = "tests/manager/test_invariants.py"


@dataclass(frozen=True)
class Mutant:
    invariant: str
    bug: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...] = MINE


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "I1", "skip the exactly-once check: a consumed step id stays consumable",
        "omni_cache/runtime/staging.py",
        "            del self._by_step[step_id]\n",
        "            pass  # MUTANT I1: the step id is never retired\n",
    ),
    Mutant(
        "I6", "serve zeros for absent rows: a hit on never-written slots is read from the pool",
        "omni_cache/runtime/tenancy.py",
        "        if absent.any():\n",
        "        if False:  # MUTANT I6: absent rows are read as zeros\n",
    ),
    Mutant(
        "I7", "skip the tenant version check: a newer tenant's rows are returned",
        "omni_cache/runtime/tenancy.py",
        "            ahead = current > expected\n",
        "            ahead = current < 0  # MUTANT I7: never look for the planned version\n",
    ),
    Mutant(
        "I7", "drop a late older write's rows (a newer tenant landed first) instead of keeping them for a pinned read",
        "omni_cache/runtime/tenancy.py",
        "                        self._preserve_late_locked(key, v, rows, slots_np, ~newer, tid)\n",
        "                        pass  # MUTANT I7: the late rows are dropped\n",
    ),
    Mutant(
        "I7", "a read that finds a newer tenant landed gives up instead of waiting for the late, in-flight write",
        "omni_cache/runtime/tenancy.py",
        "                    if row is None and version not in settled:\n",
        "                    if False:  # MUTANT I7: never wait for a late older write\n",
    ),
    Mutant(
        "I3", "release a page while a pool write still reads it",
        "omni_cache/runtime/staging.py",
        'if slot.state == "materialized" and not slot.reading and slot.num_write_holds == 0:',
        'if slot.state == "materialized" and not slot.reading:  # MUTANT I3: ignores write holds',
    ),
    Mutant(
        "I9", "drop an aborted (or finished) request's open writes",
        "omni_cache/runtime/manager.py",
        "                    to_flush.extend(self.scheduling.take_open_of_locked(req_id))\n",
        "                    to_flush.extend([])  # MUTANT I9: open writes are forgotten\n",
    ),
)


def make_copy(dest: Path) -> None:
    shutil.copytree(ROOT / "omni_cache", dest / "omni_cache",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for extra in ("pyproject.toml", "spec", "tla"):
        src = ROOT / extra
        if src.is_file():
            shutil.copy2(src, dest / extra)
        elif src.is_dir():
            shutil.copytree(src, dest / extra, ignore=shutil.ignore_patterns("__pycache__", "states"))


def apply(mutant: Mutant, dest: Path) -> None:
    target = dest / mutant.path
    text = target.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise LookupError(
            f"mutant {mutant.invariant}: the original text occurs {count} times in {mutant.path} "
            f"(expected exactly 1); the code moved -- update tools/mutation_check.py\n  text: {mutant.old!r}"
        )
    target.write_text(text.replace(mutant.old, mutant.new))


def run_tests(dest: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[str, float, str]:
    """('pass' | 'fail' | 'error' | 'timeout', seconds, output) of pytest in the copy."""
    env = {**os.environ, "CI": "true", "PYTHONPATH": str(dest), "PYTHONDONTWRITEBYTECODE": "1",
           "HYPOTHESIS_PROFILE": "mutation"}  # ci, without shrinking
    probe = subprocess.run([sys.executable, "-c", "import omni_cache; print(omni_cache.__file__)"],
                           cwd=dest, env=env, capture_output=True, text=True, timeout=60)
    where = probe.stdout.strip()
    if not where.startswith(str(dest)):
        raise RuntimeError(f"the copy's tests would import omni_cache from {where!r}, not from {dest}")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", "-o", "addopts=",
           "--timeout", str(int(timeout_s)), *tests]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout_s + 30)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return "timeout", time.perf_counter() - t0, out
    dt = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    status = {0: "pass", 1: "fail"}.get(proc.returncode, "error")
    return status, dt, out


def first_failure(output: str) -> str:
    """The first failing test and the first line of its error, from pytest's output."""
    for line in output.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            return line[:150]
    name = re.search(r"^_{3,} (.+?) _{3,}$", output, re.M)
    error = re.search(r"^\s*\|?\s*(E\s+.+|\w+(?:Error|Exception|Failure)\b.*)$", output, re.M)
    parts = [name.group(1) if name else "", error.group(1).strip() if error else ""]
    return (" - ".join(p for p in parts if p) or output.strip().splitlines()[-1])[:150]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="invariant ids to run (default: all)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run")
    ap.add_argument("--with-lead-tests", action="store_true",
                    help=f"also run {LEAD_INVARIANTS} against each mutant")
    ap.add_argument("--tests", nargs="*", help="pytest node ids to run instead of each mutant's own")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies")
    args = ap.parse_args(argv)
    known = sorted({m.invariant for m in MUTANTS})
    unknown = [i for i in args.only or () if i not in known]
    if unknown or (args.only is not None and not args.only):
        ap.error(f"--only wants invariant ids among {known}, got {args.only}")
    mutants = [m for m in MUTANTS if not args.only or m.invariant in args.only]
    names = [m.invariant for m in mutants]
    labels = [f"{n}{'abcdefgh'[names[:i].count(n)] if names.count(n) > 1 else ''}" for i, n in enumerate(names)]
    if args.tests:
        mutants = [dataclasses.replace(m, tests=tuple(args.tests)) for m in mutants]
    base = Path(tempfile.mkdtemp(prefix="omni-mutants-"))
    rows: list[tuple[str, str, str, str, str]] = []
    worst = 0
    try:
        baseline = base / "baseline"
        make_copy(baseline)
        for label, mutant in zip(labels, mutants, strict=True):  # every mutant must still apply first
            probe = base / f"probe-{label}"
            shutil.copytree(baseline / "omni_cache", probe / "omni_cache")
            try:
                apply(mutant, probe)
            except LookupError as exc:
                print(exc, file=sys.stderr)
                return 2
        all_tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests + (
            (LEAD_INVARIANTS,) if args.with_lead_tests else ())))
        status, dt, out = run_tests(baseline, all_tests, args.timeout)
        print(f"baseline (unmutated copy): {status} in {dt:.1f}s", flush=True)
        if status != "pass":
            print(out[-4000:], file=sys.stderr)
            print("the unmutated copy must pass its tests first", file=sys.stderr)
            return 2
        for label, mutant in zip(labels, mutants, strict=True):
            copy = base / f"mutant-{label}"
            make_copy(copy)
            apply(mutant, copy)
            tests = mutant.tests + ((LEAD_INVARIANTS,) if args.with_lead_tests else ())
            status, dt, out = run_tests(copy, tests, args.timeout)
            verdict = {"fail": "killed", "timeout": "killed (timeout)", "pass": "SURVIVED"}.get(status, "ERROR")
            if verdict == "SURVIVED":
                worst = max(worst, 1)
            elif verdict == "ERROR":
                worst = 2
            by = first_failure(out) if status != "pass" else "-"
            rows.append((label, mutant.bug, verdict, f"{dt:.1f}s", by))
            print(f"{label}: {verdict} in {dt:.1f}s  {by}", flush=True)
            if verdict == "ERROR":
                print(out[-4000:], file=sys.stderr)
    finally:
        if args.keep:
            print(f"copies kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    print()
    print("| invariant | deliberate bug | result | time | first failing test |")
    print("|---|---|---|---|---|")
    for inv, bug, verdict, dt, by in rows:
        print(f"| {inv} | {bug} | {verdict} | {dt} | `{by}` |")
    killed = sum(1 for r in rows if r[2].startswith("killed"))
    print(f"\n{killed}/{len(rows)} mutants killed")
    return worst


if __name__ == "__main__":
    sys.exit(main())
