"""Input validation of the manager's entry points: errors before any state changes.

Owns: ``validate_hit`` (I5), ``check_capacity`` (I10), ``check_slot_mapping`` and ``validate_save`` (the
step's layout covers its rows: "slot mapping covers"; hidden has enough rows), ``check_scheduled``
(each request's rows equal its scheduled count, zero included), ``StepRows``, the validated form of a layout, and
``RowSig`` / ``check_sig``: a key's (dtype, row shape), read once per save and compared as a tuple
by the staging pages, the pool and the landing ("width and dtype never change"), and ``allocate_rows``:
a pool or staging tensor whose refusal by the allocator is named as the sizing problem it is.
Pure functions of their arguments: an input that fails here has changed nothing.

Cost: a save's checks run no Python per request. The layout's writes were walked once when
the layout was built (``events.StepRows``: row order, tiling, unique requests), so the save
checks those facts and compares the scheduled counts as lists or dicts (C loops). Only an input
that fails the fast checks takes the per-write walk, which names the first bad write in the
error, or (for writes that tile the rows out of order) returns them sorted.

Upholds I5 (``validate_hit``), I10 (``check_capacity``) and I4 (``check_slot_mapping``: the save's
private copy of the slot mapping): an input that fails here has changed nothing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from operator import itemgetter
from typing import Any, cast

import torch

from omni_cache.runtime.errors import (
    PHRASE_CAPACITY,
    PHRASE_NO_BLOCK_IDS,
    PHRASE_NOT_ALIGNED,
    PHRASE_SLOT_MAPPING,
    OmniPrefixCacheUnmatchError,
)
from omni_cache.runtime.events import (
    PrefixCacheRequestEvent,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
    StepRows,
    as_index,
    layout_rows,
)
from omni_cache.runtime.interface import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig, ReqId


def validate_hit(event: PrefixCacheRequestEvent, config: PrefixCacheConfig) -> None:
    """A hit is block aligned, starts at 0 and carries enough in-range, distinct block ids in the
    output KV-cache group (``config.output_group_id``) (I5)."""
    bs = config.block_size
    where = (
        f"new_step_starts: {event.kind.name} request {event.req_id!r} "
        f"hit [{event.hit_start}, {event.hit_end})"
    )
    if event.hit_start % bs or event.hit_end % bs:
        # "prefix hit not block aligned": the reference's wording, which callers match on.
        raise OmniPrefixCacheUnmatchError(f"{where}: prefix hit {PHRASE_NOT_ALIGNED} (block_size {bs}) (I5)")
    if event.hit_start != 0:
        raise OmniPrefixCacheUnmatchError(f"{where}: a prefix hit must start at position 0 (I5)")
    if event.hit_end < 0:
        raise OmniPrefixCacheUnmatchError(f"{where}: a prefix hit must not end before position 0 (I5)")
    group = config.output_group_id
    blocks = event.group_block_ids(group)
    if not blocks:
        groups = "" if group == 0 else (
            f" for KV-cache group {group} (output_group_id; the event carries {len(event.block_ids)} groups)")
        raise OmniPrefixCacheUnmatchError(f"{where} {PHRASE_NO_BLOCK_IDS}{groups} (I5)")
    need = event.hit_end // bs
    if len(blocks) < need:
        raise OmniPrefixCacheUnmatchError(
            f"{where} carries {len(blocks)} block ids for a hit of {need} blocks (I5)"
        )
    bad = [b for b in blocks[:need] if not 0 <= b < config.num_blocks]
    if bad:
        raise OmniPrefixCacheUnmatchError(
            f"{where}: block ids {bad[:8]} are outside [0, {config.num_blocks}) (I5)"
        )
    if len(set(blocks[:need])) != need:  # two prefix positions at one KV slot: no engine's prefix
        twice = next(b for i, b in enumerate(blocks[:need]) if b in blocks[:i])
        raise OmniPrefixCacheUnmatchError(
            f"{where}: block id {twice} appears twice among its {need} hit blocks; a prefix's blocks are "
            f"distinct (I5)"
        )


def check_capacity(num_rows: int, capacity_tokens: int) -> None:
    """A step larger than a staging page raises; the cache never clamps (I10)."""
    if num_rows > capacity_tokens:
        raise OmniPrefixCacheUnmatchError(
            f"a step of {num_rows} tokens does not fit a staging page: {PHRASE_CAPACITY} "
            f"{capacity_tokens} tokens (staging_capacity_tokens); the cache never clamps -- "
            "raise max_num_batched_tokens or staging_capacity_tokens (I10)"
        )


RowSig = tuple[torch.dtype, tuple[int, ...]]
"""A key's row signature: (dtype, shape of one row). A key's never changes once held."""


def row_sig(rows: torch.Tensor) -> RowSig:
    """The signature of ``rows`` (one tuple, compared without touching a tensor again)."""
    return rows.dtype, rows.shape[1:]


def check_sig(what: str, held: RowSig | None, sig: RowSig) -> None:
    """``sig`` must equal ``held`` (nothing held yet: anything goes); else raise naming both."""
    if held is None or held == sig:
        return
    raise OmniPrefixCacheUnmatchError(
        f"{what} holds rows of shape {tuple(held[1])} {held[0]}; this step brought rows of "
        f"shape {tuple(sig[1])} {sig[0]}: a key's width and dtype never change"
    )


def check_held_sigs(
    store: str, held_sigs: dict[str, RowSig], sigs: dict[str, RowSig], keys: Iterable[str]
) -> None:
    """Each of ``keys``, of signature ``sigs[key]``, must match what ``held_sigs`` holds for it (a
    key held nowhere matches); the error names ``f"{store} {key!r}"`` (``check_sig``)."""
    for key in keys:
        held = held_sigs.get(key)
        if held is not None and held != sigs[key]:
            check_sig(f"{store} {key!r}", held, sigs[key])


def allocate_rows(shape: tuple[int, ...], dtype: torch.dtype, *, pin_memory: bool, zeroed: bool, what: str) -> torch.Tensor:
    """A tensor of ``shape`` (zeros with ``zeroed``, else uninitialised). The allocator's refusal
    (``RuntimeError`` or ``MemoryError``) is ``OmniPrefixCacheUnmatchError`` "``what`` = N bytes"
    naming the allocator's own first line: a sizing problem, never the allocator's bare error."""
    try:
        return (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, pin_memory=pin_memory)
    except (RuntimeError, MemoryError) as exc:
        nbytes = math.prod(shape) * dtype.itemsize  # Python ints: ``numel`` wraps past int64
        first = (str(exc).splitlines() or [""])[0]
        raise OmniPrefixCacheUnmatchError(f"{what} = {nbytes:,} bytes ({exc.__class__.__name__}: {first})") from exc


def check_slot_mapping(slots: Any, n: int) -> torch.Tensor:
    """``slots`` is a 1-D int64 CPU tensor of at least ``n`` KV slots; return a private copy of
    its first ``n``: the save's writes read them until they land, so a later write into the
    caller's tensor (the layout's ``slots_cpu``) never moves them (I4; one clone of ``n`` int64,
    docs/performance-notes.md)."""
    problem = None
    if not isinstance(slots, torch.Tensor):
        problem = "is missing" if slots is None else f"is a {type(slots).__name__}, not a tensor"
    elif not slots.is_cpu:  # one attribute: ``device.type`` builds a device object (~1 µs)
        problem = f"is on device {slots.device}, not the CPU"
    elif slots.layout is not torch.strided:  # a sparse mapping has no per-row slots to read
        problem = f"has layout {slots.layout}, not a dense tensor"
    elif slots.dtype != torch.int64:  # the constructor made any integer mapping int64; ``taking`` keeps it
        integer = not (slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype is torch.bool)
        problem = f"has dtype {slots.dtype}, not " + ("int64 (PrefixCacheWriteLayout.taking keeps it as it is)" if integer
                                                      else "an integer dtype")
    elif len(shape := slots.shape) != 1:
        problem = f"has shape {tuple(shape)}, not 1-D"
    elif shape[0] < n:
        problem = f"has {shape[0]} entries"
    if problem is not None:
        raise OmniPrefixCacheUnmatchError(
            f"save_outputs: the {PHRASE_SLOT_MAPPING} the step's {n} rows only as a 1-D integer CPU "
            f"tensor of at least {n} KV slots; slots_cpu {problem}"
        )
    # a 1-D int64 CPU tensor: every check above passed
    return cast(torch.Tensor, slots).clone() if shape[0] == n else cast(torch.Tensor, slots)[:n].clone()


def validate_save(
    config: PrefixCacheConfig,
    policy: ModelCachePolicy,
    hidden: torch.Tensor | None,
    mm: dict[str, Any] | None,
    n: int,
    padded: int,
    layout: PrefixCacheWriteLayout,
) -> tuple[torch.Tensor, StepRows]:
    """Check a save's inputs; return the KV slots of its ``n`` rows and the layout's writes
    in row order (they cover the ``n`` rows exactly once)."""
    if (
        isinstance(n, bool)
        or not isinstance(n, int)
        or n <= 0
        or isinstance(padded, bool)
        or not isinstance(padded, int)
        or padded < n
    ):
        raise OmniPrefixCacheUnmatchError(
            f"save_outputs: num_tokens_unpadded={n!r} must be a positive int <= "
            f"num_tokens_padded={padded!r}"
        )
    check_capacity(n, config.staging_capacity_tokens)
    if not isinstance(layout, PrefixCacheWriteLayout):
        raise TypeError(f"write_layout must be a PrefixCacheWriteLayout, got {type(layout).__name__}")
    slots = check_slot_mapping(layout.slots_cpu, n)
    total = layout.total_rows  # an int (or integer-like); 5.0 == 5 and True == 1 are refused
    if (type(total) is not int and not _is_int_like(total)) or total != n:  # an array's != is not a bool
        raise OmniPrefixCacheUnmatchError(
            f"save_outputs: the {PHRASE_SLOT_MAPPING} {layout.total_rows} rows (layout total_rows); "
            f"the step has {n} unpadded tokens"
        )
    rows = layout_rows(layout)  # derived when the layout was built (total_rows == n was checked above)
    if rows is None or not rows.tiles:  # raises unless the writes tile the rows out of order
        rows = StepRows(tuple(_checked_spans(layout.writes, n).values()), n)
        assert rows.tiles, f"_checked_spans returned writes that do not tile {n} rows: validation bug"
    if mm is not None and not isinstance(mm, dict):
        raise OmniPrefixCacheUnmatchError(
            f"save_outputs: mm_outputs must be a dict of mm key name -> value (or None), got {type(mm).__name__}")
    if mm and not all(type(k) is str and k for k in mm):
        raise OmniPrefixCacheUnmatchError(
            f"save_outputs: mm_outputs keys must be mm key names (non-empty str), got {[k for k in mm]!r}")
    if mm and HIDDEN_KEY in mm:
        raise OmniPrefixCacheUnmatchError(
            f"save_outputs: mm_outputs uses the reserved key {HIDDEN_KEY!r}; pass hidden as hidden_states"
        )
    if policy.hidden_key is not None:
        if not isinstance(hidden, torch.Tensor) or hidden.is_nested or len(hidden_shape := hidden.shape) < 2:
            raise OmniPrefixCacheUnmatchError(
                "save_outputs: the policy caches hidden states but hidden_states is not a 2-D+ tensor"
                + (" (a nested tensor: its rows must be one dense tensor)" if getattr(hidden, "is_nested", False) else "")
            )
        if hidden_shape[0] < n:
            raise OmniPrefixCacheUnmatchError(
                f"save_outputs: hidden_states has {hidden.shape[0]} rows; the step has {n} unpadded tokens"
            )
    return slots, rows


def check_scheduled(scheduled: dict[ReqId, Any], rows: StepRows) -> None:
    """Where counts were given, every request's rows equal its scheduled count, zero included: a
    request with a count but no rows, rows but no count (a count of 0), or rows that differ from its
    count is refused. A request absent from both has 0 of each.

    Fast paths (C loops): the counts list the layout's requests in row order, or the nonzero counts
    are exactly the layout's nonzero (request, rows) pairs. Anything else walks the counts, then the
    layout, and raises naming the first request whose rows differ ("slot mapping covers").
    """
    if not scheduled:
        return
    if tuple(scheduled) == rows.req_ids and list(scheduled.values()) == rows.sizes:
        return
    counts = dict(zip(rows.req_ids, rows.sizes, strict=True))
    if dict(filter(itemgetter(1), scheduled.items())) == dict(filter(itemgetter(1), counts.items())):
        return
    for req_id, count in scheduled.items():
        got = counts.get(req_id, 0)
        if got != count:
            raise OmniPrefixCacheUnmatchError(
                f"save_outputs: request {req_id!r} was scheduled {count!r} tokens but the "
                f"{PHRASE_SLOT_MAPPING} {got} rows for it"
            )
    for req_id, got in counts.items():
        if got and req_id not in scheduled:
            raise OmniPrefixCacheUnmatchError(
                f"save_outputs: request {req_id!r} was not scheduled (no count: 0 tokens) but the "
                f"{PHRASE_SLOT_MAPPING} {got} rows for it"
            )
    raise OmniPrefixCacheUnmatchError(  # counts that compare oddly (not ints): name them all
        f"save_outputs: the scheduled counts {scheduled!r} differ from the rows the {PHRASE_SLOT_MAPPING} "
        f"for each request ({counts!r})"
    )


_WRITE_FIELDS = ("req_id", "row_start", "row_end", "token_start", "token_end")


def _is_int_like(value: Any) -> bool:
    """An integer-like scalar ``as_index`` takes (a numpy int, a 0-d integer tensor); not a bool, an
    array or a float."""
    try:
        as_index("total_rows", value)
    except TypeError:
        return False
    return True


def _snapshot_write(w: Any) -> PrefixCacheWrite:
    """A frozen ``PrefixCacheWrite`` of a write-like object (duck-typed writes are accepted): the
    step's rows are read from this snapshot at materialize, never from the caller's object, which
    may change after the save (I4); its row and position spans are checked as a real write's."""
    if type(w) is PrefixCacheWrite:  # frozen; a subclass may not be, so it is copied like any write-like
        return w
    if not all(hasattr(w, f) and (f == "req_id" or _is_int_like(getattr(w, f))) for f in _WRITE_FIELDS):
        raise OmniPrefixCacheUnmatchError(
            f"save_outputs: the {PHRASE_SLOT_MAPPING} rows of writes (a req_id and int row_start, row_end, "
            f"token_start, token_end: a PrefixCacheWrite) only; got a {type(w).__name__} in the layout's "
            f"writes ({w!r})")
    try:
        hash(w.req_id)
    except TypeError:
        raise OmniPrefixCacheUnmatchError(
            f"save_outputs: write {w} names an unhashable request id: the {PHRASE_SLOT_MAPPING} "
            "rows of requests only") from None
    try:
        return PrefixCacheWrite(w.req_id, w.row_start, w.row_end, w.token_start, w.token_end)
    except (TypeError, ValueError) as exc:
        raise OmniPrefixCacheUnmatchError(f"save_outputs: write {w!r} of the layout is refused: {exc}") from exc


def _checked_spans(writes: tuple[PrefixCacheWrite, ...], n: int) -> dict[ReqId, PrefixCacheWrite]:
    """The full check, in row order: raises naming the first overlap, repeat, excess or gap."""
    rows_seen = 0
    spans: dict[ReqId, PrefixCacheWrite] = {}
    if not all(type(w) is PrefixCacheWrite for w in writes):
        writes = tuple(map(_snapshot_write, writes))  # every write first: the order below reads their rows
    if any(a.row_start > b.row_start for a, b in itertools.pairwise(writes)):
        writes = tuple(sorted(writes, key=lambda w: w.row_start))
    for w in writes:  # each a PrefixCacheWrite now: its request id was hashed when it was made
        if w.row_start < rows_seen or w.row_end > n or w.req_id in spans:
            raise OmniPrefixCacheUnmatchError(
                f"save_outputs: write {w} overlaps another, repeats a request, or exceeds the "
                f"{n} rows the {PHRASE_SLOT_MAPPING}"
            )
        if w.row_start > rows_seen:
            raise OmniPrefixCacheUnmatchError(
                f"save_outputs: rows [{rows_seen}, {w.row_start}) belong to no request: the "
                f"{PHRASE_SLOT_MAPPING} every row of the step exactly once (write {w})"
            )
        rows_seen = w.row_end
        spans[w.req_id] = w
    if rows_seen != n:
        raise OmniPrefixCacheUnmatchError(
            f"save_outputs: rows [{rows_seen}, {n}) belong to no request: the {PHRASE_SLOT_MAPPING} "
            f"every row of the step exactly once (writes {list(writes)})"
        )
    return spans
