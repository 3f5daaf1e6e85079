"""tools/ast_mutants.py itself: operators, stable ids, the seeded sample, the run on a copy.

Invariants touched: none of the runtime's; this guards the tool that measures how
well the suite guards them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tool_loader import load_tool

ROOT = Path(__file__).resolve().parents[2]
am = load_tool("ast_mutants")

TOY = '''"""Toy module."""
import logging

log = logging.getLogger(__name__)
LIMIT = 3


class Box:
    """A box."""

    __slots__ = ("items", "lock")

    def put(self, item, strict):
        """Put."""
        assert item is not None, "never None"
        with self.lock:
            if len(self.items) >= LIMIT and strict:
                raise ValueError(f"full at {LIMIT + 1}")
            self.items.append(item)
            self.count += 1
        log.info("put %s", item)
        return item if strict else None
'''


def _mutants(tmp_path: Path, source: str = TOY) -> list:  # type: ignore[type-arg]
    path = tmp_path / "omni_cache" / "toy.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return am.generate(path, "omni_cache/toy.py")


def _by_op(mutants: list) -> dict[str, list[str]]:  # type: ignore[type-arg]
    out: dict[str, list[str]] = {}
    for m in mutants:
        out.setdefault(m.operator, []).append(TOY[m.start : m.end] + " -> " + m.replacement)
    return out


def test_every_operator_produces_its_mutants_and_nothing_else(tmp_path: Path) -> None:
    ops = _by_op(_mutants(tmp_path))
    assert ops == {
        "drop_with": ["with self.lock: -> if True:"],
        "cmp_flip": ["len(self.items) >= LIMIT -> (len(self.items) < LIMIT)"],
        "boolop_swap": ["len(self.items) >= LIMIT and strict -> (len(self.items) >= LIMIT or strict)"],
        "negate_cond": [
            "len(self.items) >= LIMIT and strict -> not (len(self.items) >= LIMIT and strict)",
            "strict -> not (strict)",
        ],
        "del_raise": ['raise ValueError(f"full at {LIMIT + 1}") -> pass'],
        "del_call": ["self.items.append(item) -> pass"],
        "del_assign": ["self.count += 1 -> pass"],
        "int_off": ["3 -> (4)", "3 -> (2)", "1 -> (2)", "1 -> (0)"],  # module constants too
    }, ops
    # not generated: the assert, the logger call, docstrings, __slots__, deleting module-level
    # assignments, imports, and f-string contents (LIMIT + 1 inside the message)


def test_every_mutant_compiles_and_changes_only_its_span(tmp_path: Path) -> None:
    for m in _mutants(tmp_path):
        new = m.apply(TOY)
        compile(new, "toy.py", "exec")
        assert new[: m.start] == TOY[: m.start] and new[m.start + len(m.replacement) :] == TOY[m.end :]
        assert m.diff(TOY).count("\n-") >= 1


def test_ids_are_stable_when_unrelated_code_moves(tmp_path: Path) -> None:
    before = {m.id for m in _mutants(tmp_path)}
    moved = TOY.replace("LIMIT = 3\n", "LIMIT = 3\n\n\ndef helper(x):\n    return x < 2\n")
    after = {m.id for m in _mutants(tmp_path, moved)}
    assert before < after and len(after - before) == 3  # helper's cmp_flip and two int_off
    assert len(before) == len(_mutants(tmp_path))  # ids are unique


def test_identical_sites_in_one_function_get_distinct_ids(tmp_path: Path) -> None:
    src = "def f(a):\n    a.x()\n    a.x()\n"
    ids = [m.id for m in _mutants(tmp_path, src)]
    assert len(ids) == len(set(ids)) == 2 and ids[1] == ids[0] + "#1"


def test_sample_is_deterministic_and_barely_moves_when_mutants_change() -> None:
    mutants = am.all_mutants()
    assert len(mutants) > 500
    one, two = am.sample(mutants, 60, 11), am.sample(mutants, 60, 11)
    assert [m.id for m in one] == [m.id for m in two]
    assert {m.id for m in am.sample(mutants, 60, 12)} != {m.id for m in one}
    dropped = one[0]
    three = am.sample([m for m in mutants if m.id != dropped.id], 60, 11)
    assert len({m.id for m in one} - {m.id for m in three}) == 1  # only the dropped one left the sample
    assert {m.module for m in mutants} == set(am.CORE_MODULES)


def test_equivalent_list_names_existing_mutants_with_reasons() -> None:
    data = json.loads((ROOT / "tools" / "equivalent_mutants.json").read_text())
    # the core modules, and any other module an entry names (samples run with --modules)
    modules = tuple(dict.fromkeys([*am.CORE_MODULES, *(mid.split(":", 1)[0] for mid in data)]))
    ids = {m.id for m in am.all_mutants(modules=modules)}
    stale = sorted(set(data) - ids)
    assert not stale, f"equivalent_mutants.json lists mutants that no longer exist (code moved): {stale}"
    for mid, entry in data.items():
        assert len(entry["reason"]) > 20 and entry["kind"] in ("equivalent", "cpu-unreachable"), mid


def test_summary_rate_excludes_equivalent_and_counts_errors_as_survivors() -> None:
    rows = [
        {"id": "a", "module": "m", "operator": "x", "line": 1, "verdict": "killed", "diff": ""},
        {"id": "b", "module": "m", "operator": "x", "line": 2, "verdict": "killed (timeout)", "diff": ""},
        {"id": "c", "module": "m", "operator": "x", "line": 3, "verdict": "equivalent", "diff": ""},
        {"id": "d", "module": "n", "operator": "x", "line": 4, "verdict": "error", "diff": "-x\n+y"},
    ]
    report, rate, survivors = am.summarize(rows, {"c": "no observable difference at all here"})
    assert rate == pytest.approx(2 / 3) and [r["id"] for r in survivors] == ["d"]
    assert "| m | 2 | 2 | 0 | 0 | 100% |" not in report and "| m | 3 | 2 | 1 | 0 | 100% |" in report
    assert "`d`" in report and "no observable difference" in report


def test_run_kills_and_keeps_survivors_on_a_copy_never_the_tree(tmp_path: Path) -> None:
    """End to end on a toy package: one mutant killed, one survivor; the source is untouched."""
    pkg, tests = tmp_path / "omni_cache", tmp_path / "tests"
    pkg.mkdir()
    tests.mkdir()
    (pkg / "__init__.py").write_text("")
    toy = "def clamp(x):\n    if x > 10:\n        x = 10\n    return x\n"
    (pkg / "toy.py").write_text(toy)
    (tests / "test_toy.py").write_text(
        "from omni_cache.toy import clamp\n\ndef test_clamp():\n    assert clamp(11) == 10 and clamp(3) == 3\n"
    )
    mutants = {(m.line, m.replacement): m for m in am.generate(pkg / "toy.py", "omni_cache/toy.py")}
    chosen = [mutants[2, "(x <= 10)"], mutants[2, "(9)"]]  # clamp(10) is not tested: x > 9 survives
    lines: list[str] = []
    results = am.run(chosen, root=tmp_path, tests=("tests/test_toy.py",), deselect=(), timeout_s=60,
                     run_timeout_s=300, equivalent={}, log=lines.append)
    assert [r["verdict"] for r in results] == ["killed", "survived"], lines
    assert (pkg / "toy.py").read_text() == toy
    assert "+    if x > (9):" in str(results[1]["diff"])


@pytest.mark.parametrize("argv", [
    ["tools/ast_mutants.py", "--sample", "0"],
    ["tools/ast_mutants.py", "--sample", "-5"],
    ["tools/ast_mutants.py", "--modules"],
    ["tools/ast_mutants.py", "--only"],
    ["tools/mutation_check.py", "--only", "i7"],
    ["tools/mutation_check.py", "--only"],
    ["tools/tla_manifest_states.py", "--only", "no-such-model"],
], ids=" ".join)
def test_a_mutation_or_manifest_tool_given_an_empty_selection_refuses_it(argv: list[str]) -> None:
    """A selection of nothing is a usage error (exit 2, one line), never a kill rate of 0/0 reported
    as a pass, a whole-suite run, or a manifest rewritten from no runs."""
    manifest = (ROOT / "tla" / "manifest.json").read_bytes()
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-500:])
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr
    assert (ROOT / "tla" / "manifest.json").read_bytes() == manifest
