"""A pytest plugin that shakes thread interleavings, to find tests that pass by the scheduler's luck.

Owns: nothing of the runtime; it only delays threads at the points where the engine, the
committer and test threads race, by a few random milliseconds:

* every ``threading.Thread`` sleeps before its target runs (a waiter thread is late to its wait);
* the committer sleeps before each write it processes (a write lands late after a save);
* a write's hold on its staging page is let go late (the page stays ``materialized`` a while
  after the write is ``written``: I3 lets it, and a test must wait for the page, not the write).

A test that asserts a state of another thread right after a call, or after a fixed sleep,
fails here where it would fail one run in fifty on a loaded machine; a test that waits on the
condition (tests/cache_helpers.py ``settle`` and ``wait_until``) passes. Load it with

    PYTHONPATH=$PWD python -m pytest -p tools.jitter_plugin tests/manager/test_faults.py

(tools/determinism_check.py does, over the files that start threads). ``OMNI_JITTER_MAX_MS``
sets the largest delay (default 15), ``OMNI_JITTER_SEED`` the delays' seed (default: the pid).
No delay is long enough to reach a runtime timeout (claims wait 2 s in the tests). Touches no
invariant; it checks the tests of I2, I3, I8, I9 and I11 are race-free.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

from omni_cache.runtime import copier, staging

_MAX_S = float(os.environ.get("OMNI_JITTER_MAX_MS", "15")) / 1000.0
# A private generator: Hypothesis seeds the global ``random`` per example, and these delays
# must not change the examples it draws. Guarded by a lock: several threads draw from it.
_RNG = random.Random(int(os.environ.get("OMNI_JITTER_SEED", os.getpid())))
_RNG_LOCK = threading.Lock()


def _pause() -> None:
    with _RNG_LOCK:
        delay = _RNG.uniform(0.0, _MAX_S)
    time.sleep(delay)


def _late_thread_run(real: Any) -> Any:
    def run(self: threading.Thread) -> None:
        _pause()
        real(self)

    return run


def _late_process(real: Any) -> Any:
    def process(self: copier.Committer, write: Any) -> None:
        if self.threaded:
            _pause()
        real(self, write)

    return process


def _late_unhold(real: Any) -> Any:
    def unhold(self: staging.StagingPool, slot: Any) -> None:
        if threading.current_thread().name == "omni-cache-committer":
            _pause()
        real(self, slot)

    return unhold


def pytest_configure(config: Any) -> None:
    threading.Thread.run = _late_thread_run(threading.Thread.run)  # type: ignore[method-assign]
    copier.Committer.process = _late_process(copier.Committer.process)  # type: ignore[method-assign]
    staging.StagingPool.unhold = _late_unhold(staging.StagingPool.unhold)  # type: ignore[method-assign]


def pytest_report_header() -> str:
    return f"jitter: threads, committer writes and page releases delayed by up to {_MAX_S * 1000:.0f} ms"
