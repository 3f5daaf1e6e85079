"""KV-slot tenancy: per-(slot, key) row versions, planned reads and preserved rows.

Owns: four vectors per key -- ``registered`` (tid of the newest write
registered for the slot), ``tenant`` (the step id of that write), ``landed``
(tid whose rows are in the block pool) and ``pins`` (how many planned hit reads
still need the slot) --, one vector per slot, ``_tenant`` (the step id of the
newest write of any key: the slot's tenant), and the rows preserved for planned
reads before a newer tenant overwrites them. Everything here is guarded by the
block pool's leaf data lock (``PrefixBlockPool.lock``).

Layout: ``_tenant`` and every key's ``registered``/``tenant``/``landed`` are columns of
one table, a row per KV slot, so the versions a step reads and writes for a request's
slot share a cache line or two instead of one line per vector (a decode step between
forward passes finds them cold). ``pins`` (read only for hits) stays its own vector.

A version is the tid of the write that produced the rows (tids are monotonic),
so "newer tenant" is simply "larger tid". A KV slot has one tenant for all keys:
the step that last registered a write on it. A key whose version was written by
an older step than the slot's tenant is *absent* there (the tenant's write did
not carry it), exactly like a key never written.

Upholds:
  I6  a planned read of a slot no write ever registered, or of a key the
      slot's tenant did not write, is absent: ``read`` raises "is not
      readable"; rows are never served as zeros nor from an older tenant.
  I7  ``land`` preserves the current rows of a slot before it overwrites them
      exactly when a planned read still needs that version there, and ``read``
      returns exactly the planned version (from the pool or from the preserved
      copy) or raises -- never a newer tenant's rows. ``land`` also never lets
      an older write overwrite a newer one. Preserved rows are bounded: a
      (slot, key) keeps only versions an active planned read pins there, so at
      most one preserved version per planned slot, however many tenants
      overwrite it meanwhile (``unplan`` drops what no remaining plan needs).

With a ``TraceRecorder``, register/land/plan/read log notes (under the pool
lock, so in the lock's order; a read logs the version it really served per
slot) that ``omni_cache.verify.tenancy_trace`` maps onto the Tenancy spec.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

import numpy as np
import torch

from omni_cache.runtime.block_pool import PrefixBlockPool, scatter_rows
from omni_cache.runtime.errors import PHRASE_NOT_READABLE, OmniPrefixCacheUnmatchError
from omni_cache.runtime.interface import TensorName, Tid
from omni_cache.runtime.trace import TraceRecorder
from omni_cache.runtime.validation import RowSig, row_sig


@dataclass
class PlannedRead:
    """A hit read planned at save: ``slots`` at the versions in ``expected`` (per key)."""

    slots: torch.Tensor
    slots_np: np.ndarray
    expected: dict[TensorName, np.ndarray]
    plan_id: int = 0  # names the plan in tenancy trace notes (0: not traced)


class NotLandedYet(Exception):
    """``read`` found rows whose write has not landed; wait for ``tids`` and retry."""

    def __init__(self, tids: list[Tid]) -> None:
        super().__init__(f"writes {tids} have not landed")
        self.tids = tids


class _KeyVersions:
    """The version vectors of one key (numpy: a few cheap ops per step, whatever the batch)."""

    __slots__ = ("landed", "newest_landed", "num_pins", "pins", "preserved", "registered", "sig", "tenant", "tensor")

    def __init__(self, num_slots: int, table: np.ndarray, index: int, num_keys: int) -> None:
        self.bind(table, index, num_keys)
        # max(landed): the newest tid that ever landed for this key. A write above it is newer
        # than every slot's version, so ``land_all`` skips the per-slot order check (the common
        # case: immediate writes land in tid order).
        self.newest_landed = 0
        self.pins = np.zeros(num_slots, dtype=np.int32)
        self.num_pins = 0  # sum of pins: 0 lets ``land`` skip the preservation check
        # slot -> version -> row (a clone), kept while a planned read pins that version there.
        self.preserved: dict[int, dict[Tid, torch.Tensor]] = {}
        # The pool tensor of this key once allocated (pools never drop keys), and its row signature.
        self.tensor: torch.Tensor | None = None
        self.sig: RowSig | None = None

    def bind(self, table: np.ndarray, index: int, num_keys: int) -> None:
        """Make this key's version vectors its columns of ``table`` (``SlotTenancy._table``), as the
        ``index``-th of ``num_keys`` keys."""
        self.registered = table[:, 1 + 2 * index]
        # The step id that registered ``registered`` (compared with the slot's tenant).
        self.tenant = table[:, 2 + 2 * index]
        self.landed = table[:, 1 + 2 * num_keys + index]


def _all_below(values: np.ndarray, bound: int) -> bool:
    """Every value < ``bound`` (short arrays, as a decode step's, without numpy reductions)."""
    if len(values) <= 8:
        return max(values.tolist(), default=-1) < bound
    return bool(np.maximum.reduce(values) < bound)  # one reduction, no temporary (values < bound)


class SlotTenancy:
    """Versions and preserved rows for the block pool's KV slots."""

    def __init__(self, pool: PrefixBlockPool, recorder: TraceRecorder | None = None) -> None:
        self.pool = pool
        # Trace notes for tla/tenancy/TenancyTrace.tla (register, land, plan, read); None: off.
        self.recorder = recorder
        self._num_plans = 0
        # id(plan) -> every planned read not yet unplanned (the versions they pin decide which
        # overwritten rows are preserved); guarded by pool.lock, mutated by plan/unplan only.
        self._plans: dict[int, PlannedRead] = {}
        # key -> versions; guarded by pool.lock.
        self._keys: dict[TensorName, _KeyVersions] = {}
        # A row per KV slot: [tenant, (registered, tenant) per key, landed per key], keys in
        # ``_keys`` order; the vectors are views of its columns. Replaced (copied) when a key is
        # added. NOTE: a write of every key registers (and lands) with one numpy call on a
        # contiguous column range instead of several per key: a step runs them with numpy cold.
        self._table = np.zeros((pool.num_slots, 1), dtype=np.int64)
        # slot -> step id of the newest write registered on it, whatever its keys (the tenant).
        self._tenant = self._table[:, 0]
        self.num_preserved_total = 0

    def _versions_locked(self, key: TensorName) -> _KeyVersions:
        versions = self._keys.get(key)
        if versions is None:  # a wider table; everything is allocated before anything changes
            old, k = self._table, len(self._keys)
            try:
                table = np.zeros((old.shape[0], old.shape[1] + 3), dtype=np.int64)
            except MemoryError as exc:  # a sizing problem of this key's save, named as one
                raise OmniPrefixCacheUnmatchError(
                    f"cannot allocate the version table for key {key!r}: {old.shape[0]:,} KV slots "
                    f"(num_blocks x block_size) x {old.shape[1] + 3} int64 versions = {8 * old.shape[0] * (old.shape[1] + 3):,} bytes"
                ) from exc
            versions = _KeyVersions(self.pool.num_slots, table, k, k + 1)
            table[:, : 1 + 2 * k] = old[:, : 1 + 2 * k]  # tenant, (registered, tenant) pairs
            table[:, 3 + 2 * k : 3 + 3 * k] = old[:, 1 + 2 * k :]  # landed, after the new pair
            self._table, self._tenant = table, table[:, 0]
            for index, v in enumerate(self._keys.values()):
                v.bind(table, index, k + 1)
            self._keys[key] = versions
        return versions

    # ---- engine thread: registration and planning --------------------------
    def prepare_keys(self, sigs: dict[TensorName, RowSig]) -> list[TensorName]:
        """Allocate the pool tensors and the version vectors of the keys of ``sigs`` now, so neither
        ``register`` nor a landing allocates; return the keys whose pool tensor was reserved now
        (``PrefixBlockPool.drop_reserved`` gives them back if the save is refused).

        The manager calls this before a save claims anything: a pool tensor the allocator refuses
        or a version table too large to allocate is an ``OmniPrefixCacheUnmatchError`` naming the key
        and its bytes, with nothing to undo.
        """
        reserved = self.pool.prepare_keys(sigs)
        if self._keys.keys() >= sigs.keys():  # keys are only ever added (one C-level set comparison)
            return reserved
        try:
            with self.pool.lock:
                for key in sigs:
                    self._versions_locked(key)
        except BaseException:
            self.pool.drop_reserved(reserved)
            raise
        return reserved

    def register(
        self, keys: list[TensorName], slots: np.ndarray, tid: Tid, *, step_id: int, scan_older: bool = True
    ) -> set[Tid]:
        """Record ``tid`` (of step ``step_id``) as the newest tenant of ``slots``; return older unlanded tids.

        Step ``step_id`` becomes the tenant of ``slots`` for every key: a key
        this step registers no write for is absent there from now on (I7). The
        caller must get the older writes landed before ``tid`` (it pushes them
        to the front of the copy queue), so a preempted tenant's late write
        never lands over its successor's rows.
        """
        older_tids: set[Tid] = set()
        with self.pool.lock:
            # may allocate (a key ``prepare_keys`` did not see): before any change
            versions = [self._keys.get(key) or self._versions_locked(key) for key in keys]
            num_keys = len(self._keys)
            if not scan_older and len(versions) == num_keys and len(set(keys)) == num_keys:
                # every key (the usual save): the tenant and each key's (registered, tenant) pair, in one call
                self._table[slots, : 1 + 2 * num_keys] = [step_id] + [tid, step_id] * num_keys
            else:
                self._tenant[slots] = step_id
                for v in versions:
                    if scan_older:
                        older = v.registered[slots]
                        behind = older > v.landed[slots]
                        if behind.any():
                            older_tids.update(np.unique(older[behind]).tolist())
                    v.registered[slots] = tid
                    v.tenant[slots] = step_id
            if self.recorder is not None:
                self._note("register", step_id, tid=tid, keys=tuple(keys), slots=tuple(slots.tolist()))
        return older_tids

    def take_slots(self, slots: np.ndarray, *, step_id: int) -> None:
        """Step ``step_id``, which registers no write (it carries no per-token key), becomes the
        tenant of ``slots``: every key is absent there from now on (I6/I7), so a later hit on them
        raises "is not readable" instead of serving an older tenant's rows."""
        with self.pool.lock:
            self._tenant[slots] = step_id
            if self.recorder is not None:
                self._note("tenant", step_id, slots=tuple(slots.tolist()))

    def _note(self, what: str, step_id: int | None, **data: object) -> None:
        """Log a tenancy event for trace validation (pool lock held: notes keep the lock's order)."""
        assert self.recorder is not None, "tenancy note without a recorder: tenancy bug"
        self.recorder.note("tenancy", "tenancy", what, "-", step_id, **data)

    def plan(self, keys: list[TensorName], slots: torch.Tensor, *, block_size: int | None = None) -> PlannedRead:
        """Pin ``slots`` for ``keys`` at their current registered versions.

        A key whose version was not written by the slot's tenant is planned
        as absent (version 0): ``read`` refuses it (I6/I7). With ``block_size``, ``slots`` are
        whole KV blocks in token order: a block is written in token order, each write newer than
        the last, so a slot holding an older version than an earlier slot of its block holds
        another tenant's row (a newer tenant wrote only the block's first slots) and is planned
        as absent too (I6): a hit is never served half of one tenant's block and half of another's.
        """
        slots_np = slots.numpy()
        expected: dict[TensorName, np.ndarray] = {}
        bs = block_size if block_size is not None and block_size > 1 and len(slots_np) % block_size == 0 else 0
        mixed: dict[TensorName, tuple[int, ...]] = {}  # per key, slots the block rule planned absent (trace notes)
        with self.pool.lock:
            tenant = self._tenant[slots_np]
            for key in keys:
                v = self._versions_locked(key)
                planned = np.where(v.tenant[slots_np] == tenant, v.registered[slots_np], 0)
                if bs:  # whole blocks
                    by_block = planned.reshape(-1, bs)
                    behind = by_block < np.maximum.accumulate(by_block, axis=1)
                    if self.recorder is not None and (dropped := slots_np[(behind & (by_block > 0)).ravel()]).size:
                        mixed[key] = tuple(dropped.tolist())
                    planned = np.where(behind, 0, by_block).ravel()
                expected[key] = planned
                v.pins[slots_np] += 1
                v.num_pins += len(slots_np)
            plan = PlannedRead(slots, slots_np, expected)
            self._plans[id(plan)] = plan
            if self.recorder is not None:
                self._num_plans += 1
                plan.plan_id = self._num_plans
                self._note("plan", None, plan=plan.plan_id, slots=tuple(slots_np.tolist()),
                           expected=tuple((k, tuple(e.tolist())) for k, e in expected.items()),
                           mixed=tuple(mixed.items()))
        return plan

    def unplan(self, read: PlannedRead) -> None:
        """Drop the pins of ``read``; forget preserved rows no remaining planned read needs."""
        with self.pool.lock:
            self._plans.pop(id(read), None)
            for key in read.expected:
                v = self._versions_locked(key)
                v.pins[read.slots_np] -= 1
                v.num_pins -= len(read.slots_np)
                if not v.preserved:
                    continue
                mine = [slot for slot in read.slots_np.tolist() if slot in v.preserved]
                if not mine:
                    continue
                still = [slot for slot in mine if v.pins[slot] > 0]
                for slot in mine:
                    if v.pins[slot] == 0:
                        del v.preserved[slot]
                if still:  # another plan pins the slot: keep only the versions the plans left need
                    wanted = self._needed_pairs_locked(key, np.array(still, dtype=np.int64))
                    for slot in still:
                        kept = v.preserved[slot]
                        for version in [x for x in kept if (slot, x) not in wanted]:
                            del kept[version]
                        if not kept:
                            del v.preserved[slot]

    def _needed_pairs_locked(self, key: TensorName, slots_np: np.ndarray) -> set[tuple[int, Tid]]:
        """The (slot, version) pairs of ``key`` that an active planned read pins, among ``slots_np``.

        Runs only where a pinned slot is overwritten or unplanned with rows preserved (rare):
        per plan one ``isin`` over its slots, then a Python loop over the matches only."""
        pairs: set[tuple[int, Tid]] = set()
        for plan in self._plans.values():
            expected = plan.expected.get(key)
            if expected is None:
                continue
            hit = np.flatnonzero(np.isin(plan.slots_np, slots_np))
            pairs.update(zip(plan.slots_np[hit].tolist(), expected[hit].tolist(), strict=True))
        return pairs

    # ---- committer: landing -------------------------------------------------
    def land_all(
        self, rows_by_key: dict[TensorName, torch.Tensor], slots: torch.Tensor, tid: Tid, *,
        slots_np: np.ndarray | None = None, sigs: dict[TensorName, RowSig] | None = None,
    ) -> None:
        """Scatter one write's rows of every key (version ``tid``) at ``slots`` (I7).

        Rows a planned read still pins are preserved before they are overwritten;
        rows whose slot already holds a newer version are skipped. ``slots`` were
        range-checked when the write was registered (``slots_np``: their numpy view, and
        ``sigs``: each key's ``row_sig``, when the write carries them).
        """
        tensors = {}
        for key, rows in rows_by_key.items():
            sig = sigs.get(key) if sigs is not None else None
            if sig is None:
                sig = row_sig(rows)
            known = self._keys.get(key)
            tensor = known.tensor if known is not None and known.sig == sig else None
            if tensor is None:
                tensor = self.pool.ensure_key(key, rows)  # allocates outside the lock; checks shapes
            tensors[key] = (tensor, sig, known)
        all_slots, all_np = slots, (slots.numpy() if slots_np is None else slots_np)
        with self.pool.lock:
            unmasked: list[_KeyVersions] = []  # keys landed on every slot: versions set after the loop
            try:
                for key, rows in rows_by_key.items():
                    tensor, sig, known = tensors[key]
                    v = known or self._versions_locked(key)  # a key's versions are never replaced
                    v.tensor, v.sig = tensor, sig
                    slots, slots_np = all_slots, all_np
                    current = None if v.newest_landed < tid else v.landed[slots_np]
                    newer = None if current is None or _all_below(current, tid) else current < tid
                    if newer is not None and current is not None:  # never let an older write overwrite a newer one
                        if v.num_pins:  # ...but keep its rows for a planned read of this version (I7)
                            self._preserve_late_locked(key, v, rows, slots_np, ~newer, tid)
                        mask = torch.from_numpy(newer)
                        slots, rows, slots_np, current = slots[mask], rows[mask], slots_np[newer], current[newer]
                    if v.num_pins:
                        self._preserve_locked(key, v, tensor, slots, slots_np,
                                              v.landed[slots_np] if current is None else current)
                    scatter_rows(tensor, slots, rows, slots_np)
                    if slots_np is all_np:
                        unmasked.append(v)
                    else:
                        v.landed[slots_np] = tid
                    v.newest_landed = max(v.newest_landed, tid)
            finally:
                # NOTE: also when a later key raised: a key whose rows are in the pool reads as this
                # version from now on (a planned read of its older version gets the preserved rows).
                num_keys = len(self._keys)
                if len(unmasked) == num_keys:  # every key on every slot (keys are unique): one call for all
                    self._table[all_np, 1 + 2 * num_keys :] = tid
                else:
                    for v in unmasked:
                        v.landed[all_np] = tid
            if self.recorder is not None:
                self._note("land", None, tid=tid, keys=tuple(rows_by_key), slots=tuple(all_np.tolist()))

    def _preserve_late_locked(
        self, key: TensorName, v: _KeyVersions, rows: torch.Tensor, slots_np: np.ndarray, late: np.ndarray, tid: Tid
    ) -> None:
        """An older write landed after a newer tenant: keep its rows as version ``tid`` where a
        planned read pins that version (nowhere else: preserved rows stay bounded, I7)."""
        idx = np.flatnonzero(late & (v.pins[slots_np] > 0))
        if not len(idx):
            return
        wanted = self._needed_pairs_locked(key, slots_np[idx])
        for j in idx.tolist():
            slot = int(slots_np[j])
            if (slot, tid) in wanted:
                v.preserved.setdefault(slot, {})[tid] = rows[j].clone()
                self.num_preserved_total += 1

    def _preserve_locked(
        self, key: TensorName, v: _KeyVersions, tensor: torch.Tensor, slots: torch.Tensor, slots_np: np.ndarray,
        current: np.ndarray,
    ) -> None:
        """Keep the current rows of written slots before they are overwritten, where a planned read
        pins exactly the current version (a version no plan needs is dropped: bounded, I7)."""
        keep = (v.pins[slots_np] > 0) & (current > 0)
        if not keep.any():
            return
        idx = np.flatnonzero(keep)
        wanted = self._needed_pairs_locked(key, slots_np[idx])
        idx = np.array([j for j in idx.tolist() if (int(slots_np[j]), int(current[j])) in wanted], dtype=np.int64)
        if not len(idx):
            return
        old_rows = tensor.index_select(0, slots[torch.from_numpy(idx)])
        for j, (slot, version) in enumerate(zip(slots_np[idx].tolist(), current[idx].tolist(), strict=True)):
            v.preserved.setdefault(slot, {})[version] = old_rows[j]
            self.num_preserved_total += 1

    # ---- reader -------------------------------------------------------------
    def read(
        self, key: TensorName, read: PlannedRead, *, what: str, settled: Set[Tid] = frozenset(),
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows of ``read.slots`` at the planned versions of ``key`` (written into ``out`` if given).

        Raises ``NotLandedYet`` when a planned version is still in flight, or when a
        newer tenant landed first and the planned version's write is not known to be
        ``settled`` (terminal; its rows are preserved when it lands late). Raises
        ``OmniPrefixCacheUnmatchError`` ("is not readable") when rows are absent (I6)
        or were overwritten by a newer tenant and the settled planned write left no
        copy (I7). Takes only the pool's leaf lock.
        """
        slots_np, expected = read.slots_np, read.expected[key]
        absent = expected == 0
        if absent.any():
            first = int(np.flatnonzero(absent)[0])
            if self.recorder is not None:
                with self.pool.lock:
                    self._note("read", None, plan=read.plan_id, key=key, slot=int(slots_np[first]), raised=True)
            raise OmniPrefixCacheUnmatchError(
                f"{what}: key {key!r} at KV slot {int(slots_np[first])} {PHRASE_NOT_READABLE}: "
                f"{int(absent.sum())} of {len(slots_np)} hit rows are absent (never written, the "
                "KV slot's newest tenant did not write this key, or an earlier slot of its block holds a "
                "newer tenant's row); the omni cache diverged from the "
                "KV cache (I6/I7) -- never served as zeros nor from an older tenant"
            )
        with self.pool.lock:
            v = self._versions_locked(key)
            current = v.landed[slots_np]
            behind = current < expected
            if behind.any():
                raise NotLandedYet(np.unique(expected[behind]).tolist())
            tensor = self.pool.tensor_locked(key)
            assert tensor is not None, f"{key!r} has landed versions but no pool tensor: tenancy bug"
            rows = tensor.index_select(0, read.slots) if out is None else torch.index_select(
                tensor, 0, read.slots, out=out)
            served = current.copy()  # the version of the rows returned, per slot (trace notes)
            ahead = current > expected
            if ahead.any():
                for j in np.flatnonzero(ahead).tolist():
                    slot, version = int(slots_np[j]), int(expected[j])
                    row = v.preserved.get(slot, {}).get(version)
                    if row is None and version not in settled:
                        raise NotLandedYet([version])
                    if row is None:
                        if self.recorder is not None:
                            self._note("read", None, plan=read.plan_id, key=key, slot=slot, raised=True)
                        raise OmniPrefixCacheUnmatchError(
                            f"{what}: key {key!r} at KV slot {slot} {PHRASE_NOT_READABLE}: the hit "
                            f"planned version {version}, a newer tenant (version {int(current[j])}) "
                            "overwrote it and no preserved copy exists (I7) -- refusing the newer rows"
                        )
                    rows[j] = row
                    served[j] = version
            if self.recorder is not None:
                self._note("read", None, plan=read.plan_id, key=key, served=tuple(served.tolist()))
        return rows

    def nbytes(self) -> int:
        """Host bytes of the version vectors: the slots' tenant and, per key, registered/tenant/landed
        and the pin counts (``omni-cache bench --memory`` reports it)."""
        with self.pool.lock:
            return int(self._tenant.nbytes) + sum(
                int(v.registered.nbytes + v.tenant.nbytes + v.landed.nbytes + v.pins.nbytes) for v in self._keys.values())

    def num_preserved(self) -> int:
        with self.pool.lock:
            return sum(len(per_slot) for v in self._keys.values() for per_slot in v.preserved.values())
