"""The next stage's side of every real-engine driver: materialize each published step id once.

Owns: ``StepConsumer`` -- it takes each ``PublishedStep`` a runner bridge queues, materializes
it, hands the outputs to the driver's ``served`` (check (a), the rows the next stage keeps) or
the error to its ``failed`` (a finding, with the step), and counts what it took; drivers run it on
a consumer thread (``run``: ``simulate --engine vllm`` in process, and each worker's probe) or
inline after each engine step (``take_waiting``: the pipeline's thinker).
``second_materialize_refused`` (a consumed id must not materialize again) and ``exactly_once``
(check (c): every published step id consumed once, a second materialize refused, nothing
unconsumed at shutdown, as mismatches) close a run. ``absorb_worker_replies`` takes the workers'
drained reports of a multi-process run: every rank's materialize errors as findings, the output
rank's forwards into the capture and its served outputs through check (a).

Upholds nothing itself: I1 and I4 are checked from outside.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omni_cache.harness.sim_engine.checker import Mismatch
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError

__all__ = ["ExactlyOnce", "StepConsumer", "absorb_worker_replies", "exactly_once", "second_materialize_refused"]


class StepConsumer:
    """Materializes the step ids ``bridge.step_ids`` publishes, each once, in publication order.

    ``served(ps, out)`` runs with the outputs and ``failed(ps, exc)`` with an error of a type in
    ``catch`` (of the materialize or of ``served``); any other error propagates. ``timed(seconds)``
    gets the time of each materialize call. Each queue item is marked done only after it was
    served or failed, so ``bridge.step_ids.join()`` returns once every published step was checked.
    """

    def __init__(self, bridge: Any, *, served: Callable[[Any, Any], None], failed: Callable[[Any, Exception], None],
                 catch: tuple[type[Exception], ...] = (Exception,),
                 timed: Callable[[float], None] | None = None) -> None:
        self.bridge = bridge
        self._served, self._failed, self._catch, self._timed = served, failed, catch, timed
        self.consumed: Counter[int] = Counter()  # step id -> times taken (one thread takes)
        self.first_step_id: int | None = None

    @property
    def taken(self) -> int:
        return sum(self.consumed.values())

    def take(self, ps: Any) -> None:
        """Materialize one published step and hand on its outputs or its error."""
        self.consumed[ps.step_id] += 1
        if self.first_step_id is None:
            self.first_step_id = ps.step_id
        try:
            start = time.perf_counter()
            try:
                out = self.bridge.hooks.materialize(ps.step_id)
            finally:
                if self._timed is not None:
                    self._timed(time.perf_counter() - start)
            self._served(ps, out)
        except self._catch as exc:  # a contract error is a finding, reported with the step
            self._failed(ps, exc)
        finally:
            self.bridge.step_ids.task_done()

    def take_waiting(self) -> None:
        """Take every step id published so far (inline, on the engine thread)."""
        while True:
            try:
                ps = self.bridge.step_ids.get_nowait()
            except queue.Empty:
                return
            self.take(ps)

    def run(self, stop: threading.Event) -> None:
        """Take step ids as they are published until ``stop`` is set and none is waiting (a thread's body)."""
        while True:
            try:
                ps = self.bridge.step_ids.get(timeout=0.05)
            except queue.Empty:
                if stop.is_set():
                    return
                continue
            self.take(ps)


def second_materialize_refused(manager: Any, step_id: int) -> bool:
    """Does ``manager`` refuse to materialize the consumed ``step_id`` again (I1)?"""
    try:
        manager.materialize(step_id, [])
    except OmniPrefixCacheUnmatchError:
        return True
    return False


@dataclass
class ExactlyOnce:
    """Check (c): every published step id consumed once (I1), a second materialize refused,
    nothing unconsumed at shutdown; ``mismatches`` says what broke."""

    published: int = 0
    consumed: int = 0
    double_consume_refused: bool = False
    unconsumed: dict[int, str] = field(default_factory=dict)
    mismatches: list[Mismatch] = field(default_factory=list)


def exactly_once(published: list[int], consumed: Counter[int], refused: bool,
                 unconsumed: dict[int, str]) -> ExactlyOnce:
    """Check (c) on a run's facts: the step ids saved (in order), how often each was taken, whether
    a second materialize of the first was refused, and what shutdown found unconsumed."""
    out = ExactlyOnce(len(published), sum(consumed.values()), refused, dict(unconsumed))
    twice = sorted(s for s, n in consumed.items() if n > 1)
    never = sorted(set(published) - set(consumed))
    if twice:
        out.mismatches.append(Mismatch(None, twice[0], None, None, None, f"step ids consumed twice: {twice[:5]}"))
    if never:
        out.mismatches.append(Mismatch(None, never[0], None, None, None, f"step ids never consumed: {never[:5]}"))
    if published and not out.double_consume_refused:
        out.mismatches.append(Mismatch(None, published[0], None, None, None,
                                       "a second materialize of a consumed step id was not refused"))
    if out.unconsumed:
        out.mismatches.append(Mismatch(None, None, None, None, None,
                                       f"unconsumed step ids at shutdown: {out.unconsumed}"))
    return out


def absorb_worker_replies(replies: list[dict[str, Any]], output_rank: int, capture: Any,
                          mismatches: list[Mismatch], *, record: Callable[[Any], None] | None = None,
                          served: Callable[[int, Any, int, Any, Any], None] | None = None) -> None:
    """The workers' drained reports (``worker_probe.drain``/``settle``/``finish``), one per rank.

    Every rank's materialize errors become findings; the output rank's forward records go to
    ``record`` (when given) and into ``capture``; every served output goes to ``served(rank,
    engine_step, step_id, spans, out)`` (when given), and the output rank's through check (a),
    where an error is a finding too.
    """
    for rank, reply in enumerate(replies):
        for engine_step, step_id, error in reply["errors"]:
            mismatches.append(Mismatch(engine_step, step_id, None, None, None, f"rank {rank}: materialize raised {error}"))
    for rec in replies[output_rank]["records"]:
        if record is not None:
            record(rec)
        capture.observe(rec)
    for rank, reply in enumerate(replies):
        for engine_step, step_id, spans, out in reply["served"]:
            if served is not None:
                served(rank, engine_step, step_id, spans, out)
            if rank == output_rank:
                try:
                    capture.check_step(engine_step, step_id, spans, out)
                except Exception as exc:  # a finding, reported with the step
                    mismatches.append(Mismatch(engine_step, step_id, None, None, None,
                                               f"check (a) raised {type(exc).__name__}: {exc}"))
