"""Rows in and out of the block pool for the hidden-state tier (contract section 4.10).

Owns: ``block_rows(manager, slots)`` (the rows of one KV block at the versions its
slots' tenant wrote, for every key the pool holds, or ``None`` when any key is
absent there), ``restore_rows(manager, slots, rows)`` (rows that came back
from the tier, registered as a new write on the block's new slots) and
``vacate_rows(manager, slots)`` (a load the tier cannot serve: the new block's
slots get a new tenant that wrote nothing, so every key is absent there). Both run on
the engine thread, between ``new_step_starts`` and the step's ``save_outputs``;
they use the manager's collaborators and its state lock, never holding the lock
across a wait (I11).

Upholds I6/I7 for tier hits: a restore is an ordinary write with its own step id
and tid, so the restored slots get a new tenant for every key (a key the tier
entry lacks is absent there and a hit on it raises "is not readable"), an older
unlanded write of a previous tenant never lands over it, and the hit read that
save_outputs plans afterwards expects exactly this version (it waits for it to
land like any write in transit). ``block_rows`` reads through a planned read, so
it gets the tenant's version or nothing -- never an older tenant's rows nor zeros.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.interface import StepId, WriteSchedule
from omni_cache.runtime.tenancy import NotLandedYet
from omni_cache.runtime.validation import check_held_sigs, row_sig

if TYPE_CHECKING:
    from omni_cache.runtime.manager import OmniPrefixCacheManager

__all__ = ["block_rows", "restore_rows", "vacate_rows"]

_MAX_WAITS = 1000


def block_rows(manager: OmniPrefixCacheManager, slots: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Every pool key's rows at ``slots`` as their tenant wrote them; ``None`` if any key is absent."""
    manager._check_usable("read rows for the hidden-state tier")
    manager.pool.check_slots(slots, where="tier store")
    keys = manager.pool.keys()
    if not keys:
        return None
    plan = manager.tenancy.plan(keys, slots)
    try:
        if any((expected == 0).any() for expected in plan.expected.values()):
            return None
        what = f"tier store of KV slots [{int(slots[0])}, {int(slots[-1])}]"
        rows: dict[str, torch.Tensor] = {}
        for key in keys:
            settled: set[int] = set()
            for _ in range(_MAX_WAITS):
                try:
                    rows[key] = manager.tenancy.read(key, plan, what=what, settled=settled)
                    break
                except NotLandedYet as late:
                    for tid in late.tids:
                        write = manager.book.get(tid)
                        if write is None:
                            settled.add(tid)
                            continue
                        if write.state in ("pending", "queued"):
                            manager._flush([write], front=True, why=f"{what} needs write tid {tid}")
                        manager.book.wait(write, ("written",), why=f"{what} waits for its rows")
                    manager.book.check_failed(what)
            else:
                raise OmniPrefixCacheUnmatchError(f"{what}: rows of {key!r} never landed")
        return rows
    finally:
        manager.tenancy.unplan(plan)


def restore_rows(manager: OmniPrefixCacheManager, slots: torch.Tensor, rows: dict[str, torch.Tensor]) -> StepId:
    """Register ``rows`` (host tensors, one row per slot) as a new write on ``slots``; return its step id.

    Refused (nothing changed) when the manager is unusable, a slot is out of range, a row count
    differs from the slot count, or a key's dtype/row shape differs from what the pool holds."""
    manager._check_usable("restore rows from the hidden-state tier")
    if not rows:
        raise ValueError("restore_rows: no rows")
    slots = slots.to(torch.int64).contiguous()
    slots_np: np.ndarray = manager.pool.check_slots(slots, where="tier restore")
    for key, t in rows.items():
        if int(t.shape[0]) != len(slots_np):
            raise OmniPrefixCacheUnmatchError(
                f"tier restore of {key!r}: {int(t.shape[0])} rows for {len(slots_np)} KV slots")
    source = {k: t.detach().to("cpu").contiguous() for k, t in rows.items()}
    sigs = {k: row_sig(t) for k, t in source.items()}
    manager.pool.check_sigs(sigs)
    check_held_sigs("deferred key", manager._deferred_sigs, sigs, [k for k in sigs if k in manager._deferred_sigs])
    manager.tenancy.prepare_keys(sigs.keys())
    with manager._lock:
        from omni_cache.runtime.manager import _STEP_IDS

        step_id = next(_STEP_IDS)
        manager._ids_issued += 1
        manager.counters["tier_restores"] = manager.counters.get("tier_restores", 0) + 1
    write = manager.book.register(WriteSchedule.JOIN_NEXT_STEP, step_id, slots, source, slots_np=slots_np, sigs=sigs)
    older = manager.tenancy.register(list(source), slots_np, write.tid, step_id=step_id, scan_older=True)
    front = [w for t in sorted(older) if (w := manager.book.get(t)) is not None and w.state == "pending"]
    if front:  # a previous tenant's open write lands first (it is then skipped on these slots, I7)
        manager._flush(front, front=True, why="older tenants of restored slots")
    manager.book.enqueue([write])
    manager.committer.kick()
    return step_id


def vacate_rows(manager: OmniPrefixCacheManager, slots: torch.Tensor) -> StepId:
    """``slots`` (a block the KV connector filled with content the tier cannot serve) get a new
    tenant that wrote no key: a hit on them raises "is not readable" instead of serving the rows of
    the block's previous tenant (another content). Returns the tenant's step id."""
    manager._check_usable("vacate KV slots the hidden-state tier cannot serve")
    slots_np: np.ndarray = manager.pool.check_slots(slots.to(torch.int64).contiguous(), where="tier vacate")
    with manager._lock:
        from omni_cache.runtime.manager import _STEP_IDS

        step_id = next(_STEP_IDS)
        manager._ids_issued += 1
    manager.tenancy.take_slots(slots_np, step_id=step_id)
    return step_id
