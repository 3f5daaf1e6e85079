"""The README's countable facts, computed from this tree: print them, check them, or rewrite them.

It also keeps docs/architecture.md's module map (between ``<!-- module-map:begin -->`` and
``<!-- module-map:end -->``) equal to the modules' docstrings: each module's first paragraph and
the invariants its "Upholds" paragraph names ("none" for "Upholds nothing"; a module without one
is an error). The README holds the facts in one marked table (between ``<!-- facts:begin -->`` and
``<!-- facts:end -->``): tests collected, ``vllm``-marked tests, the mutation fast subset, TLC
runs and pinned distinct states per tier, and runtime Python lines per decode step. Each row
names the command that gives its number. ``tests/project/test_readme_facts.py`` runs ``--check``'s
comparison in the suite, so a number cannot drift; after adding tests (or merging branches
that did), regenerate with ``--write``.

    .venv/bin/python tools/readme_facts.py            # print the facts as computed now
    .venv/bin/python tools/readme_facts.py --check    # exit 1 if the README's table differs
    .venv/bin/python tools/readme_facts.py --write    # rewrite the README's table

Invariants: none (documentation).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN, END = "<!-- facts:begin -->", "<!-- facts:end -->"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAP_BEGIN, MAP_END = "<!-- module-map:begin -->", "<!-- module-map:end -->"


_COLLECT = """
import json, sys
import pytest

class Items:
    def pytest_collection_finish(self, session):
        self.items = [(i.nodeid, [m.name for m in i.iter_markers()]) for i in session.items]

items = Items()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[items])
print("ITEMS " + json.dumps(getattr(items, "items", None)))
sys.exit(int(code))
"""


@functools.cache
def collected() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Every test id the suite collects from the repository root, with its markers (one collection)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", _COLLECT], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=900, check=False)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("ITEMS ")), "ITEMS null")
    items = json.loads(line[len("ITEMS "):])
    if done.returncode != 0 or not items:
        raise RuntimeError(f"pytest --collect-only failed (exit {done.returncode}):\n{done.stdout[-2000:]}"
                           f"{done.stderr[-2000:]}")
    return tuple((nodeid, tuple(markers)) for nodeid, markers in items)


def _collected(marker: str | None = None) -> int:
    return sum(1 for _nodeid, markers in collected() if marker is None or marker in markers)


def _fast_subset() -> int:
    sys.path.insert(0, str(ROOT / "tools"))
    from ast_mutants import FAST_DESELECT, FAST_TESTS

    return sum(1 for nodeid, _m in collected()
               if nodeid.split("::")[0] in FAST_TESTS and not nodeid.startswith(FAST_DESELECT))


def _tlc(tier: str, what: str) -> int:
    runs = [r for r in json.loads((ROOT / "tla" / "manifest.json").read_text())["runs"] if r.get("tier", "ci") == tier]
    if what == "runs":
        return len(runs)
    if what == "pinned":
        return sum(1 for r in runs if r.get("states"))
    return sum(r["states"]["distinct"] for r in runs if r.get("states"))


def _lines_per_decode_step() -> int:
    sys.path.insert(0, str(ROOT))
    from omni_cache.harness.bench.sweep import SWEEP_SHAPE, python_lines_per_decode_step
    from omni_cache.harness.bench.workload import WorkloadSpec

    return python_lines_per_decode_step(WorkloadSpec(batch_size=8, num_blocks=1024, **SWEEP_SHAPE))


@dataclass(frozen=True)
class Fact:
    label: str
    command: str
    compute: Callable[[], int]
    slow: bool = False  # runs pytest's collection (tens of seconds)


FACTS = (
    Fact("tests collected", "`.venv/bin/python -m pytest --collect-only -q`", lambda: _collected(), slow=True),
    Fact("tests marked `vllm` (the real engine)", "`.venv/bin/python -m pytest --collect-only -q -m vllm`",
         lambda: _collected("vllm"), slow=True),
    Fact("tests in the mutation fast subset", "`FAST_TESTS` of `tools/ast_mutants.py`, collected", _fast_subset,
         slow=True),
    Fact("TLC runs, CI tier", "`.venv/bin/omni-cache verify` (rows of its table)", lambda: _tlc("ci", "runs")),
    Fact("TLC runs with pinned state counts, CI tier", "`tla/manifest.json`", lambda: _tlc("ci", "pinned")),
    Fact("distinct states of the pinned CI runs", "`.venv/bin/omni-cache verify --json` (sum of `distinct_states` over the pinned runs)",
         lambda: _tlc("ci", "distinct")),
    Fact("TLC runs, nightly tier", "`.venv/bin/omni-cache verify --tier nightly`", lambda: _tlc("nightly", "runs")),
    Fact("distinct states, nightly tier", "`.venv/bin/omni-cache verify --tier nightly --json`",
         lambda: _tlc("nightly", "distinct")),
    Fact("runtime Python lines per decode step of 8 requests",
         "`.venv/bin/omni-cache bench --sweep` (last column)", _lines_per_decode_step),
)


def compute(*, slow: bool = True) -> dict[str, int]:
    return {f.label: f.compute() for f in FACTS if slow or not f.slow}


def render(values: dict[str, int]) -> str:
    rows = "\n".join(f"| {f.label} | {values[f.label]:,} | {f.command} |" for f in FACTS)
    return (f"{BEGIN}\n| fact (checked by `tests/project/test_readme_facts.py`) | count | from |\n|---|---|---|\n"
            f"{rows}\n{END}")


def stated(text: str | None = None) -> dict[str, int]:
    """The facts as the README states them now."""
    text = README.read_text() if text is None else text
    match = re.search(re.escape(BEGIN) + r"(.*?)" + re.escape(END), text, re.S)
    if not match:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block")
    out = {}
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"[\d,]+", cells[1]):
            out[cells[0]] = int(cells[1].replace(",", ""))
    return out


WING_ORDER = ("omni_cache.runtime", "omni_cache.integration", "omni_cache", "omni_cache.harness", "omni_cache.verify",
              "omni_cache.cli")  # the layers, bottom up (tests/project/test_layering.py)
_INVARIANT = re.compile(r"\bI1[0-4]\b|\bI[1-9]\b")


def upheld(doc: str) -> str | None:
    """What a module docstring's "Upholds" paragraph names: its invariants and contract sections
    ("I6, I7, contract 4.10"), "checks I1, I2" for a checker ("Upholds (by checking) ..."), "none"
    when it upholds nothing ("Upholds nothing ..."), or None when the docstring has no "Upholds"."""
    match = re.search(r"\bUpholds\b:?\s*(.*?)(?:\n\s*\n|\Z)", doc, re.S)
    if match is None:
        return None
    text = " ".join(match.group(1).split())
    if text.startswith("nothing"):
        return "none"
    named = sorted(set(_INVARIANT.findall(text)), key=lambda i: int(i[1:]))
    named += [f"contract {s}" for s in dict.fromkeys(re.findall(r"contract section (\d+(?:\.\d+)*)", text))]
    listed = ", ".join(named) or "none named"
    return f"checks {listed}" if text.startswith("(by checking") else listed


def module_map() -> str:
    """docs/architecture.md's module map, wing by wing (bottom up): each module's docstring's first
    paragraph and the invariants its "Upholds" paragraph names. Raises for a module that does not say."""
    import ast

    groups: dict[str, list[str]] = {}
    silent = []
    for path in sorted((ROOT / "omni_cache").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = " ".join(doc.split("\n\n")[0].split()).replace("|", "/")
        package = ".".join(path.parent.relative_to(ROOT).parts)
        if (upholds := upheld(doc)) is None:
            silent.append(str(path.relative_to(ROOT)))
        groups.setdefault(package, []).append(f"| `{path.name}` | {first} | {upholds} |")
    if silent:
        raise ValueError(f"modules whose docstring has no \"Upholds\" line: {silent}")

    def rank(package: str) -> tuple[int, str]:
        wing = max((w for w in WING_ORDER if package == w or package.startswith(w + ".")), key=len)
        return WING_ORDER.index(wing), package

    parts = [f"### `{package}`\n\n| module | what it owns | invariants it upholds |\n|---|---|---|\n"
             + "\n".join(groups[package]) for package in sorted(groups, key=rank)]
    return f"{MAP_BEGIN}\n" + "\n\n".join(parts) + f"\n{MAP_END}"


def stated_module_map() -> str:
    match = re.search(re.escape(MAP_BEGIN) + r".*?" + re.escape(MAP_END), ARCHITECTURE.read_text(), re.S)
    if not match:
        raise ValueError(f"docs/architecture.md has no {MAP_BEGIN} ... {MAP_END} block")
    return match.group(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the README's facts differ from this tree's")
    mode.add_argument("--write", action="store_true", help="rewrite the README's facts table")
    args = parser.parse_args(argv)
    values = compute()
    if args.write:
        text = README.read_text()
        new = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _m: render(values), text, flags=re.S)
        if new == text and render(values) not in text:
            print(f"README.md has no {BEGIN} ... {END} block", file=sys.stderr)
            return 2
        README.write_text(new)
        stated_module_map()  # the block must exist
        arch = ARCHITECTURE.read_text()
        ARCHITECTURE.write_text(re.sub(re.escape(MAP_BEGIN) + r".*?" + re.escape(MAP_END), lambda _m: module_map(),
                                       arch, flags=re.S))
        print(f"wrote {len(values)} facts into README.md and the module map into docs/architecture.md")
        return 0
    if args.check:
        have = stated()
        wrong = [f"{k}: README says {have.get(k)}, this tree has {v}" for k, v in values.items() if have.get(k) != v]
        if stated_module_map() != module_map():
            wrong.append("docs/architecture.md: the module map differs from the modules' docstrings")
        for line in wrong:
            print(line, file=sys.stderr)
        if wrong:
            print("regenerate with: .venv/bin/python tools/readme_facts.py --write", file=sys.stderr)
        return 1 if wrong else 0
    for k, v in values.items():
        print(f"{k}: {v:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
