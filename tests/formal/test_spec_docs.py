"""spec/state_machines.md and `omni-cache diagram` stay what the state tables in code say.

Owns the "diagram generated from the machine itself, checked up to date" check of
spec/README.md: the generated file must equal what ``omni_cache.verify.spec_render``
renders now from ``omni_cache.runtime.states`` (I1/I3/I8 are documented there), and the
rendered Mermaid must carry exactly the tables' edges.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import os
import re
from pathlib import Path

import pytest

from omni_cache.cli import SUBCOMMANDS, diagram, main
from omni_cache.runtime import states
from omni_cache.runtime.states import ALL_TABLES, StateTable, TransitionSpec
from omni_cache.verify import spec_render

EDGE = re.compile(r"^\s*(\w+) --> (\w+): (.+)$")
STATE = re.compile(r'^\s*state "(\w+)" as (\w+)$')


def _run_diagram(argv: list[str]) -> int:
    """Run the ``diagram`` subcommand through its own parser registration."""
    parser = argparse.ArgumentParser(prog="omni-cache")
    diagram.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["diagram", *argv])
    return int(args.func(args))


def _mermaid_edges(text: str) -> tuple[set[tuple[str, str, str]], list[str], list[str]]:
    edges: set[tuple[str, str, str]] = set()
    initial: list[str] = []
    declared: list[str] = []
    for line in text.splitlines():
        if m := re.match(r"^\s*\[\*\] --> (\w+)$", line):
            initial.append(m.group(1))
        elif m := EDGE.match(line):
            for trigger in m.group(3).split(" | "):
                edges.add((m.group(1), trigger.strip(), m.group(2)))
        elif m := STATE.match(line):
            declared.append(m.group(2))
    return edges, initial, declared


def test_state_machines_md_is_current() -> None:
    expected = spec_render.render_state_machines_md()
    path = spec_render.SPEC_FILE
    assert path.exists(), f"{path} is missing: {spec_render.REGENERATE_HINT}"
    actual = path.read_text(encoding="utf-8")
    if actual != expected:
        diff = "".join(
            list(
                difflib.unified_diff(
                    actual.splitlines(keepends=True),
                    expected.splitlines(keepends=True),
                    "spec/state_machines.md (on disk)",
                    "rendered from omni_cache/runtime/states.py now",
                )
            )[:60]
        )
        pytest.fail(f"spec/state_machines.md is stale: {spec_render.REGENERATE_HINT}\n{diff}")


@pytest.mark.parametrize("table", ALL_TABLES, ids=lambda t: t.name)
def test_mermaid_is_exactly_the_table(table: StateTable) -> None:
    text = spec_render.mermaid(table)
    assert text.startswith(f"---\ntitle: {table.name}\n---\nstateDiagram-v2\n")
    edges, initial, declared = _mermaid_edges(text)
    assert edges == table.edges()
    assert initial == [table.initial]
    assert declared == list(table.states)
    assert all(line == line.rstrip() for line in text.splitlines())


@pytest.mark.parametrize("table", ALL_TABLES, ids=lambda t: t.name)
def test_markdown_tables_carry_every_state_and_transition(table: StateTable) -> None:
    md = spec_render.markdown_tables(table)
    rows = [line for line in md.splitlines() if line.startswith("| `")]
    state_rows = rows[: len(table.states)]
    transition_rows = rows[len(table.states) :]
    assert len(transition_rows) == len(table.transitions)
    for state, row in zip(table.states, state_rows, strict=True):
        assert row.startswith(f"| `{state}`")
        assert row.endswith(f"| {table.descriptions[state]} |")
    for spec, row in zip(table.transitions, transition_rows, strict=True):
        sources = ", ".join(f"`{s}`" for s in spec.sources)
        assert row == f"| `{spec.trigger}` | {sources} -> `{spec.dest}` | {table.descriptions[spec.trigger]} |"


def test_renderer_reads_the_tables_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed table changes the output, so a stale spec file is caught (never a copy)."""
    before = spec_render.render_state_machines_md()
    changed = dataclasses.replace(
        states.STAGING_TABLE,
        transitions=(*states.STAGING_TABLE.transitions, TransitionSpec("evict", ("saved",), "free")),
        descriptions={**states.STAGING_TABLE.descriptions, "evict": "a made-up trigger"},
    )
    monkeypatch.setattr(states, "STAGING_TABLE", changed)
    after = spec_render.render_state_machines_md()
    assert after != before
    assert "saved --> free: evict" in after
    assert "| `evict` | `saved` -> `free` | a made-up trigger |" in after
    assert _run_diagram(["--check"]) == 1


def test_diagram_is_a_subcommand() -> None:
    assert "diagram" in SUBCOMMANDS


def test_omni_cache_main_runs_diagram(capsys: pytest.CaptureFixture[str]) -> None:
    """The real entry point (it imports every subcommand module to build its parser)."""
    missing = [n for n in SUBCOMMANDS if importlib.util.find_spec(f"omni_cache.cli.{n.replace('-', '_')}") is None]
    if missing and os.environ.get("CI", "").lower() not in ("true", "1"):
        pytest.skip(f"subcommand modules {missing} are not written yet; omni-cache cannot build its parser")
    assert main(["diagram", "--machine", "write"]) == 0
    assert capsys.readouterr().out == spec_render.mermaid(states.WRITE_TABLE)


def test_diagram_prints_the_text_spec_holds(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_diagram([]) == 0
    printed = capsys.readouterr().out
    spec_text = spec_render.SPEC_FILE.read_text(encoding="utf-8")
    for table in ALL_TABLES:
        text = spec_render.mermaid(table)
        assert text in printed
        assert f"```mermaid\n{text}```" in spec_text
    assert printed == "\n".join(spec_render.mermaid(t) for t in ALL_TABLES)


@pytest.mark.parametrize(("machine", "table"), [("staging", states.STAGING_TABLE), ("write", states.WRITE_TABLE)])
def test_diagram_machine_selects_one(machine: str, table: StateTable, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_diagram(["--machine", machine]) == 0
    printed = capsys.readouterr().out
    assert printed == spec_render.mermaid(table)
    assert printed.count("stateDiagram-v2") == 1


def test_diagram_write_then_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "spec" / "state_machines.md"
    target.parent.mkdir()  # --path must name a file in an existing folder (nothing else is created)
    assert _run_diagram(["--check", "--path", str(target)]) == 1
    assert "is missing" in capsys.readouterr().err
    assert _run_diagram(["--write", "--path", str(target)]) == 0
    assert target.read_text(encoding="utf-8") == spec_render.render_state_machines_md()
    assert _run_diagram(["--check", "--path", str(target)]) == 0
    target.write_text(target.read_text(encoding="utf-8").replace("consume", "consume twice", 1))
    capsys.readouterr()
    assert _run_diagram(["--check", "--path", str(target)]) == 1
    assert "omni-cache diagram --write" in capsys.readouterr().err


def test_unknown_machine_raises() -> None:
    with pytest.raises(ValueError, match="unknown machine"):
        spec_render.table_for("kv")


def test_diagram_write_outside_a_checkout_needs_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(spec_render, "IN_SOURCE_CHECKOUT", False)
    with pytest.raises(SystemExit) as exited:  # an argument error: the usage and one line, exit 2
        _run_diagram(["--write"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: omni-cache diagram") and "pass --path" in err
    assert _run_diagram(["--write", "--path", str(tmp_path / "sm.md")]) == 0
    assert (tmp_path / "sm.md").read_text(encoding="utf-8") == spec_render.render_state_machines_md()


def test_check_of_another_path_hints_the_write_of_that_path(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """``--check --path X`` of a missing or stale X names the command that writes X, not the default file."""
    target = tmp_path / "machines.md"
    assert _run_diagram(["--check", "--path", str(target)]) == 1
    assert f"is missing: run `omni-cache diagram --write --path {target}`" in capsys.readouterr().err
    assert _run_diagram(["--write", "--path", str(target)]) == 0
    assert _run_diagram(["--check", "--path", str(target)]) == 0
