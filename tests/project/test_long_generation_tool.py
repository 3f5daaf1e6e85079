"""tools/long_generation_cost.py itself: it times a long generation whose writes all stay open, lands
them all at the finish (or fails), and refuses bad arguments in one line."""

from __future__ import annotations

import re
from typing import Any

from tool_loader import load_tool

lg = load_tool("long_generation_cost")


def test_the_tool_lands_every_open_write_and_prints_both_medians(capsys: Any) -> None:
    assert lg.main(["--steps", "120", "--window", "30", "--width", "32"]) == 0
    out = capsys.readouterr().out
    assert "all 120 landed at it" in out, out
    first, last, ratio = (float(x) for x in re.findall(r"first 30 ([\d.]+) µs, of the last 30 ([\d.]+) µs, "
                                                       r"last / first ([\d.]+)", out)[0])
    assert first > 0 and last > 0 and abs(ratio - last / first) < 0.05, out  # each printed rounded


def test_the_tool_refuses_bad_arguments_in_one_line(capsys: Any) -> None:
    assert lg.main(["--steps", "30", "--window", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("long_generation_cost: need") and err.count("\n") == 1, err
