"""The harness's server process: none is left running when its start does not complete.

Protected: ``ServerProcess`` starts its server in a session of its own (so SIGTERM reaches the
engine core and workers as a group); a Ctrl-C at the terminal therefore never reaches it, and a
constructor that raises hands the caller nothing to stop. Whatever ends the wait for ``/health``
(an interrupt, a timeout) stops the whole group first. A real child process stands in for the
server (it never answers ``/health``) with a grandchild in its group, as vLLM's engine core is.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from omni_cache.harness.served import process
from omni_cache.harness.served.process import ServerProcess, free_port

# a "server" that never listens, with a child of its own (an engine core) in its process group
_SERVER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); " \
          "time.sleep(120)"


def _record_starts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pid of every process ``ServerProcess`` starts (each its own process group's leader)."""
    started: list[int] = []
    real_popen = process.subprocess.Popen

    def popen(*args: object, **kwargs: object) -> object:
        proc = real_popen(*args, **kwargs)  # type: ignore[call-overload]
        started.append(proc.pid)
        return proc

    monkeypatch.setattr(process.subprocess, "Popen", popen)
    return started


def _group_gone(pgid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["interrupt", "timeout"])
def test_a_start_that_does_not_complete_leaves_no_server_running(how: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    started = _record_starts(monkeypatch)
    calls = []

    def healthy(self: ServerProcess, timeout_s: float = 10.0) -> bool:
        calls.append(1)
        if how == "interrupt" and len(calls) == 2:  # Ctrl-C while the server starts
            raise KeyboardInterrupt
        return False

    monkeypatch.setattr(ServerProcess, "healthy", healthy)
    expected = KeyboardInterrupt if how == "interrupt" else RuntimeError
    with pytest.raises(expected):
        ServerProcess([sys.executable, "-c", _SERVER], port=free_port(), log_path=tmp_path / "server.log",
                      start_timeout_s=3.0)
    (pid,) = started
    assert _group_gone(pid), "the server's process group is still running"


def test_a_server_that_exits_during_its_start_leaves_no_engine_core_behind(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The server process dies at start while a process it started (its engine core) lives on in its
    group: the error says so, and the group is stopped before it leaves the constructor."""
    started = _record_starts(monkeypatch)
    exits = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); " \
            "time.sleep(0.5); sys.exit(3)"
    with pytest.raises(RuntimeError, match="the server exited with 3 during start"):
        ServerProcess([sys.executable, "-c", exits], port=free_port(), log_path=tmp_path / "server.log",
                      start_timeout_s=30.0)
    (pid,) = started
    assert _group_gone(pid), "the server's engine core (its process group) is still running"
