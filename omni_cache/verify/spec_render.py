"""Render the state-machine part of ``spec/`` from the state tables in code.

Owns: the generated file ``spec/state_machines.md`` -- per machine, a Markdown
table of states and of transitions (with the tables' own descriptions) and a
Mermaid diagram drawn by ``transitions``' own
``GraphMachine(..., graph_engine="mermaid")`` (no graphviz).

Everything is read from ``omni_cache.runtime.states`` at call time (``STAGING_TABLE``,
``WRITE_TABLE``); nothing here repeats a state, a trigger or a description, so
the spec cannot drift from the code: ``tests/formal/test_spec_docs.py`` fails when the
file on disk is not what this module renders now (fix: ``omni-cache diagram
--write``).

Upholds the documentation side of I1/I3 (the staging-slot machine is the only
door to a page) and I8 (``failed`` is terminal): it shows exactly the tables the
runtime fires.
"""

from __future__ import annotations

from pathlib import Path

from transitions.extensions import GraphMachine

from omni_cache.runtime import states
from omni_cache.runtime.states import StateTable

# Keys of the ``--machine`` choice -> the attribute of ``omni_cache.runtime.states`` that holds
# the table. Looked up on every call, so a changed table is rendered as it is now.
MACHINE_ATTRS: dict[str, str] = {"staging": "STAGING_TABLE", "write": "WRITE_TABLE"}

SPEC_FILE = Path(__file__).resolve().parents[2] / "spec" / "state_machines.md"
"""Where the generated spec lives in a source checkout (editable install)."""

IN_SOURCE_CHECKOUT = (SPEC_FILE.parent.parent / "pyproject.toml").is_file()
"""False for a wheel install, where ``SPEC_FILE`` would point into site-packages."""

REGENERATE_HINT = "run `omni-cache diagram --write` (or `python -m omni_cache.verify.spec_render`) and commit the result"


def table_for(machine: str) -> StateTable:
    """The state table named by a ``--machine`` key (``staging`` or ``write``)."""
    try:
        return getattr(states, MACHINE_ATTRS[machine])
    except KeyError:
        raise ValueError(f"unknown machine {machine!r}; choose from {sorted(MACHINE_ATTRS)}") from None


def tables(machine: str = "all") -> list[StateTable]:
    """The tables for ``staging``, ``write`` or ``all`` (in that order)."""
    keys = list(MACHINE_ATTRS) if machine == "all" else [machine]
    return [table_for(k) for k in keys]


class _DiagramModel:
    """A throwaway model: ``GraphMachine`` needs one to bind ``get_graph`` to."""

    state: str


def mermaid(table: StateTable) -> str:
    """The Mermaid ``stateDiagram-v2`` text of ``table``, drawn by ``transitions``.

    The machine is built the way the runtime builds it (``TableMachine``): the
    table's states, transitions and initial state, no auto transitions. The
    initial state is the throwaway model's current state, so ``transitions``
    styles it as active. Trailing blanks are stripped from each line so that
    editors cannot make the checked-in copy differ.
    """
    model = _DiagramModel()
    GraphMachine(
        model=model,
        states=list(table.states),
        transitions=[
            {"trigger": t.trigger, "source": list(t.sources), "dest": t.dest} for t in table.transitions
        ],
        initial=table.initial,
        auto_transitions=False,
        graph_engine="mermaid",
        # transitions writes the title as the whole front matter; "title: X" makes it valid YAML.
        title=f"title: {table.name}",
    )
    # transitions adds get_graph to the model at run time: its stubs cannot declare it
    source = model.get_graph().draw(None)  # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in source.splitlines()) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_tables(table: StateTable) -> str:
    """The state table and the transition table of ``table`` in Markdown."""
    terminal = set(table.terminal)
    lines = ["| state | meaning |", "|---|---|"]
    for state in table.states:
        marks = [m for m, on in (("initial", state == table.initial), ("terminal", state in terminal)) if on]
        suffix = f" ({', '.join(marks)})" if marks else ""
        lines.append(f"| `{state}`{suffix} | {_cell(table.descriptions.get(state, ''))} |")
    lines += ["", "| trigger | sources -> dest | meaning |", "|---|---|---|"]
    for t in table.transitions:
        sources = ", ".join(f"`{s}`" for s in t.sources)
        lines.append(f"| `{t.trigger}` | {sources} -> `{t.dest}` | {_cell(table.descriptions.get(t.trigger, ''))} |")
    return "\n".join(lines) + "\n"


def machine_section(table: StateTable) -> str:
    """One machine's section of ``spec/state_machines.md``."""
    terminal = ", ".join(f"`{s}`" for s in table.terminal) or "none (the machine cycles)"
    return (
        f"## `{table.name}`\n\n"
        f"Initial state: `{table.initial}`. Terminal states: {terminal}. "
        "Any trigger not listed from an object's current state is illegal: it raises "
        "`OmniPrefixCacheUnmatchError` and changes nothing.\n\n"
        f"{markdown_tables(table)}\n"
        f"```mermaid\n{mermaid(table)}```\n"
    )


def render_state_machines_md() -> str:
    """The full text of ``spec/state_machines.md`` as the tables in code say now."""
    head = (
        "<!-- GENERATED by omni_cache/verify/spec_render.py from omni_cache/runtime/states.py. Do not edit:\n"
        f"     {REGENERATE_HINT}. -->\n"
        "# State machines\n\n"
        "The runtime's two `transitions` machines, rendered from the tables it fires "
        "(`omni_cache.runtime.states.STAGING_TABLE` and `WRITE_TABLE`). `TableMachine.fire` is the only "
        "way a staging slot or a pool write changes state. The diagrams are drawn by "
        '`transitions.extensions.GraphMachine(..., graph_engine="mermaid")` from the same tables; '
        "`omni-cache diagram` prints them; the state drawn highlighted is the initial one.\n\n"
        "A page of the staging pool is written, read and reused only through a staging slot in "
        "the state the table allows (I3), and a step id is consumed exactly once (I1); the first "
        "failed pool write fails the manager for good (I8). The invariants are in "
        "[invariants.md](invariants.md); the calls that fire these triggers are in "
        "[contract.md](contract.md).\n\n"
    )
    return head + "\n".join(machine_section(t) for t in tables("all"))


def write_state_machines_md(path: Path | None = None) -> Path:
    """Regenerate ``spec/state_machines.md`` (or ``path``); returns the path written."""
    path = SPEC_FILE if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_state_machines_md(), encoding="utf-8")
    return path


if __name__ == "__main__":  # pragma: no cover
    print(write_state_machines_md())
