"""Transition traces: what the runtime's machines did, in order.

Owns: ``TraceRecorder`` and ``TraceEvent``. Off by default: a machine with no
recorder pays one ``is None`` check per trigger. Traces feed trace validation
(the pure-Python replay in ``omni_cache.verify`` and TLC in ``tla/``), which
checks that the runtime only took transitions that the state tables (and so
the TLA+ model) allow.

Besides the fired triggers (``kind="fire"``), owners log *notes*
(``kind="note"``): bookkeeping that moves no machine but that the TLA+ trace
specs map to an action or a variable (a staging page's write holds and its
reader, a rejected consume, a write's queue position, a tenancy version).
A note's ``data`` carries the values the runtime holds after the event.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceEvent:
    """One fired trigger: ``obj`` went ``source`` -> ``dest`` by ``trigger``."""

    machine: str
    obj: str
    trigger: str
    source: str
    dest: str
    step_id: int | None
    kind: str = "fire"
    data: tuple[tuple[str, object], ...] = ()

    def get(self, name: str, default: object = None) -> object:
        """The value ``name`` of ``data`` (or ``default``)."""
        return next((v for k, v in self.data if k == name), default)


class TraceRecorder:
    """Append-only, thread-safe list of ``TraceEvent``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Appended by TableMachine.fire (any thread); read by tests after the run.
        self._events: list[TraceEvent] = []

    def record(
        self, machine: str, obj: str, trigger: str, source: str, dest: str, step_id: int | None
    ) -> None:
        with self._lock:
            self._events.append(TraceEvent(machine, obj, trigger, source, dest, step_id))

    def note(
        self, machine: str, obj: str, what: str, state: str, step_id: int | None, **data: object
    ) -> None:
        """Log bookkeeping ``what`` on ``obj`` (in ``state``) that moves no machine."""
        with self._lock:
            self._events.append(
                TraceEvent(machine, obj, what, state, state, step_id, "note", tuple(sorted(data.items())))
            )

    def events(self, machine: str | None = None, *, notes: bool = False) -> list[TraceEvent]:
        """The fired triggers (of ``machine``), in order; with ``notes`` the notes too."""
        with self._lock:
            return [
                e for e in self._events
                if (machine is None or e.machine == machine) and (notes or e.kind == "fire")
            ]

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
