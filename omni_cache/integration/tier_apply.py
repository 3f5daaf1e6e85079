"""The worker half of the hidden-state tier: apply the connector's per-step plan to the cache.

Owns: ``TierPlan`` (what ``OmniKVConnector.build_connector_meta`` sends the
worker each step inside the connector metadata: ``stores``, blocks of finished
requests whose rows go to the tier under their block hash, and ``loads``, the
new blocks the scheduler filled with external KV for a request, each with the
block hash of the content it holds), and ``TierApplier`` (the tier's counters
and the one call, ``apply``, the runner bridge makes at the top of each step,
after ``new_step_starts`` and before the forward, so every restored row is
registered before ``save_outputs`` plans the hit's read). Plain data and no
vLLM import: the plan crosses the scheduler/worker process boundary pickled
inside vLLM's ``SchedulerOutput``.

Upholds contract section 4.10: stores are applied before loads (a block freed
by a finished request and handed to a new request in the same step is read
before its new rows are placed), a load places exactly the rows the tier holds
for the block's hash into the block's *new* slots, and a load the tier cannot
serve restores nothing and vacates the new block (its previous tenant's rows
are of another content) -- never zeros nor another block's rows; ``load_failures``
names each such block (a damaged or foreign tier file is such a miss, counted
by the tier, never raised). Such a block is also a failed KV load to vLLM: its id is
held until ``take_load_errors`` (``OmniKVConnector.get_block_ids_with_load_errors``,
the same step's forward) hands it to the scheduler, whose ``kv_load_failure_policy``
recomputes the block (the forward computes its rows) or fails the request; ``apply``
returns such blocks' ids too, and the runner bridge serves no row of this step to a
request whose cached prefix holds one (its hit would read the vacated block: "is not
readable", I6; its rows were computed over KV that never came).

A plan the scheduler side never sends is refused whole before anything is
applied (``OmniPrefixCacheUnmatchError`` naming the step, request, block and
its KV slots, and what is wrong): an entry of the wrong type, a negative or
non-integer block id or index, a block outside the pool, an empty block hash,
two loads into one block, or two stores of one block under different hashes.
A tier entry that does not fit the pool (a row count other than the block size,
a dtype or row shape other than the pool's -- or an earlier entry's of the same
plan -- for a key, a key the pool holds missing; a key is held from its first registered
write on, its rows landed or not) is a
load the tier cannot serve, like a miss, and is dropped from the tier; every
load's entry is fetched and checked before the first restore, so an unusable
entry never raises after other loads were applied (a manager that fails or shuts
down meanwhile refuses the rest: I8).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.tier import HiddenTier
from omni_cache.runtime.tier_rows import (
    block_rows,
    reserve_problem,
    restore_problem,
    restore_rows,
    vacate_rows,
)

__all__ = ["TierApplier", "TierLoad", "TierPlan", "TierStore"]

_KEPT_FAILURES = 64  # failed loads kept in detail by ``TierApplier.load_failures``


@dataclass(frozen=True)
class TierStore:
    req_id: str
    block_hash: bytes
    block_id: int


@dataclass(frozen=True)
class TierLoad:
    req_id: str
    block_index: int  # the block's index in the request (its tokens start at block_index * block_size)
    block_hash: bytes
    block_id: int


@dataclass(frozen=True)
class TierPlan:
    stores: tuple[TierStore, ...] = ()
    loads: tuple[TierLoad, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


@dataclass
class TierApplier:
    """The worker's tier and what applying plans did to it (counters read by reports)."""

    tier: HiddenTier
    block_size: int
    stored_blocks: int = 0
    store_skipped: int = 0  # blocks with a key absent in the pool (never stored half)
    restored_blocks: int = 0
    tier_hit_tokens: int = 0
    num_load_failures: int = 0  # loads the tier could not serve (misses)
    # the first ``_KEPT_FAILURES`` of them in detail (a server runs for ever: the rest are counted only)
    load_failures: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # block ids of loads the tier could not serve, not yet reported to vLLM; guarded by _lock
    _load_errors: set[int] = field(default_factory=set, repr=False)

    def close(self) -> None:
        """At the connector's shutdown: the tier drops its entries and removes its spill files."""
        self.tier.close()

    def take_load_errors(self) -> set[int]:
        """The block ids of the loads this tier could not serve since the last call (vLLM's
        ``invalid_block_ids``: the scheduler recomputes or fails their requests)."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def slots_of(self, block_id: int) -> torch.Tensor:
        bs = self.block_size
        return torch.from_numpy(np.arange(block_id * bs, (block_id + 1) * bs, dtype=np.int64))

    def check_plan(self, plan: TierPlan, num_blocks: int | None = None) -> None:
        """Refuse a malformed plan (see the module docstring) before any of it is applied; with
        ``num_blocks`` (the pool's), a block outside ``[0, num_blocks)`` too."""
        if not isinstance(plan, TierPlan):
            raise OmniPrefixCacheUnmatchError(f"tier plan refused: {type(plan).__name__} is not a TierPlan")
        stored: dict[int, bytes] = {}
        loaded: dict[int, bytes] = {}
        for kind, entries, cls in (("store", plan.stores, TierStore), ("load", plan.loads, TierLoad)):
            for i, e in enumerate(entries):
                where = f"tier plan refused: {kind} #{i}"
                if not isinstance(e, cls):
                    raise OmniPrefixCacheUnmatchError(f"{where}: {type(e).__name__} is not a {cls.__name__}")
                where += f" (request {e.req_id!r}, block {e.block_id!r})"
                ints = [("block_id", e.block_id)] + ([("block_index", e.block_index)] if isinstance(e, TierLoad) else [])
                for name, value in ints:
                    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                        raise OmniPrefixCacheUnmatchError(f"{where}: {name} must be an integer >= 0, got {value!r}")
                if num_blocks is not None and e.block_id >= num_blocks:
                    raise OmniPrefixCacheUnmatchError(f"{where}: block_id is outside the pool's blocks "
                                                      f"[0, {num_blocks})")
                if not isinstance(e.req_id, str) or not isinstance(e.block_hash, bytes) or not e.block_hash:
                    raise OmniPrefixCacheUnmatchError(f"{where}: needs a str request id and a non-empty bytes "
                                                      f"block hash, got {e.req_id!r}, {e.block_hash!r}")
                twice = kind == "load" and e.block_id in loaded
                seen = stored if kind == "store" else loaded
                prev = seen.setdefault(e.block_id, e.block_hash)
                bs = self.block_size
                slots = f"KV slots [{e.block_id * bs}, {(e.block_id + 1) * bs - 1}]"
                if twice:
                    raise OmniPrefixCacheUnmatchError(
                        f"{where}: {slots} loaded twice in one step (state: contents {prev.hex()} and "
                        f"{e.block_hash.hex()}); one block holds one content")
                if kind == "store" and prev != e.block_hash:
                    raise OmniPrefixCacheUnmatchError(
                        f"{where}: {slots} stored twice in one step under two hashes "
                        f"(state: {prev.hex()}, {e.block_hash.hex()})")

    def tier_failures(self) -> dict[str, int]:
        """What the tier lost or could not read back: ``spill_failures`` (evicted entries that could
        not be written to disk), ``file_load_failures`` (damaged or foreign files, each a miss) and
        ``misses`` (loads the tier could not serve; the first ones listed in ``load_failures``)."""
        stats = self.tier.stats()
        with self._lock:
            return {"spill_failures": stats.spill_failures, "file_load_failures": stats.load_failures,
                    "misses": self.num_load_failures}

    def apply(self, plan: TierPlan, manager: Any) -> set[int]:
        """Stores, then loads (see the module docstring); engine thread, before the forward.
        Returns the block ids of the loads the tier could not serve (also held for ``take_load_errors``)."""
        bs = self.block_size
        self.check_plan(plan, manager.pool.num_slots // bs)
        failed: set[int] = set()
        for store in plan.stores:
            rows = block_rows(manager, self.slots_of(store.block_id))
            with self._lock:
                if rows is None:
                    self.store_skipped += 1
                    continue
            if self.tier.put(store.block_hash, rows):
                with self._lock:
                    self.stored_blocks += 1
        fetched = []  # every entry fetched and checked before the first restore
        held = manager.pool.sigs()  # and, as entries are accepted, the keys they bring
        for load in plan.loads:
            rows = self.tier.get(load.block_hash)
            why = "the tier holds no rows for its hash" if rows is None else restore_problem(rows, bs, held)
            if rows is not None and why is not None:  # never restorable into this pool: not kept
                self.tier.discard(load.block_hash)
            elif rows is not None:  # a key new to the pool gets its tensor now (a refusal: this load's miss)
                why = reserve_problem(manager, rows)
            fetched.append((load, None if why else rows, why))
        for load, rows, why in fetched:
            if rows is None:
                with self._lock:
                    self.num_load_failures += 1
                    if len(self.load_failures) < _KEPT_FAILURES:
                        self.load_failures.append({"req_id": load.req_id, "block_index": load.block_index,
                                                   "block_id": load.block_id, "block_hash": load.block_hash.hex(),
                                                   "why": why})
                    self._load_errors.add(load.block_id)
                failed.add(load.block_id)
                # the new block's previous tenant (another content) must not serve the hit: it
                # raises "is not readable" (I6), never zeros nor another block's rows
                vacate_rows(manager, self.slots_of(load.block_id))
                continue
            restore_rows(manager, self.slots_of(load.block_id), rows)
            with self._lock:
                self.restored_blocks += 1
                self.tier_hit_tokens += self.block_size
        return failed

    def summary(self) -> dict[str, Any]:
        stats = self.tier.stats()
        with self._lock:
            return {"tier_hit_tokens": self.tier_hit_tokens, "tier_bytes": stats.bytes,
                    "tier_entries": stats.entries, "tier_evictions": stats.evictions,
                    "tier_spilled": stats.spilled, "tier_disk_hits": stats.disk_hits,
                    "tier_stored_blocks": self.stored_blocks, "tier_store_skipped": self.store_skipped,
                    "tier_restored_blocks": self.restored_blocks,
                    "tier_load_failures": self.num_load_failures,
                    "tier_spill_failures": stats.spill_failures, "tier_file_load_failures": stats.load_failures,
                    "tier_load_failure_blocks": list(self.load_failures[:8])}
