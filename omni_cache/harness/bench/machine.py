"""The state-machine cost benchmark (docs/performance.md, "State machines").

Owns: ``run_machine_bench`` and the plain-Python baseline it compares against.
Measured in one run, interleaved, median over repeats:

  staging_pool_cycle  one claim -> save -> consume -> release cycle through the
                      real ``omni_cache.runtime.staging.StagingPool`` (its lock, its
                      condition variable, its step-id map, and the
                      ``transitions`` machine built from ``STAGING_TABLE``);
  dict_table_cycle    the same four state changes with the same structure (one
                      lock and condition, find-a-free-slot, the step-id map) but
                      a dict lookup ``(state, trigger) -> dest`` built from the
                      same ``STAGING_TABLE`` instead of ``transitions``;
  per trigger         ``Machine(model=None)`` firing ``events[name].trigger(obj)``;
                      ``TableMachine.fire`` (the runtime's wrapper); a machine with
                      ``add_model`` models firing ``obj.claim()``; a
                      ``LockedMachine(model=None)``; the bare dict lookup;
  add_model           mean µs per model when adding N models to one machine,
                      garbage collector off (it grows with N: quadratic in total).

Upholds: nothing at run time; it measures the O(1)-triggers-per-step cost the
design relies on (four staging triggers and four write triggers per step). The
baseline raises on an illegal trigger just as the machine does (I1/I3's "an
illegal trigger is a contract error"), so neither side skips the check.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from transitions import Machine
from transitions.extensions import LockedMachine

from omni_cache.runtime.states import STAGING_TABLE, StateTable, TableMachine


class _Obj:
    """A plain object the machines drive: it carries ``state``."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = STAGING_TABLE.initial


class _DictSlot:
    __slots__ = ("index", "state", "step_id")

    def __init__(self, index: int) -> None:
        self.index = index
        self.state = STAGING_TABLE.initial
        self.step_id: int | None = None


class DictTablePool:
    """The baseline: StagingPool's bookkeeping with a dict table instead of ``transitions``."""

    def __init__(self, depth: int, table: StateTable = STAGING_TABLE) -> None:
        self._next = {(s, t.trigger): t.dest for t in table.transitions for s in t.sources}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._slots = [_DictSlot(i) for i in range(depth)]
        self._by_step: dict[int, _DictSlot] = {}

    def _fire(self, slot: _DictSlot, trigger: str) -> None:
        dest = self._next.get((slot.state, trigger))
        if dest is None:
            raise RuntimeError(f"illegal trigger {trigger!r} in state {slot.state!r}")
        slot.state = dest

    def claim(self) -> _DictSlot:
        with self._cond:
            slot = next((s for s in self._slots if s.state == "free"), None)
            if slot is None:
                raise RuntimeError("no free slot")  # the bench never waits
            self._fire(slot, "claim")
            return slot

    def save(self, slot: _DictSlot, step_id: int) -> None:
        with self._cond:
            self._fire(slot, "save")
            slot.step_id = step_id
            self._by_step[step_id] = slot

    def consume(self, step_id: int) -> _DictSlot:
        with self._cond:
            slot = self._by_step.pop(step_id)
            self._fire(slot, "consume")
            return slot

    def release(self, slot: _DictSlot) -> None:
        with self._cond:
            self._fire(slot, "release")
            slot.step_id = None
            self._cond.notify_all()


class _Model:
    """A bare model for ``add_model`` (it gains trigger methods and ``state``)."""


def _transitions_spec(table: StateTable) -> dict[str, Any]:
    return {
        "states": list(table.states),
        "transitions": [{"trigger": t.trigger, "source": list(t.sources), "dest": t.dest}
                        for t in table.transitions],
        "initial": table.initial,
        "auto_transitions": False,
    }


def _per_op_us(fn: Callable[[int], None], n: int) -> float:
    t0 = time.perf_counter_ns()
    fn(n)
    return (time.perf_counter_ns() - t0) / n / 1e3


def _bench_staging_cycle(n: int) -> None:
    from omni_cache.runtime.staging import StagingPool

    pool = StagingPool(4, 16, 5.0)
    for step_id in range(1, n + 1):
        slot = pool.claim(1)
        pool.save(slot, step_id, "bench")
        pool.done_reading(pool.consume(step_id, caller="bench"))


def _bench_dict_cycle(n: int) -> None:
    pool = DictTablePool(4)
    for step_id in range(1, n + 1):
        slot = pool.claim()
        pool.save(slot, step_id)
        pool.release(pool.consume(step_id))


def _pairs(fire: Callable[[str], object], n: int) -> None:
    """``n`` triggers: claim/abort alternately (free <-> claimed, always legal)."""
    for _ in range(n // 2):
        fire("claim")
        fire("abort")


def _bench_model_none(n: int) -> None:
    machine = Machine(model=None, **_transitions_spec(STAGING_TABLE))
    events, obj = machine.events, _Obj()
    _pairs(lambda t: events[t].trigger(obj), n)


def _bench_table_machine(n: int) -> None:
    machine, obj = TableMachine(STAGING_TABLE), _Obj()
    _pairs(lambda t: machine.fire(obj, t, what="bench slot"), n)


def _bench_add_model(n: int) -> None:
    model = _Model()
    Machine(model=model, **_transitions_spec(STAGING_TABLE))
    _pairs(lambda t: getattr(model, t)(), n)


def _bench_locked(n: int) -> None:
    machine = LockedMachine(model=None, **_transitions_spec(STAGING_TABLE))
    events, obj = machine.events, _Obj()
    _pairs(lambda t: events[t].trigger(obj), n)


def _bench_dict_trigger(n: int) -> None:
    table = {(s, t.trigger): t.dest for t in STAGING_TABLE.transitions for s in t.sources}
    obj = _Obj()

    def fire(trigger: str) -> None:
        dest = table.get((obj.state, trigger))
        if dest is None:
            raise RuntimeError(trigger)
        obj.state = dest

    _pairs(fire, n)


def _add_model_us_per_model(num_models: int) -> float:
    """Mean µs per ``add_model`` over ``num_models`` models (GC off: the library's own growth)."""
    machine = Machine(model=None, **_transitions_spec(STAGING_TABLE))
    models = [_Model() for _ in range(num_models)]
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        for m in models:
            machine.add_model(m)
        return (time.perf_counter_ns() - t0) / num_models / 1e3
    finally:
        gc.enable()


@dataclass
class MachineRow:
    name: str
    what: str
    us: float  # median µs per unit
    unit: str
    repeats_us: list[float]


@dataclass
class MachineBenchResult:
    rows: list[MachineRow]
    config: dict[str, Any]

    def get(self, name: str) -> MachineRow:
        return next(r for r in self.rows if r.name == name)

    @property
    def cycle_ratio(self) -> float:
        """StagingPool cycle / dict-table cycle (how many times slower the real path is)."""
        return self.get("staging_pool_cycle").us / self.get("dict_table_cycle").us

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "rows": [asdict(r) for r in self.rows],
                "cycle_ratio": self.cycle_ratio}


CASES: tuple[tuple[str, str, Callable[[int], None], str], ...] = (
    ("staging_pool_cycle", "StagingPool claim -> save -> consume -> release (lock + transitions)",
     _bench_staging_cycle, "cycle"),
    ("dict_table_cycle", "same four changes, same lock/map, dict table from STAGING_TABLE",
     _bench_dict_cycle, "cycle"),
    ("trigger_model_none", "Machine(model=None): events[name].trigger(obj)", _bench_model_none, "trigger"),
    ("trigger_table_machine", "TableMachine.fire (the runtime's wrapper, no recorder)",
     _bench_table_machine, "trigger"),
    ("trigger_add_model", "Machine(model=obj): obj.claim() (add_model style)", _bench_add_model, "trigger"),
    ("trigger_locked", "LockedMachine(model=None): events[name].trigger(obj)", _bench_locked, "trigger"),
    ("trigger_dict", "dict lookup (state, trigger) -> dest", _bench_dict_trigger, "trigger"),
)


def run_machine_bench(
    *, cycles: int = 2000, triggers: int = 4000, repeats: int = 5,
    add_model_sizes: tuple[int, ...] = (1000, 4000, 8000),
) -> MachineBenchResult:
    """All cases, interleaved per repeat; medians."""
    samples: dict[str, list[float]] = {name: [] for name, *_ in CASES}
    for _name, _what, fn, _unit in CASES:  # warm-up (imports, caches)
        _per_op_us(fn, 20)
    for r in range(repeats):
        cases = CASES if r % 2 == 0 else tuple(reversed(CASES))
        for name, _what, fn, unit in cases:
            samples[name].append(_per_op_us(fn, cycles if unit == "cycle" else triggers))
    rows = [MachineRow(name, what, statistics.median(samples[name]), f"µs/{unit}", samples[name])
            for name, what, _fn, unit in CASES]
    _add_model_us_per_model(10)  # warm-up
    for size in add_model_sizes:
        per_model = [_add_model_us_per_model(size) for _ in range(max(1, min(3, repeats)))]
        rows.append(MachineRow(f"add_model_{size}", f"add_model of {size} models to one machine",
                               statistics.median(per_model), "µs/model", per_model))
    config = {"cycles": cycles, "triggers": triggers, "repeats": repeats,
              "add_model_sizes": list(add_model_sizes)}
    return MachineBenchResult(rows, config)
