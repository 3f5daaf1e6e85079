"""A save keeps a private copy of its KV slots (I4): later writes into ``layout.slots_cpu`` are harmless.

Owns the tests that an engine reusing its slot-mapping buffer (writing into the layout's
``slots_cpu`` right after ``save_outputs`` returned) moves none of the save's in-flight
writes: an immediate write the committer has not landed yet (async) and a deferred write that
lands at its request's finish (eager) both land at the slots of the save, and a later hit on
those blocks serves exactly the saved rows.
"""

from __future__ import annotations

import threading

import torch
from cache_helpers import WIDTH, finished, manager, slots, started, truth
from thread_helpers import JOIN_S, hold_first_copy

from omni_cache import ModelCachePolicy, PrefixCacheWriteLayout

MM = "audio.codes"


def _save_then_overwrite_slots(m: object, mm: dict[str, torch.Tensor] | None = None) -> int:
    """Save a's positions [0, 8) on blocks 0-1, then write other slots (blocks 5-6) into the layout's
    ``slots_cpu``, as an engine reusing its slot-mapping buffer does; return the step id."""
    layout = PrefixCacheWriteLayout.packed([("a", 0, 8)], slots([0, 1], 0, 8))
    step = m.save_outputs(truth("a", range(8)), mm or {}, num_tokens_unpadded=8, num_tokens_padded=8,  # type: ignore[attr-defined]
                          write_layout=layout)
    layout.slots_cpu.copy_(slots([5, 6], 0, 8))
    return step


def _hit_serves_a(m: object, mm_key: str | None = None) -> None:
    """b hits a's blocks 0-1 and continues at position 8: it gets a's saved rows then its own."""
    m.new_step_starts([finished("a"), started("b", hit_end=8, blocks=[0, 1], scheduled=4)])  # type: ignore[attr-defined]
    layout = PrefixCacheWriteLayout.packed([("b", 8, 12)], slots([0, 1, 2], 8, 12))
    rows_b = truth("b", range(8, 12))
    mm = {mm_key: -rows_b[:, :2].clone()} if mm_key else {}
    step = m.save_outputs(rows_b, mm, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)  # type: ignore[attr-defined]
    result: dict[str, object] = {}
    reader = threading.Thread(target=lambda: result.update(out=m.materialize(step, ["b"])), daemon=True)  # type: ignore[attr-defined]
    reader.start()
    reader.join(JOIN_S)
    assert "out" in result, "the hit on a's blocks never got a's rows (the write landed elsewhere)"
    out = result["out"]
    expected = torch.cat([truth("a", range(8)), rows_b])
    assert torch.equal(out.hidden_states["b"], expected)  # type: ignore[attr-defined]
    if mm_key:
        assert torch.equal(out.mm_outputs[mm_key]["b"], -expected[:, :2])  # type: ignore[attr-defined]
    assert torch.equal(m.pool.rows("hidden", slots([5, 6], 0, 8)), torch.zeros(8, WIDTH))  # type: ignore[attr-defined]


def test_a_queued_write_lands_at_the_saved_slots_after_the_caller_reuses_slots_cpu() -> None:
    hold = hold_first_copy()
    m = manager(eager=False)
    m.faults = m.committer.faults = hold
    m.new_step_starts([started("a", scheduled=8)])
    step = _save_then_overwrite_slots(m)
    assert hold.entered.wait(JOIN_S), "the committer never started a's write"
    hold.release.set()  # a's write lands now, after its layout's slots were overwritten
    m.materialize(step, ["a"])
    _hit_serves_a(m)


def test_a_deferred_write_lands_at_the_saved_slots_after_the_caller_reuses_slots_cpu() -> None:
    m = manager(eager=True)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({MM})))
    m.new_step_starts([started("a", scheduled=8)])
    step = _save_then_overwrite_slots(m, {MM: -truth("a", range(8))[:, :2].clone()})
    m.materialize(step, ["a"])
    _hit_serves_a(m, MM)  # a's FINISHED lands its deferred write, after the slots were overwritten
