"""Conformance: the spec's action graph against the code's state tables.

Owns: parsing TLC's ``-dump dot,actionlabels`` graph and ``PrintT`` output,
and comparing them with ``omni_cache.runtime.states`` tables. TLC runs a one-object
model (one staging page, one pool write); every edge of its state graph is
projected on the object's machine state (``page = <<"free">>`` gives
``free``). An edge labelled with a trigger name must be an edge of the table;
an edge with any other label must leave the machine state alone; every table
edge must appear. The edge set the spec states (``SlotEdges`` /
``WriteEdges``, printed by the MC module's ``ASSUME PrintT``) must equal the
table's too.

Upholds: the link between code and spec for the machines behind I1/I3 (staging
slot) and I8/I9 (pool write): the code cannot take a transition the model
checker never checked, and the model cannot check a machine the code lacks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_cache.runtime.states import ALL_TABLES, StateTable

_NODE_RE = re.compile(r'^(-?\d+) \[label="(.*)"(?:,style = filled)?\];?$')
_EDGE_RE = re.compile(r'^(-?\d+) -> (-?\d+) \[label="([^"]*)"')
_TRIPLE_RE = re.compile(r'<<\s*"(\w+)",\s*"(\w+)",\s*"(\w+)"\s*>>')


def table_by_name(name: str) -> StateTable:
    for table in ALL_TABLES:
        if table.name == name:
            return table
    raise KeyError(f"no state table named {name!r} (tables: {[t.name for t in ALL_TABLES]})")


@dataclass(frozen=True)
class DotGraph:
    """TLC's dumped state graph: node id -> label, and labelled edges (src, dst, action)."""

    nodes: dict[str, str]
    edges: list[tuple[str, str, str]]


def parse_dot(path: Path) -> DotGraph:
    nodes: dict[str, str] = {}
    edges: list[tuple[str, str, str]] = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if m := _EDGE_RE.match(line):
            edges.append((m.group(1), m.group(2), m.group(3)))
        elif m := _NODE_RE.match(line):
            nodes[m.group(1)] = m.group(2)
    return DotGraph(nodes, edges)


def machine_state(label: str, variable: str) -> str:
    """The one-object machine state in a dot node label (``page = <<"free">>`` -> ``free``)."""
    m = re.search(rf'(?:^|\\n|/\\\\ ){re.escape(variable)} = <<\\"(\w+)\\">>', label)
    if m is None:
        raise ValueError(f"no one-element {variable} = <<...>> in state label {label[:200]!r}")
    return m.group(1)


def action_graph(graph: DotGraph, variable: str) -> set[tuple[str, str, str]]:
    """Every (source state, action, destination state) of the projected graph."""
    return {
        (machine_state(graph.nodes[a], variable), action, machine_state(graph.nodes[b], variable))
        for a, b, action in graph.edges
    }


def printed_edges(output: str, operator: str) -> set[tuple[str, str, str]] | None:
    """The edge set printed by ``ASSUME PrintT(<<"<operator>", ...>>)``, or None if absent."""
    start = output.find(f'"{operator}"')
    if start < 0:
        return None
    end = output.find("} >>", start)
    block = output[start : end if end > 0 else len(output)]
    return {tuple(t) for t in _TRIPLE_RE.findall(block)}


def compare_graph(
    table: StateTable, observed: set[tuple[str, str, str]], fires: dict[str, str] | None = None
) -> list[str]:
    """Differences between a projected action graph and ``table`` (empty: they conform).

    ``fires`` names spec actions that are not triggers but fire one on the object
    (``{"finish": "enqueue"}``: ending an admission enqueues its writes); their
    edges count as edges of that trigger.
    """
    problems: list[str] = []
    fires = fires or {}
    observed = {(s, fires.get(a, a) if s != d else a, d) for s, a, d in observed}
    triggers = set(table.triggers)
    by_trigger = {e for e in observed if e[1] in triggers}
    for s, action, d in sorted(observed - by_trigger):
        if s != d:
            problems.append(f"spec action {action!r} moves {table.name} {s} -> {d} but is not a trigger of the table")
    for s, t, d in sorted(by_trigger - table.edges()):
        problems.append(f"spec takes {s} -{t}-> {d}, which {table.name} does not allow")
    for s, t, d in sorted(table.edges() - by_trigger):
        problems.append(f"{table.name} allows {s} -{t}-> {d}, which the spec never takes")
    return problems


def compare_edges(table: StateTable, stated: set[tuple[str, str, str]]) -> list[str]:
    problems = [f"spec edge set has {e}, {table.name} does not" for e in sorted(stated - table.edges())]
    problems += [f"{table.name} has {e}, the spec edge set does not" for e in sorted(table.edges() - stated)]
    return problems


def check_conformance(spec: dict[str, Any], dot_path: Path, output: str, table: StateTable | None = None) -> list[str]:
    """Compare a dumped one-object run with its table; ``spec`` is the manifest's conformance entry."""
    table = table or table_by_name(spec["table"])
    if not dot_path.is_file():
        return [f"TLC wrote no state graph at {dot_path}"]
    fires = spec.get("fires")
    problems = compare_graph(
        table, action_graph(parse_dot(dot_path), spec["variable"]), fires if isinstance(fires, dict) else None
    )
    operator = spec.get("edges")
    if operator:
        stated = printed_edges(output, operator)
        if stated is None:
            problems.append(f"TLC output lacks the PrintT of {operator}")
        else:
            problems += compare_edges(table, stated)
    return problems
