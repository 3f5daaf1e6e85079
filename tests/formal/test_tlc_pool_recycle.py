"""TLCPool's health rules (omni_cache/verify/tlc_batch.py), with a stand-in driver process.

A pooled run that ends in TLC's own error (exit 255: out of memory, an internal failure) is
no verdict on the model: ``run`` returns None so ``run_tlc`` reruns it alone, and the JVM is
retired. A driver JVM is retired after ``MAX_RUNS_PER_JVM`` runs. The stand-in answers each
request line with the exit code written in its output path's name, the way the Java driver
answers with TLC's exit code.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omni_cache.verify import tlc_batch
from omni_cache.verify.tlc_batch import MAX_RUNS_PER_JVM, TLCPool

_STAND_IN = r"""
import sys
for line in sys.stdin:
    out = line.rstrip("\n").split("\t", 1)[0]
    open(out, "w").write("stand-in TLC output\n")
    print("EXIT\t" + out.rsplit("-", 1)[1], flush=True)
"""


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> TLCPool:
    started: list[subprocess.Popen[str]] = []
    real_popen = subprocess.Popen

    def popen(cmd: list[str], **kw: object) -> subprocess.Popen[str]:
        proc = real_popen([sys.executable, "-c", _STAND_IN], **kw)  # type: ignore[call-overload]
        started.append(proc)
        return proc

    monkeypatch.setattr(tlc_batch.subprocess, "Popen", popen)
    p = TLCPool("java", tmp_path / "tla2tools.jar", tmp_path)
    p.started = started  # type: ignore[attr-defined]
    yield p
    p.close()


def test_a_tlc_error_is_rerun_alone_and_retires_the_jvm(pool: TLCPool, tmp_path: Path) -> None:
    assert pool.run([], tmp_path / "out-12", 10) == (12, "stand-in TLC output\n")
    assert pool.run([], tmp_path / "out-255", 10) is None  # run_tlc reruns it in its own JVM
    assert pool.started[0].wait(timeout=10) == 0, "the JVM that gave exit 255 must be retired"  # type: ignore[attr-defined]
    assert pool.run([], tmp_path / "out-0", 10) == (0, "stand-in TLC output\n")
    assert len(pool.started) == 2  # type: ignore[attr-defined]


def test_a_jvm_is_retired_after_max_runs(pool: TLCPool, tmp_path: Path) -> None:
    for i in range(MAX_RUNS_PER_JVM):
        assert pool.run([], tmp_path / f"out{i}-13", 10) == (13, "stand-in TLC output\n")
    assert len(pool.started) == 1  # type: ignore[attr-defined]
    assert pool.started[0].wait(timeout=10) == 0  # type: ignore[attr-defined]
    assert pool.run([], tmp_path / "out-13", 10) is not None
    assert len(pool.started) == 2  # type: ignore[attr-defined]
