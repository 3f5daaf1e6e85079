"""The TLC (java) processes this Python process started, so an interrupt can end them at once.

Owns: the set of live TLC processes (``started``/``ended``: the threads that start and reap
them) and the stop flag (``stop_all``: the thread that caught Ctrl-C). Once stopped, no new
TLC process may start (``start`` raises ``TLCStopped``), so worker threads that were waiting
on a killed run return instead of rerunning it: ``omni-cache verify`` ends within a moment of
Ctrl-C and leaves no java behind.

Upholds nothing of I1..I13: it only makes the model checking interruptible.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import subprocess
import threading
from collections.abc import Iterator
from typing import Any


class TLCStopped(RuntimeError):
    """The run was interrupted: no further TLC process is started."""


_lock = threading.Lock()
_live: set[subprocess.Popen[Any]] = set()  # guarded by _lock; mutated by start() and ended()
_stopped = threading.Event()  # set by stop_all(); cleared by reset() (tests, a new run)


def start(cmd: list[str], **popen: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(cmd, **popen)``, remembered until ``ended``; refused after ``stop_all``."""
    with _lock:
        if _stopped.is_set():
            raise TLCStopped("interrupted: no new TLC run is started")
        proc = subprocess.Popen(cmd, **popen)
        _live.add(proc)
    return proc


def ended(proc: subprocess.Popen[Any]) -> None:
    """Forget ``proc`` (it has exited or been killed)."""
    with _lock:
        _live.discard(proc)


def stopped() -> bool:
    return _stopped.is_set()


def stop_all() -> int:
    """Refuse new TLC processes and kill every live one; the number killed."""
    with _lock:
        _stopped.set()
        procs = list(_live)
    for proc in procs:
        with contextlib.suppress(OSError):
            proc.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        ended(proc)
    return len(procs)


def reset() -> None:
    """Allow TLC processes again (a new run in the same Python process)."""
    _stopped.clear()


@contextlib.contextmanager
def executor(jobs: int) -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """A thread pool for TLC runs that, on Ctrl-C or any error, cancels what has not started,
    kills the running TLC processes and does not wait for the rest (a clean exit waits)."""
    reset()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        stop_all()
        raise
    pool.shutdown(wait=True)
