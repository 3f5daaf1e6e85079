"""spec/invariants.md's traceability table stays true (I1..I14).

Parses the table and checks: every ID I1..I14 appears once with a statement;
each has a TLA+ property or a stated reason; every named TLA+ property is
defined in the named ``tla/<model>/*.tla`` and checked by TLC, i.e. listed under
INVARIANT(S) or PROPERTY(IES) of one of that model's ``*.cfg`` files (a
property nobody checks proves nothing); every named test is defined in the
named file; a ``test_I<k>_...`` test sits in row I<k>, and every row names one;
and ``tla/manifest.json`` has, for every property in the table, a broken variant
that TLC must reject with exactly that property (and a deadlocking one where a
row cites TLC's deadlock check).

A model directory or a test file that does not exist yet (other engineers are
writing them) skips that sub-check -- except in CI (``CI=true``), where it
fails. The checkers are plain functions so the last tests can feed them a
broken table and watch them complain.
"""

from __future__ import annotations

import ast
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INVARIANTS_MD = ROOT / "spec" / "invariants.md"
MANIFEST = ROOT / "tla" / "manifest.json"
IDS = tuple(f"I{i}" for i in range(1, 15))
IN_CI = os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")

TLA_MODEL = re.compile(r"`(tla/[\w.-]+)`\s*:")
TEST_REF = re.compile(r"`(tests/[\w/.-]+\.py)::(\w+)`")
INVARIANT_TEST = re.compile(r"^test_(I\d+)_")
MIN_REASON = 40


@dataclass(frozen=True)
class Row:
    id: str
    statement: str
    tla: str
    tests: str


def _table_rows(md: str, header_first_cell: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header starts with ``header_first_cell``."""
    rows: list[list[str]] = []
    lines = md.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"| {header_first_cell} |"):
            for body in lines[i + 2 :]:
                if not body.startswith("|"):
                    break
                rows.append([c.strip() for c in re.split(r"(?<!\\)\|", body.strip())[1:-1]])
            break
    return rows


def parse_rows(md: str) -> list[Row]:
    return [Row(*cells) if len(cells) == 4 else Row("<malformed>", "|".join(cells), "", "") for cells in _table_rows(md, "ID")]


def tla_refs(cell: str) -> list[tuple[str, str]]:
    """(model dir, property) pairs named in a TLA+ cell; none for a ``none:`` cell. Every backticked
    name after a `` `tla/<model>`: `` counts, up to the next model, except inside a parenthesized note
    (which may name actions: `` `finish` itself enqueues them``)."""
    if cell.startswith("none:"):
        return []
    parts = TLA_MODEL.split(cell)
    refs = []
    for model, segment in zip(parts[1::2], parts[2::2], strict=True):
        while (plain := re.sub(r"\([^()]*\)", "", segment)) != segment:  # innermost notes first
            segment = plain
        refs += [(model, p) for p in re.findall(r"`(\w+)`", segment)]
    return refs


def model_wide_refs(md: str) -> list[tuple[str, str]]:
    return [(cells[0].strip("`"), cells[1].strip("`")) for cells in _table_rows(md, "model")]


def named_tests(cell: str) -> list[tuple[str, str]]:
    return TEST_REF.findall(cell)



def check_rows(rows: list[Row]) -> list[str]:
    """Problems with the table's shape: IDs, statements, properties or reasons, tests."""
    problems: list[str] = []
    ids = [r.id for r in rows]
    for missing in [i for i in IDS if i not in ids]:
        problems.append(f"{missing}: no row")
    for extra in sorted({i for i in ids if i not in IDS or ids.count(i) > 1}):
        problems.append(f"{extra}: unexpected or duplicated row")
    for row in rows:
        if len(row.statement) < 20:
            problems.append(f"{row.id}: no statement")
        refs = tla_refs(row.tla)
        if row.tla.startswith("none:"):
            if len(row.tla[len("none:") :].strip()) < MIN_REASON:
                problems.append(f"{row.id}: 'none:' without a stated reason")
        elif not refs:
            problems.append(f"{row.id}: neither a TLA+ property (`tla/<model>`: `Prop`) nor 'none: <reason>'")
        tests = named_tests(row.tests)
        if not tests:
            problems.append(f"{row.id}: names no test")
        tagged = [name for _, name in tests if INVARIANT_TEST.match(name)]
        for name in tagged:
            if INVARIANT_TEST.match(name).group(1) != row.id:  # type: ignore[union-attr]
                problems.append(f"{row.id}: lists {name}, which belongs to another invariant")
        if row.id in IDS and not any(n.startswith(f"test_{row.id}_") for n in tagged):
            problems.append(f"{row.id}: names no test_{row.id}_... test")
    return problems


def _strip_tla_comments(text: str) -> str:
    text = re.sub(r"\(\*.*?\*\)", "", text, flags=re.S)
    return re.sub(r"\\\*.*$", "", text, flags=re.M)


CFG_KEYWORDS = re.compile(
    r"^(CONSTANTS?|INIT|NEXT|SPECIFICATION|INVARIANTS?|PROPERTY|PROPERTIES|SYMMETRY|VIEW|ALIAS|"
    r"CONSTRAINTS?|ACTION_CONSTRAINTS?|CHECK_DEADLOCK|POSTCONDITION)$"
)


def checked_names(cfg_text: str) -> set[str]:
    """Names listed under INVARIANT(S) / PROPERTY(IES) of a TLC ``.cfg`` file."""
    names: set[str] = set()
    section = ""
    for token in _strip_tla_comments(cfg_text).split():
        if CFG_KEYWORDS.match(token):
            section = token
        elif section.startswith(("INVARIANT", "PROPERT")) and re.fullmatch(r"\w+", token):
            names.add(token)
    return names


def check_tla(refs: list[tuple[str, str]], root: Path) -> tuple[list[str], list[str]]:
    """(problems, missing model dirs): every property must be defined in ``<root>/<model>/*.tla``
    and listed as an invariant or property in one of ``<root>/<model>/*.cfg``."""
    problems: list[str] = []
    missing: list[str] = []
    for model in sorted({m for m, _ in refs}):
        directory = root / model
        files = sorted(directory.glob("*.tla"))
        if not files:
            missing.append(model)
            continue
        text = "\n".join(_strip_tla_comments(f.read_text(encoding="utf-8")) for f in files)
        checked: set[str] = set()
        for cfg in directory.glob("*.cfg"):
            checked |= checked_names(cfg.read_text(encoding="utf-8"))
        for prop in sorted({p for m, p in refs if m == model}):
            if not re.search(rf"^\s*(?:LOCAL\s+)?{prop}\s*(?:\([^)]*\))?\s*==", text, flags=re.M):
                problems.append(f"{model}: property {prop} is not defined in {[f.name for f in files]}")
            elif prop not in checked:
                problems.append(f"{model}: property {prop} is not checked by any {model}/*.cfg")
    return problems, missing


def check_broken_variants(rows: list[Row], manifest: dict) -> list[str]:
    """Every property of the table is the expected failure of some run of its model."""
    rejected = {
        (f"tla/{run['model']}", run["expect"].split(":", 1)[1])
        for run in manifest.get("runs", [])
        if run.get("expect", "").startswith(("invariant:", "property:"))
    }
    deadlocking = {f"tla/{run['model']}" for run in manifest.get("runs", []) if run.get("expect") == "deadlock"}
    problems = [
        f"{row.id}: no broken variant of {model} that TLC must reject with {prop}"
        for row in rows
        for model, prop in tla_refs(row.tla)
        if (model, prop) not in rejected
    ]
    for row in rows:
        models = {m for m, _ in tla_refs(row.tla)}
        if "deadlock check" in row.tla and not models & deadlocking:
            problems.append(f"{row.id}: cites TLC's deadlock check but no run of {sorted(models)} expects a deadlock")
    return problems


def _defined_names(path: Path) -> set[str]:
    """Functions and classes anywhere in the module, and top-level assignment targets
    (``TestX = Machine.TestCase``, the Hypothesis idiom)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def check_tests(refs: list[tuple[str, str]], root: Path) -> tuple[list[str], list[str]]:
    """(problems, missing files): every named test must be defined in its file."""
    problems: list[str] = []
    missing: list[str] = []
    for rel in sorted({f for f, _ in refs}):
        path = root / rel
        if not path.exists():
            missing.append(rel)
            continue
        defined = _defined_names(path)
        for name in sorted({n for f, n in refs if f == rel}):
            if name not in defined:
                problems.append(f"{rel}: no def/class {name}")
    return problems, missing


def _skip_or_fail_missing(missing: list[str], what: str) -> None:
    if not missing:
        return
    message = f"{what} not written yet: {missing}; this sub-check runs once they exist"
    if IN_CI:
        pytest.fail(f"{message} -- and CI=true, where a missing {what} is a failure")
    pytest.skip(message)


# ---- the real spec -----------------------------------------------------------

@pytest.fixture(scope="module")
def spec_md() -> str:
    return INVARIANTS_MD.read_text(encoding="utf-8")


def test_every_invariant_has_a_row_a_property_or_reason_and_tests(spec_md: str) -> None:
    rows = parse_rows(spec_md)
    assert check_rows(rows) == []
    assert [r.id for r in rows] == list(IDS)


def test_named_tla_properties_are_defined(spec_md: str) -> None:
    refs = [ref for row in parse_rows(spec_md) for ref in tla_refs(row.tla)] + model_wide_refs(spec_md)
    assert {"tla/staging", "tla/tenancy"} <= {m for m, _ in refs}
    problems, missing = check_tla(refs, ROOT)
    assert problems == []
    _skip_or_fail_missing(missing, "TLA+ model directory")


def test_named_tests_exist(spec_md: str) -> None:
    refs = [ref for row in parse_rows(spec_md) for ref in named_tests(row.tests)]
    problems, missing = check_tests(refs, ROOT)
    assert problems == []
    _skip_or_fail_missing(missing, "test file")


def test_every_property_has_a_broken_variant_tlc_rejects(spec_md: str) -> None:
    if not MANIFEST.exists():
        _skip_or_fail_missing(["tla/manifest.json"], "TLC run manifest")
    manifest = json.loads(MANIFEST.read_text(encoding="utf-8"))
    assert check_broken_variants(parse_rows(spec_md), manifest) == []


# ---- the checkers catch a broken table ----------------------------------------

def _row(id_: str, tla: str = "`tla/m`: `Inv`", tests: str = "") -> str:
    tests = tests or f"`tests/t.py::test_{id_}_holds`"
    return f"| {id_} | a statement long enough to count | {tla} | {tests} |"


def _table(*rows: str) -> str:
    return "\n".join(["| ID | statement | TLA+ | tests |", "|---|---|---|---|", *rows, ""])


def test_check_rows_flags_missing_ids_reasons_and_misplaced_tests() -> None:
    good = [_row(i) for i in IDS]
    assert check_rows(parse_rows(_table(*good))) == []
    broken = [
        *good[:4],  # I5 missing
        _row("I6", tla="none: too short"),
        _row("I7", tla="see the model"),
        _row("I8", tests="`tests/t.py::test_I9_holds`"),
        *good[8:],
    ]
    problems = check_rows(parse_rows(_table(*broken)))
    assert "I5: no row" in problems
    assert "I6: 'none:' without a stated reason" in problems
    assert any(p.startswith("I7: neither a TLA+ property") for p in problems)
    assert "I8: lists test_I9_holds, which belongs to another invariant" in problems
    assert "I8: names no test_I8_... test" in problems


def test_check_tla_flags_undefined_and_commented_out_properties(tmp_path: Path) -> None:
    (tmp_path / "tla" / "m").mkdir(parents=True)
    (tmp_path / "tla" / "m" / "Spec.tla").write_text(
        "---- MODULE Spec ----\nInv == TRUE\nLive(x) == x\nIdle == TRUE\n"
        "\\* Gone == TRUE\n(* Old ==\n TRUE *)\n====\n"
    )
    (tmp_path / "tla" / "m" / "MC.cfg").write_text(
        "CONSTANTS N = 2\nSPECIFICATION Spec\nINVARIANTS TypeOK\n  Inv \\* Idle\nPROPERTIES Live\n"
    )
    refs = [("tla/m", p) for p in ("Inv", "Live", "Idle", "Gone", "Old")] + [("tla/absent", "X")]
    problems, missing = check_tla(refs, tmp_path)
    assert missing == ["tla/absent"]
    assert problems == [
        "tla/m: property Gone is not defined in ['Spec.tla']",
        "tla/m: property Idle is not checked by any tla/m/*.cfg",
        "tla/m: property Old is not defined in ['Spec.tla']",
    ]


def test_check_tests_flags_undefined_tests(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text(
        "def test_I1_a():\n    pass\n\nclass M:\n    def test_I2_b(self):\n        pass\n\nTestMachine = M\n"
    )
    refs = [("tests/t.py", n) for n in ("test_I1_a", "test_I2_b", "TestMachine", "test_I3_c")]
    refs.append(("tests/none.py", "test_x"))
    problems, missing = check_tests(refs, tmp_path)
    assert problems == ["tests/t.py: no def/class test_I3_c"]
    assert missing == ["tests/none.py"]


def test_check_broken_variants_flags_a_property_nobody_breaks() -> None:
    rows = parse_rows(_table(
        _row("I1", tla="`tla/m`: `Inv`, `Live`"),
        _row("I2", tla="`tla/m`: `Inv`; and TLC's deadlock check"),
    ))
    manifest = {"runs": [
        {"model": "m", "expect": "ok"},
        {"model": "m", "expect": "invariant:Inv"},
        {"model": "other", "expect": "property:Live"},
    ]}
    assert check_broken_variants(rows, manifest) == [
        "I1: no broken variant of tla/m that TLC must reject with Live",
        "I2: cites TLC's deadlock check but no run of ['tla/m'] expects a deadlock",
    ]
    manifest["runs"] += [{"model": "m", "expect": "property:Live"}, {"model": "m", "expect": "deadlock"}]
    assert check_broken_variants(rows, manifest) == []
