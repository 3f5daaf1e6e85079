"""Small threading helpers of the runtime.

Owns: ``OwnedLock`` (the manager's state lock, which knows its owner so I11
tests can assert that no wait, copy or flush runs under it),
``caller_location`` (where a step was saved, for the I2 timeout message and
``shutdown``'s report) and ``SaveGate`` (the saves in progress, which
``shutdown`` waits for so a save that claimed its page lands, contract 4.6).
``LockWrap`` is the type of the lock instrumentation seam: every runtime lock
owner's ``wrap_lock(wrap)`` guards it with ``wrap(lock)`` until the undo it
returns runs (``OmniPrefixCacheManager.wrap_locks`` does all of them; the
bench's ``--profile`` times lock waits with it).

Upholds: I11 (``OwnedLock.held_by_current_thread`` lets tests assert that no
wait, copy or flush runs under the state lock), contract 4.6 (``SaveGate``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

_RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__))
# The frames a saved step's location walks past: the cache itself and the engine wiring beside it
# (``omni_cache/integration``, which calls the manager on an engine's behalf). Anything else -- an
# engine, a user's driver, or the package's harness and CLI, which call the manager as an engine
# does -- is where the step was saved.
# A lock -> a lock-like proxy of it (``acquire``/``release``, a context manager).
LockWrap = Callable[[Any], Any]

_CACHE_DIRS = tuple(os.path.join(os.path.dirname(_RUNTIME_DIR), d) + os.sep for d in ("runtime", "integration"))


def caller_location() -> str:
    """file:line of the first frame outside the cache (where a step was saved): outside
    ``omni_cache/runtime`` and ``omni_cache/integration``."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_CACHE_DIRS):
            break
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


class OwnedLock:
    """A plain (non-reentrant) lock that knows its owner thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> OwnedLock:
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc: object) -> None:
        self._owner = None
        self._lock.release()

    def held_by_current_thread(self) -> bool:
        return self._owner == threading.get_ident()

    def wrap_lock(self, wrap: LockWrap) -> Callable[[], None]:
        """Instrumentation seam: take and release ``wrap(lock)`` instead of the inner lock until
        the returned undo runs. Only while no thread holds it."""
        inner = self._lock
        self._lock = wrap(inner)

        def undo() -> None:
            self._lock = inner

        return undo


class SaveGate:
    """Counts the ``save_outputs`` calls in progress; once closed, admits none and lets the
    closer wait until the admitted ones have left (contract 4.6: shutdown drains them)."""

    def __init__(self) -> None:
        # Guards the two fields below; mutated only by enter/leave/close_and_wait.
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._closed = False

    def enter(self) -> bool:
        """Admit one save; False once closed (the caller refuses the save)."""
        with self._cond:
            if self._closed:
                return False
            self._active += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            if self._closed and not self._active:
                self._cond.notify_all()

    def close_and_wait(self, timeout_s: float) -> int:
        """Admit no more saves; wait (bounded) until every admitted one left; return how many
        are still in progress (0 unless the wait timed out)."""
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: not self._active, timeout_s)
            return self._active
