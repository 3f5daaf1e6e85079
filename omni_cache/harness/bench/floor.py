"""The raw-copy floor of ``omni-cache bench``: the same copies with no bookkeeping.

Owns: ``RawCopyFloor``, the lower bound the manager is measured against. Per
step and per key it does only what any implementation must do to give the
next stage rows that no reused buffer can change:

  save         the step's rows -> one preallocated staging buffer (``copy_``),
               then the staging rows -> the block pool at the step's KV slots
               (``block_pool.scatter_rows``, the manager's own scatter: ``index_copy_``,
               or a numpy assignment for large steps);
  materialize  per request and key, a ``clone`` of its rows of the staging buffer
               (the caller keeps what materialize returns while the staging
               buffer is reused), or for the first step after a hit
               ``index_select`` of the hit's KV slots from the pool + ``cat``
               with its rows of this step (one copy either way).

No states, locks, versions, events or validation. Buffers are allocated once
(a long-running server allocates its pool at start-up). Upholds nothing: it is
a measuring stick, and ``check_outputs`` proves it does the same work.
"""

from __future__ import annotations

import torch

from omni_cache.harness.bench.workload import Step, WorkloadSpec
from omni_cache.runtime.block_pool import scatter_rows
from omni_cache.runtime.interface import HIDDEN_KEY, ReqId, StageCacheOutputs, TensorName


class RawCopyFloor:
    """Preallocated staging buffer and block pool per key; copies only."""

    def __init__(self, spec: WorkloadSpec) -> None:
        num_slots = spec.num_blocks * spec.block_size
        self.keys: tuple[TensorName, ...] = spec.keys
        self.pool = {k: torch.zeros((num_slots, w), dtype=spec.dtype) for k, w in spec.widths().items()}
        self.staging = {k: torch.empty((spec.max_step_tokens, w), dtype=spec.dtype)
                        for k, w in spec.widths().items()}
        self._step: Step | None = None

    def save(self, step: Step) -> None:
        n = step.num_tokens
        slots = step.slots
        for key in self.keys:
            page = self.staging[key][:n]
            page.copy_(step.outputs[key][:n])
            scatter_rows(self.pool[key], slots, page)
        self._step = step

    def materialize(self, step: Step) -> StageCacheOutputs:
        assert self._step is step, "floor: materialize of a step that was not the last saved"
        hidden: dict[ReqId, torch.Tensor] = {}
        mm: dict[TensorName, dict[ReqId, torch.Tensor]] = {}  # key-major, as materialize
        for w in step.layout.writes:
            hit = step.hit_slots.get(w.req_id)
            rows: dict[TensorName, torch.Tensor] = {}
            for key in self.keys:
                mine = self.staging[key][w.row_start : w.row_end]
                rows[key] = mine.clone() if hit is None else torch.cat([self.pool[key].index_select(0, hit), mine])
            hidden[w.req_id] = rows.pop(HIDDEN_KEY)
            for key, value in rows.items():
                mm.setdefault(key, {})[w.req_id] = value
        self._step = None
        return StageCacheOutputs(hidden, mm)
