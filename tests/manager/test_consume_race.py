"""Two consumers racing for one step id: exactly one consumes it (I1), the other is refused.

``materialize`` takes the step's context before its consume; another ``materialize`` or
``discard_step`` of the same id in that window is refused ("already consumed or never saved":
another call is consuming it) and changes nothing, so no staging page is left consumed but
never released, no stale context is left for ``trim_step`` to accept, and the winner's read is
whole. The window is held open deterministically: a request id whose ``==`` blocks on a gate
(materialize compares the ids it is given with the step's before it consumes).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from cache_helpers import manager, save, settle

from omni_cache import OmniPrefixCacheUnmatchError

JOIN_S = 30.0


class _GatedId(str):
    """A request id equal to its str; its first comparison waits until the test opens the gate."""

    entered = threading.Event()
    gate = threading.Event()

    def __eq__(self, other: object) -> bool:
        if not _GatedId.entered.is_set():
            _GatedId.entered.set()
            assert _GatedId.gate.wait(JOIN_S), "the test never opened the gate"
        return str.__eq__(self, other)

    __hash__ = str.__hash__


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
@pytest.mark.parametrize("rival", ["discard_step", "materialize"])
def test_a_consumer_racing_a_materialize_is_refused_and_nothing_leaks(eager: bool, rival: str) -> None:
    _GatedId.entered.clear()
    _GatedId.gate.clear()
    m = manager(eager=eager)
    try:
        step_id, rows = save(m, [("a", [0, 1], 0, 6), ("b", [2, 3], 0, 5)])
        got: dict[str, Any] = {}

        def first() -> None:
            try:
                got["out"] = m.materialize(step_id, [_GatedId("b"), "a"])
            except BaseException as exc:  # the test asserts there was none
                got["error"] = exc

        reader = threading.Thread(target=first, daemon=True)
        reader.start()
        assert _GatedId.entered.wait(JOIN_S), "materialize never compared the request ids"
        with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed or never saved: another call is "
                                                               "consuming it; nothing was consumed"):
            m.discard_step(step_id) if rival == "discard_step" else m.materialize(step_id, ["a", "b"])
        with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed or never saved"):
            m.trim_step(step_id, {"a": 1, "b": 1})  # no verdict on rows being read
        _GatedId.gate.set()
        reader.join(JOIN_S)
        assert not reader.is_alive() and "error" not in got, got.get("error")
        out = got["out"]
        assert out.hidden_states["a"].equal(rows[:6]) and out.hidden_states["b"].equal(rows[6:])  # whole, in row order
        for again in (lambda: m.discard_step(step_id), lambda: m.materialize(step_id, ["a"]),
                      lambda: m.trim_step(step_id, {"a": 1})):
            with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed or never saved"):
                again()
        settle(m)
        stats = m.stats()
        assert stats["unconsumed_step_ids"] == {} and stats["materialized"] == 1 and stats["discarded"] == 0
        slot_states = stats["staging"]["slots"]
        assert slot_states["free"] == stats["staging"]["depth"], slot_states  # no page left consumed
        nxt, _ = save(m, [("a", [0, 1], 6, 7)])  # the pool is whole: a later save claims and consumes as usual
        m.discard_step(nxt)
    finally:
        _GatedId.gate.set()
        m.shutdown()
