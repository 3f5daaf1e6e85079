"""tools/ablate_bookkeeping.py itself: each ablation switches off exactly its piece, only inside
its ``with``, and the tool prints every row (or refuses bad arguments in one line)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cache_helpers import manager, save, slot_of, started
from tool_loader import load_tool

import omni_cache.runtime.manager as manager_module
from omni_cache.runtime.block_pool import PrefixBlockPool
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.events import PrefixCacheWriteLayout, layout_rows

ab = load_tool("ablate_bookkeeping")


def test_range_check_ablation_accepts_bad_slots_only_inside() -> None:
    pool = PrefixBlockPool(8)
    with ab.ABLATIONS["range check"]():
        pool.check_slots(torch.tensor([-1, 8]))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="out of range"):
        pool.check_slots(torch.tensor([-1, 8]))


def test_scheduled_check_ablation_accepts_wrong_counts_only_inside() -> None:
    rows = layout_rows(PrefixCacheWriteLayout.packed([("a", 0, 1)], torch.tensor([0])))
    assert rows is not None
    with ab.ABLATIONS["scheduled check"]():
        manager_module.check_scheduled({"a": 3}, rows)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="scheduled 3 tokens"):
        manager_module.check_scheduled({"a": 3}, rows)


def test_scheduled_copy_ablation_keeps_the_steps_dict_only_inside() -> None:
    counts = {"a": 1}
    with ab.ABLATIONS["scheduled copy"]():
        assert manager_module.dict(counts) is counts  # type: ignore[attr-defined]
        assert manager_module.dict(counts, b=2) == {"a": 1, "b": 2}  # type: ignore[attr-defined]
    assert "dict" not in vars(manager_module)


def _tenants_after_a_step(spans: list[tuple[str, list[int], int, int]]) -> list[int]:
    m = manager()
    m.new_step_starts([started(r) for r, *_ in spans])
    step, _ = save(m, spans)
    m.materialize(step, [r for r, *_ in spans])
    tenants = m.tenancy._tenant[[slot_of(b, s) for _, b, s, _ in spans]].tolist()
    m.shutdown()
    return tenants


def test_version_writes_ablation_skips_decode_steps_only_inside() -> None:
    decode = [("a", [1], 0, 1), ("b", [2], 0, 1)]  # one row per request: a decode step
    prefill = [("a", [1], 0, 2), ("b", [2], 0, 2)]
    with ab.ABLATIONS["version writes"]():
        assert _tenants_after_a_step(decode) == [0, 0]  # no version registered
        assert 0 not in _tenants_after_a_step(prefill)  # a prefill step is unchanged
    assert 0 not in _tenants_after_a_step(decode)


def test_the_tool_prints_every_ablation_and_refuses_bad_arguments(capsys: Any) -> None:
    assert ab.main(["--requests", "1", "2", "--rounds", "1", "--passes", "1", "--decode-steps", "2"]) == 0
    out = capsys.readouterr().out
    for name in ("none", *ab.ABLATIONS):
        assert any(line.startswith(name) for line in out.splitlines()), out
    assert ab.main(["--requests", "2", "1"]) == 2
    assert capsys.readouterr().err.startswith("ablate_bookkeeping: need 1 <= FEW < MANY")
