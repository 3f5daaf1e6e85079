"""I7's bound on preserved rows: a (slot, key) keeps only the versions an active planned read pins.

Owns the tests that many tenants overwriting the blocks of one unconsumed step's planned hit
keep at most one preserved version per planned slot (the version that read needs), through the
public manager in both modes and directly on ``SlotTenancy`` (overwrites, late older writes,
two plans of different versions on one slot, unplanning one of them); the planned reads still
serve exactly their rows.
"""

from __future__ import annotations

import pytest
import torch
from cache_helpers import MODES, finished, manager, save, settle, started

from omni_cache.runtime.block_pool import PrefixBlockPool
from omni_cache.runtime.tenancy import SlotTenancy

TENANTS = 30


@pytest.mark.parametrize("eager", MODES)
def test_I7_tenants_rewriting_a_planned_hit_keep_one_preserved_version_per_slot(eager: bool) -> None:
    m = manager(eager=eager, staging_depth=4)
    m.new_step_starts([started("a", scheduled=8)])
    s_a, rows_a = save(m, [("a", [0, 1], 0, 8)])
    m.materialize(s_a, ["a"])
    m.new_step_starts([finished("a"), started("b", hit_end=8, blocks=[0, 1], scheduled=4)])
    s_b, rows_b = save(m, [("b", [0, 1, 2], 8, 12)])  # plans a's rows on blocks 0-1 (8 slots); unconsumed
    for i in range(TENANTS):  # staging has room: each later tenant rewrites blocks 0-1 and is consumed
        req = f"t{i}"
        m.new_step_starts([started(req, scheduled=8)])
        step, _ = save(m, [(req, [0, 1], 0, 8)])
        m.materialize(step, [req])
        m.new_step_starts([finished(req)])
        if not eager:
            settle(m)
        preserved = m.stats()["preserved_rows"]
        assert preserved <= 8, (
            f"{preserved} preserved rows after {i + 1} tenants of 8 planned slots: only the planned "
            "version may be kept (I7)")
    assert m.stats()["preserved_rows"] == 8  # a's 8 rows, the version b's hit planned
    out = m.materialize(s_b, ["b"])
    assert torch.equal(out.hidden_states["b"], torch.cat([rows_a, rows_b]))
    assert m.stats()["preserved_rows"] == 0


def _rows(value: float, n: int = 4) -> torch.Tensor:
    return torch.full((n, 2), value)


def test_only_pinned_versions_are_preserved_through_overwrites_and_late_writes() -> None:
    pool = PrefixBlockPool(64)
    tenancy = SlotTenancy(pool)
    slots = torch.arange(8, 12)
    tenancy.register(["k"], slots.numpy(), 1, step_id=1)
    tenancy.land_all({"k": _rows(1.0)}, slots, 1)
    first = tenancy.plan(["k"], slots)  # pins version 1
    for tid in range(2, 12):  # ten newer tenants, each landed: only version 1 is kept
        tenancy.register(["k"], slots.numpy(), tid, step_id=tid)
        tenancy.land_all({"k": _rows(float(tid))}, slots, tid)
    assert tenancy.num_preserved() == 4
    second = tenancy.plan(["k"], slots)  # pins version 11
    tenancy.register(["k"], slots.numpy(), 12, step_id=12)
    tenancy.register(["k"], slots.numpy(), 13, step_id=13)
    third = tenancy.plan(["k"], slots)  # pins version 13, not landed yet
    tenancy.land_all({"k": _rows(13.0)}, slots, 13)  # 11 is preserved (second), 12 is still in transit
    tenancy.land_all({"k": _rows(12.0)}, slots, 12)  # lands late: nobody pins 12, so it is not kept
    assert tenancy.num_preserved() == 8, "versions 1 and 11 only: one per planned (read, slot)"
    assert torch.equal(tenancy.read("k", first, what="t"), _rows(1.0))
    assert torch.equal(tenancy.read("k", second, what="t"), _rows(11.0))
    assert torch.equal(tenancy.read("k", third, what="t"), _rows(13.0))
    tenancy.unplan(first)  # second still pins the slots: version 1 goes, version 11 stays
    assert tenancy.num_preserved() == 4
    assert torch.equal(tenancy.read("k", second, what="t"), _rows(11.0))
    tenancy.unplan(second)
    tenancy.unplan(third)
    assert tenancy.num_preserved() == 0


def test_a_late_older_write_a_plan_pins_is_preserved() -> None:
    pool = PrefixBlockPool(64)
    tenancy = SlotTenancy(pool)
    slots = torch.arange(4)
    tenancy.register(["k"], slots.numpy(), 1, step_id=1)
    plan = tenancy.plan(["k"], slots)  # pins version 1, in transit
    tenancy.register(["k"], slots.numpy(), 2, step_id=2)
    tenancy.land_all({"k": _rows(2.0)}, slots, 2)
    tenancy.land_all({"k": _rows(1.0)}, slots, 1)  # late: kept for the plan, not landed over 2
    assert tenancy.num_preserved() == 4
    assert torch.equal(tenancy.read("k", plan, what="t"), _rows(1.0))
    assert torch.equal(pool.rows("k", slots), _rows(2.0))
