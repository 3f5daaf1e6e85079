"""Pending prefix hits: a started or resumed request's hit, served by its next save.

Owns: ``PendingHits`` -- req -> (hit_end, the hit's block ids in the output KV-cache group), installed
by ``new_step_starts`` for the request's current admission and taken by the save
that carries the request's first rows (restored if that save fails) -- the KV
slots of a hit's blocks, and the memo of a policy's hit keys per key set.

Not locked itself: the manager's state lock guards ``PendingHits`` (methods
that touch the map say "caller holds the lock"); ``hit_keys`` runs on the
engine thread only.

Upholds: I5 (the save that serves a hit must continue it: its rows start at
the hit's end and land outside the hit's blocks, else it raises and nothing is
taken) and, with the manager's failure path, that a refused save loses no hit
(``restore``).
"""

from __future__ import annotations

import numpy as np
import torch

from omni_cache.runtime.errors import PHRASE_SLOT_MAPPING, OmniPrefixCacheUnmatchError
from omni_cache.runtime.events import PrefixCacheRequestEvent, StepRows
from omni_cache.runtime.interface import ModelCachePolicy, ReqId

Hit = tuple[int, tuple[int, ...]]  # (hit_end, the hit's block ids in the output KV-cache group)


class PendingHits:
    """The hits registered by ``new_step_starts`` and not yet served by a save."""

    def __init__(self, block_size: int, group_id: int = 0) -> None:
        self.block_size = block_size
        self.group_id = group_id  # the KV-cache group whose blocks address the rows (output_group_id)
        self._pending: dict[ReqId, Hit] = {}
        # per-token key tuple -> (policy, its hit keys); engine thread only.
        self._hit_keys: dict[tuple[str, ...], tuple[ModelCachePolicy, tuple[str, ...]]] = {}

    def __bool__(self) -> bool:
        """Any hit pending (installed and taken only on the engine thread)."""
        return bool(self._pending)

    def install(self, req_id: ReqId, event: PrefixCacheRequestEvent) -> bool:
        """The lookup of ``event``: a hit is pending from now on, a miss drops any. Caller holds the lock."""
        if event.hit_end > 0:
            blocks = event.group_block_ids(self.group_id)[: event.hit_end // self.block_size]
            self._pending[req_id] = (event.hit_end, blocks)
            return True
        self._pending.pop(req_id, None)
        return False

    def drop(self, req_id: ReqId) -> None:
        """The request's admission ended or was replaced. Caller holds the lock."""
        self._pending.pop(req_id, None)

    def take(self, rows: StepRows, slots: np.ndarray) -> dict[ReqId, Hit]:
        """Pop the hits this step serves; raise (taking nothing) if one is not continued. Caller holds the lock.

        A served hit's rows must continue it (``token_start == hit_end``) and land outside its
        blocks: ``slots`` (the step's KV slot per row) mapping a request's new rows into the
        blocks of its own hit is a slot mapping that does not follow the request's block table
        (its cached prefix would be overwritten by, and then read as, its own new rows).
        Walks the pending hits, not the step's writes: a decode step of many requests with
        a few new hits pending costs per hit, not per request."""
        pending = self._pending
        hits: dict[ReqId, Hit] = {}
        if not pending:
            return hits
        by_req = rows.by_req
        # A zero-row write (in the batch, nothing scheduled) does not take its hit: the first step
        # that schedules the request serves it (contract section 4.4).
        served = sorted(((w, hit) for req_id, hit in pending.items()
                         if (w := by_req.get(req_id)) is not None and w.row_end > w.row_start),
                        key=lambda pair: pair[0].row_start)  # row order, as the writes are
        bs = self.block_size
        for w, (hit_end, blocks) in served:  # the first write in row order that does not continue its hit is named
            if hit_end != w.token_start:
                raise OmniPrefixCacheUnmatchError(
                    f"save_outputs: request {w.req_id!r} has a hit of {hit_end} tokens "
                    f"but this step's rows start at position {w.token_start}; they must continue the hit")
            mine = (slots[w.row_start : w.row_end] // bs).tolist()  # the blocks its new rows land in
            if not (hit_blocks := set(blocks)).isdisjoint(mine):
                row = next(i for i, block in enumerate(mine) if block in hit_blocks)
                slot = int(slots[w.row_start + row])
                raise OmniPrefixCacheUnmatchError(
                    f"save_outputs: the {PHRASE_SLOT_MAPPING} request {w.req_id!r} outside its own hit, but its "
                    f"position {w.token_start + row} is at KV slot {slot}, in block {slot // bs} of its hit "
                    f"[0, {hit_end}) (blocks {list(blocks)}); the slot mapping does not follow its block table")
        for w, _ in served:
            hits[w.req_id] = pending.pop(w.req_id)
        return hits

    def restore(self, hits: dict[ReqId, Hit]) -> None:
        """Give back the hits of a save that failed before it registered anything. Caller holds the lock."""
        self._pending.update(hits)

    def slots_of(self, blocks: tuple[int, ...]) -> torch.Tensor:
        """The KV slots of ``blocks``, in order."""
        bs = self.block_size
        ids = np.fromiter(blocks, dtype=np.int64, count=len(blocks))
        return torch.from_numpy((ids[:, None] * bs + np.arange(bs, dtype=np.int64)).ravel())

    def hit_keys(self, policy: ModelCachePolicy, keys: tuple[str, ...]) -> tuple[str, ...]:
        """``policy.get_hit_keys`` of this step's per-token keys, memoised per key set."""
        cached = self._hit_keys.get(keys)
        if cached is None or cached[0] is not policy:
            cached = (policy, tuple(policy.get_hit_keys(keys)) if keys else ())
            self._hit_keys[keys] = cached
        return cached[1]
