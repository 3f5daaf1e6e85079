"""Guards that the suite's "this state was reached" tests reach it by construction, not by luck.

Owns two static checks over tests/*.py (an AST scan, well under a second):

* a ``time.sleep(...)`` statement directly followed by an ``assert`` is refused: what another
  thread was meant to reach in the sleep is waited for instead (``cache_helpers.wait_until``,
  ``wait_for_waiter``, ``settle``); a loaded machine outlasts any fixed sleep;
* a test that runs a state machine (``run_state_machine_as_test``) and then asserts what the
  run reached must pass a machine with an ``initialize`` rule of its own, which puts every
  program on that state whatever the seed (the random rules follow it).

tools/determinism_check.py is the dynamic side: the reachability tests over many seeds and
the threaded files under tools/jitter_plugin.py. Invariants touched: none; it keeps the tests
of I2, I3, I8, I11 (and the TLC trace checks) honest on every seed and interleaving.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(TESTS.rglob("*.py"))]


def _is_sleep(stmt: ast.stmt) -> bool:
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return False
    func = stmt.value.func
    return (isinstance(func, ast.Attribute) and func.attr == "sleep") or (isinstance(func, ast.Name) and func.id == "sleep")


def sleeps_then_asserts(tree: ast.AST) -> list[int]:
    """Line numbers of ``sleep(...)`` statements whose next statement is an ``assert``."""
    found = []
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list):
                continue
            for a, b in itertools.pairwise(stmts):
                if _is_sleep(a) and isinstance(b, ast.Assert):
                    found.append(a.lineno)
    return found


def _has_own_initialize(cls: ast.ClassDef) -> bool:
    for item in cls.body:
        if isinstance(item, ast.FunctionDef):
            for dec in item.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if (isinstance(target, ast.Name) and target.id == "initialize") or (
                        isinstance(target, ast.Attribute) and target.attr == "initialize"):
                    return True
    return False


def machine_runs_without_an_opening(tree: ast.Module, shared: dict[str, ast.ClassDef] | None = None) -> list[str]:
    """``test:Machine`` for each test that asserts after running a machine with no ``initialize`` of its own.

    A machine is looked up in ``tree`` first, then in ``shared`` (the classes of the suite's helper
    modules, e.g. tests/manager_machine.py, which the tests import)."""
    classes = {**(shared or {}), **{n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}}
    found = []
    for fn in tree.body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test")):
            continue
        runs = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                and n.func.id == "run_state_machine_as_test" and n.args and isinstance(n.args[0], ast.Name)]
        for call in runs:
            asserts_after = any(isinstance(n, ast.Assert) and n.lineno > call.lineno for n in ast.walk(fn))
            machine = classes.get(call.args[0].id)  # type: ignore[union-attr]
            if asserts_after and (machine is None or not _has_own_initialize(machine)):
                found.append(f"{fn.name}:{call.args[0].id}")  # type: ignore[union-attr]
    return found


def test_no_fixed_sleep_stands_in_for_a_wait() -> None:
    bad = {p.name: lines for p, tree in _modules() if (lines := sleeps_then_asserts(tree))}
    assert not bad, f"sleep then assert (wait on the condition instead, cache_helpers.wait_until): {bad}"


def test_each_machine_run_that_asserts_a_reached_state_opens_on_it() -> None:
    modules = _modules()
    shared = {n.name: n for p, tree in modules if p.parent == TESTS for n in tree.body if isinstance(n, ast.ClassDef)}
    bad = {p.name: runs for p, tree in modules if (runs := machine_runs_without_an_opening(tree, shared))}
    assert not bad, f"a reachability assert after a machine run with no initialize rule of its own: {bad}"


def test_the_guards_see_both_patterns() -> None:
    """Each check finds its pattern in a sample (so a broken scan cannot pass the suite silently)."""
    sample = ast.parse(
        "import time\n"
        "class M(RuleBasedStateMachine):\n    pass\n"
        "class N(M):\n    @initialize()\n    def opening(self): pass\n"
        "def test_a():\n    run_state_machine_as_test(M)\n    assert SEEN\n"
        "def test_b():\n    run_state_machine_as_test(N)\n    assert SEEN\n"
        "def test_c():\n    start()\n    time.sleep(0.1)\n    assert done\n"
        "def test_d():\n    while not done:\n        time.sleep(0.01)\n    assert done\n"
    )
    assert machine_runs_without_an_opening(sample) == ["test_a:M"]
    assert sleeps_then_asserts(sample) == [15]
