"""KV-slot tenancy: per-(slot, key) row versions, planned reads and preserved rows.

Owns: three version vectors per key -- ``registered`` (tid of the newest write
registered for the slot), ``landed`` (tid whose rows are in the block pool) and
``pins`` (how many planned hit reads still need the slot) -- and the rows
preserved for planned reads before a newer tenant overwrites them. Everything
here is guarded by the block pool's leaf data lock (``PrefixBlockPool.lock``).

A version is the tid of the write that produced the rows (tids are monotonic),
so "newer tenant" is simply "larger tid".

Upholds:
  I6  a planned read of a slot no write ever registered is absent: ``read``
      raises "is not readable"; rows are never served as zeros.
  I7  ``land`` preserves the current rows of every pinned slot before it
      overwrites them, and ``read`` returns exactly the planned version (from
      the pool or from the preserved copy) or raises -- never a newer tenant's
      rows. ``land`` also never lets an older write overwrite a newer one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_cache.block_pool import PrefixBlockPool
from omni_cache.errors import PHRASE_NOT_READABLE, OmniPrefixCacheUnmatchError
from omni_cache.interface import TensorName, Tid


@dataclass
class PlannedRead:
    """A hit read planned at save: ``slots`` at the versions in ``expected``."""

    slots: torch.Tensor
    expected: dict[TensorName, torch.Tensor]


class NotLandedYet(Exception):
    """``read`` found rows whose write has not landed; wait for ``tids`` and retry."""

    def __init__(self, tids: list[Tid]) -> None:
        super().__init__(f"writes {tids} have not landed")
        self.tids = tids


class SlotTenancy:
    """Versions and preserved rows for the block pool's KV slots."""

    def __init__(self, pool: PrefixBlockPool) -> None:
        self.pool = pool
        # All below: guarded by pool.lock.
        self._registered: dict[TensorName, torch.Tensor] = {}
        self._landed: dict[TensorName, torch.Tensor] = {}
        self._pins: dict[TensorName, torch.Tensor] = {}
        # key -> slot -> version -> row (a clone).
        self._preserved: dict[TensorName, dict[int, dict[Tid, torch.Tensor]]] = {}
        self.num_preserved_total = 0

    def _vectors_locked(self, key: TensorName) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if key not in self._registered:
            n = self.pool.num_slots
            self._registered[key] = torch.zeros(n, dtype=torch.int64)
            self._landed[key] = torch.zeros(n, dtype=torch.int64)
            self._pins[key] = torch.zeros(n, dtype=torch.int32)
            self._preserved[key] = {}
        return self._registered[key], self._landed[key], self._pins[key]

    # ---- engine thread: registration and planning --------------------------
    def register(self, key: TensorName, slots: torch.Tensor, tid: Tid) -> list[Tid]:
        """Record ``tid`` as the newest tenant of ``slots``; return older unlanded tids.

        The caller must get those older writes landed before ``tid`` (it pushes
        them to the front of the copy queue), so a preempted tenant's late
        write never lands over its successor's rows.
        """
        with self.pool.lock:
            registered, landed, _ = self._vectors_locked(key)
            older = registered[slots]
            behind = older > landed[slots]
            older_tids = torch.unique(older[behind]).tolist() if bool(behind.any()) else []
            registered[slots] = tid
        return older_tids

    def plan(self, keys: list[TensorName], slots: torch.Tensor) -> PlannedRead:
        """Pin ``slots`` for ``keys`` at their current registered versions."""
        expected: dict[TensorName, torch.Tensor] = {}
        with self.pool.lock:
            for key in keys:
                registered, _, pins = self._vectors_locked(key)
                expected[key] = registered[slots].clone()
                pins[slots] += 1
        return PlannedRead(slots, expected)

    def unplan(self, read: PlannedRead) -> None:
        """Drop the pins of ``read``; forget preserved rows nobody needs any more."""
        with self.pool.lock:
            for key in read.expected:
                _, _, pins = self._vectors_locked(key)
                pins[read.slots] -= 1
                preserved = self._preserved[key]
                if preserved:
                    for slot in read.slots.tolist():
                        if slot in preserved and int(pins[slot]) == 0:
                            del preserved[slot]

    # ---- committer: landing -------------------------------------------------
    def land(self, key: TensorName, slots: torch.Tensor, rows: torch.Tensor, tid: Tid) -> None:
        """Scatter ``rows`` (version ``tid``) into the pool at ``slots`` (I7)."""
        tensor = self.pool.ensure_key(key, rows)  # allocates outside the lock
        self.pool.check_slots(slots)
        with self.pool.lock:
            _, landed, pins = self._vectors_locked(key)
            current = landed[slots]
            newer = current < tid
            if not bool(newer.all()):
                slots, rows, current = slots[newer], rows[newer], current[newer]
            keep = (pins[slots] > 0) & (current > 0)
            if bool(keep.any()):
                preserved = self._preserved[key]
                idx = keep.nonzero().flatten()
                old_rows = tensor.index_select(0, slots[idx])
                for j, (slot, version) in enumerate(zip(slots[idx].tolist(), current[idx].tolist(), strict=True)):
                    preserved.setdefault(slot, {})[version] = old_rows[j]
                    self.num_preserved_total += 1
            tensor.index_copy_(0, slots, rows)
            landed[slots] = tid

    # ---- reader -------------------------------------------------------------
    def read(self, key: TensorName, read: PlannedRead, *, what: str) -> torch.Tensor:
        """Rows of ``read.slots`` at the planned versions of ``key``.

        Raises ``NotLandedYet`` when a planned version is still in flight, and
        ``OmniPrefixCacheUnmatchError`` ("is not readable") when rows are absent
        (I6) or were overwritten by a newer tenant without a preserved copy (I7).
        """
        slots, expected = read.slots, read.expected[key]
        absent = expected == 0
        if bool(absent.any()):
            first = int(absent.nonzero()[0])
            raise OmniPrefixCacheUnmatchError(
                f"{what}: key {key!r} at KV slot {int(slots[first])} {PHRASE_NOT_READABLE}: "
                f"{int(absent.sum())} of {slots.numel()} hit rows were never written; the omni "
                "cache diverged from the KV cache (I6) -- never served as zeros"
            )
        with self.pool.lock:
            _, landed, _ = self._vectors_locked(key)
            current = landed[slots]
            behind = current < expected
            if bool(behind.any()):
                raise NotLandedYet(torch.unique(expected[behind]).tolist())
            tensor = self.pool.tensor_locked(key)
            assert tensor is not None, f"{key!r} has landed versions but no pool tensor: tenancy bug"
            rows = tensor.index_select(0, slots)
            ahead = current > expected
            if bool(ahead.any()):
                preserved = self._preserved[key]
                for j in ahead.nonzero().flatten().tolist():
                    slot, version = int(slots[j]), int(expected[j])
                    row = preserved.get(slot, {}).get(version)
                    if row is None:
                        raise OmniPrefixCacheUnmatchError(
                            f"{what}: key {key!r} at KV slot {slot} {PHRASE_NOT_READABLE}: the hit "
                            f"planned version {version}, a newer tenant (version {int(current[j])}) "
                            "overwrote it and no preserved copy exists (I7) -- refusing the newer rows"
                        )
                    rows[j] = row
        return rows

    def num_preserved(self) -> int:
        with self.pool.lock:
            return sum(len(v) for per_key in self._preserved.values() for v in per_key.values())
