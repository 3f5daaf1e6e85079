"""What the manager accepts at its door: the types of ids, bounds and settings.

  I1  step ids are ints issued by this manager: a bool, a float or another manager's id
      is "already consumed or never saved"; two managers never issue the same id; an id
      held as an int subclass is the same id, consumed once; ``PrefixCacheWrite`` bounds
      are ints (integer-likes become ints) and a layout's ``total_rows`` must be an int;
      ``from_vllm_config`` refuses a non-positive ``max_num_batched_tokens``.

A refused call changes nothing. The layout, hit and width checks are in test_door_checks.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cache_helpers import manager, save, started, truth

from omni_cache import OmniPrefixCacheUnmatchError, PrefixCacheConfig
from omni_cache.runtime.errors import PHRASE_NOT_SAVED
from omni_cache.runtime.events import PrefixCacheWrite

# ---- item 8: types checked at the door -----------------------------------------------------


@pytest.mark.parametrize("field", ["row_start", "row_end", "token_start", "token_end"])
@pytest.mark.parametrize("bad", [1.0, True, "1", None])
def test_write_bounds_must_be_ints(field: str, bad: object) -> None:
    bounds = dict(row_start=0, row_end=1, token_start=0, token_end=1)
    bounds[field] = bad  # type: ignore[assignment]
    with pytest.raises((TypeError, ValueError), match="int"):
        PrefixCacheWrite("r", **bounds)  # type: ignore[arg-type]


def test_write_bounds_accept_integer_likes_as_ints() -> None:
    import numpy as np

    w = PrefixCacheWrite("r", np.int64(0), np.int32(2), torch.tensor(4), 6)  # type: ignore[arg-type]
    assert (w.row_start, w.row_end, w.token_start, w.token_end) == (0, 2, 4, 6)
    assert all(type(v) is int for v in (w.row_start, w.row_end, w.token_start, w.token_end))


@pytest.mark.parametrize("via", ["materialize", "discard_step"])
@pytest.mark.parametrize("bad", ["bool", "float", "other manager"])
def test_I1_step_id_must_be_an_int_issued_by_this_manager(via: str, bad: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import itertools

    from omni_cache.runtime import manager as manager_mod

    monkeypatch.setattr(manager_mod, "_STEP_IDS", itertools.count(1))  # this manager's first id is 1
    m, other = manager(), manager()
    m.new_step_starts([started("a")])
    other.new_step_starts([started("a")])
    mine, _ = save(m, [("a", [0], 0, 3)])
    theirs, _ = save(other, [("a", [0], 0, 3)])
    # True == 1 and 1.0 == 1 hash alike: unchecked, both consumed a manager's first step
    assert mine == 1
    forged = {"bool": True, "float": float(mine), "other manager": theirs}[bad]
    call = m.materialize if via == "materialize" else m.discard_step
    args = (forged, ["a"]) if via == "materialize" else (forged,)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED):
        call(*args)  # type: ignore[operator]
    assert m.stats()["unconsumed_step_ids"].keys() == {mine}, "a forged id consumed a step"
    assert torch.equal(m.materialize(mine, ["a"]).hidden_states["a"], truth("a", range(3)))
    other.discard_step(theirs)
    m.shutdown()
    other.shutdown()


def test_I1_two_managers_never_issue_the_same_step_id() -> None:
    a, b = manager(), manager()
    a.new_step_starts([started("x")])
    b.new_step_starts([started("x")])
    ids_a = {save(a, [("x", [0], 0, 1)])[0]}
    ids_b = {save(b, [("x", [0], 0, 1)])[0]}
    assert not ids_a & ids_b, (ids_a, ids_b)
    assert all(type(i) is int for i in ids_a | ids_b)
    a.shutdown()
    b.shutdown()


@pytest.mark.parametrize("value", [0, -5])
def test_from_vllm_config_refuses_non_positive_max_num_batched_tokens(value: int) -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        PrefixCacheConfig.from_vllm_config(num_blocks=8, block_size=16,
                                           scheduler_config=SimpleNamespace(max_num_batched_tokens=value))


@pytest.mark.parametrize("total", [5.0, True])
def test_layout_total_rows_must_be_an_int(total: object) -> None:
    """``total_rows`` 5.0 (== 5) used to pass the coverage check; it is refused at save, before a claim."""
    from cache_helpers import slots as kv_slots

    from omni_cache import PrefixCacheWriteLayout

    m = manager()
    m.new_step_starts([started("a")])
    n = 5 if total == 5.0 else 1
    layout = PrefixCacheWriteLayout(PrefixCacheWriteLayout.packed([("a", 0, n)], None).writes, total,  # type: ignore[arg-type]
                                    kv_slots([0, 1], 0, n))
    claims = m.stats()["staging"]["claims"]
    with pytest.raises(OmniPrefixCacheUnmatchError, match="slot mapping covers"):
        m.save_outputs(truth("a", range(n)), {}, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)
    assert m.stats()["staging"]["claims"] == claims and m._ids_issued == 0
    m.shutdown()


@pytest.mark.parametrize("via", ["materialize", "discard_step"])
def test_I1_an_int_subclass_step_id_is_the_same_id(via: str) -> None:
    """An id held as an int subclass (an engine's own id type) is the id: the step is consumed once
    and its staging slot is given back. Found by an independent attack: materialize looked the
    context up only for ``type(id) is int`` while the consume took any int, so it consumed the step,
    then failed its context assertion and left the slot 'materialized' for good."""

    class EngineStepId(int):
        pass

    m = manager(staging_depth=1)
    m.new_step_starts([started("a")])
    step, rows = save(m, [("a", [0], 0, 3)])
    if via == "materialize":
        assert torch.equal(m.materialize(EngineStepId(step), ["a"]).hidden_states["a"], rows)
    else:
        m.discard_step(EngineStepId(step))
    assert m.staging.slot_states() == ["free"], "the slot was not given back"
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED):
        m.materialize(step, ["a"])  # consumed exactly once (I1)
    m.new_step_starts([started("b")])
    again, rows_b = save(m, [("b", [1], 0, 2)])  # depth 1: only a freed slot lets this save claim
    assert torch.equal(m.materialize(again, ["b"]).hidden_states["b"], rows_b)
    m.shutdown()
