#!/usr/bin/env python3
"""AST mutation testing: generated mutants of the core modules must be killed by the fast tests.

Owns: the mutation operators, the stable mutant ids, the seeded sample, the
fast test subset and the report (kill rate by module, every survivor with its
diff). ``tools/mutant_runner.py`` applies each sampled mutant, alone, to a
temporary copy of the package and tests (the working tree is never written)
and runs the fast subset against it. ``tools/mutation_check.py`` keeps the hand-written,
invariant-named mutants; this tool generates them mechanically.

Operators (each yields one mutant per site):
  cmp_flip     negate a one-operator comparison (``<`` -> ``>=``, ``==`` -> ``!=``, ``in`` -> ``not in``...)
  negate_cond  ``if c`` / ``while c`` / ``x if c else y`` -> ``not (c)``
  boolop_swap  ``and`` <-> ``or``
  int_off      an int literal ``n`` -> ``n + 1`` and ``n - 1`` (two mutants)
  del_call     delete a statement that is a call (``pass`` instead)
  del_assign   delete an assignment or augmented assignment
  del_raise    delete a ``raise``
  drop_with    ``with <...lock...|...cond...>:`` -> ``if True:`` (the body runs without the lock)

Not generated: anything inside an ``assert`` (internal checks, not behaviour),
docstrings, calls on the module logger ``log`` (logging is not a contract),
``__slots__``, and module-level ``from __future__``/import lines.

A mutant id is ``module:qualname:operator:digest[#k]`` where the digest hashes
the original and mutated source of the site, so ids survive unrelated edits
(lines moving) and change when the mutated code itself changes. The sample is
the first ``--sample`` ids ordered by a keyed hash of (seed, id): adding or
removing other mutants barely changes which ones are picked.

``tools/equivalent_mutants.json`` lists survivors judged equivalent, keyed by
mutant id, each with the reason and a kind: ``equivalent`` (no test can tell
it from the original) or ``cpu-unreachable`` (only a CUDA device runs that
code; the machine the suite runs on has none). The kill rate is
killed / (sampled - listed).

Exit status: 0 the rate meets ``--target`` and every survivor is listed;
1 otherwise; 2 the baseline failed or the tests could not run.

Usage:  nice -n 10 python tools/ast_mutants.py [--sample 80] [--seed 11] [--list] [--only ID ...]
Stdlib only.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from mutant_runner import run

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT_FILE = ROOT / "tools" / "equivalent_mutants.json"

CORE_MODULES = (
    "adapter", "block_pool", "consumption", "copier", "events", "locks", "manager", "reader", "scheduling", "staging",
    "states", "step_outputs", "tenancy", "validation", "writes",
)

# The fast subset: unit and behaviour tests first (they kill most mutants in a second or
# two), the stateful and end-to-end tests last. No TLC, soak, bench or CLI subprocesses.
FAST_TESTS = (
    "tests/manager/test_state_tables.py",
    "tests/staging/test_staging_pool.py",
    "tests/writes/test_write_book_and_pool.py",
    "tests/writes/test_scatter_rows.py",
    "tests/manager/test_interface.py",
    "tests/manager/test_events.py",
    "tests/manager/test_locking.py",
    "tests/writes/test_copier.py",
    "tests/tenancy/test_landing_order.py",
    "tests/tenancy/test_reads.py",
    "tests/writes/test_committer.py",
    "tests/writes/test_cuda.py",  # skips without a CUDA device
    "tests/manager/test_step_cost.py",  # the fast paths of a step (layout facts, scheduled counts, slot range, hit merges)
    "tests/manager/test_invariants.py",
    "tests/manager/test_behaviour.py",
    "tests/manager/test_deferred_budget_and_stats.py",
    "tests/manager/test_threads_and_shutdown.py",  # its shutdown test fails in ~11 s on a committer that never stops
    "tests/manager/test_door_checks.py",
    "tests/manager/test_door_checks_types.py",
    "tests/manager/test_door_checks_kept.py",
    "tests/request_identity/test_identity_and_replay.py",
    "tests/request_identity/test_step_events.py",  # one step's events apply to the admission each names
    "tests/manager/test_typed_input.py",
    "tests/tenancy/test_preserved_rows.py",
    "tests/manager/test_shutdown.py",
    "tests/writes/test_slot_snapshot.py",
    "tests/adapter/test_output_group.py",
    "tests/writes/test_write_failures.py",
    "tests/manager/test_reference_parity.py",
    "tests/manager/test_reference_parity_adapter.py",
    "tests/manager/test_reference_parity_replacement.py",
    "tests/manager/test_faults.py",
    "tests/manager/test_faults_rollback.py",
    "tests/adapter/test_scheduler_adapter.py",
    "tests/integration/test_block_table.py",
    "tests/integration/test_config_gate.py",
    "tests/integration/test_runner_hooks.py",
    "tests/integration/test_delivery_names.py",  # served delivery: safe names, client-given paths
    "tests/integration/test_delivery_files.py",  # served delivery: atomic writes, lock files
    "tests/integration/test_delivery_retention.py",  # served delivery: retention, adoption at start
    "tests/integration/test_delivery_worker.py",  # RowDelivery on a real manager: rows, I1, containment
    "tests/integration/test_delivery_scheduler.py",  # DeliveryScheduler and the delivery settings
    "tests/integration/test_delivery_bridge.py",  # the bridge's consumer modes (deliver, discard, queue)
    "tests/integration/test_fake_engine_e2e.py",
    "tests/staging/test_staging_stateful.py",
    "tests/adapter/test_adapter_stateful.py",
    "tests/manager/test_manager_stateful.py",
)
# TLC runs Java for seconds; the stateful TLC replay is covered by the full suite instead.
# vLLM's reader imports vLLM (seconds); the other delivery-file tests kill the same mutants.
FAST_DESELECT = ("tests/manager/test_manager_stateful.py::TestManagerTracesWithTLC",
                 "tests/integration/test_delivery_files.py::test_vllms_reader_waits_for_the_lock_then_reads_the_complete_file")

_NEGATE = {
    ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}
_LOCKISH = ("lock", "cond")


@dataclass(frozen=True)
class Mutant:
    id: str
    module: str  # e.g. "staging"
    path: str  # relative to the repository root
    operator: str
    line: int
    start: int  # character offsets of the replaced span in the original source
    end: int
    replacement: str

    def apply(self, source: str) -> str:
        return source[: self.start] + self.replacement + source[self.end :]

    def diff(self, source: str) -> str:
        new = self.apply(source)
        lines = difflib.unified_diff(
            source.splitlines(keepends=True), new.splitlines(keepends=True),
            fromfile=f"a/{self.path}", tofile=f"b/{self.path}", n=1,
        )
        return "".join(line for line in lines if not line.startswith(("---", "+++")))


class _Sites(ast.NodeVisitor):
    """Walks one module and yields (qualname, operator, node, start, end, replacement)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.offsets = [0]
        for line in source.splitlines(keepends=True):
            self.offsets.append(self.offsets[-1] + len(line))
        self.scope: list[str] = []
        self.sites: list[tuple[str, str, int, int, int, str]] = []

    # ---- helpers -------------------------------------------------------------
    def _span(self, node: ast.AST) -> tuple[int, int]:
        start = self.offsets[node.lineno - 1] + _char_col(self.source, self.offsets[node.lineno - 1], node.col_offset)
        end_base = self.offsets[node.end_lineno - 1]
        end = end_base + _char_col(self.source, end_base, node.end_col_offset)
        return start, end

    def _add(self, operator: str, node: ast.AST, replacement: str, span: tuple[int, int] | None = None) -> None:
        start, end = span or self._span(node)
        self.sites.append((".".join(self.scope) or "<module>", operator, node.lineno, start, end, replacement))

    def _text(self, node: ast.AST) -> str:
        start, end = self._span(node)
        return self.source[start:end]

    # ---- scopes and exclusions -------------------------------------------------
    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        for stmt in body:
            self.visit(stmt)
        for deco in node.decorator_list:
            self.visit(deco)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        for stmt in node.body:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                continue
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in stmt.targets):
                continue
            self.visit(stmt)
        self.scope.pop()

    def visit_Assert(self, node: ast.Assert) -> None:
        return  # internal consistency checks are not behaviour

    def visit_Import(self, node: ast.AST) -> None:
        return

    visit_ImportFrom = visit_Import

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None and node.simple:
            self._add("del_assign", node, "pass")
        if node.value is not None:
            self.visit(node.value)  # never the annotation

    def visit_arg(self, node: ast.arg) -> None:
        return  # annotations

    # ---- statement operators ---------------------------------------------------
    def visit_Expr(self, node: ast.Expr) -> None:
        value = node.value
        if isinstance(value, ast.Call) and not _is_logger_call(value):
            self._add("del_call", node, "pass")
        if isinstance(value, ast.Constant):
            return
        if not (isinstance(value, ast.Call) and _is_logger_call(value)):
            self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if self.scope:  # module-level assignments define the API; deleting them only breaks imports
            self._add("del_assign", node, "pass")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._add("del_assign", node, "pass")
        self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise) -> None:
        self._add("del_raise", node, "pass")
        self.generic_visit(node)

    def visit_With(self, node: ast.With) -> None:
        if len(node.items) == 1 and any(w in self._text(node.items[0].context_expr).lower() for w in _LOCKISH):
            start, _ = self._span(node)
            _, expr_end = self._span(node.items[-1].optional_vars or node.items[-1].context_expr)
            colon = self.source.index(":", expr_end)
            self._add("drop_with", node, "if True:", (start, colon + 1))
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        self._negate(node.test)
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        if not (isinstance(node.test, ast.Constant) and node.test.value is True):
            self._negate(node.test)
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._negate(node.test)
        self.generic_visit(node)

    def _negate(self, test: ast.expr) -> None:
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _NEGATE:
            return  # cmp_flip makes the same mutant
        self._add("negate_cond", test, f"not ({self._text(test)})")

    # ---- expression operators --------------------------------------------------
    def visit_Compare(self, node: ast.Compare) -> None:
        if len(node.ops) == 1 and type(node.ops[0]) in _NEGATE:
            flipped = ast.Compare(node.left, [_NEGATE[type(node.ops[0])]()], node.comparators)
            self._add("cmp_flip", node, f"({ast.unparse(flipped)})")
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self._add("boolop_swap", node, f"({ast.unparse(ast.BoolOp(other, node.values))})")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if type(node.value) is int:
            self._add("int_off", node, f"({node.value + 1})")
            self._add("int_off", node, f"({node.value - 1})")

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return  # message text: its content is checked by phrase tests, not by operators


def _char_col(source: str, line_start: int, byte_col: int) -> int:
    """ast columns are UTF-8 byte offsets; convert to a character offset within the line."""
    line_end = source.find("\n", line_start)
    line = source[line_start : line_end if line_end >= 0 else len(source)]
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


def _is_logger_call(call: ast.Call) -> bool:
    func = call.func
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "log"


def generate(path: Path, rel: str) -> list[Mutant]:
    """Every mutant of one module, in source order, each checked to compile."""
    source = path.read_text()
    sites = _Sites(source)
    sites.visit(ast.parse(source))
    module = Path(rel).stem
    mutants: list[Mutant] = []
    seen: dict[str, int] = {}
    for qualname, operator, line, start, end, replacement in sites.sites:
        digest = hashlib.sha1(f"{source[start:end]}\0{replacement}".encode()).hexdigest()[:8]
        base = f"{module}:{qualname}:{operator}:{digest}"
        k = seen.get(base, 0)
        seen[base] = k + 1
        mid = base if k == 0 else f"{base}#{k}"
        mutant = Mutant(mid, module, rel, operator, line, start, end, replacement)
        try:
            compile(mutant.apply(source), rel, "exec")
        except SyntaxError:
            continue  # e.g. a deleted statement left a block empty: not a mutant
        mutants.append(mutant)
    return mutants


WINGS = ("runtime", "integration")
"""Where a module name of ``--modules`` is looked up, in order (ids keep the bare name)."""


def module_path(name: str, root: Path = ROOT) -> str:
    """The repository path of the package module ``name`` (``manager`` -> ``omni_cache/runtime/manager.py``)."""
    for wing in WINGS:
        rel = f"omni_cache/{wing}/{name}.py"
        if (root / rel).exists():
            return rel
    raise SystemExit(f"ast_mutants: no module {name!r} in omni_cache/{{{','.join(WINGS)}}}/")


def all_mutants(root: Path = ROOT, modules: tuple[str, ...] = CORE_MODULES) -> list[Mutant]:
    out: list[Mutant] = []
    for name in modules:
        rel = module_path(name, root)
        out.extend(generate(root / rel, rel))
    return out


def sample(mutants: list[Mutant], n: int, seed: int) -> list[Mutant]:
    """The first ``n`` mutants ordered by a keyed hash of (seed, id); deterministic."""
    def rank(m: Mutant) -> str:
        return hashlib.sha256(f"{seed}\0{m.id}".encode()).hexdigest()

    picked = sorted(mutants, key=rank)[:n]
    return sorted(picked, key=lambda m: (m.module, m.line, m.id))


def load_equivalent(path: Path = EQUIVALENT_FILE) -> dict[str, str]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {mid: f"[{entry.get('kind', 'equivalent')}] {entry['reason']}" for mid, entry in data.items()}


def summarize(results: list[dict[str, object]], equivalent: dict[str, str]) -> tuple[str, float, list[dict[str, object]]]:
    """The Markdown report, the kill rate over non-equivalent mutants, and the unexplained survivors."""
    modules = sorted({str(r["module"]) for r in results})
    lines = ["| module | sampled | killed | equivalent | survived | kill rate |", "|---|---|---|---|---|---|"]

    def counts(rows: list[dict[str, object]]) -> tuple[int, int, int, int, float]:
        killed = sum(1 for r in rows if str(r["verdict"]).startswith("killed"))
        eq = sum(1 for r in rows if r["verdict"] == "equivalent")
        surv = sum(1 for r in rows if r["verdict"] in ("survived", "error"))
        denom = len(rows) - eq
        return len(rows), killed, eq, surv, (killed / denom if denom else 1.0)

    for mod in modules:
        n, k, e, s, rate = counts([r for r in results if r["module"] == mod])
        lines.append(f"| {mod} | {n} | {k} | {e} | {s} | {rate:.0%} |")
    n, k, e, s, rate = counts(results)
    lines.append(f"| **all** | {n} | {k} | {e} | {s} | **{rate:.1%}** |")
    survivors = [r for r in results if r["verdict"] in ("survived", "error")]
    eq_rows = [r for r in results if r["verdict"] == "equivalent"]
    stale = [r for r in results if str(r["verdict"]).startswith("killed") and r["id"] in equivalent]
    if survivors:
        lines += ["", f"Survivors ({len(survivors)}; kill each with a test or list it in tools/equivalent_mutants.json):"]
        for r in survivors:
            lines += ["", f"`{r['id']}` ({r['operator']}, line {r['line']})", "```diff", str(r["diff"]).rstrip(), "```"]
    if eq_rows:
        lines += ["", f"Equivalent ({len(eq_rows)}, from tools/equivalent_mutants.json):"]
        for r in eq_rows:
            lines += ["", f"`{r['id']}`: {equivalent[str(r['id'])]}", "```diff", str(r["diff"]).rstrip(), "```"]
    if stale:
        lines += ["", "Listed as equivalent but killed (remove from tools/equivalent_mutants.json): "
                  + ", ".join(f"`{r['id']}`" for r in stale)]
    lines.append(f"\nkill rate: {k}/{n - e} = {rate:.1%} of sampled non-equivalent mutants "
                 f"({n} sampled, {e} equivalent, {s} unexplained survivors)")
    return "\n".join(lines), rate, survivors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sample", type=int, default=80, help="how many mutants to run (default 80)")
    ap.add_argument("--seed", type=int, default=11, help="sampling seed (default 11)")
    ap.add_argument("--modules", nargs="*", default=list(CORE_MODULES), help="omni_cache module names")
    ap.add_argument("--only", nargs="*", help="run exactly these mutant ids (ignores --sample)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per test (a hang is a kill)")
    ap.add_argument("--run-timeout", type=float, default=1200.0, help="seconds per mutant's whole pytest run")
    ap.add_argument("--target", type=float, default=0.90, help="kill rate to reach (default 0.90)")
    ap.add_argument("--tests", nargs="*", help="pytest paths instead of the fast subset")
    ap.add_argument("--list", action="store_true", help="list the sampled mutants with their diffs; run nothing")
    ap.add_argument("--json", type=Path, help="also write the per-mutant results to this file")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    ap.add_argument("--spawn", action="store_true",
                    help="run each mutant's pytest in a fresh interpreter instead of a fork of this one")
    args = ap.parse_args(argv)
    if args.sample < 1:
        ap.error(f"--sample wants a positive number of mutants, got {args.sample}")
    if not args.modules:
        ap.error("--modules wants at least one module name")
    if args.only is not None and not args.only:
        ap.error("--only wants at least one mutant id")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: kill the pytest group, drop the copy
    everything = all_mutants(ROOT, tuple(args.modules))
    if args.only:
        by_id = {m.id: m for m in everything}
        missing = [i for i in args.only if i not in by_id]
        if missing:
            print(f"unknown mutant ids (the code moved?): {missing}", file=sys.stderr)
            return 2
        chosen = [by_id[i] for i in args.only]
    else:
        chosen = sample(everything, args.sample, args.seed)
    if not chosen:  # a kill rate of nothing is no result
        print(f"no mutant selected from modules {args.modules}: nothing to run", file=sys.stderr)
        return 2
    per_op: dict[str, int] = {}
    for m in everything:
        per_op[m.operator] = per_op.get(m.operator, 0) + 1
    print(f"{len(everything)} mutants generated ({', '.join(f'{k} {v}' for k, v in sorted(per_op.items()))}); "
          f"running {len(chosen)} (seed {args.seed})", flush=True)
    if args.list:
        for m in chosen:
            print(f"\n{m.id} (line {m.line})\n{m.diff((ROOT / m.path).read_text())}", end="")
        return 0
    equivalent = load_equivalent()
    tests = tuple(args.tests) if args.tests else tuple(t for t in FAST_TESTS if (ROOT / t).exists())
    deselect = () if args.tests else FAST_DESELECT
    try:
        results = run(chosen, root=ROOT, tests=tests, deselect=deselect, timeout_s=args.timeout,
                      run_timeout_s=args.run_timeout, fork=not args.spawn and hasattr(os, "fork"),
                      equivalent=equivalent, keep=args.keep, log=lambda s: print(s, flush=True))
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 2
    report, rate, survivors = summarize(results, equivalent)
    print("\n" + report)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    errors = [r["id"] for r in results if r["verdict"] == "error"]
    if errors:
        print(f"could not run (counted as survivors): {errors}", file=sys.stderr)
    return 0 if rate >= args.target and not survivors and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
