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

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from omni_cache.runtime.states import ALL_TABLES, STAGING_TABLE, WRITE_TABLE, StateTable
from omni_cache.runtime.trace import TraceEvent, TraceRecorder
from omni_cache.verify.tenancy_trace import check_tenancy_trace_tlc, has_tenancy_notes
from omni_cache.verify.tlc import default_tla_dir
from omni_cache.verify.trace_tlc import TraceCheck, trace_cfg
from omni_cache.verify.trace_tlc import run_trace_spec as _run_trace_spec
from omni_cache.verify.trace_tlc import tla_string as _tla_string

_TABLES = {t.name: t for t in ALL_TABLES}


class TraceReplayError(AssertionError):
    """A recorded event the state table (or the step-id protocol) does not allow."""

    def __init__(self, index: int, event: TraceEvent, reason: str) -> None:
        self.index = index
        self.event = event
        self.reason = reason
        super().__init__(f"trace event #{index} {event}: {reason}")


def _events(trace: TraceRecorder | Iterable[TraceEvent]) -> list[TraceEvent]:
    return trace.events(notes=True) if isinstance(trace, TraceRecorder) else list(trace)


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
        if ev.kind != "fire" or (table is not None and ev.machine != table.name):
            continue  # notes move no machine (the TLA+ trace specs read them)
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
_SLOT_RE = re.compile(r"(\d+)$")


def _slot_index(obj: str) -> int:
    m = _SLOT_RE.search(obj)
    return int(m.group(1)) if m else -1


def _staging_record(e: TraceEvent) -> str:
    reading = e.get("reading", None)
    return (
        f"[ev |-> {_tla_string(e.trigger)}, slot |-> {_slot_index(e.obj)}, "
        f"src |-> {_tla_string(e.source)}, dst |-> {_tla_string(e.dest)}, "
        f"step |-> {_NO_STEP if e.step_id is None else int(e.step_id)}, "
        f"holds |-> {e.int_of('holds', -1) if e.kind == 'note' else -1}, "
        f"reading |-> {-1 if e.kind != 'note' or reading is None else int(bool(reading))}]"
    )


def trace_module(events: Sequence[TraceEvent], name: str = "StagingTraceData") -> str:
    """The generated TLA+ module defining ``Trace``: the staging events as records."""
    records = ",\n    ".join(_staging_record(e) for e in events)
    return f"""---- MODULE {name} ----
\\* Generated by omni_cache.verify.traces from a recorded runtime trace
\\* ({len(events)} staging events), for tla/staging/StagingTrace.tla.
EXTENDS Integers
Trace == <<
    {records}
    >>
====
"""


def staging_trace_constants(events: Sequence[TraceEvent]) -> dict[str, int]:
    """Staging's constants for a trace: the configured depth (the pool's "open" note), enough
    save attempts for every claim (and one spare id for a rejected never-saved id), and as many
    misbehaving calls as rejected consumes."""
    depths = {e.int_of("depth") for e in events if e.trigger == "open" and e.kind == "note"}
    if len(depths) > 1:
        raise TraceReplayError(0, events[0], f"one trace, several staging pools (depths {sorted(depths)})")
    slots = {_slot_index(e.obj) for e in events if _slot_index(e.obj) >= 0}
    depth = depths.pop() if depths else max(slots, default=0) + 1
    claims = sum(1 for e in events if e.trigger == "claim" and e.kind == "fire")
    rejects = sum(1 for e in events if e.trigger == "reject")
    return {"Depth": depth, "MaxSaves": claims + 1, "MaxBad": rejects}


def _staging_cfg(constants: dict[str, int]) -> str:
    return trace_cfg(constants, "TypeOK ExactlyOnce BoundedStaging PageExclusive NoLostPage OnePagePerSave "
                     "AttemptsAccounted", "RejectChangesNothing RejectOnlyUnknown TimeoutOnlyWhenFull WaitOnlyWhenFull")


_TID_RE = re.compile(r"^write tid (\d+)$")


def _tid(obj: str) -> int:
    m = _TID_RE.match(obj)
    if m is None:
        raise ValueError(f"not a pool write: {obj!r}")
    return int(m.group(1))


def writes_trace_data(events: Sequence[TraceEvent], name: str = "WritesTraceData") -> tuple[str, dict[str, int]]:
    """The generated module for tla/writes/WritesTrace.tla (``Trace``, ``TraceReq``) and the
    constants of Writes for it. Writes pushed to the front together form one request."""
    records: list[str] = []
    req: dict[int, int] = {}
    fronts = 0
    for e in events:
        if e.kind == "note" and e.trigger == "register":
            tid = e.int_of("tid")
            records.append(f'[ev |-> "register", tid |-> {tid}, dst |-> "-", '
                           f'deferred |-> {"TRUE" if e.get("deferred") else "FALSE"}, tids |-> <<>>]')
        elif e.kind == "note" and e.trigger in ("enqueue_back", "enqueue_front"):
            tids = list(e.ints_of("tids"))
            if not tids:
                continue
            if e.trigger == "enqueue_back":
                records += [f'[ev |-> "enqueue_back", tid |-> {t}, dst |-> "-", deferred |-> FALSE, '
                            "tids |-> <<>>]" for t in tids]
            else:
                fronts += 1
                for t in tids:
                    req[t] = -fronts  # numbered below
                seq = ", ".join(map(str, tids))
                records.append(f'[ev |-> "enqueue_front", tid |-> {tids[0]}, dst |-> "-", '
                               f"deferred |-> FALSE, tids |-> <<{seq}>>]")
        elif e.kind == "fire":
            records.append(f"[ev |-> {_tla_string(e.trigger)}, tid |-> {_tid(e.obj)}, "
                           f"dst |-> {_tla_string(e.dest)}, deferred |-> FALSE, tids |-> <<>>]")
    num_writes = max([e.int_of("tid") for e in events if e.trigger == "register"] or [1])
    # Requests: one per front batch (in order), then one per write never pushed to the front.
    numbering: dict[int, int] = {}
    for tid in range(1, num_writes + 1):
        key = req.get(tid, tid)
        if key not in numbering:
            numbering[key] = len(numbering) + 1
    trace_req = [numbering[req.get(tid, tid)] for tid in range(1, num_writes + 1)]
    body = ",\n    ".join(records) if records else ""
    text = f"""---- MODULE {name} ----
\\* Generated by omni_cache.verify.traces from a recorded runtime trace
\\* ({len(records)} write events), for tla/writes/WritesTrace.tla.
EXTENDS Integers, Sequences
Trace == <<
    {body}
    >>
TraceReq == <<{", ".join(map(str, trace_req))}>>
====
"""
    constants = {"NumWrites": num_writes, "NumReqs": len(numbering), "MaxGen": 1,
                 "MaxSeq": len(numbering) + fronts, "MaxErrors": 1}
    return text, constants


def _writes_cfg(constants: dict[str, int]) -> str:
    return trace_cfg(constants, "TypeOK QueueConsistent FailureSticks AdmissionsCounted EndedByOwner TerminalsKnown "
                     "TerminalsEnd ReplayRefused",
                     "StickyFailure FrontFirst SequenceMonotonic OwnerFixed",
                     ("ReqOf <- TraceReqOf", "Orders <- TraceOrders"))


def check_trace_tlc(
    events: TraceRecorder | Iterable[TraceEvent],
    *,
    tla_dir: Path | None = None,
    timeout_s: float = 120.0,
) -> TraceCheck:
    """Check the staging events of a trace with TLC against tla/staging/StagingTrace.tla.

    Accepted iff exit 0. ``stuck_at`` is the 0-based index (in the staging events) of the
    event the spec did not allow (deadlock) or after which an invariant broke.
    """
    staging = [e for e in _events(events) if e.machine == STAGING_TABLE.name]
    return _run_trace_spec(
        (tla_dir or default_tla_dir()) / "staging", ("StagingSlot.tla", "Staging.tla", "StagingTrace.tla"),
        "StagingTrace", trace_module(staging), _staging_cfg(staging_trace_constants(staging)),
        len(staging), timeout_s,
    )


def check_writes_trace_tlc(
    events: TraceRecorder | Iterable[TraceEvent],
    *,
    tla_dir: Path | None = None,
    timeout_s: float = 120.0,
) -> TraceCheck:
    """Check the pool-write events of a trace with TLC against tla/writes/WritesTrace.tla.

    Accepted iff exit 0; ``stuck_at`` indexes the generated ``Trace`` records (0-based).
    """
    writes = [e for e in _events(events) if e.machine == WRITE_TABLE.name]
    data, constants = writes_trace_data(writes)
    return _run_trace_spec(
        (tla_dir or default_tla_dir()) / "writes", ("WriteMachine.tla", "Writes.tla", "WritesTrace.tla"),
        "WritesTrace", data, _writes_cfg(constants), len(writes), timeout_s,
    )


def validate_trace(
    trace: TraceRecorder | Iterable[TraceEvent], *, tlc: bool = False, tla_dir: Path | None = None,
    verdicts: list[TraceCheck] | None = None,
) -> dict[tuple[str, str], str]:
    """Assert a recorded trace is valid: Python replay of every table, and TLC if ``tlc``
    (staging and writes always; tenancy whenever the trace has tenancy notes, steps with an
    immediate and a deferred write included). ``verdicts``: TLC's verdicts are appended to it.

    For other test suites: ``validate_trace(recorder)`` after driving the
    runtime with ``recorder=TraceRecorder()``. Raises ``TraceReplayError`` or
    ``AssertionError``; returns the final state of every object. An empty trace is refused
    (``AssertionError``): it validates nothing, and a manager built with a recorder always
    records the staging pool's opening, so an empty one was never wired to a manager.
    """
    events = _events(trace)
    if not events:
        raise AssertionError("validate_trace: the trace holds no events, so nothing was validated; pass the "
                             "TraceRecorder to the manager (recorder=...) before driving it")
    final = replay(events)
    if tlc:
        checks = [check_trace_tlc, check_writes_trace_tlc]
        if has_tenancy_notes(events):
            checks.append(check_tenancy_trace_tlc)
        for check in checks:
            verdict = check(events, tla_dir=tla_dir)
            if verdicts is not None:
                verdicts.append(verdict)
            if not verdict.accepted:
                raise AssertionError(f"{check.__name__}: " + verdict.explain() + "\n" + verdict.output[-1500:])
    return final
