"""Two consumers racing for one step id: exactly one consumes it (I1), the other is refused.

``materialize`` takes the step's context before its consume; another ``materialize`` or
``discard_step`` of the same id in that window is refused ("already consumed or never saved":
another call is consuming it) and changes nothing, so no staging page is left consumed but
never released, no stale context is left for ``trim_step`` to accept, and the winner's read is
whole. The window is held open deterministically: the first call's staging consume waits on a
gate (the context is taken, the id not consumed yet). A call naming requests outside the step is
refused before it takes the context (under the same lock), so it never turns a valid consumer
away: its rival consumes the step. A consumer of
an id whose save has not returned yet finds the step's context in place the moment the id is
consumable (the context goes in before the staging save publishes the id).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from cache_helpers import manager, save, settle, wait_until

from omni_cache import ModelCachePolicy, OmniPrefixCacheUnmatchError, PrefixCacheWriteLayout
from omni_cache.runtime.errors import PHRASE_OUTSIDE_SNAPSHOT

JOIN_S = 30.0


class _Gate:
    """Makes the first staging consume of ``m`` wait until the test opens the gate."""

    def __init__(self, m: Any) -> None:
        self.entered, self.opened = threading.Event(), threading.Event()
        real = m.staging.consume

        def gated(*args: Any, **kwargs: Any) -> Any:
            if not self.entered.is_set():
                self.entered.set()
                assert self.opened.wait(JOIN_S), "the test never opened the gate"
            return real(*args, **kwargs)

        m.staging.consume = gated


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
@pytest.mark.parametrize("rival", ["discard_step", "materialize"])
def test_a_consumer_racing_a_materialize_is_refused_and_nothing_leaks(eager: bool, rival: str) -> None:
    m = manager(eager=eager)
    gate = _Gate(m)
    try:
        step_id, rows = save(m, [("a", [0, 1], 0, 6), ("b", [2, 3], 0, 5)])
        got: dict[str, Any] = {}

        def first() -> None:
            try:
                got["out"] = m.materialize(step_id, ["b", "a"])
            except BaseException as exc:  # the test asserts there was none
                got["error"] = exc

        reader = threading.Thread(target=first, daemon=True)
        reader.start()
        assert gate.entered.wait(JOIN_S), "materialize never reached its consume"
        with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed or never saved: another call is "
                                                               "consuming it; nothing was consumed"):
            m.discard_step(step_id) if rival == "discard_step" else m.materialize(step_id, ["a", "b"])
        with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed or never saved"):
            m.trim_step(step_id, {"a": 1, "b": 1})  # no verdict on rows being read
        gate.opened.set()
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
        gate.opened.set()
        m.shutdown()


class _SlowId(str):
    """A request id that is none of the step's; its first comparison lets the rival start, then
    waits until the rival's materialize is over (the window in which the rival, before, was
    turned away: the refused call held the step while it compared)."""

    comparing = threading.Event()
    rival_done = threading.Event()

    def __eq__(self, other: object) -> bool:
        if not _SlowId.comparing.is_set():
            _SlowId.comparing.set()
            _SlowId.rival_done.wait(JOIN_S)
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_a_materialize_naming_other_requests_never_turns_a_valid_consumer_away() -> None:
    """I1: a call refused for naming a request outside the step changes nothing, and a valid
    consumer racing it consumes the step (before: the refused call held the step while it
    compared the ids, and the valid consumer was told the id was being consumed)."""
    _SlowId.comparing.clear()
    _SlowId.rival_done.clear()
    m = manager()
    try:
        step_id, rows = save(m, [("a", [0, 1], 0, 6)])
        refused: list[BaseException] = []

        def wrong() -> None:
            try:
                m.materialize(step_id, [_SlowId("z")])
            except BaseException as exc:
                refused.append(exc)

        caller = threading.Thread(target=wrong, daemon=True)
        caller.start()
        assert _SlowId.comparing.wait(JOIN_S), "materialize never compared the request ids"
        try:
            assert m.materialize(step_id, ["a"]).hidden_states["a"].equal(rows)
        finally:
            _SlowId.rival_done.set()
        caller.join(JOIN_S)
        assert len(refused) == 1 and isinstance(refused[0], OmniPrefixCacheUnmatchError)
        assert PHRASE_OUTSIDE_SNAPSHOT in str(refused[0])
        assert m.shutdown() == {}  # consumed exactly once
    finally:
        m.shutdown()


@pytest.mark.parametrize("rival", ["discard_step", "materialize"])
def test_a_consumer_of_an_id_still_being_saved_never_consumes_it_without_its_context(rival: str) -> None:
    """A step id is consumable only once its context is in place: a consumer on another thread that
    guesses the id of the step being saved, the moment the staging pool makes it consumable, consumes
    it whole, never hits a missing context, and no staging page is left consumed."""
    m = manager()
    staging_save = m.staging.save
    seen: dict[str, Any] = {}

    def consume(step_id: int) -> None:
        try:
            seen["out"] = m.discard_step(step_id) if rival == "discard_step" else m.materialize(step_id, ["a"])
        except BaseException as exc:  # the test asserts there was none
            seen["error"] = exc

    def save_then_consume(slot: Any, step_id: int, saved_at: str) -> None:
        staging_save(slot, step_id, saved_at)  # the id is consumable from here on
        seen["thread"] = rival_thread = threading.Thread(target=consume, args=(step_id,), daemon=True)
        rival_thread.start()  # the save goes on once the rival consumed the id (or ended)
        wait_until(lambda: step_id not in m.staging.unconsumed() or not rival_thread.is_alive(),
                   "the rival consumed the step id")

    m.staging.save = save_then_consume  # type: ignore[method-assign]
    try:
        step_id, rows = save(m, [("a", [0, 1], 0, 6)])
    finally:
        m.staging.save = staging_save  # type: ignore[method-assign]
    seen["thread"].join(JOIN_S)
    assert not seen["thread"].is_alive() and "error" not in seen, repr(seen.get("error"))
    if rival == "materialize":
        assert seen["out"].hidden_states["a"].equal(rows)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed or never saved"):
        m.materialize(step_id, ["a"])  # the engine's own consume comes second: refused, nothing leaks
    settle(m)
    stats = m.stats()
    assert stats["unconsumed_step_ids"] == {}
    assert stats["staging"]["slots"]["free"] == stats["staging"]["depth"], stats["staging"]


@pytest.mark.parametrize("first", ["materialize", "discard"])
def test_a_finished_consume_leaves_no_claim_on_the_id(first: str) -> None:
    """Once a consume is over, the id is simply consumed: a later consumer is refused by the staging
    pool's one-consume check (which lists the unconsumed ids), never as "another call is consuming
    it", and the consumption keeps no record of it."""
    m = manager()
    m.new_step_starts([])
    step, _ = save(m, [("a", [0], 0, 2)])
    m.materialize(step, ["a"]) if first == "materialize" else m.discard_step(step)
    for again in (lambda: m.materialize(step, ["a"]), lambda: m.discard_step(step)):
        with pytest.raises(OmniPrefixCacheUnmatchError, match="unconsumed step ids") as info:
            again()
        assert "another call is consuming it" not in str(info.value)
    assert m.shutdown() == {}


@pytest.mark.parametrize("rival", ["discard_step", "materialize"])
def test_a_consumer_refused_before_the_id_is_published_gives_the_context_back(rival: str) -> None:
    """A consumer that guesses the id of the step being saved after its context is in place but
    before the staging pool publishes the id is refused ("never saved") and gives the context back,
    so the step's own consumer, once the save returns, gets every row."""
    m = manager()
    staging_save = m.staging.save
    refused: list[str] = []

    def consume_then_save(slot: Any, step_id: int, saved_at: str) -> None:
        with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed or never saved") as info:
            m.discard_step(step_id) if rival == "discard_step" else m.materialize(step_id, ["a"])
        refused.append(str(info.value))
        staging_save(slot, step_id, saved_at)

    m.staging.save = consume_then_save  # type: ignore[method-assign]
    try:
        step_id, rows = save(m, [("a", [0, 1], 0, 6)])
    finally:
        m.staging.save = staging_save  # type: ignore[method-assign]
    assert refused
    assert m.materialize(step_id, ["a"]).hidden_states["a"].equal(rows)
    assert m.shutdown() == {}


def test_a_save_that_fails_before_publishing_its_id_leaves_no_context_behind() -> None:
    """A save refused by the staging pool's publish (its id never handed out) takes its context with it:
    a verdict for that id, guessed, is refused as never saved and vacates nothing. A save with no
    per-token key registers no write, so the manager stays usable after it."""
    m = manager()
    m.register_policy(ModelCachePolicy(needs_full_hidden_states=False))
    m.new_step_starts([])
    staging_save = m.staging.save
    ids: list[int] = []

    def refuse(slot: Any, step_id: int, saved_at: str) -> None:
        ids.append(step_id)
        raise RuntimeError("the publish failed")

    m.staging.save = refuse  # type: ignore[method-assign]
    layout = PrefixCacheWriteLayout.packed([("a", 0, 4)], torch.arange(4))
    with pytest.raises(RuntimeError, match="the publish failed"):
        m.save_outputs(None, {}, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)
    m.staging.save = staging_save  # type: ignore[method-assign]
    assert m.stats()["failed"] is None and ids
    with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed or never saved"):
        m.trim_step(ids[0], {"a": 1})
    assert m.stats()["trimmed_rows"] == 0 and m.shutdown() == {}
