"""Thread helpers of the manager tests: a builder thread, committer pacing hooks, error checks.

Owns: ``Builder`` (runs materialize/discard tasks inline, or on a second thread
fed by a queue, collecting failures for the engine thread to raise),
``SlowCommitter``, ``HoldStep`` and ``Gate`` (``omni_cache.runtime.faults.FaultHooks`` that
pace the committer -- they inject no fault, they only widen or hold the windows in
which the engine, the builder and the committer interleave; ``Gate`` is the one "enter,
then wait for release" gate, on whichever hook a test names) and
``expect_error`` (a call must raise the documented phrase). Used by the
manager's stateful machine and the tests that hold a thread at a hook; exercises I2/I3/I7/I11 from the outside.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable

from omni_cache import OmniPrefixCacheUnmatchError
from omni_cache.runtime.faults import FaultHooks

JOIN_S = 20.0


def expect_error(phrase: str, call: Callable[[], object], exc: type[Exception] = OmniPrefixCacheUnmatchError) -> str:
    try:
        call()
    except exc as err:
        assert phrase in str(err), f"expected {phrase!r} in: {err}"
        return str(err)
    raise AssertionError(f"expected {exc.__name__} with {phrase!r}; the call returned")


class Builder:
    """Runs consume tasks inline, or on a second thread fed by a queue (threaded mode)."""

    def __init__(self, threaded: bool) -> None:
        self.errors: list[str] = []
        self.threaded = threaded
        self.q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.thread: threading.Thread | None = None
        if threaded:
            self.thread = threading.Thread(target=self._run, name="test-builder", daemon=True)
            self.thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        if self.thread is None:
            task()
        else:
            self.q.put(task)

    def _run(self) -> None:
        while (task := self.q.get()) is not None:
            try:
                task()
            except BaseException:
                self.errors.append(traceback.format_exc())
            finally:
                self.q.task_done()

    def check(self) -> None:
        assert not self.errors, "builder thread failed:\n" + "\n".join(self.errors)

    def drain(self) -> None:
        if self.thread is None:
            return
        done = threading.Event()
        self.q.put(done.set)
        assert done.wait(JOIN_S), "builder thread did not drain its queue (hang?)"
        self.check()

    def stop(self) -> None:
        if self.thread is not None:
            self.q.put(None)
            self.thread.join(JOIN_S)
            assert not self.thread.is_alive(), "builder thread did not stop"


class SlowCommitter(FaultHooks):
    """No fault: every third write lands a few ms late, widening the async windows."""

    def before_pool_write(self, write: object, key: str) -> None:
        if getattr(write, "tid", 0) % 3 == 0:
            time.sleep(0.003)



class HoldStep(FaultHooks):
    """Holds the committer inside the device->host copy of chosen steps' writes until each is released."""

    def __init__(self) -> None:
        self.entered: dict[int, threading.Event] = {}
        self.gates: dict[int, threading.Event] = {}

    def hold(self, step_id: int) -> None:
        self.entered[step_id], self.gates[step_id] = threading.Event(), threading.Event()

    def release(self, step_id: int) -> None:
        self.gates[step_id].set()

    def before_device_to_host(self, write: object) -> None:
        step_id = getattr(write, "step_id", None)
        if step_id in self.gates:
            self.entered[step_id].set()
            assert self.gates[step_id].wait(10), f"test gate of step {step_id} never opened"


class Gate(FaultHooks):
    """The tests' one "enter, then wait for release" fault gate.

    When the hook named ``hook`` (``before_device_to_host``, ``before_pool_write``,
    ``after_claim`` or ``committer_tick``) fires for a subject ``when`` accepts (the write, or
    the claimed slot; every one by default), the calling thread -- the committer, or a save --
    sets ``entered`` and waits, bounded by ``timeout_s``, until the test sets ``release``.
    ``first_only`` holds only the first such call (later ones pass). ``hook=None`` gates
    nothing by itself: a subclass calls ``hold()`` where it wants to stop.
    """

    HOOKS = ("before_device_to_host", "before_pool_write", "after_claim", "committer_tick")

    def __init__(self, hook: str | None = "before_device_to_host", when: Callable[[object], bool] | None = None,
                 *, first_only: bool = False, timeout_s: float = JOIN_S) -> None:
        if hook is not None and hook not in self.HOOKS:
            raise ValueError(f"no fault hook {hook!r} to gate (one of {self.HOOKS})")
        self.hook, self.when, self.first_only, self.timeout_s = hook, when, first_only, timeout_s
        self.entered, self.release = threading.Event(), threading.Event()

    def hold(self) -> None:
        """Set ``entered``, then wait until ``release`` is set (bounded: a test that never
        releases fails here instead of hanging)."""
        self.entered.set()
        assert self.release.wait(self.timeout_s), f"test gate on {self.hook} never opened"

    def _arrive(self, hook: str, subject: object) -> None:
        if hook != self.hook or (self.first_only and self.entered.is_set()):
            return
        if self.when is None or self.when(subject):
            self.hold()

    def before_device_to_host(self, write: object) -> None:
        self._arrive("before_device_to_host", write)

    def before_pool_write(self, write: object, key: str) -> None:
        self._arrive("before_pool_write", write)

    def after_claim(self, slot: object) -> None:
        self._arrive("after_claim", slot)

    def committer_tick(self) -> None:
        self._arrive("committer_tick", None)


def hold_first_copy() -> Gate:
    """Holds the committer inside the first write's device->host copy until ``release`` is set
    (for a write whose step id is not known before its save: ``HoldStep`` holds chosen steps)."""
    return Gate("before_device_to_host", first_only=True)
