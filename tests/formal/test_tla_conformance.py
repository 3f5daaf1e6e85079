"""The spec's action graphs against the code's state tables (tla/ vs omni_cache/runtime/states.py).

TLC runs the one-page staging model and the one-write model with
``-dump dot,actionlabels``; the projected edges (state -action-> state) must
equal ``STAGING_TABLE.edges()`` / ``WRITE_TABLE.edges()``, and so must the edge
sets the specs state (``SlotEdges`` / ``WriteEdges``, printed by the MC
modules). A table that differs from the spec by one edge is caught.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest

from omni_cache.runtime.states import STAGING_TABLE, WRITE_TABLE, StateTable, TransitionSpec
from omni_cache.verify.conformance import (
    DotGraph,
    action_graph,
    compare_edges,
    compare_graph,
    parse_dot,
    printed_edges,
)
from omni_cache.verify.testing import require_tlc
from omni_cache.verify.tlc import default_tla_dir, load_manifest, run_tlc

TLA = default_tla_dir()
CONFORMANCE = {e.conformance["table"]: e for e in load_manifest(TLA) if e.conformance}


@pytest.fixture(scope="module")
def dumps() -> dict[str, tuple[DotGraph, str]]:
    """table name -> (TLC's dumped state graph, TLC's output) for each one-object model."""
    require_tlc()
    out: dict[str, tuple[DotGraph, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, entry in CONFORMANCE.items():
            folder = TLA / entry.model
            work = Path(tmp) / name
            run = run_tlc(folder / entry.spec, folder / entry.cfg, workdir=work, dump_dot=work / "graph")
            assert run.exit_code == 0, run.output
            out[name] = (parse_dot(work / "graph.dot"), run.output)
    return out


def _with(table: StateTable, transitions: tuple[TransitionSpec, ...]) -> StateTable:
    return dataclasses.replace(table, transitions=transitions)


def test_both_tables_have_a_conformance_run() -> None:
    assert set(CONFORMANCE) == {STAGING_TABLE.name, WRITE_TABLE.name}


@pytest.mark.tlc
@pytest.mark.parametrize("table", [STAGING_TABLE, WRITE_TABLE], ids=lambda t: t.name)
def test_spec_action_graph_equals_table(dumps: dict[str, tuple[DotGraph, str]], table: StateTable) -> None:
    graph, output = dumps[table.name]
    variable = CONFORMANCE[table.name].conformance["variable"]  # type: ignore[index]
    observed = action_graph(graph, variable)
    assert {e for e in observed if e[1] in table.triggers} == table.edges()
    fires = CONFORMANCE[table.name].conformance.get("fires")  # type: ignore[union-attr]
    assert compare_graph(table, observed, fires) == []
    if fires:  # the composite actions really move the object (else the entry would be dead)
        assert {a for s, a, d in observed if a in fires and s != d} == set(fires) - {"admit"}
    stated = printed_edges(output, CONFORMANCE[table.name].conformance["edges"])  # type: ignore[index]
    assert stated == table.edges()


@pytest.mark.tlc
def test_a_table_that_differs_by_one_edge_is_caught(dumps: dict[str, tuple[DotGraph, str]]) -> None:
    graph, output = dumps[STAGING_TABLE.name]
    observed = action_graph(graph, "page")
    stated = printed_edges(output, "SlotEdges")
    assert stated is not None
    # The code lets a materialized page be claimed again (no release): the spec never does that.
    extra = _with(STAGING_TABLE, (*STAGING_TABLE.transitions, TransitionSpec("claim", ("materialized",), "claimed")))
    assert compare_graph(extra, observed) == [
        "staging_slot allows materialized -claim-> claimed, which the spec never takes"
    ]
    assert compare_edges(extra, stated) == [
        "staging_slot has ('materialized', 'claim', 'claimed'), the spec edge set does not"
    ]
    # The code lacks abort: the spec takes an edge the code would refuse.
    fewer = _with(STAGING_TABLE, tuple(t for t in STAGING_TABLE.transitions if t.trigger != "abort"))
    problems = compare_graph(fewer, observed)
    assert problems == ["spec action 'abort' moves staging_slot claimed -> free but is not a trigger of the table"]


@pytest.mark.tlc
def test_write_table_with_a_missing_fail_edge_is_caught(dumps: dict[str, tuple[DotGraph, str]]) -> None:
    graph, _ = dumps[WRITE_TABLE.name]
    observed = action_graph(graph, "w")
    narrowed = _with(
        WRITE_TABLE,
        tuple(
            TransitionSpec(t.trigger, tuple(s for s in t.sources if s != "copying"), t.dest)
            if t.trigger == "fail" else t
            for t in WRITE_TABLE.transitions
        ),
    )
    assert compare_graph(narrowed, observed, {"finish": "enqueue"}) == [
        "spec takes copying -fail-> failed, which pool_write does not allow"
    ]
