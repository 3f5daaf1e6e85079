"""The async output builder: materialize on its own thread, then verify.

Owns: the builder thread and its queue of ``StepExpectation``. For each step id
the engine hands over, it calls ``manager.materialize(step_id, req_ids)`` --
while the engine thread is already in a later step, as vLLM's async output
processing does -- checks the result with ``OutputChecker`` and feeds the
hidden rows to the ``Talker``. Notices (finished/aborted requests) are handled
in queue order, after the outputs of the step that produced them.

Every step id is consumed exactly once (I1): a step that cannot be checked is
still materialized. A contract error from the manager is recorded as a
``Mismatch`` naming the step and the builder keeps draining, so the engine's
next ``save_outputs`` never waits on a dead consumer (I2, I11).

Upholds nothing itself: it checks I1 from outside and keeps I2's consumer alive.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from omni_cache.harness.sim_engine.checker import Mismatch, OutputChecker, StepExpectation, Talker


class OutputBuilder:
    """A thread that consumes step ids in order and verifies their outputs."""

    def __init__(self, manager: Any, checker: OutputChecker, talker: Talker, *, delay_s: float = 0.0) -> None:
        self.manager = manager
        # Extra latency before each materialize (a slow output builder: more lag, more claim waits).
        self.delay_s = delay_s
        self.checker = checker
        self.talker = talker
        self._queue: queue.Queue[StepExpectation | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="omni-sim-builder", daemon=True)
        self.failed = threading.Event()
        # Seconds from the save (enqueue) to the start of materialize, per step.
        self.lags_s: list[float] = []
        # Seconds spent inside materialize, per step.
        self.materialize_s: list[float] = []
        self.steps_done = 0
        # Requests whose outputs could not be checked (after a contract error): the talker skips them.
        self._poisoned: set[str] = set()

    def start(self) -> None:
        self._thread.start()

    def submit(self, exp: StepExpectation) -> None:
        exp.enqueued_at = time.perf_counter()
        self._queue.put(exp)

    def close(self, timeout_s: float = 60.0) -> None:
        """Drain the queue and stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.checker.record(Mismatch(None, None, None, None, None, f"builder did not drain within {timeout_s}s"))
            self.failed.set()

    def backlog(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        while True:
            exp = self._queue.get()
            if exp is None:
                return
            try:
                self._handle(exp)
            except Exception as exc:  # a contract error: report it, keep draining
                self._poisoned.update(exp.req_ids)
                self.checker.record(Mismatch(
                    exp.step, exp.step_id, None, None, None,
                    f"materialize raised {type(exc).__name__}: {exc}",
                ))
                self.failed.set()

    def _handle(self, exp: StepExpectation) -> None:
        if exp.step_id is not None:
            if self.delay_s > 0:
                time.sleep(self.delay_s)
            t0 = time.perf_counter()
            self.lags_s.append(t0 - exp.enqueued_at)
            out = self.manager.materialize(exp.step_id, exp.req_ids)
            self.materialize_s.append(time.perf_counter() - t0)
            found = self.checker.check_step(exp, out)
            if found:
                self.failed.set()
                self._poisoned.update(m.req_id or "" for m in found)
            for req in exp.reqs:
                if req.req_id in self._poisoned:
                    continue
                m = self.talker.receive(exp.step, req, out.hidden_states[req.req_id])
                if m is not None:
                    self._report(m)
            self.steps_done += 1
        for req_id in exp.aborted:
            self.talker.abort(req_id)
        for req_id, hashes, n in exp.finished:
            if req_id in self._poisoned:
                self.talker.abort(req_id)
                continue
            m = self.talker.finish(exp.step, req_id, hashes, n)
            if m is not None:
                self._report(m)

    def _report(self, m: Mismatch) -> None:
        self.checker.record(m)
        self.failed.set()
        if m.req_id is not None:
            self._poisoned.add(m.req_id)
