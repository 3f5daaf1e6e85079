"""Driving pipeline runs: one at a time, or several in lockstep.

Owns: ``RunStats`` (one run's counts and times), ``Drive`` (what a run produced), ``PipelineRun``
(one run -- the planned turns arrive at their steps, the thinker steps, each request it
finishes goes onto the handoff queue, the talker takes it in the same pipeline step and steps
too -- advanced one pipeline step at a time), ``drive`` (one run to its end) and
``drive_together`` (several runs, each with its own thinker and talker engines, advanced in
lockstep: a step of each in turn, the order rotating every round).

Why lockstep: on a machine shared with other jobs a burst of load lasts seconds; runs one
after the other each meet a different load, and their time ratios move by tens of percent.
Interleaved step by step, every run meets the same bursts. Each run's times are the sums of
its own steps' times (wall and process CPU), the checker's own time taken out; a run never
waits for another run's step inside its own timers.

Upholds nothing itself (the checks are the stages' and ``pipeline.checks``').
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

from omni_cache.harness.pipeline.stages import StageTimers
from omni_cache.harness.pipeline.workload import PlannedTurn, resolve_prompt

__all__ = ["Drive", "PipelineRun", "RunStats", "drive", "drive_together"]


@dataclass
class RunStats:
    """One pipeline run (with or without prefix caching on the thinker)."""

    finished: int = 0
    talker_finished: int = 0
    pipeline_steps: int = 0
    prefill_tokens: int = 0
    hit_tokens: int = 0  # the engine's num_cached_tokens, summed over requests
    hit_requests: int = 0
    thinker_s: float = 0.0
    end_to_end_s: float = 0.0
    talker_s: float = 0.0
    thinker_cpu_s: float = 0.0  # process CPU time, all threads
    end_to_end_cpu_s: float = 0.0
    overlap_steps: int = 0  # pipeline steps in which both engines stepped
    timers: StageTimers = field(default_factory=StageTimers)


@dataclass
class Drive:
    """What one pipeline run produced: stats, each turn's prompt and answer, the talker's request names."""

    stats: RunStats
    prompts: dict[str, tuple[int, ...]]
    answers: dict[str, tuple[int, ...]]
    sent: list[str]


class PipelineRun:
    """One pipeline run of ``plan`` on a thinker stage and a talker stage; the talker's requests are
    named ``prefix`` + turn. ``step`` advances one pipeline step and says whether the run goes on."""

    def __init__(self, thinker: Any, talker: Any, plan: list[PlannedTurn], *, turn_gap: int, steps_limit: int,
                 prefix: str = "") -> None:
        self.thinker, self.talker, self.prefix = thinker, talker, prefix
        self.turn_gap, self.steps_limit = turn_gap, steps_limit
        self.stats = RunStats()
        self.children: dict[str, list[PlannedTurn]] = collections.defaultdict(list)
        self.due: list[tuple[int, PlannedTurn]] = []
        for turn in plan:
            if turn.parent is None:
                self.due.append((turn.arrive_step, turn))
            else:
                self.children[turn.parent].append(turn)
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.answers: dict[str, tuple[int, ...]] = {}
        self.handoff: collections.deque[str] = collections.deque()  # finished, not yet taken by the talker
        self.sent: list[str] = []
        self.step_no = 0
        self.done = False
        self._talker0 = talker.step_s
        self._wall = self._cpu = 0.0  # this run's own steps, summed

    def step(self) -> bool:
        """One pipeline step (timed as this run's own); False once the run is over."""
        if self.done:
            return False
        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            self._step()
        finally:
            self._wall += time.perf_counter() - t0
            self._cpu += time.process_time() - cpu0
        return not self.done

    def _step(self) -> None:
        thinker, talker, due = self.thinker, self.talker, self.due
        step = self.step_no
        due.sort(key=lambda d: d[0])
        while due and due[0][0] <= step:
            turn = due.pop(0)[1]
            self.prompts[turn.name] = resolve_prompt(turn, self.prompts, self.answers)
            thinker.add(turn.name, self.prompts[turn.name], turn.max_tokens)
        stepped = False
        if thinker.busy():
            stepped = True
            for name, answer in thinker.step():
                self.answers[name] = answer
                self.handoff.append(name)
                due.extend((step + self.turn_gap, child) for child in self.children.pop(name, ()))
        while self.handoff:
            name = self.handoff.popleft()
            talker.add(self.prefix + name, thinker.prompt_rows(name))
            self.sent.append(self.prefix + name)
        if talker.busy():
            self.stats.overlap_steps += int(stepped)
            talker.step()
        if not due and not thinker.busy() and not talker.busy():
            self.done = True
            return
        step += 1
        if not thinker.busy() and not talker.busy() and due:
            step = max(step, min(d[0] for d in due))
        if step >= self.steps_limit:
            raise RuntimeError(f"the pipeline did not finish within {self.steps_limit} steps")
        self.step_no = step

    def result(self) -> Drive:
        stats, thinker, talker = self.stats, self.thinker, self.talker
        t = thinker.timers
        stats.pipeline_steps = self.step_no + 1
        stats.finished = len(self.answers)
        stats.talker_finished = sum(1 for n in self.sent if n in talker.outputs)
        stats.prefill_tokens = thinker.prefill_tokens
        stats.hit_tokens = sum(thinker.cached_tokens.values())
        stats.hit_requests = sum(1 for v in thinker.cached_tokens.values() if v > 0)
        stats.thinker_s = t.step_s - t.checker_s
        stats.end_to_end_s = self._wall - t.checker_s
        stats.thinker_cpu_s = t.step_cpu_s - t.checker_cpu_s
        stats.end_to_end_cpu_s = self._cpu - t.checker_cpu_s
        stats.talker_s = talker.step_s - self._talker0
        stats.timers = t
        return Drive(stats, self.prompts, self.answers, self.sent)


def drive(thinker: Any, talker: Any, plan: list[PlannedTurn], *, turn_gap: int, steps_limit: int,
          prefix: str = "") -> Drive:
    """One pipeline run to its end."""
    run = PipelineRun(thinker, talker, plan, turn_gap=turn_gap, steps_limit=steps_limit, prefix=prefix)
    while run.step():
        pass
    return run.result()


def drive_together(runs: list[PipelineRun], *, first: int = 0) -> list[Drive]:
    """``runs`` (each with its own engines) in lockstep: one step of each in turn, the run that goes
    first rotating every round (starting with ``runs[first]``), until all are over."""
    live = list(range(len(runs)))
    offset = first
    while live:
        order = live[offset % len(live):] + live[:offset % len(live)]
        for i in order:
            if not runs[i].step():
                live.remove(i)
        offset += 1
    return [run.result() for run in runs]
