"""tools/scatter_cost.py itself: every way it times lands the same bits, each case reports all three
ways and the path ``scatter_rows`` takes, and a bad argument is refused in one line."""

from __future__ import annotations

from typing import Any

import pytest
from tool_loader import load_tool

from omni_cache.runtime.block_pool import SCATTER_NUMPY_MIN_BYTES

sc = load_tool("scatter_cost")


def test_every_case_is_timed_three_ways_and_names_its_path() -> None:
    results = sc.measure(1)
    assert len(results) == 2 * 3 * 3  # dtypes x widths x row counts
    for r in results:
        assert all(r[f"{way}_us"] > 0 for way in ("index_copy_", "numpy", "scatter_rows")), r
        assert r["path"] == ("numpy" if r["bytes"] >= SCATTER_NUMPY_MIN_BYTES else "index_copy_"), r
    assert {r["path"] for r in results} == {"numpy", "index_copy_"}


def test_the_tool_refuses_bad_arguments_in_one_line(capsys: Any) -> None:
    assert sc.main(["--rounds", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("scatter_cost: --rounds must be") and err.count("\n") == 1, err


def test_the_prefill_save_is_timed_both_ways_and_the_landing_is_restored() -> None:
    from omni_cache.runtime import tenancy

    kept = tenancy.scatter_rows
    saves = sc.save_ab(1)
    assert set(saves) == {"scatter_rows", "index_copy_"} and all(v > 0 for v in saves.values()), saves
    assert tenancy.scatter_rows is kept


def _other_bits(dst: Any, slots: Any, rows: Any) -> None:
    dst.index_copy_(0, slots, rows + 1)


def _spills(dst: Any, slots: Any, rows: Any) -> None:
    dst.index_copy_(0, slots, rows)
    dst[(slots.max() + 1) % dst.shape[0]] = 1


@pytest.mark.parametrize(("way", "phrase"), [(_other_bits, "numpy differs from index_copy_"),
                                             (_spills, "numpy wrote outside its slots")])
def test_a_way_that_lands_other_bits_or_outside_its_slots_fails_the_run(way: Any, phrase: str,
                                                                        monkeypatch: Any) -> None:
    monkeypatch.setattr(sc, "_numpy_only", way)
    with pytest.raises(SystemExit, match=phrase):
        sc.measure(1)
