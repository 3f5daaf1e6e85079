"""Engine-facing value types: request events and the step's write layout.

Owns: ``PrefixCacheEventKind``, ``PrefixCacheRequestOwner``,
``PrefixCacheRequestEvent``, ``PrefixCacheStep``, ``PrefixCacheWrite`` and
``PrefixCacheWriteLayout`` -- immutable snapshots the engine hands to the
manager. ``omni_cache.integration.adapter`` (the public import path, spec/contract.md section 10)
re-exports them next to ``PrefixCacheSchedulerAdapter``, which builds them.

Upholds the input half of I5: events carry block ids as tuples (one per KV
group, group 0 used), so later changes to scheduler objects cannot change them;
and the value half of I12/I13: events carry their admission's owner, a step its
``sequence``.
"""

from __future__ import annotations

import copy
import enum
import operator
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache.runtime.interface import ReqId


class PrefixCacheEventKind(str, enum.Enum):
    """What happened to a request at the start of this step."""

    STARTED = "started"
    EXTENDED = "extended"
    RESUMED = "resumed"
    FINISHED = "finished"
    ABORTED = "aborted"
    REPLACED = "replaced"
    """A control: the request id now belongs to a new owner (a new admission, or a
    new content generation of the same one). Ends the previous owner's admission."""


@dataclass(frozen=True, order=True)
class PrefixCacheRequestOwner:
    """Who a request id belongs to: the scheduler's admission and its content generation.

    Not a cache key. A new admission gets a larger ``admission_id`` even when
    the client reuses the request id; only an accepted replacement advances
    ``generation``. Owners compare in that order: a smaller owner is older (I12).
    """

    admission_id: int
    generation: int = 0

    def __post_init__(self) -> None:
        for name in ("admission_id", "generation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"PrefixCacheRequestOwner.{name} must be an int >= 0, got {value!r}")


def freeze_block_ids(block_ids: Any) -> tuple[tuple[int, ...], ...]:
    """Snapshot vLLM block ids as plain ints, one tuple per KV group.

    Accepts a flat sequence (one group), a sequence of per-group sequences
    (vLLM's ``tuple[list[int], ...]``), numpy arrays or ``None``. Integer-likes
    (numpy ints, 0-d tensors) become ``int`` so that later changes to the
    scheduler's lists cannot reach the event.
    """
    if block_ids is None:
        return ()
    groups = list(block_ids)
    if not groups:
        return ()

    def _is_scalar(b: Any) -> bool:
        try:
            operator.index(b)
        except TypeError:
            return False
        return True

    if all(_is_scalar(b) for b in groups):
        return (tuple(as_index("a block id", b) for b in groups),)
    return tuple(tuple(as_index("a block id", b) for b in (() if group is None else group)) for group in groups)


def _is_bool(value: Any) -> bool:
    """A bool, or a numpy or torch scalar of a bool dtype (``operator.index`` takes some of them)."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def as_index(where: str, value: Any) -> int:
    """``value`` as an ``int``: integer-likes (numpy ints, 0-d integer tensors) become ``int``;
    a bool, float, string or ``None`` raises ``TypeError`` naming ``where``."""
    if type(value) is int:
        return value
    if _is_bool(value) or not hasattr(value, "__index__") or (isinstance(value, torch.Tensor) and value.dim() != 0):
        raise TypeError(f"{where} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError as exc:  # e.g. a floating tensor
        raise TypeError(f"{where} must be an int, got {value!r}") from exc


def check_req_id(where: str, req_id: Any) -> None:
    """A request id is hashable (the manager keys its state by it); else ``TypeError`` naming ``where``."""
    try:
        hash(req_id)
    except TypeError as exc:
        raise TypeError(f"{where}: req_id must be hashable (a str), got {type(req_id).__name__} {req_id!r}") from exc


def scheduled_counts(where: str, counts: Any) -> dict[ReqId, int]:
    """A private ``{req_id: int}`` copy of ``counts`` (a mapping or ``(req_id, n)`` pairs);
    ``TypeError`` naming ``where`` for an unhashable id or a count that is not an int."""
    try:
        pairs = dict(counts)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{where} must be a {{req_id: n}} mapping or (req_id, n) pairs, got {counts!r}") from exc
    if all(type(n) is int for n in pairs.values()):
        return pairs
    return {rid: as_index(f"{where}[{rid!r}]", n) for rid, n in pairs.items()}


@dataclass(frozen=True)
class PrefixCacheRequestEvent:
    """One request's event: a hit span ``[hit_start, hit_end)`` on ``block_ids``.

    ``owner`` is the admission the event belongs to (``None``: whichever
    admission of ``req_id`` is live); on FINISHED/ABORTED it is the owner the
    event ends. ``lookup_complete=False`` says the prefix lookup of a new owner
    is still pending: its hit fields mean nothing yet, and the first later event
    of that owner with ``lookup_complete=True`` carries the lookup (I12).
    """

    req_id: ReqId
    kind: PrefixCacheEventKind
    hit_start: int = 0
    hit_end: int = 0
    block_ids: tuple[tuple[int, ...], ...] = ()
    scheduled_tokens: int = 0
    num_output_tokens: int = 0
    owner: PrefixCacheRequestOwner | None = None
    lookup_complete: bool = True

    def __post_init__(self) -> None:
        try:
            hash(self.req_id)
        except TypeError:  # the refusal, named (its message is built only here)
            check_req_id(f"PrefixCacheRequestEvent {self.req_id!r}", self.req_id)
        # NOTE: exact ints (what the adapter passes) need no coercion; anything else goes through
        # ``as_index``, which makes integer-likes ints and refuses the rest, naming the field.
        if not (type(self.hit_start) is int and type(self.hit_end) is int
                and type(self.scheduled_tokens) is int and type(self.num_output_tokens) is int):
            where = f"PrefixCacheRequestEvent {self.req_id!r}"
            for name in ("hit_start", "hit_end", "scheduled_tokens", "num_output_tokens"):
                object.__setattr__(self, name, as_index(f"{where}: {name}", getattr(self, name)))
        block_ids = self.block_ids
        if not (block_ids is None or (type(block_ids) is tuple and not block_ids)):
            try:
                object.__setattr__(self, "block_ids", freeze_block_ids(self.block_ids))
            except TypeError as exc:
                raise TypeError(f"PrefixCacheRequestEvent {self.req_id!r}: block_ids must be ints (one sequence "
                                f"per KV group), got {self.block_ids!r}") from exc
        elif block_ids is None:  # () and None freeze to (): nothing to walk
            object.__setattr__(self, "block_ids", ())
        if not isinstance(self.kind, PrefixCacheEventKind):
            object.__setattr__(self, "kind", PrefixCacheEventKind(self.kind))
        if self.owner is not None and not isinstance(self.owner, PrefixCacheRequestOwner):
            raise TypeError(
                f"PrefixCacheRequestEvent {self.req_id!r}: owner must be a PrefixCacheRequestOwner or None, "
                f"got {type(self.owner).__name__}"
            )

    @property
    def group0_block_ids(self) -> tuple[int, ...]:
        return self.group_block_ids(0)

    def group_block_ids(self, group_id: int) -> tuple[int, ...]:
        """The block ids of KV-cache group ``group_id`` (``()`` when the event carries fewer groups)."""
        return self.block_ids[group_id] if 0 <= group_id < len(self.block_ids) else ()


@dataclass(frozen=True)
class PrefixCacheStep:
    """The events of one scheduler step and its scheduled tokens per request.

    ``scheduled_tokens`` is a ``{req_id: n}`` mapping (``(req_id, n)`` pairs are
    accepted too). ``sequence`` is the scheduler step's number when the engine
    has one: a step whose sequence is not above the last applied one is a
    replay and changes nothing (I13).
    """

    events: tuple[PrefixCacheRequestEvent, ...]
    scheduled_tokens: dict[ReqId, int] = field(default_factory=dict)
    sequence: int | None = None

    def __init__(self, events: Iterable[PrefixCacheRequestEvent],
                 scheduled_tokens: Mapping[ReqId, int] | Iterable[tuple[ReqId, int]] = (),
                 sequence: int | None = None) -> None:
        """Any iterable of events, and counts as a mapping or pairs: ``__post_init__`` checks them
        and keeps a tuple and a private dict (the fields' types)."""
        object.__setattr__(self, "events", events)
        object.__setattr__(self, "scheduled_tokens", scheduled_tokens)
        object.__setattr__(self, "sequence", sequence)
        self.__post_init__()

    def __post_init__(self) -> None:
        try:
            events = tuple(self.events)
        except TypeError as exc:
            raise TypeError(f"PrefixCacheStep.events must be an iterable of PrefixCacheRequestEvent, "
                            f"got {self.events!r}") from exc
        for i, event in enumerate(events):
            if not isinstance(event, PrefixCacheRequestEvent):
                raise TypeError(f"PrefixCacheStep.events[{i}] must be a PrefixCacheRequestEvent, "
                                f"got {type(event).__name__} {event!r}")
        object.__setattr__(self, "events", events)
        object.__setattr__(self, "scheduled_tokens",
                           scheduled_counts("PrefixCacheStep.scheduled_tokens", self.scheduled_tokens))
        if self.sequence is not None:  # integer-likes (numpy ints) become int, as a write's bounds do
            object.__setattr__(self, "sequence", as_index("PrefixCacheStep.sequence", self.sequence))

    def __iter__(self) -> Iterator[PrefixCacheRequestEvent]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)


@dataclass(frozen=True)
class PrefixCacheWrite:
    """Rows ``[row_start, row_end)`` of the packed batch are the request's
    positions ``[token_start, token_end)``."""

    req_id: ReqId
    row_start: int
    row_end: int
    token_start: int
    token_end: int

    def __post_init__(self) -> None:
        try:
            hash(self.req_id)
        except TypeError:  # the refusal, named (its message is built only here)
            check_req_id(f"PrefixCacheWrite {self.req_id!r}", self.req_id)
        if not (type(self.row_start) is int and type(self.row_end) is int
                and type(self.token_start) is int and type(self.token_end) is int):
            for name in ("row_start", "row_end", "token_start", "token_end"):
                # Integer-likes (numpy ints, 0-d integer tensors) become ``int``; floats, bools,
                # strings and None are refused here, never at materialize after an id is consumed.
                object.__setattr__(self, name, as_index(f"PrefixCacheWrite {self.req_id!r}: {name}",
                                                        getattr(self, name)))
        if not (0 <= self.row_start <= self.row_end):
            raise ValueError(f"PrefixCacheWrite {self.req_id!r}: bad rows [{self.row_start}, {self.row_end})")
        if self.token_end - self.token_start != self.row_end - self.row_start or self.token_start < 0:
            raise ValueError(
                f"PrefixCacheWrite {self.req_id!r}: rows [{self.row_start}, {self.row_end}) and "
                f"positions [{self.token_start}, {self.token_end}) differ in length"
            )

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


@dataclass(frozen=True)
class PrefixCacheWriteLayout:
    """Where this step's packed rows go: per-request spans and every row's KV slot.

    ``slots_cpu`` is an int64 CPU tensor of the KV slot of every row (at least
    ``total_rows`` long). The manager refuses a layout that does not cover the
    step ("slot mapping covers").
    """

    writes: tuple[PrefixCacheWrite, ...]
    total_rows: int
    slots_cpu: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.writes, Iterable):
            raise TypeError(f"PrefixCacheWriteLayout: writes must be an iterable of PrefixCacheWrite, "
                            f"not {type(self.writes).__name__}")
        object.__setattr__(self, "writes", tuple(self.writes))
        if self.slots_cpu is not None:
            slots = self.slots_cpu
            if not isinstance(slots, torch.Tensor):  # a list or numpy array of slot ids
                try:
                    slots = torch.as_tensor(slots)
                except (TypeError, ValueError, RuntimeError, OverflowError):  # no integer mapping at all
                    object.__setattr__(self, "slots_cpu", copy.deepcopy(slots))  # refused by save_outputs
                    object.__setattr__(self, "_rows", StepRows.of(self.writes, self.total_rows))
                    return
                if slots.numel() == 0:
                    slots = slots.to(torch.int64)
            slots = slots.detach()
            if slots.device.type == "cpu" and slots.layout is torch.strided and not (
                slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool
            ):
                slots = slots.to(torch.int64)
            # A malformed mapping (not integer, not CPU, not dense, not 1-D) is kept as given, never
            # coerced: ``save_outputs`` refuses it before anything is claimed ("slot mapping
            # covers"). Own a private copy: the engine reuses its slot-mapping buffers.
            object.__setattr__(self, "slots_cpu", slots.clone())
        # Derived once here, where the engine builds the layout (one walk over the writes it
        # just made); ``save_outputs`` checks these facts instead of walking the writes again.
        object.__setattr__(self, "_rows", StepRows.of(self.writes, self.total_rows))

    @property
    def req_ids(self) -> tuple[ReqId, ...]:
        rows = layout_rows(self)
        return rows.req_ids if rows is not None else tuple(w.req_id for w in self.writes)

    @classmethod
    def taking(cls, writes: tuple[PrefixCacheWrite, ...], total_rows: int, slots_cpu: torch.Tensor) -> PrefixCacheWriteLayout:
        """A layout that takes ``slots_cpu`` as it is: a tensor the caller made for this layout alone
        and never writes again (e.g. ``BlockTableView.slots_for_counts``'s), so no private copy
        is made. Anything else about it is checked by ``save_outputs`` as for any layout."""
        layout = object.__new__(cls)
        object.__setattr__(layout, "writes", writes if type(writes) is tuple else tuple(writes))
        object.__setattr__(layout, "total_rows", total_rows)
        object.__setattr__(layout, "slots_cpu", slots_cpu)
        object.__setattr__(layout, "_rows", StepRows.of(layout.writes, total_rows))
        return layout

    @classmethod
    def packed(cls, spans: Iterable[tuple[ReqId, int, int]], slots_cpu: torch.Tensor | None) -> PrefixCacheWriteLayout:
        """Pack ``(req_id, token_start, token_end)`` spans in batch order."""
        writes: list[PrefixCacheWrite] = []
        row = 0
        for req_id, start, end in spans:
            writes.append(PrefixCacheWrite(req_id, row, row + end - start, start, end))
            row += end - start
        return cls(tuple(writes), row, slots_cpu)


class StepRows:
    """A layout's writes with the facts a save checks, derived in one walk over them.

    ``tiles``: in the given order the writes tile rows ``[0, total)`` exactly once (each starts
    where the previous ended, the first at 0, the last ends at ``total``, no request twice;
    none ends past ``total`` then, as a write's rows never end before they start). ``validation.validate_save`` uses a ``StepRows`` only when it tiles
    the save's ``n`` rows; otherwise it walks the writes and raises, naming the first bad one.
    Immutable (its writes are); ``by_req`` is built on first use.
    """

    __slots__ = ("_by_req", "ends", "req_ids", "sizes", "starts", "tiles", "writes")

    def __init__(self, writes: tuple[PrefixCacheWrite, ...], total: Any, *, frozen_only: bool = False) -> None:
        req_ids, starts, ends, sizes = [], [], [], []
        seen, rows, tiles = set(), 0, True
        for w in writes:
            if frozen_only and type(w) is not PrefixCacheWrite:  # only a frozen write keeps its facts true
                raise TypeError(f"{w!r} is not a PrefixCacheWrite")
            req_id, start, end = w.req_id, w.row_start, w.row_end
            if start != rows or req_id in seen:
                tiles = False
            seen.add(req_id)
            rows = end
            req_ids.append(req_id)
            starts.append(start)
            ends.append(end)
            sizes.append(end - start)
        self.writes = writes
        self.req_ids: tuple[ReqId, ...] = tuple(req_ids)
        self.starts: list[int] = starts
        self.ends: list[int] = ends
        self.sizes: list[int] = sizes
        self.tiles: bool = tiles and bool(writes) and rows == total
        self._by_req: dict[ReqId, PrefixCacheWrite] | None = None

    @classmethod
    def of(cls, writes: tuple[PrefixCacheWrite, ...], total: Any) -> StepRows | None:
        """The facts of ``writes``, or None when they cannot be derived (a write that is not a
        ``PrefixCacheWrite``, an unhashable request id): the save then walks the writes itself."""
        try:
            return cls(writes, total, frozen_only=True)
        except Exception:
            return None

    def __len__(self) -> int:
        return len(self.writes)

    @property
    def by_req(self) -> dict[ReqId, PrefixCacheWrite]:
        """req -> its write."""
        if self._by_req is None:
            self._by_req = dict(zip(self.req_ids, self.writes, strict=True))
        return self._by_req

    def describe_row(self, row: int) -> str:
        """Row ``row`` as an error names it: its request and token position."""
        for w in self.writes:
            if w.row_start <= row < w.row_end:
                return f"row {row} (request {w.req_id!r}, position {w.token_start + row - w.row_start})"
        return f"row {row}"

    def write_of(self, req_id: Any) -> PrefixCacheWrite | None:
        """``req_id``'s write, or ``None`` when it is not one of the step's (an unhashable id never is)."""
        try:
            return self.by_req.get(req_id)
        except TypeError:
            return None


def layout_rows(layout: PrefixCacheWriteLayout) -> StepRows | None:
    """The ``StepRows`` derived when ``layout`` was built, if they still describe its writes."""
    rows = getattr(layout, "_rows", None)
    return rows if rows is not None and rows.writes is layout.writes else None
