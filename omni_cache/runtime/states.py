"""The two state tables, as data, and the one way to fire them.

Owns: ``STAGING_TABLE`` (staging-slot lifecycle) and ``WRITE_TABLE`` (pool-write
lifecycle). These tables exist here and nowhere else: the runtime builds its
``transitions`` machines from them, ``spec/`` renders its tables and Mermaid
diagrams from them, and the TLA+ conformance test compares them with the
spec's action graph.

Upholds: the "illegal trigger is a contract error" half of I1/I3 -- an illegal
trigger raises ``OmniPrefixCacheUnmatchError`` naming the object, its state, the
trigger and the step id, and changes nothing.

Cost: one ``Machine(model=None)`` per table, never ``add_model`` (quadratic)
nor ``LockedMachine`` (5x slower; callers hold their own lock). A fire uses
the dispatch map compiled from the machine's transitions (a dict lookup), or,
with ``OMNI_CACHE_LIBRARY_TRIGGERS=1``, ``machine.events[name].trigger(obj)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from transitions import Machine, MachineError

from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.trace import TraceRecorder


@dataclass(frozen=True)
class TransitionSpec:
    """One row of a state table: ``trigger`` moves ``sources`` -> ``dest``."""

    trigger: str
    sources: tuple[str, ...]
    dest: str


@dataclass(frozen=True)
class StateTable:
    """A named state machine as plain data."""

    name: str
    states: tuple[str, ...]
    initial: str
    terminal: tuple[str, ...]
    transitions: tuple[TransitionSpec, ...]
    descriptions: dict[str, str]

    @property
    def triggers(self) -> tuple[str, ...]:
        return tuple(t.trigger for t in self.transitions)

    def edges(self) -> set[tuple[str, str, str]]:
        """Every (source, trigger, dest) edge of the table."""
        return {(s, t.trigger, t.dest) for t in self.transitions for s in t.sources}

    def next_state(self, state: str, trigger: str) -> str | None:
        """The destination of ``trigger`` from ``state``, or None if illegal."""
        for t in self.transitions:
            if t.trigger == trigger and state in t.sources:
                return t.dest
        return None


STAGING_TABLE = StateTable(
    name="staging_slot",
    states=("free", "claimed", "saved", "materialized"),
    initial="free",
    terminal=(),
    transitions=(
        TransitionSpec("claim", ("free",), "claimed"),
        TransitionSpec("abort", ("claimed",), "free"),
        TransitionSpec("save", ("claimed",), "saved"),
        TransitionSpec("consume", ("saved",), "materialized"),
        TransitionSpec("release", ("materialized",), "free"),
    ),
    descriptions={
        "free": "no holder; the page may be claimed",
        "claimed": "a save took the page; the device->host copy may be in flight; no step id yet",
        "saved": "the step id is issued; its context waits for exactly one consume",
        "materialized": "the step was consumed (materialize or discard); pool writes may still read the page",
        "claim": "a save found this free page (atomic with the search, under the pool lock)",
        "abort": "the save failed after claiming; the page returns unused",
        "save": "the step id is issued and the step context snapshotted",
        "consume": "materialize or discard_step took the step id (exactly once, I1)",
        "release": "no pool write still reads the page (I3)",
    },
)

_WRITE_LIVE = ("pending", "queued", "copying", "host_ready")

WRITE_TABLE = StateTable(
    name="pool_write",
    states=("pending", "queued", "copying", "host_ready", "written", "failed"),
    initial="pending",
    terminal=("written", "failed"),
    transitions=(
        TransitionSpec("enqueue", ("pending",), "queued"),
        TransitionSpec("start_copy", ("queued",), "copying"),
        TransitionSpec("finish_copy", ("copying",), "host_ready"),
        TransitionSpec("commit", ("host_ready",), "written"),
        TransitionSpec("fail", _WRITE_LIVE, "failed"),
    ),
    descriptions={
        "pending": "registered at save; deferred rows wait on a device clone",
        "queued": "in the copy queue (finished/aborted requests go to the front)",
        "copying": "the device->host copy is in flight",
        "host_ready": "the rows are in host memory; the committer may scatter them",
        "written": "the rows are in the block pool at their KV slots",
        "failed": "the write failed; the manager is failed for good (I8)",
        "enqueue": "pushed to the copy queue (save, finish/abort, budget, or a hit that needs it)",
        "start_copy": "the device->host copy started",
        "finish_copy": "the copy event completed",
        "commit": "the committer scattered the rows into the block pool",
        "fail": "any error before the write landed",
    },
)

ALL_TABLES: tuple[StateTable, ...] = (STAGING_TABLE, WRITE_TABLE)


class Stateful(Protocol):
    """An object a table's machine drives: it carries ``state``."""

    state: str


LIBRARY_TRIGGERS_ENV = "OMNI_CACHE_LIBRARY_TRIGGERS"
"""Set to 1 to fire every trigger through ``transitions``' ``Event.trigger`` (slow path)."""


def _dest(trigger: str, source: str, dest: str | None) -> str:
    """A compiled transition's destination; the tables have no internal (destination-less) ones."""
    if dest is None:
        raise ValueError(f"transition {trigger!r} from {source!r} has no destination")
    return dest


class TableMachine:
    """One ``transitions.Machine(model=None)`` built from a ``StateTable``.

    ``fire`` is the only way the runtime changes a slot's or a write's state.
    It is not locked: the caller holds the lock that protects the object.

    Two ways to fire, with identical results (a test checks every
    (state, trigger) pair on both):
      * default: the dispatch map compiled once from the ``transitions``
        machine's own ``events[trigger].transitions[source]`` objects -- the
        library decides what is legal, and a fire costs a dict lookup;
      * ``library_triggers=True`` (or env ``OMNI_CACHE_LIBRARY_TRIGGERS=1``):
        ``machine.events[trigger].trigger(obj)``, the library's full trigger
        path (~6-13 us each here; the manager fires 8 per step).
    """

    def __init__(
        self,
        table: StateTable,
        recorder: TraceRecorder | None = None,
        *,
        library_triggers: bool | None = None,
        name_of: Callable[[Any], str] | None = None,
    ) -> None:
        self.table = table
        # Names an object in errors and traces when ``fire`` is given no ``what`` (built only then).
        self._name_of = name_of or (lambda obj: f"{table.name} {obj!r}")
        # Set once by the owner (tests and trace validation); read on every fire.
        self.recorder = recorder
        self._machine = Machine(
            model=None,
            states=list(table.states),
            transitions=[
                {"trigger": t.trigger, "source": list(t.sources), "dest": t.dest}
                for t in table.transitions
            ],
            initial=table.initial,
            auto_transitions=False,
            send_event=False,
        )
        self._events = self._machine.events
        if library_triggers is None:
            library_triggers = os.environ.get(LIBRARY_TRIGGERS_ENV, "") not in ("", "0")
        self.library_triggers = library_triggers
        # (source, trigger) -> dest, read off the library's compiled transitions.
        self.dispatch: dict[tuple[str, str], str] = {
            (source, name): _dest(name, source, transitions[0].dest)
            for name, event in self._events.items()
            for source, transitions in event.transitions.items()
        }

    def fire(self, obj: Any, trigger: str, *, what: str | None = None, step_id: int | None = None) -> None:
        """Fire ``trigger`` on ``obj``; an illegal trigger raises and changes nothing.

        ``what`` names ``obj`` in the error and the trace; without it the machine's
        ``name_of`` builds the name, only when one of those needs it.
        """
        source = obj.state
        if self.library_triggers:
            try:
                self._events[trigger].trigger(obj)
            except (MachineError, KeyError) as exc:
                raise self._illegal(source, trigger, what or self._name_of(obj), step_id) from exc
        else:
            dest = self.dispatch.get((source, trigger))
            if dest is None:
                raise self._illegal(source, trigger, what or self._name_of(obj), step_id)
            obj.state = dest
        if self.recorder is not None:
            self.recorder.record(self.table.name, what or self._name_of(obj), trigger, source, obj.state, step_id)

    def _illegal(self, source: str, trigger: str, what: str, step_id: int | None) -> OmniPrefixCacheUnmatchError:
        legal = sorted(t for (s, t) in self.dispatch if s == source)
        return OmniPrefixCacheUnmatchError(
            f"illegal {self.table.name} trigger {trigger!r} on {what} in state {source!r} "
            f"(step id {step_id}); legal triggers from {source!r}: {legal}"
        )
