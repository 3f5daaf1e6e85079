"""Request identity on the manager side: which admission of a request id an event belongs to.

Owns: ``Admission`` (the owner of a live request id's admission and its prefix
lookup) and ``plan_events``, a pure function that turns one step's events into
the changes the manager applies (end an admission, admit a new one, install a
lookup) without touching any state, so a step that raises changes nothing.

Upholds I12 (request identity): a request id reused by a new owner is a new
admission -- the old admission ends exactly as on FINISHED/ABORTED (its open
writes still land, I9) and its pending hit is dropped, so the new admission
reads old rows only through a hit of its own; an event older than the id's
current owner (a late terminal, a stale lookup, a stale control) changes
nothing; a new owner's lookup may arrive later than its admission
(``lookup_complete=False``) and is installed once; each event applies to the
admission it names, whatever its position in the step (a terminal of an owner
that another event of the step carries ends it after them), and a terminal of a
newer owner proves every older admission of its id over (an older owner's
control in the same step is stale). I13 (replayed step no-op)
is the manager's sequence check; this module never sees a replayed step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.events import PrefixCacheEventKind, PrefixCacheRequestEvent, PrefixCacheRequestOwner
from omni_cache.runtime.interface import ReqId

__all__ = ["Admission", "EventPlan", "lookup_of", "newest_terminal_owners", "plan_events", "plans_nothing"]

K = PrefixCacheEventKind
TERMINAL = (K.FINISHED, K.ABORTED)
Lookup = tuple[int, tuple[int, ...]]


@dataclass(frozen=True)
class Admission:
    """The live admission of one request id: its owner (``None``: ownerless) and its lookup
    (``None`` while a new owner's prefix lookup is still pending)."""

    owner: PrefixCacheRequestOwner | None = None
    lookup: Lookup | None = (0, ())


@dataclass
class EventPlan:
    """What one step's events do, in order: ``changes`` are ``("end", req, None)``,
    ``("admit", req, Admission)`` and ``("lookup", req, event)``; ``stale`` counts
    events older than their id's current owner (ignored)."""

    changes: list[tuple[str, ReqId, Admission | PrefixCacheRequestEvent | None]]
    stale: int = 0


def lookup_of(event: PrefixCacheRequestEvent, block_size: int, group_id: int = 0) -> Lookup:
    """The hit length and the hit's blocks of the output KV-cache group ``group_id``."""
    return event.hit_end, event.group_block_ids(group_id)[: max(event.hit_end, 0) // block_size]


def _owners(event: PrefixCacheRequestEvent, current: Admission) -> str:
    return f"request {event.req_id!r}: {event.kind.name} of owner {event.owner} while owner {current.owner} is live"


def newest_terminal_owners(events: Sequence[PrefixCacheRequestEvent]) -> dict[ReqId, PrefixCacheRequestOwner]:
    """Per request id, the newest owner a terminal event of ``events`` ends."""
    newest: dict[ReqId, PrefixCacheRequestOwner] = {}
    for e in events:
        if e.kind in TERMINAL and e.owner is not None and (e.req_id not in newest or newest[e.req_id] < e.owner):
            newest[e.req_id] = e.owner
    return newest


class _Admitted(Protocol):
    admission: Admission


def plans_nothing(events: Sequence[PrefixCacheRequestEvent], live: Mapping[ReqId, _Admitted]) -> bool:
    """Whether ``plan_events`` would plan no change and count nothing stale for ``events``, read
    cheaply: every event EXTENDs the live admission of its request (``live[req_id].admission``) as
    that admission's owner (or as no owner), and carries no lookup that admission still waits for.
    A steady decode step of a real engine is all such events. False says nothing: plan them."""
    extended = K.EXTENDED
    for event in events:
        if event.kind is not extended or (request := live.get(event.req_id)) is None:
            return False
        admission = request.admission
        if (event.owner is not None and event.owner != admission.owner) or \
                (event.lookup_complete and admission.lookup is None):
            return False
    return True


def plan_events(
    events: Sequence[PrefixCacheRequestEvent],
    live: Mapping[ReqId, Admission],
    block_size: int,
    group_id: int = 0,
) -> EventPlan:
    """The changes ``events`` make to ``live``: terminal events first, then the rest in order, then
    the terminals of owners the rest carry (each event applies to the admission it names); lookups
    read the blocks of KV-cache group ``group_id`` (the config's ``output_group_id``).

    Raises ``OmniPrefixCacheUnmatchError`` (and plans nothing) for a REPLACED
    without an owner, a STARTED for a live id that is not a newer admission, a
    new content generation without REPLACED, an EXTENDED/RESUMED that changes the
    owner, and a second, different lookup for the same owner.
    """
    state = dict(live)
    plan = EventPlan([])

    def end(req_id: ReqId) -> None:
        plan.changes.append(("end", req_id, None))
        state.pop(req_id, None)

    def admit(event: PrefixCacheRequestEvent) -> None:
        admission = Admission(event.owner, None)
        plan.changes.append(("admit", event.req_id, admission))
        state[event.req_id] = admission
        if event.lookup_complete:
            install(event)

    def install(event: PrefixCacheRequestEvent) -> None:
        plan.changes.append(("lookup", event.req_id, event))
        state[event.req_id] = Admission(state[event.req_id].owner, lookup_of(event, block_size, group_id))

    def terminal(event: PrefixCacheRequestEvent) -> None:
        current = state.get(event.req_id)
        if current is not None and event.owner is not None and current.owner is not None \
                and event.owner < current.owner:
            plan.stale += 1  # a late terminal of an older admission never ends the newer one
            return
        end(event.req_id)

    # Each event applies to the admission it names, whatever its position in the step: a terminal
    # of an owner that another event of this step carries (it may be started or replaced-to here)
    # ends that admission after them; the others end the admission live before the step, so an id
    # may end and start again in one step.
    # A terminal of a newer owner proves every older admission of its id over: an event of the step
    # older than it (a control of an owner aborted in this step, before the id was reused again) is stale.
    named = {(e.req_id, e.owner) for e in events if e.kind not in TERMINAL and e.owner is not None}
    later = [e for e in events if e.kind in TERMINAL and e.owner is not None and (e.req_id, e.owner) in named]
    ended_up_to = newest_terminal_owners(events)
    for event in events:
        if event.kind in TERMINAL and not (event.owner is not None and (event.req_id, event.owner) in named):
            terminal(event)
    for event in (e for e in events if e.kind not in TERMINAL):
        req_id, kind = event.req_id, event.kind
        current = state.get(req_id)
        newest_end = ended_up_to.get(req_id)
        if event.owner is not None and newest_end is not None and event.owner < newest_end:
            plan.stale += 1  # its admission ended before this step's newer owner of the id did
            continue
        if kind is K.REPLACED and event.owner is None:
            raise OmniPrefixCacheUnmatchError(
                f"new_step_starts: REPLACED for request {req_id!r} carries no owner; a replacement names "
                "the admission and generation it installs (I12)")
        if current is None:
            if kind is K.EXTENDED:  # an id never announced: live from now on, no lookup to serve
                plan.changes.append(("admit", req_id, Admission(event.owner)))
                state[req_id] = Admission(event.owner)
            else:
                admit(event)
            continue
        if event.owner is not None and current.owner is not None and event.owner < current.owner:
            plan.stale += 1  # a stale lookup or control of an older owner
            continue
        newer = event.owner is not None and event.owner != current.owner
        if kind is K.REPLACED or (kind is K.STARTED and newer):
            if not newer:  # a duplicate control of the live owner
                if event.lookup_complete and current.lookup is None:
                    install(event)
                elif event.lookup_complete and current.lookup != lookup_of(event, block_size, group_id):
                    raise OmniPrefixCacheUnmatchError(
                        f"new_step_starts: conflicting initial lookup for {_owners(event, current)}: "
                        f"{lookup_of(event, block_size, group_id)} after {current.lookup} (I12)")
                continue
            if kind is K.STARTED and current.owner is not None and event.owner is not None \
                    and event.owner.admission_id == current.owner.admission_id:
                raise OmniPrefixCacheUnmatchError(
                    f"new_step_starts: {_owners(event, current)}: a new content generation of the same "
                    "admission needs a REPLACED control first (I12)")
            end(req_id)  # the old admission ends as on FINISHED: its writes still land (I9)
            admit(event)
            continue
        if newer:
            raise OmniPrefixCacheUnmatchError(
                f"new_step_starts: {_owners(event, current)}: only STARTED or REPLACED may change a "
                "request's owner (I12)")
        if kind is K.STARTED:
            if current.lookup is None and event.lookup_complete:
                install(event)
                continue
            if event.owner is not None and current.owner is not None:  # same owner, lookup done
                if event.lookup_complete and current.lookup != lookup_of(event, block_size, group_id):
                    raise OmniPrefixCacheUnmatchError(
                        f"new_step_starts: conflicting initial lookup for {_owners(event, current)}: "
                        f"{lookup_of(event, block_size, group_id)} after {current.lookup} (I12)")
                continue
            raise OmniPrefixCacheUnmatchError(
                f"new_step_starts: STARTED for request {req_id!r}, which is still live "
                "(no FINISHED/ABORTED since it started, and no newer owner); the adapter must send "
                "EXTENDED or RESUMED (I12)")
        if event.lookup_complete and (kind is K.RESUMED or current.lookup is None):
            install(event)  # a resume's hit, or the delayed first lookup of a new owner
    for event in later:
        terminal(event)
    return plan
