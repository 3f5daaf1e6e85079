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
A note's ``data`` carries the values the runtime holds after the event; ``int_of``,
``ints_of``, ``strs_of`` and ``versions_of`` read them back typed (trace validation's readers).

Upholds: nothing (a record of what happened).
"""

from __future__ import annotations

import operator
import threading
from dataclasses import dataclass
from typing import SupportsIndex


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

    def int_of(self, name: str, default: int | None = None) -> int:
        """``name``'s value, an integer (a tid, plan id, slot, depth), or ``default`` when absent;
        ``TypeError`` otherwise."""
        return _as_int(self, name, self.get(name, default))

    def ints_of(self, name: str) -> tuple[int, ...]:
        """``name``'s value, a sequence of integers (slots, tids, versions); empty when absent."""
        return tuple(_as_int(self, name, v) for v in _as_sequence(self, name, self.get(name, ())))

    def strs_of(self, name: str) -> tuple[str, ...]:
        """``name``'s value, a sequence of names (keys); empty when absent."""
        return tuple(str(v) for v in _as_sequence(self, name, self.get(name, ())))

    def versions_of(self, name: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``name``'s value, ``(key, versions)`` pairs (a planned read's expected versions)."""
        pairs = []
        for pair in _as_sequence(self, name, self.get(name, ())):
            key, versions = _as_sequence(self, name, pair)
            pairs.append((str(key), tuple(_as_int(self, name, v) for v in _as_sequence(self, name, versions))))
        return tuple(pairs)


def _as_int(event: TraceEvent, name: str, value: object) -> int:
    if isinstance(value, SupportsIndex) and not isinstance(value, bool):
        return operator.index(value)
    raise TypeError(f"trace note {event.trigger!r}: {name} holds {value!r}, not an integer")


def _as_sequence(event: TraceEvent, name: str, value: object) -> tuple[object, ...]:
    if isinstance(value, (tuple, list)):
        return tuple(value)
    raise TypeError(f"trace note {event.trigger!r}: {name} holds {value!r}, not a sequence")


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
