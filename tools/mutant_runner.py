"""Running mutants for tools/ast_mutants.py: a temporary copy, pytest per mutant, verdicts.

Owns: the copy of the package and tests (the working tree is never written), the
pytest runs (a fresh interpreter, or a fork of a runner that imported torch once),
their time limits, and each mutant's verdict (killed, killed (timeout), survived,
equivalent, error). A mutant is anything with ``id``, ``module``, ``path``,
``operator``, ``line``, ``apply(source)`` and ``diff(source)``.
Stdlib only.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def make_copy(dest: Path, root: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "states")
    shutil.copytree(root / "omni_cache", dest / "omni_cache", ignore=ignore)
    shutil.copytree(root / "tests", dest / "tests", ignore=ignore)
    for extra in ("pyproject.toml", "spec", "tla", "README.md"):
        src = root / extra
        if src.is_file():
            shutil.copy2(src, dest / extra)
        elif src.is_dir():
            shutil.copytree(src, dest / extra, ignore=ignore)


def run_tests(dest: Path, tests: tuple[str, ...], deselect: tuple[str, ...], test_timeout_s: float,
              run_timeout_s: float) -> tuple[str, float, str]:
    """('pass' | 'fail' | 'error' | 'timeout', seconds, output) of pytest in ``dest``.

    ``test_timeout_s`` bounds each test (pytest-timeout: a mutant that hangs a test is
    killed by that test); ``run_timeout_s`` bounds the whole run, generously, so a slow
    machine never turns a survivor into a "kill".
    """
    env = {**os.environ, "CI": "true", "PYTHONPATH": str(dest), "PYTHONDONTWRITEBYTECODE": "1",
           "HYPOTHESIS_PROFILE": "mutation"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", "-o", "addopts=",
           "--timeout", str(int(test_timeout_s)), *tests, *(f"--deselect={d}" for d in deselect)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=dest, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=run_timeout_s)
    except BaseException:  # the run's own timeout, or this tool being interrupted: end the whole group
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
            raise
        return "error", time.perf_counter() - t0, f"the whole run exceeded {run_timeout_s:.0f}s\n{out}"
    dt = time.perf_counter() - t0
    if proc.returncode == 1 and "Timeout (" in out:
        return "timeout", dt, out
    return {0: "pass", 1: "fail"}.get(proc.returncode, "error"), dt, out


_PRELOAD = ("numpy", "torch", "transitions")  # not pytest or its plugins: they must load (and rewrite) in the child


def run_tests_forked(dest: Path, tests: tuple[str, ...], deselect: tuple[str, ...], test_timeout_s: float,
                     run_timeout_s: float) -> tuple[str, float, str]:
    """``run_tests`` in a forked child of this process, which has imported torch & co. once.

    ``omni_cache`` is never imported here, so each child imports the (mutated) copy
    afresh. Saves the interpreter and torch start-up (seconds on a loaded machine)
    per mutant. POSIX only; ``--spawn`` uses fresh interpreters instead.
    """
    os.environ["CI"] = "true"  # before hypothesis is imported: it reads CI once
    for name in _PRELOAD:
        importlib.import_module(name)
    assert "omni_cache" not in sys.modules, "the runner must not import the package it mutates"
    args = ["-x", "-q", "-rfE", "-p", "no:cacheprovider", "-o", "addopts=", "--timeout", str(int(test_timeout_s)),
            *tests, *(f"--deselect={d}" for d in deselect)]
    with tempfile.TemporaryFile(mode="w+") as out:
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # child: never returns
            code = 3
            try:
                os.setsid()
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                os.chdir(dest)
                os.environ.update(CI="true", PYTHONPATH=str(dest), PYTHONDONTWRITEBYTECODE="1",
                                  HYPOTHESIS_PROFILE="mutation")
                sys.dont_write_bytecode = True
                sys.path.insert(0, str(dest))
                import pytest

                code = int(pytest.main(args))
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        try:
            deadline = time.monotonic() + run_timeout_s
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    out.seek(0)
                    return "error", time.perf_counter() - t0, f"the whole run exceeded {run_timeout_s:.0f}s\n{out.read()}"
                time.sleep(0.05)
        except BaseException:
            try:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            raise
        dt = time.perf_counter() - t0
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    if code == 1 and "Timeout (" in text:
        return "timeout", dt, text
    return {0: "pass", 1: "fail"}.get(code, "error"), dt, text


def check_imports_copy(dest: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(dest), "PYTHONDONTWRITEBYTECODE": "1"}
    probe = subprocess.run([sys.executable, "-c", "import omni_cache; print(omni_cache.__file__)"],
                           cwd=dest, env=env, capture_output=True, text=True, timeout=120)
    if not probe.stdout.strip().startswith(str(dest)):
        raise RuntimeError(f"the copy's tests would import omni_cache from {probe.stdout.strip()!r}, not {dest}")


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            return line[:160]
    lines = output.strip().splitlines()
    return lines[-1][:160] if lines else "?"


def run(mutants: list[Any], *, root: Path, tests: tuple[str, ...], deselect: tuple[str, ...],
        timeout_s: float, run_timeout_s: float, equivalent: dict[str, str], keep: bool = False,
        log=print, fork: bool = False) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    """Run the baseline, then each mutant against one temporary copy (restored after each)."""
    base = Path(tempfile.mkdtemp(prefix="omni-ast-mutants-"))
    results: list[dict[str, object]] = []
    try:
        copy = base / "repo"
        make_copy(copy, root)
        check_imports_copy(copy)
        runner = run_tests_forked if fork else run_tests
        status, dt, out = runner(copy, tests, deselect, timeout_s, run_timeout_s)
        log(f"baseline (unmutated copy): {status} in {dt:.1f}s")
        if status != "pass":
            raise RuntimeError(f"the unmutated copy must pass the fast tests first:\n{out[-4000:]}")
        for i, m in enumerate(mutants, 1):
            target = copy / m.path
            original = (root / m.path).read_text()
            target.write_text(m.apply(original))
            try:
                status, dt, out = runner(copy, tests, deselect, timeout_s, run_timeout_s)
            finally:
                target.write_text(original)
            verdict = {"fail": "killed", "timeout": "killed (timeout)", "pass": "survived"}.get(status, "error")
            if verdict == "error":  # not a kill: pytest could not run (or the whole run timed out)
                log(out[-3000:])
            if verdict == "survived" and m.id in equivalent:
                verdict = "equivalent"
            by = first_failure(out) if status != "pass" else ""
            results.append({"id": m.id, "module": m.module, "operator": m.operator, "line": m.line,
                            "verdict": verdict, "seconds": round(dt, 1), "by": by, "diff": m.diff(original)})
            log(f"[{i}/{len(mutants)}] {m.id} (line {m.line}): {verdict} in {dt:.1f}s {by}")
    finally:
        if keep:
            log(f"copy kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return results
