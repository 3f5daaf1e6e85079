"""The state tables as data, and TableMachine: illegal triggers raise and change nothing."""

from __future__ import annotations

import pytest

from omni_cache import STAGING_TABLE, WRITE_TABLE, OmniPrefixCacheUnmatchError, TraceRecorder
from omni_cache.runtime.states import TableMachine


class Obj:
    def __init__(self, state: str) -> None:
        self.state = state


def test_tables_match_the_design() -> None:
    assert STAGING_TABLE.states == ("free", "claimed", "saved", "materialized")
    assert STAGING_TABLE.edges() == {
        ("free", "claim", "claimed"), ("claimed", "abort", "free"), ("claimed", "save", "saved"),
        ("saved", "consume", "materialized"), ("materialized", "release", "free"),
    }
    assert WRITE_TABLE.states[:5] == ("pending", "queued", "copying", "host_ready", "written")
    assert {(s, "fail", "failed") for s in ("pending", "queued", "copying", "host_ready")} <= WRITE_TABLE.edges()
    assert WRITE_TABLE.terminal == ("written", "failed")
    for table in (STAGING_TABLE, WRITE_TABLE):
        for name in (*table.states, *table.triggers):
            assert table.descriptions[name], name


@pytest.mark.parametrize("table", [STAGING_TABLE, WRITE_TABLE], ids=lambda t: t.name)
@pytest.mark.parametrize("library", [False, True], ids=["dispatch", "library"])
def test_every_trigger_from_every_state(table, library: bool) -> None:  # type: ignore[no-untyped-def]
    recorder = TraceRecorder()
    machine = TableMachine(table, recorder, library_triggers=library)
    for state in table.states:
        for trigger in table.triggers:
            obj = Obj(state)
            dest = table.next_state(state, trigger)
            if dest is None:
                with pytest.raises(OmniPrefixCacheUnmatchError) as info:
                    machine.fire(obj, trigger, what="staging slot 7", step_id=42)
                assert obj.state == state  # changed nothing
                msg = str(info.value)
                assert all(part in msg for part in ("staging slot 7", repr(state), repr(trigger), "42"))
            else:
                machine.fire(obj, trigger, what="obj", step_id=1)
                assert obj.state == dest
    legal = [e for e in recorder.events()]
    assert {(e.source, e.trigger, e.dest) for e in legal} == table.edges()


def test_unknown_trigger_is_a_contract_error() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="explode"):
        TableMachine(STAGING_TABLE).fire(Obj("free"), "explode", what="slot")


@pytest.mark.parametrize("table", [STAGING_TABLE, WRITE_TABLE], ids=lambda t: t.name)
def test_compiled_dispatch_equals_the_library_trigger_path(table) -> None:  # type: ignore[no-untyped-def]
    """The fast path and transitions' own Event.trigger agree on every (state, trigger)."""
    fast, slow = TableMachine(table, library_triggers=False), TableMachine(table, library_triggers=True)
    assert slow.library_triggers and not fast.library_triggers
    for state in table.states:
        for trigger in (*table.triggers, "bogus"):
            outcomes = []
            for machine in (fast, slow):
                obj = Obj(state)
                try:
                    machine.fire(obj, trigger, what="x")
                    outcomes.append(obj.state)
                except OmniPrefixCacheUnmatchError as exc:
                    assert obj.state == state
                    outcomes.append(f"illegal: {exc}")
            assert outcomes[0] == outcomes[1], (state, trigger, outcomes)
            expected = table.next_state(state, trigger)
            if expected is None:  # an illegal pair must be refused by both paths, not silently kept
                assert outcomes[0].startswith("illegal: "), (state, trigger, outcomes)
            else:
                assert outcomes[0] == expected, (state, trigger, outcomes)


def test_library_trigger_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_CACHE_LIBRARY_TRIGGERS", "1")
    assert TableMachine(STAGING_TABLE).library_triggers
    monkeypatch.setenv("OMNI_CACHE_LIBRARY_TRIGGERS", "0")
    assert not TableMachine(STAGING_TABLE).library_triggers
