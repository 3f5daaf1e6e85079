"""Trace validation of the KV-slot tenancy by TLC (tla/tenancy/TenancyTrace.tla).

Owns: mapping the tenancy notes a ``TraceRecorder`` holds (``SlotTenancy``'s
register, land, plan and read) onto the actions of the real Tenancy spec --
runtime KV slots and keys to the model's, per slot the k-th tenant (step) that
registers to version k, each (planned read, slot, key) to one model reader --
and ``check_tenancy_trace_tlc``, which runs TLC on the generated module.

The mapping only renames identities; what the runtime pinned and served is
compared with what the spec computes (``TracePlan``/``TraceRead``), and TLC
checks NeverSilentMiss (I6), NoStaleTenant and HitServed (I7, against the
spec's ghost history) along the trace.

A runtime step with deferred keys registers two writes per KV slot (immediate
keys, then deferred keys: disjoint key sets) as one tenant: both map to the
same model version, each to its own write in transit ``<<ver, keys>>``, and
each ``land`` note to the landing of that write (Tenancy's ``EachKeyLandsOnce``
checks every key lands once). ``split_writes`` counts such (step, slot) pairs.

Scope: the model plans hits only on slots some tenant registered a write for
(a hit refers to a block its tenant computed); a runtime hit on a slot no write
was ever registered for (a diverged KV cache, which the runtime refuses with "is
not readable", I6: tests/manager/) is left out of the trace, with its
reads. So is a hit on a slot whose newest tenant registered no write (a step that carried no
per-token key: ``SlotTenancy.take_slots``, a ``tenant`` note): in the model that tenant's
``reuse`` leaves the slot unregistered, where ``plan`` is not enabled, and the runtime refuses
such a hit with "is not readable" (I6/I7). So is a hit's slot that the runtime plans absent by its
block rule (an earlier slot of the KV block holds a newer tenant's row: a newer tenant wrote only
the block's first slots, a diverged KV cache; the plan note's ``mixed`` slots): the per-slot model
has no blocks, and the runtime refuses such a hit with "is not readable" (I6). Only the (slot, key)
readers the rule itself changed are left out (a slot absent for another reason stays in).

Upholds nothing itself: TLC checks I6 and I7 along a recorded trace.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from omni_cache.runtime.trace import TraceEvent, TraceRecorder
from omni_cache.verify.tlc import default_tla_dir
from omni_cache.verify.trace_tlc import TraceCheck, trace_cfg
from omni_cache.verify.trace_tlc import run_trace_spec as _run_trace_spec
from omni_cache.verify.trace_tlc import tla_string as _tla_string

MACHINE = "tenancy"
RAISED = -1
_UNKNOWN = 10**6  # a version no tenant has: the spec rejects it


def _record(ev: str, slot: int, ver: int = 0, keys: Iterable[int] = (), r: int = 0, key: int = 0,
            got: int = 0) -> str:
    ks = ", ".join(map(str, sorted(keys)))
    return (f"[ev |-> {_tla_string(ev)}, slot |-> {slot}, ver |-> {ver}, keys |-> {{{ks}}}, "
            f"r |-> {r}, key |-> {key}, got |-> {got}]")


def _step_id(e: TraceEvent) -> int:
    """The step that registered a write (every register note carries one)."""
    if e.step_id is None:
        raise ValueError(f"tenancy note {e.trigger!r} on {e.obj!r} carries no step id")
    return e.step_id


def tenancy_trace_data(events: Sequence[TraceEvent], name: str = "TenancyTraceData") -> tuple[str, dict[str, int]]:
    """The generated module (``Trace``) and Tenancy's constants for the tenancy notes of a trace."""
    slot_ix: dict[int, int] = {}
    key_ix: dict[str, int] = {}
    tenants: dict[int, list[int]] = {}        # runtime slot -> the steps that registered on it, in order
    blank: set[int] = set()                   # runtime slots whose newest tenant registered no write
    version: dict[tuple[int, int], int] = {}  # (runtime slot, tid) -> the model version
    plans: dict[int, tuple[int, ...]] = {}    # plan id -> its runtime slots
    reader: dict[tuple[int, int, str], int | None] = {}  # None: a hit on a never-written slot
    records: list[str] = []

    def s_of(slot: int) -> int:
        return slot_ix.setdefault(slot, len(slot_ix) + 1)

    def k_of(key: str) -> int:
        return key_ix.setdefault(key, len(key_ix) + 1)

    for e in events:
        if e.machine != MACHINE or e.kind != "note":
            continue
        if e.trigger == "register":
            tid, keys = e.int_of("tid"), [k_of(k) for k in e.strs_of("keys")]
            for slot in e.ints_of("slots"):
                blank.discard(slot)
                steps = tenants.setdefault(slot, [])
                if not steps or steps[-1] != e.step_id:  # a new tenant; else the step's second write
                    steps.append(_step_id(e))
                version[(slot, tid)] = len(steps)
                records.append(_record("register", s_of(slot), len(steps), keys))
        elif e.trigger == "tenant":  # a tenant without a write: hits on these slots leave the model
            blank.update(e.ints_of("slots"))
        elif e.trigger == "land":
            tid, keys = e.int_of("tid"), [k_of(k) for k in e.strs_of("keys")]
            for slot in e.ints_of("slots"):
                records.append(_record("land", s_of(slot), version.get((slot, tid), _UNKNOWN), keys))
        elif e.trigger == "plan":
            pid, slots, mixed = e.int_of("plan"), e.ints_of("slots"), dict(e.versions_of("mixed"))
            plans[pid] = slots
            for key, expected in e.versions_of("expected"):
                for j, (slot, tid) in enumerate(zip(slots, expected, strict=True)):
                    if slot not in tenants or slot in blank or slot in mixed.get(key, ()):  # outside the model: see above
                        reader[(pid, j, key)] = None
                        continue
                    r = reader[(pid, j, key)] = 1 + sum(1 for x in reader.values() if x is not None)
                    ver = 0 if tid == 0 else version.get((slot, tid), _UNKNOWN)
                    records.append(_record("plan", s_of(slot), ver, r=r, key=k_of(key)))
        elif e.trigger == "read":
            pid, key = e.int_of("plan"), str(e.get("key"))
            slots = plans.get(pid, ())
            if e.get("raised"):
                j = slots.index(e.int_of("slot"))
                if (reader_no := reader[(pid, j, key)]) is not None:
                    records.append(_record("read", s_of(slots[j]), r=reader_no, got=RAISED))
                continue
            for j, (slot, tid) in enumerate(zip(slots, e.ints_of("served"), strict=True)):
                if (reader_no := reader[(pid, j, key)]) is not None:
                    got = 0 if tid == 0 else version.get((slot, tid), _UNKNOWN)
                    records.append(_record("read", s_of(slot), r=reader_no, got=got))
    body = ",\n    ".join(records)
    text = f"""---- MODULE {name} ----
\\* Generated by omni_cache.verify.tenancy_trace from a recorded runtime trace
\\* ({len(records)} per-slot tenancy events), for tla/tenancy/TenancyTrace.tla.
EXTENDS Integers
Trace == <<
    {body}
    >>
====
"""
    constants = {"NumSlots": max(1, len(slot_ix)), "MaxVer": max([len(t) for t in tenants.values()] or [1]),
                 "NumKeys": max(1, len(key_ix)),
                 "NumReaders": max(1, sum(1 for r in reader.values() if r is not None)), "MaxGen": 1}
    return text, constants


def _tenancy_cfg(constants: dict[str, int]) -> str:
    return trace_cfg(constants, "TypeOK NeverSilentMiss NoStaleTenant HitServed NewestLanded HitOwned KeptNeeded KeptBounded "
                     "WritesCarryKeys EachKeyLandsOnce ReplacedIsNew")


def has_tenancy_notes(events: TraceRecorder | Iterable[TraceEvent]) -> bool:
    """The trace holds tenancy notes (a ``SlotTenancy`` with a recorder registered or planned)."""
    evs = events.events(notes=True) if isinstance(events, TraceRecorder) else list(events)
    return any(e.machine == MACHINE and e.kind == "note" for e in evs)


def split_writes(events: TraceRecorder | Iterable[TraceEvent]) -> int:
    """How many (step, KV slot) pairs register two writes (immediate + deferred keys) in the trace."""
    evs = events.events(notes=True) if isinstance(events, TraceRecorder) else list(events)
    writes: dict[tuple[int | None, int], int] = {}
    for e in evs:
        if e.machine == MACHINE and e.kind == "note" and e.trigger == "register":
            for slot in e.ints_of("slots"):
                writes[(e.step_id, slot)] = writes.get((e.step_id, slot), 0) + 1
    return sum(1 for n in writes.values() if n > 1)


@dataclass(frozen=True)
class TenancyTraceCheck(TraceCheck):
    """TLC's verdict on a tenancy trace, with how many (step, slot) pairs had two writes."""

    split_writes: int = 0


def check_tenancy_trace_tlc(
    events: TraceRecorder | Iterable[TraceEvent], *, tla_dir: Path | None = None, timeout_s: float = 120.0
) -> TenancyTraceCheck:
    """Check the tenancy notes of a trace with TLC against tla/tenancy/TenancyTrace.tla.

    Accepted iff exit 0; ``stuck_at`` indexes the generated ``Trace`` records (0-based);
    ``split_writes`` counts the (step, slot) pairs with an immediate and a deferred write.
    """
    evs = events.events(notes=True) if isinstance(events, TraceRecorder) else list(events)
    data, constants = tenancy_trace_data(evs)
    verdict = _run_trace_spec(
        (tla_dir or default_tla_dir()) / "tenancy", ("Tenancy.tla", "TenancyTrace.tla"),
        "TenancyTrace", data, _tenancy_cfg(constants), data.count("[ev |->"), timeout_s,
    )
    return TenancyTraceCheck(**verdict.__dict__, split_writes=split_writes(evs))
