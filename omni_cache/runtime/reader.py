"""The materialize read path: one step's rows from its page, its host copies and its hits.

Owns: ``StepReader``, which turns a consumed ``StepContext`` into
``StageCacheOutputs``. It waits (outside every state lock) for the step's own
device->host copy and for hit rows whose writes have not landed, pushing a
still-pending write to the front of the queue first so no read waits on a
request that may never finish.

Upholds: I4 (reads only the context's page, host copies and planned reads),
I6/I7 (hit rows come from ``SlotTenancy.read``, which raises instead of serving
absent or newer-tenant rows), I11 (waits go through ``WriteBook.wait`` with no
manager lock held; the ``on_blocking`` fault hook sees each one).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from omni_cache.runtime.copier import CopyEngine
from omni_cache.runtime.events import PrefixCacheWrite
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.interface import HIDDEN_KEY, ReqId, StageCacheOutputs
from omni_cache.runtime.staging import StagingPool
from omni_cache.runtime.step_outputs import StepContext
from omni_cache.runtime.tenancy import NotLandedYet, PlannedRead, SlotTenancy
from omni_cache.runtime.writes import PoolWrite, WriteBook

# How often a hit read may find rows still in flight before it calls it a bug.
_MAX_READ_RETRIES = 10_000
# Above this many bytes per key, materialize clones per request instead of once per step.
_ONE_CLONE_MAX_BYTES = 1 << 20


def per_request(req_ids: Sequence[ReqId], parts: Sequence[torch.Tensor]) -> dict[ReqId, torch.Tensor]:
    """The one entry per request of a key's output (``omni-cache bench --profile`` times it with the views)."""
    return dict(zip(req_ids, parts, strict=True))


class _Shape(NamedTuple):
    """Which rows of the step materialize returns, per request in the caller's order."""

    req_ids: tuple[ReqId, ...]
    wanted: Sequence[PrefixCacheWrite]
    sizes: list[int]
    lo: int
    contiguous: bool
    hit_reqs: dict[ReqId, PlannedRead]
    unique: bool  # no request named twice


class StepReader:
    """Builds materialize's outputs; stateless beyond its collaborators."""

    def __init__(
        self,
        staging: StagingPool,
        tenancy: SlotTenancy,
        book: WriteBook,
        copies: CopyEngine,
        faults: FaultHooks,
        push_front: Callable[[list[PoolWrite], str], None],
    ) -> None:
        self.staging = staging
        self.tenancy = tenancy
        self.book = book
        self.copies = copies
        self.faults = faults
        self._push_front = push_front

    def release(self, ctx: StepContext, slot: Any) -> None:
        """A consumed step is done with: drop its planned reads (their pins) and its page's read."""
        for plan in ctx.planned_reads():
            self.tenancy.unplan(plan)
        self.staging.done_reading(slot)

    def build_outputs(self, ctx: StepContext, req_ids: tuple[ReqId, ...]) -> StageCacheOutputs:
        imm = ctx.immediate_write
        if imm is not None and imm.state not in ("host_ready", "written"):
            self.faults.on_blocking("materialize waits for the step's device->host copy")
            self.book.wait(imm, ("host_ready", "written"), why=f"materialize step {ctx.step_id}")
        for event in ctx.host_events:
            self.copies.wait(event)
        # A private copy of the step's rows (the page is reused once released): ``_per_request``.
        if not req_ids:
            return StageCacheOutputs({} if ctx.caches_hidden else None, {})
        step_rows = ctx.rows
        wanted: Sequence[PrefixCacheWrite]
        if req_ids == step_rows.req_ids and step_rows.tiles:  # every request, in row order: rows [0, n)
            wanted, sizes, contiguous = step_rows.writes, step_rows.sizes, True
            lo, hi = 0, step_rows.ends[-1]
            hit_reqs, unique = ctx.hits, True  # all hits are of this step's requests, each listed once
        else:
            spans = step_rows.by_req
            wanted = [spans[r] for r in req_ids]
            lo = min(w.row_start for w in wanted)  # req_ids is not empty (returned above)
            hi = max(w.row_end for w in wanted)
            sizes = [w.row_end - w.row_start for w in wanted]
            contiguous = sum(sizes) == hi - lo and all(
                a.row_end == b.row_start for a, b in itertools.pairwise(wanted))
            wanted_ids = set(req_ids)
            hit_reqs = {r: hit for r, hit in ctx.hits.items() if r in wanted_ids} if ctx.hits else {}
            unique = len(wanted_ids) == len(req_ids)
        # Key-major, as in the reference: out[key][req].
        out: dict[str, dict[ReqId, Any]] = {}
        shape = _Shape(req_ids, wanted, sizes, lo, contiguous, hit_reqs, unique)
        for key, page in self.staging.pages_rows(ctx.staging_slot, ctx.immediate_keys, lo, hi).items():
            out[key] = self._per_request(ctx, key, page, shape, private=False)
        for key, rows in ctx.deferred_rows.items():  # already a private host copy: views of it
            out[key] = self._per_request(ctx, key, rows[lo:hi], shape, private=True)
        hidden = out.pop(HIDDEN_KEY, {}) if ctx.caches_hidden else None
        for key, value in ctx.leftover.items():
            out[key] = dict.fromkeys(req_ids, value)
        return StageCacheOutputs(hidden, out)

    def _per_request(self, ctx: StepContext, key: str, src: torch.Tensor, shape: _Shape, *,
                     private: bool) -> dict[ReqId, torch.Tensor]:
        """req -> its rows of ``src`` (the step's rows ``[shape.lo, ...)`` of ``key``), each a private
        copy (``private``: ``src`` already is one, so views of it). A request's first step after a
        hit gets its cached prefix rows, then this step's rows, in one new tensor."""
        req_ids, wanted, lo = shape.req_ids, shape.wanted, shape.lo
        hits = shape.hit_reqs if shape.hit_reqs and key in ctx.hit_keys else {}
        if hits and (len(hits) == len(req_ids) or not shape.unique):  # every request merges, or a request
            # is named twice: merge per request, as listed, with nothing cloned first
            return per_request(req_ids, [
                self._merge_hit(ctx, r, hits[r], key, src[w.row_start - lo : w.row_end - lo]) if r in hits
                else src[w.row_start - lo : w.row_end - lo] if private else src[w.row_start - lo : w.row_end - lo].clone()
                for r, w in zip(req_ids, wanted, strict=True)])
        # Small steps (decode): one clone per key, split into per-request views -- O(1) calls per
        # step. Large steps (prefill): one clone per request, which measured faster than one huge
        # allocation (``omni-cache bench``).
        if len(req_ids) == 1 and not hits:  # ``src`` is rows [lo, hi): exactly the one request's
            # NOTE: no split of a one-request step: its private copy is its whole output (one torch
            # call fewer per key, and a step's calls run with torch's dispatch cold).
            return {req_ids[0]: src if private else src.clone()}
        if shape.contiguous and (private or src.nbytes <= _ONE_CLONE_MAX_BYTES):
            parts: Any = (src if private else src.clone()).split_with_sizes(shape.sizes)
        else:
            parts = [src[w.row_start - lo : w.row_end - lo] if private else src[w.row_start - lo : w.row_end - lo].clone()
                     for w in wanted]
        if hits:  # a few new requests among many (each listed once): per hit, not per request
            parts = list(parts)
            for r, hit in hits.items():
                i = req_ids.index(r)
                w = wanted[i]
                parts[i] = self._merge_hit(ctx, r, hit, key, src[w.row_start - lo : w.row_end - lo])
        return per_request(req_ids, parts)

    def _merge_hit(self, ctx: StepContext, req_id: str, hit: PlannedRead, key: str,
                   rows: torch.Tensor) -> torch.Tensor:
        """The hit's cached rows of ``key`` followed by this step's ``rows``, in one new tensor:
        the pool rows are gathered straight into its head (one copy per row, no ``cat``)."""
        cached = len(hit.slots_np)
        merged = torch.empty((cached + rows.shape[0], *rows.shape[1:]), dtype=rows.dtype)
        self.read_hit(ctx, req_id, hit, key, out=merged[:cached])
        merged[cached:].copy_(rows)
        return merged

    def read_hit(self, ctx: StepContext, req_id: str, hit: PlannedRead, key: str,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        what = f"materialize step {ctx.step_id} (saved at {ctx.saved_at}) request {req_id!r}"
        return self.read_planned(hit, key, what=what, out=out)

    def read_planned(self, plan: PlannedRead, key: str, *, what: str,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of ``key`` at exactly ``plan``'s versions (I6/I7), waiting for writes still in
        flight: a pending write is pushed to the front of the queue first, and every wait goes
        through the write book with no manager lock held (I11). Used by materialize's hit reads
        and by the hidden-state tier's block reads (``tier_rows.block_rows``)."""
        settled: set[int] = set()  # planned writes seen terminal (landed or failed)
        for _ in range(_MAX_READ_RETRIES):
            try:
                return self.tenancy.read(key, plan, what=what, settled=settled, out=out)
            except NotLandedYet as late:
                for tid in late.tids:
                    write = self.book.get(tid)
                    if write is None:
                        settled.add(tid)  # terminal: the next read decides (failed: check_failed below)
                        continue
                    if write.state in ("pending", "queued"):  # queue it first and make progress
                        self._push_front([write], f"{what} needs write tid {tid}")
                    self.faults.on_blocking(f"{what} waits for write tid {tid}")
                    self.book.wait(write, ("written",), why=f"{what} waits for its rows")
                self.book.check_failed(what)
        raise AssertionError(f"{what}: rows of {key!r} never landed: tenancy bug")
