"""Protects the habits the test command enforces: ruff is clean, and the types check.

* ``ruff check omni_cache tests tools`` finds nothing (the rules in pyproject.toml).
* mypy, configured in pyproject.toml (``[tool.mypy]``), finds nothing: the whole package at
  mypy's default settings, the runtime wing under every flag ``--strict`` turns on (checked here
  against mypy's own ``--strict``, so a new strict flag in a later mypy shows up as a failure).
* Every ``# type: ignore`` in the package names its error code and says why (on its line or the
  line above): it is kept only where a third-party stub is wrong or incomplete.

mypy keeps its cache in ``.mypy_cache``: a first run takes tens of seconds, later ones a few.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ["omni_cache.runtime", "omni_cache.runtime.*"]


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_ruff_is_clean() -> None:
    done = _run("ruff", "check", "omni_cache", "tests", "tools", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def _mypy_config() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11 reads pyproject.toml")
    config: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    return config


def test_the_runtime_is_checked_under_every_strict_flag() -> None:
    pytest.importorskip("mypy", reason="the [test] extra installs mypy")
    from mypy.main import process_options
    from mypy.options import PER_MODULE_OPTIONS

    _, strict = process_options(["--strict", "-c", "pass"], require_targets=False)
    _, plain = process_options(["-c", "pass"], require_targets=False)
    names = [n for n in dir(strict) if not n.startswith("_") and not callable(getattr(strict, n))]
    turned_on = {n: getattr(strict, n) for n in names if getattr(strict, n) != getattr(plain, n)}
    assert "disallow_untyped_defs" in turned_on  # the comparison sees --strict
    config = _mypy_config()
    runtime = [o for o in config["overrides"] if o["module"] == RUNTIME]
    assert len(runtime) == 1, "pyproject.toml: one [[tool.mypy.overrides]] section for the runtime"
    sections = {**config, **runtime[0]}
    wrong = {n: (sections.get(n), v) for n, v in turned_on.items()
             if (n in PER_MODULE_OPTIONS and runtime[0].get(n) != v) or (n not in PER_MODULE_OPTIONS
                                                                          and sections.get(n) != v)}
    assert wrong == {}, f"flag: (pyproject.toml's value, --strict's value): {wrong}"


def test_mypy_finds_nothing() -> None:
    pytest.importorskip("mypy", reason="the [test] extra installs mypy")
    done = _run("mypy", timeout=600)  # the files and settings of [tool.mypy]
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert re.search(r"^Success: no issues found in \d+ source files", done.stdout, re.M), done.stdout


_IGNORE = re.compile(r"#\s*type:\s*ignore(\[[a-z-]+(?:,\s*[a-z-]+)*\])?(.*)$")


def unexplained_ignores(text: str) -> list[int]:
    """Lines of ``text`` whose ``type: ignore`` names no error code or gives no reason."""
    bad = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _IGNORE.search(line)
        if m is None:
            continue
        reason_here = m.group(2).strip().startswith("#") and len(m.group(2).strip()) > 10
        above = lines[i - 1].strip() if i else ""
        reason_above = above.startswith("#") and len(above) > 10
        if m.group(1) is None or not (reason_here or reason_above):
            bad.append(i + 1)
    return bad


def test_every_type_ignore_names_its_code_and_why() -> None:
    found = {str(p.relative_to(ROOT)): lines for p in sorted((ROOT / "omni_cache").rglob("*.py"))
             if (lines := unexplained_ignores(p.read_text(encoding="utf-8")))}
    assert found == {}
    assert unexplained_ignores("x = f()  # type: ignore\n"
                               "y = g()  # type: ignore[attr-defined]\n"
                               "z = h()  # type: ignore[attr-defined]  # the stub omits h's result\n"
                               "# the stub omits it\n"
                               "w = k()  # type: ignore[attr-defined]\n") == [1, 2]
