"""A server process of the harness: started in its own session, healthy or not, stopped by SIGTERM.

Owns: ``ServerProcess`` -- one ``vllm.entrypoints.openai.api_server`` (or ``omni-cache serve``)
process on 127.0.0.1, its log file, the wait for ``/health`` (bounded; a server that exits or
never answers is an error with the log's tail) and its stop (SIGTERM to the whole process group,
then SIGKILL after a bound). ``free_port`` picks a port. Used by the served benchmark and the
served tests. Upholds: a server whose start does not complete (it exits, never answers, or the
wait is interrupted) is stopped before the error leaves the constructor: none is left running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import IO

__all__ = ["ServerProcess", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``argv`` (which must listen on ``port``) as a server process; see the module docstring."""

    def __init__(self, argv: list[str], *, port: int, log_path: Path, env: dict[str, str | None] | None = None,
                 start_timeout_s: float = 420.0) -> None:
        """``env`` is added to this process's environment; a ``None`` value removes the variable."""
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={k: v for k, v in full_env.items() if v is not None})
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException as exc:
            # NOTE: the server runs in its own session, so a Ctrl-C at the terminal never reaches it, and
            # the caller gets no object to stop: whatever ends the wait (an interrupt included) stops it
            # here, within seconds after an interrupt (the user is waiting for the prompt).
            self.stop(timeout_s=10.0 if isinstance(exc, KeyboardInterrupt) else 60.0)
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} during start:\n{self.log()[-4000:]}")
            if self.healthy(timeout_s=5.0):
                return
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"the server was not healthy within {timeout_s:.0f} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def healthy(self, timeout_s: float = 10.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def terminate(self) -> None:
        """SIGTERM to the server's process group (as a supervisor stops it)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)

    def wait(self, timeout_s: float = 120.0) -> int:
        """The server's exit code, once every process of its group (engine core, workers) is gone
        too, so their last log lines are in the log; after ``timeout_s`` the group is killed and
        ``TimeoutError`` raised."""
        deadline = time.monotonic() + timeout_s
        try:
            code = self.proc.wait(timeout=timeout_s)
            while self._group_alive():
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(self.proc.args, timeout_s)
                time.sleep(0.2)
            return code
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            raise TimeoutError(f"the server did not exit within {timeout_s:.0f} s of SIGTERM") from None

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to the group while any of its processes lives (the server, or an engine core it left),
        SIGKILL after ``timeout_s`` or at a second interrupt."""
        try:
            if self.proc.poll() is None or self._group_alive():
                self.terminate()
                try:
                    with contextlib.suppress(TimeoutError):
                        self.wait(timeout_s)
                except KeyboardInterrupt:  # asked twice: nothing of the group may outlive this process
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    raise
        finally:
            self._log.close()
