"""Trace validation: recorded runtime transitions replayed against the spec.

Owns: ``replay`` (fast, pure Python: every ``TraceEvent`` must be an edge of
its state table from the object's current state, plus the step-id rules of
the staging slot), ``check_trace_tlc`` (generates a TLA+ module whose
``Trace`` constant is the recorded staging-slot events and a spec that steps
through it with ``tla/staging/StagingSlot.tla``'s ``Fires``; TLC accepts with
exit 0, rejects by deadlock (a step the spec does not allow) or invariant),
and ``validate_trace``, the helper other tests call on a ``TraceRecorder``.

Upholds (by checking runtime traces): the staging-slot and write machines
only take table edges; I1 along the trace (a step id is issued once, consumed
once, only while saved on the slot it was saved in, and released with it);
I2 along the trace (no more live step ids than staging slots).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from omni_cache.states import ALL_TABLES, STAGING_TABLE, StateTable
from omni_cache.trace import TraceEvent, TraceRecorder
from omni_cache.verify.tlc import (
    EXIT_DEADLOCK,
    EXIT_OK,
    default_tla_dir,
    parse_tlc_output,
    run_tlc,
)

_TABLES = {t.name: t for t in ALL_TABLES}


class TraceReplayError(AssertionError):
    """A recorded event the state table (or the step-id protocol) does not allow."""

    def __init__(self, index: int, event: TraceEvent, reason: str) -> None:
        self.index = index
        self.event = event
        self.reason = reason
        super().__init__(f"trace event #{index} {event}: {reason}")


def _events(trace: TraceRecorder | Iterable[TraceEvent]) -> list[TraceEvent]:
    return trace.events() if isinstance(trace, TraceRecorder) else list(trace)


def replay(
    events: TraceRecorder | Iterable[TraceEvent], table: StateTable | None = None
) -> dict[tuple[str, str], str]:
    """Replay ``events`` against ``table`` (or each event's own table); return final states.

    Raises ``TraceReplayError`` at the first event that is not a legal edge
    from its object's current state (objects start in the table's initial
    state), and, for staging slots, at the first step-id violation. With
    ``table`` given, events of other machines are ignored.
    """
    state: dict[tuple[str, str], str] = {}
    slot_step: dict[str, int | None] = {}
    issued: set[int] = set()
    live: set[int] = set()
    for index, ev in enumerate(_events(events)):
        if table is not None and ev.machine != table.name:
            continue
        tab = table or _TABLES.get(ev.machine)
        if tab is None:
            raise TraceReplayError(index, ev, f"unknown machine {ev.machine!r}")
        key = (ev.machine, ev.obj)
        current = state.get(key, tab.initial)
        if ev.source != current:
            raise TraceReplayError(index, ev, f"recorded source {ev.source!r} but {ev.obj} is in {current!r}")
        if (ev.source, ev.trigger, ev.dest) not in tab.edges():
            raise TraceReplayError(
                index, ev, f"{ev.source} -{ev.trigger}-> {ev.dest} is not an edge of {tab.name}"
            )
        if tab.name == STAGING_TABLE.name:
            _check_step_id(index, ev, slot_step, issued, live)
        state[key] = ev.dest
    return state


def _check_step_id(
    index: int, ev: TraceEvent, slot_step: dict[str, int | None], issued: set[int], live: set[int]
) -> None:
    held = slot_step.get(ev.obj)
    if ev.trigger == "save":
        if ev.step_id is None or ev.step_id in issued:
            raise TraceReplayError(index, ev, f"save issues step id {ev.step_id}, which is not fresh (I1)")
        issued.add(ev.step_id)
        live.add(ev.step_id)
        slot_step[ev.obj] = ev.step_id
        slots = {o for o, s in slot_step.items() if s is not None and s in live}
        if len(live) > len(slots):  # pragma: no cover - cannot happen: one live id per slot
            raise TraceReplayError(index, ev, "more live step ids than slots holding them (I2)")
    elif ev.trigger == "consume":
        if ev.step_id not in live or held != ev.step_id:
            raise TraceReplayError(
                index, ev, f"consume of step id {ev.step_id}, but {ev.obj} holds live step id "
                f"{held if held in live else None} (I1: exactly once, only while saved)"
            )
        live.discard(ev.step_id)
    elif ev.trigger == "release":
        if ev.step_id != held:
            raise TraceReplayError(index, ev, f"release names step id {ev.step_id}, {ev.obj} held {held}")
        slot_step[ev.obj] = None


# ---- TLC trace check ----------------------------------------------------------
_NO_STEP = -1
_K_RE = re.compile(r"^/\\ k = (\d+)$", re.M)


def _tla_string(text: str) -> str:
    return json.dumps(text)  # a JSON string of ASCII text is a TLA+ string literal


def trace_module(events: Sequence[TraceEvent], name: str = "StagingTrace") -> str:
    """A TLA+ module that replays staging-slot ``events`` against StagingSlot's Fires."""
    slots = sorted({e.obj for e in events}) or ["staging slot 0"]
    records = ",\n    ".join(
        f"[slot |-> {_tla_string(e.obj)}, trigger |-> {_tla_string(e.trigger)}, "
        f"src |-> {_tla_string(e.source)}, dst |-> {_tla_string(e.dest)}, "
        f"step |-> {_NO_STEP if e.step_id is None else int(e.step_id)}]"
        for e in events
    )
    return f"""---- MODULE {name} ----
\\* Generated by omni_cache.verify.traces from a recorded runtime trace
\\* ({len(events)} staging-slot events). Accepted iff TLC exits 0.
EXTENDS Integers, Sequences, FiniteSets, StagingSlot

NoStep == {_NO_STEP}
Slots == {{{", ".join(_tla_string(s) for s in slots)}}}
Trace == <<
    {records}
    >>

VARIABLES k, st, sid, live, used
vars == <<k, st, sid, live, used>>

Init == /\\ k = 0
        /\\ st = [s \\in Slots |-> "free"]
        /\\ sid = [s \\in Slots |-> NoStep]
        /\\ live = {{}}
        /\\ used = {{}}

\\* The step-id protocol (I1): a save issues a fresh id on its slot; a consume
\\* takes a live id only on the slot holding it; a release names that id.
StepIds(e) ==
    CASE e.trigger = "save" ->
              /\\ e.step # NoStep /\\ e.step \\notin used
              /\\ sid' = [sid EXCEPT ![e.slot] = e.step]
              /\\ live' = live \\cup {{e.step}}
              /\\ used' = used \\cup {{e.step}}
      [] e.trigger = "consume" ->
              /\\ e.step \\in live /\\ sid[e.slot] = e.step
              /\\ live' = live \\ {{e.step}}
              /\\ UNCHANGED <<sid, used>>
      [] e.trigger = "release" ->
              /\\ e.step = sid[e.slot]
              /\\ sid' = [sid EXCEPT ![e.slot] = NoStep]
              /\\ UNCHANGED <<live, used>>
      [] OTHER -> UNCHANGED <<sid, live, used>>

\\* The next recorded event: its source is the slot's state, it is an edge of
\\* the staging-slot machine, and it keeps the step-id protocol.
Replay ==
    /\\ k < Len(Trace)
    /\\ LET e == Trace[k + 1] IN
           /\\ st[e.slot] = e.src
           /\\ Fires(e.src, e.trigger, e.dst)
           /\\ st' = [st EXCEPT ![e.slot] = e.dst]
           /\\ StepIds(e)
    /\\ k' = k + 1

Done == k = Len(Trace) /\\ UNCHANGED vars

Spec == Init /\\ [][Replay \\/ Done]_vars

\\* I2 along the trace: no more live step ids than staging slots.
Bounded == Cardinality(live) <= Cardinality(Slots)
====
"""


@dataclass(frozen=True)
class TraceCheck:
    """TLC's verdict on a trace: accepted, or where it got stuck."""

    accepted: bool
    exit_code: int
    result: str
    num_events: int
    stuck_at: int | None
    output: str

    def explain(self) -> str:
        if self.accepted:
            return f"TLC accepted the trace ({self.num_events} events)"
        where = f" at event #{self.stuck_at}" if self.stuck_at is not None else ""
        return f"TLC rejected the trace{where}: {self.result} (exit {self.exit_code})"


def check_trace_tlc(
    events: TraceRecorder | Iterable[TraceEvent],
    *,
    tla_dir: Path | None = None,
    timeout_s: float = 120.0,
) -> TraceCheck:
    """Check the staging-slot events of a trace with TLC (accepted iff exit 0)."""
    staging = [e for e in _events(events) if e.machine == STAGING_TABLE.name]
    slot_module = (tla_dir or default_tla_dir()) / "staging" / "StagingSlot.tla"
    with tempfile.TemporaryDirectory(prefix="omni-trace-") as tmp:
        work = Path(tmp)
        shutil.copy(slot_module, work / "StagingSlot.tla")
        (work / "StagingTrace.tla").write_text(trace_module(staging))
        (work / "StagingTrace.cfg").write_text("SPECIFICATION Spec\nINVARIANT Bounded\n")
        run = run_tlc(
            work / "StagingTrace.tla", work / "StagingTrace.cfg", workdir=work / "tlc", timeout_s=timeout_s
        )
    outcome = parse_tlc_output(run.output, run.exit_code)
    stuck = None
    if run.exit_code in (EXIT_DEADLOCK, 12):
        ks = _K_RE.findall(run.output)
        stuck = int(ks[-1]) if ks else None
    return TraceCheck(
        accepted=run.exit_code == EXIT_OK and outcome.result == "ok",
        exit_code=run.exit_code, result=outcome.result, num_events=len(staging),
        stuck_at=stuck, output=run.output[-4000:],
    )


def validate_trace(
    trace: TraceRecorder | Iterable[TraceEvent], *, tlc: bool = False, tla_dir: Path | None = None
) -> dict[tuple[str, str], str]:
    """Assert a recorded trace is valid: Python replay of every table, and TLC if ``tlc``.

    For other test suites: ``validate_trace(recorder)`` after driving the
    runtime with ``recorder=TraceRecorder()``. Raises ``TraceReplayError`` or
    ``AssertionError``; returns the final state of every object.
    """
    events = _events(trace)
    final = replay(events)
    if tlc:
        verdict = check_trace_tlc(events, tla_dir=tla_dir)
        if not verdict.accepted:
            raise AssertionError(verdict.explain() + "\n" + verdict.output[-1500:])
    return final
