"""Rows in and out of the block pool for the hidden-state tier (contract section 4.10).

Owns: ``TierPort`` (the type of the manager's door for the tier), ``restore_problem`` (whether a tier
entry fits the pool), ``reserve_problem`` (a new key's pool tensor, allocated before any restore),
``block_rows(manager, slots)`` (the rows of one KV block at the versions its
slots' tenant wrote, for every key the pool holds, or ``None`` when any key is
absent there, or when a later slot of the block holds an older version than an
earlier one: a tenant that wrote only part of it), ``restore_rows(manager, slots, rows)`` (rows that came back
from the tier, registered as a new write on the block's new slots) and
``vacate_rows(manager, slots)`` (a load the tier cannot serve: the new block's
slots get a new tenant that wrote nothing, so every key is absent there). All run on
the engine thread, between ``new_step_starts`` and the step's ``save_outputs``. They
reach the manager through its one door for the tier, ``manager.tier_port`` (a
``TierPort``), and its public collaborators (``pool``, ``tenancy``, ``reader``); the
manager's state lock is never theirs to take (I11).

Upholds I6/I7 for tier hits: a restore is an ordinary write with its own step id
and tid, so the restored slots get a new tenant for every key (a key the tier
entry lacks is absent there and a hit on it raises "is not readable"), an older
unlanded write of a previous tenant never lands over it, and the hit read that
save_outputs plans afterwards expects exactly this version (it waits for it to
land like any write in transit). ``block_rows`` reads through a planned read, so
it gets the tenant's version or nothing -- never an older tenant's rows nor zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from omni_cache.runtime.block_pool import PrefixBlockPool
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.interface import StepId
from omni_cache.runtime.reader import StepReader
from omni_cache.runtime.tenancy import SlotTenancy
from omni_cache.runtime.validation import RowSig, check_held_sigs, row_sig

__all__ = ["TierHost", "TierPort", "block_rows", "restore_problem", "restore_rows", "vacate_rows"]


@dataclass(frozen=True)
class TierPort:
    """The manager's narrow door for the hidden-state tier (``omni_cache.runtime.tier_rows``).

    ``check_usable(what)`` raises as every entry point does (I8, shutdown); ``register_restored_write
    (slots, slots_np, rows, sigs)`` registers host ``rows`` as one new write on ``slots`` -- their
    new tenant for every key (I6/I7), with its own step id, an older tenant's open write landing
    first -- and queues it, returning the step id; ``vacate(slots_np)`` gives ``slots`` a new
    tenant that wrote no key (a hit on them raises "is not readable"). Engine thread only, between
    ``new_step_starts`` and ``save_outputs``; no state lock is held across a wait or a flush (I11).
    """

    check_usable: Callable[[str], None]
    register_restored_write: Callable[[torch.Tensor, np.ndarray, dict[str, torch.Tensor], dict[str, RowSig]],
                                      StepId]
    vacate: Callable[[np.ndarray], StepId]


class TierHost(Protocol):
    """What these functions use of the manager (``OmniPrefixCacheManager`` is one): its door for
    the tier and its public collaborators."""

    tier_port: TierPort
    pool: PrefixBlockPool
    tenancy: SlotTenancy
    reader: StepReader


def block_rows(manager: TierHost, slots: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Every pool key's rows at ``slots`` as their tenant wrote them; ``None`` if any key is absent
    (a key whose first write has not landed yet included: a restore would refuse the entry)."""
    manager.tier_port.check_usable("read rows for the hidden-state tier")
    manager.pool.check_slots(slots, where="tier store")
    keys = manager.pool.keys()
    if not keys or len(manager.pool.sigs()) > len(keys):
        return None
    # one block: a slot holding an older tenant's row than an earlier slot of it is planned absent,
    # so half a block, or another tenant's rows, is never stored
    plan = manager.tenancy.plan(keys, slots, block_size=len(slots))
    try:
        if any((expected == 0).any() for expected in plan.expected.values()):
            return None
        what = f"tier store of KV slots [{int(slots[0])}, {int(slots[-1])}]"
        return {key: manager.reader.read_planned(plan, key, what=what) for key in keys}
    finally:
        manager.tenancy.unplan(plan)


def restore_problem(rows: dict[str, torch.Tensor], num_slots: int, held: dict[str, RowSig]) -> str | None:
    """Why ``rows`` (a tier entry) cannot be restored onto ``num_slots`` KV slots, or None (then
    ``held`` learns its keys' signatures). ``held``: each key's (dtype, row shape) the pool has fixed,
    its rows landed or not (``PrefixBlockPool.sigs``), plus those of the entries already accepted for
    the same restore pass.
    Refused: a row count other than ``num_slots``; a key of another dtype or row shape than
    ``held``'s; an entry without a key ``held`` has (its block would read "is not readable" there:
    a miss recomputes it). A key ``held`` lacks is new to the pool: a cache started afresh restores
    what its predecessor stored."""
    if not rows:
        return "the entry holds no rows"
    if missing := sorted(set(held) - set(rows)):
        return f"the entry lacks key(s) {missing} the block pool holds"
    for key, t in rows.items():
        if int(t.shape[0]) != num_slots:
            return f"the entry holds {int(t.shape[0])} rows of {key!r} for a block of {num_slots} KV slots"
    sigs = {key: row_sig(t) for key, t in rows.items()}
    try:
        check_held_sigs("block pool key", held, sigs, sigs)
    except OmniPrefixCacheUnmatchError as exc:
        return str(exc)
    held.update(sigs)
    return None


def reserve_problem(manager: TierHost, rows: dict[str, torch.Tensor]) -> str | None:
    """Allocate now the pool tensor of each key of ``rows`` (an entry ``restore_problem`` accepted)
    that the pool does not hold yet, or say why the allocator refused it: before anything is
    restored, so the refusal is this load's miss, never a restore that fails the cache (I8)."""
    try:
        manager.pool.prepare_keys({key: row_sig(t) for key, t in rows.items()})
    except OmniPrefixCacheUnmatchError as exc:
        return str(exc)
    return None


def restore_rows(manager: TierHost, slots: torch.Tensor, rows: dict[str, torch.Tensor]) -> StepId:
    """Register ``rows`` (host tensors, one row per slot) as a new write on ``slots``; return its step id.

    Refused (nothing changed) when the manager is unusable, a slot is out of range, a row count
    differs from the slot count, or a key's dtype/row shape differs from what the pool holds."""
    manager.tier_port.check_usable("restore rows from the hidden-state tier")
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
    return manager.tier_port.register_restored_write(slots, slots_np, source, sigs)


def vacate_rows(manager: TierHost, slots: torch.Tensor) -> StepId:
    """``slots`` (a block the KV connector filled with content the tier cannot serve) get a new
    tenant that wrote no key: a hit on them raises "is not readable" instead of serving the rows of
    the block's previous tenant (another content). Returns the tenant's step id."""
    manager.tier_port.check_usable("vacate KV slots the hidden-state tier cannot serve")
    slots_np: np.ndarray = manager.pool.check_slots(slots.to(torch.int64).contiguous(), where="tier vacate")
    return manager.tier_port.vacate(slots_np)
