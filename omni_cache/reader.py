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

from collections.abc import Callable
from typing import Any

import torch

from omni_cache.copier import CopyEngine
from omni_cache.faults import FaultHooks
from omni_cache.interface import HIDDEN_KEY, ReqId, StageCacheOutputs
from omni_cache.staging import StagingPool
from omni_cache.step_outputs import RequestSpan, StepContext
from omni_cache.tenancy import NotLandedYet, SlotTenancy
from omni_cache.writes import PoolWrite, WriteBook

# How often a hit read may find rows still in flight before it calls it a bug.
_MAX_READ_RETRIES = 10_000


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

    def build_outputs(self, ctx: StepContext, req_ids: list[ReqId]) -> StageCacheOutputs:
        imm = ctx.immediate_write
        if imm is not None and imm.state not in ("host_ready", "written"):
            self.faults.on_blocking("materialize waits for the step's device->host copy")
            self.book.wait(imm, ("host_ready", "written"), why=f"materialize step {ctx.step_id}")
        for event in ctx.host_events:
            self.copies.wait(event)
        hidden: dict[ReqId, torch.Tensor] | None = {} if ctx.caches_hidden else None
        mm: dict[ReqId, dict[str, Any]] = {}
        for req_id in req_ids:
            span = ctx.spans[req_id]
            rows = {
                k: self.staging.page_rows(ctx.staging_slot, k, span.row_start, span.row_end).clone()
                for k in ctx.immediate_keys
            }
            rows.update({k: v[span.row_start : span.row_end] for k, v in ctx.deferred_rows.items()})
            if span.hit is not None:
                for key in ctx.hit_keys:
                    rows[key] = torch.cat([self._read_hit(ctx, span, key), rows[key]])
            per_req = {k: v for k, v in rows.items() if k != HIDDEN_KEY}
            per_req.update(ctx.leftover)
            mm[req_id] = per_req
            if hidden is not None and HIDDEN_KEY in rows:
                hidden[req_id] = rows[HIDDEN_KEY]
        return StageCacheOutputs(hidden, mm)

    def _read_hit(self, ctx: StepContext, span: RequestSpan, key: str) -> torch.Tensor:
        assert span.hit is not None, "reading a hit of a span without one: reader bug"
        what = f"materialize step {ctx.step_id} (saved at {ctx.saved_at}) request {span.req_id!r}"
        for _ in range(_MAX_READ_RETRIES):
            try:
                return self.tenancy.read(key, span.hit, what=what)
            except NotLandedYet as late:
                for tid in late.tids:
                    write = self.book.get(tid)
                    if write is None:
                        continue  # landed (or failed: check_failed below) since the read
                    if write.state == "pending":
                        self._push_front([write], f"{what} needs write tid {tid}")
                    self.faults.on_blocking(f"{what} waits for write tid {tid}")
                    self.book.wait(write, ("written",), why=f"{what} waits for its hit rows")
                self.book.check_failed(what)
        raise AssertionError(f"{what}: hit rows of {key!r} never landed: tenancy bug")
