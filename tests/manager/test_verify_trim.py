"""I14, accepted rows only: a verify step's rows of rejected draft tokens never leave the cache.

Protects ``OmniPrefixCacheManager.trim_step`` (contract section 4.14): after a verify step's
verdict, materialize returns per request only the rows it keeps (after its hit prefix), the cut
rows' KV slots are vacated (a hit there raises "is not readable", never the rejected rows), and
the request's later write of those slots wins for every later hit. A refused verdict changes
nothing. Rows are ``cache_helpers.truth`` values: a rejected draft's row has another tag, so a
served rejected row shows up as a wrong value.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch
from cache_helpers import MODES, finished, manager, settle, slots, started, truth

import omni_cache.runtime.consumption as consumption_module
import omni_cache.runtime.manager as manager_module
from omni_cache import ModelCachePolicy, PrefixCacheEventKind, PrefixCacheRequestEvent, PrefixCacheWriteLayout
from omni_cache.runtime.errors import (
    PHRASE_NOT_READABLE,
    PHRASE_NOT_SAVED,
    PHRASE_OUTSIDE_SNAPSHOT,
    PHRASE_TRIM,
    OmniPrefixCacheUnmatchError,
)
from omni_cache.runtime.manager import OmniPrefixCacheManager

A_BLOCKS = (0, 1, 2)
EMBEDS = "mm.embeds"


def _save(m: OmniPrefixCacheManager, parts: Sequence[tuple[str, Sequence[int], int, int, torch.Tensor]],
          *, deferred: bool = False) -> int:
    """One step of ``(req, blocks, start, end, rows)``; with ``deferred`` an mm key (the rows
    negated) rides the deferred write path too."""
    hidden = torch.cat([rows for *_, rows in parts])
    layout = PrefixCacheWriteLayout.packed([(r, s, e) for r, _, s, e, _ in parts],
                                           torch.cat([slots(b, s, e) for _, b, s, e, _ in parts]))
    mm = {EMBEDS: -hidden} if deferred else {}
    n = hidden.shape[0]
    return m.save_outputs(hidden, mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)


def _extended(req: str) -> PrefixCacheRequestEvent:
    return PrefixCacheRequestEvent(req, PrefixCacheEventKind.EXTENDED)


def _verify_step(m: OmniPrefixCacheManager, *, deferred: bool = False) -> int:
    """A's prompt [0, 7), then a verify step over [7, 12): position 7 is A's sampled token, 8 an
    accepted draft, 9..11 rejected drafts (rows of another token sequence: tag "draft")."""
    m.new_step_starts([started("A")])
    m.materialize(_save(m, [("A", A_BLOCKS, 0, 7, truth("A", range(7)))], deferred=deferred), ["A"])
    m.new_step_starts([_extended("A")])
    rows = torch.cat([truth("A", range(7, 9)), truth("draft", range(9, 12))])
    return _save(m, [("A", A_BLOCKS, 7, 12, rows)], deferred=deferred)


@pytest.mark.parametrize("eager", MODES)
def test_I14_rejected_rows_are_never_materialized_nor_read_by_a_later_hit(eager: bool) -> None:
    m = manager(eager)
    step = _verify_step(m)
    m.trim_step(step, {"A": 2})  # the verdict: positions 7, 8 are A's
    out = m.materialize(step, ["A"])
    assert torch.equal(out.hidden_states["A"], truth("A", range(7, 9)))  # the rejected rows are gone
    assert m.stats()["trimmed_rows"] == 3
    settle(m)
    # An engine that hits block 2 before A rewrote it (vLLM never does: the block holds draft
    # positions, so it is not hashed) gets "is not readable", never the rejected rows.
    m.new_step_starts([started("B", 12, A_BLOCKS)])
    early = _save(m, [("B", (*A_BLOCKS, 3), 12, 13, truth("B", range(12, 13)))])
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_READABLE):
        m.materialize(early, ["B"])
    # A hit on the blocks of kept positions only is served.
    m.new_step_starts([finished("B"), started("C", 8, A_BLOCKS[:2])])
    ok = _save(m, [("C", (*A_BLOCKS[:2], 4), 8, 9, truth("C", range(8, 9)))])
    assert torch.equal(m.materialize(ok, ["C"]).hidden_states["C"][:8], truth("A", range(8)))
    # A's next step computes positions 9..11 again, with its accepted tokens: that write wins.
    m.new_step_starts([finished("C"), _extended("A")])
    m.materialize(_save(m, [("A", A_BLOCKS, 9, 12, truth("A", range(9, 12)))]), ["A"])
    settle(m)
    m.new_step_starts([started("D", 12, A_BLOCKS)])
    late = _save(m, [("D", (*A_BLOCKS, 5), 12, 13, truth("D", range(12, 13)))])
    assert torch.equal(m.materialize(late, ["D"]).hidden_states["D"][:12], truth("A", range(12)))
    assert m.shutdown() == {}


@pytest.mark.parametrize("eager", MODES)
def test_I14_a_deferred_write_of_the_rejected_rows_never_lands_over_the_rewrite(eager: bool) -> None:
    """Both steps carry a deferred key: the verify step's deferred write (rejected rows included)
    is still pending when A rewrites the slots, and lands at A's finish with the rewrite's."""
    m = manager(eager)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({EMBEDS})))
    step = _verify_step(m, deferred=True)
    m.trim_step(step, {"A": 2})
    out = m.materialize(step, ["A"])
    assert torch.equal(out.mm_outputs[EMBEDS]["A"], -truth("A", range(7, 9)))
    m.new_step_starts([_extended("A")])
    m.materialize(_save(m, [("A", A_BLOCKS, 9, 12, truth("A", range(9, 12)))], deferred=True), ["A"])
    m.new_step_starts([finished("A")])  # both deferred writes land now
    settle(m)
    m.new_step_starts([started("D", 12, A_BLOCKS)])
    late = _save(m, [("D", (*A_BLOCKS, 5), 12, 13, truth("D", range(12, 13)))], deferred=True)
    out = m.materialize(late, ["D"])
    assert torch.equal(out.hidden_states["D"][:12], truth("A", range(12)))
    assert torch.equal(out.mm_outputs[EMBEDS]["D"][:12], -truth("A", range(12)))
    assert m.shutdown() == {}


def test_I14_a_trimmed_first_step_after_a_hit_keeps_the_hit_prefix() -> None:
    """vLLM pads a new request whose prompt is cached but for one token to a verify step (placeholder
    drafts): its first step serves the hit, then its kept rows."""
    m = manager()
    m.new_step_starts([started("A")])
    m.materialize(_save(m, [("A", (0, 1), 0, 8, truth("A", range(8)))]), ["A"])
    m.new_step_starts([finished("A"), started("B", 8, (0, 1))])
    rows = torch.cat([truth("A", range(8, 9)), truth("pad", range(9, 12))])  # B's prompt is A's + one token
    step = _save(m, [("B", (0, 1, 2), 8, 12, rows)])
    m.trim_step(step, {"B": 1})
    assert torch.equal(m.materialize(step, ["B"]).hidden_states["B"], truth("A", range(9)))
    assert m.shutdown() == {}


@pytest.mark.parametrize("order", [("A", "B", "C"), ("C", "A", "B")], ids=["row-order", "other-order"])
def test_I14_requests_the_verdict_does_not_name_keep_every_row_and_row_order_holds(order: tuple[str, ...]) -> None:
    m = manager()
    m.new_step_starts([started("A"), started("B"), started("C")])
    parts = [("A", (0,), 0, 3, truth("A", range(3))), ("B", (1,), 0, 4, truth("B", range(4))),
             ("C", (2,), 0, 2, truth("C", range(2)))]
    step = _save(m, parts)
    m.trim_step(step, {"A": 1, "C": 2})  # C keeps all: a no-op for it
    out = m.materialize(step, list(order))
    assert torch.equal(out.hidden_states["A"], truth("A", range(1)))
    assert torch.equal(out.hidden_states["B"], truth("B", range(4)))
    assert torch.equal(out.hidden_states["C"], truth("C", range(2)))
    assert m.stats()["trimmed_rows"] == 2
    assert m.shutdown() == {}


@pytest.mark.parametrize("verdict, phrase", [
    ({"Z": 1}, PHRASE_OUTSIDE_SNAPSHOT),
    ({"A": 6}, PHRASE_TRIM),
    ({"A": -1}, PHRASE_TRIM),
    ({"A": 1.0}, "must be an int"),
    ({"A": True}, "must be an int"),
    ([("A", 1)], "mapping"),
])
def test_I14_a_refused_verdict_changes_nothing(verdict: object, phrase: str) -> None:
    m = manager()
    step = _verify_step(m)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=phrase):
        m.trim_step(step, verdict)  # type: ignore[arg-type]
    assert m.stats()["trimmed_rows"] == 0
    out = m.materialize(step, ["A"])
    assert torch.equal(out.hidden_states["A"], torch.cat([truth("A", range(7, 9)), truth("draft", range(9, 12))]))
    assert m.shutdown() == {}


def test_I14_a_verdict_comes_before_the_step_is_consumed() -> None:
    m = manager()
    step = _verify_step(m)
    m.discard_step(step)
    for bad in (step, step + 1000, True):
        with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED):
            m.trim_step(bad, {"A": 1})  # type: ignore[arg-type]
    assert m.stats()["trimmed_rows"] == 0
    assert m.shutdown() == {}


def test_I14_a_verdict_racing_the_steps_materialize_is_refused_and_changes_nothing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A verdict that arrives while the step is being consumed (here: right after the staging
    page's consume, before the rows are read) is refused: the read returns every row of the step
    and no KV slot is vacated."""
    m = manager()
    step = _verify_step(m)
    real = m.staging.consume
    refused: list[str] = []

    def consume_then_verdict(*args: object, **kwargs: object) -> object:
        slot = real(*args, **kwargs)
        with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED) as info:
            m.trim_step(step, {"A": 1})
        refused.append(str(info.value))
        return slot

    monkeypatch.setattr(m.staging, "consume", consume_then_verdict)
    out = m.materialize(step, ["A"])
    assert refused and m.stats()["trimmed_rows"] == 0
    assert torch.equal(out.hidden_states["A"], torch.cat([truth("A", range(7, 9)), truth("draft", range(9, 12))]))
    assert m.shutdown() == {}


def test_I14_a_bool_is_no_step_id_even_where_step_1_is_this_managers(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``True == 1``: a verdict for ``True`` must not trim step 1, nor a consume of ``True`` take it."""
    m = manager()
    m.new_step_starts([started("A")])
    m.materialize(_save(m, [("A", A_BLOCKS, 0, 7, truth("A", range(7)))]), ["A"])
    m.new_step_starts([_extended("A")])
    monkeypatch.setattr(manager_module, "_STEP_IDS", itertools.count(1))  # this manager's next id is 1
    rows = torch.cat([truth("A", range(7, 9)), truth("draft", range(9, 12))])
    step = _save(m, [("A", A_BLOCKS, 7, 12, rows)])
    assert step == 1
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED):
        m.trim_step(True, {"A": 1})  # type: ignore[arg-type]
    for consume in (lambda: m.materialize(True, ["A"]), lambda: m.discard_step(True)):  # type: ignore[arg-type]
        with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED):
            consume()
    assert m.stats()["trimmed_rows"] == 0
    assert torch.equal(m.materialize(step, ["A"]).hidden_states["A"], rows)
    assert m.shutdown() == {}


def test_I14_a_verdict_while_a_consumer_holds_the_step_is_refused() -> None:
    """A consumer has taken the step (its outputs are being built) when the verdict comes: the
    verdict is refused, the consumer gets every row, and no KV slot is vacated."""
    m = manager()
    step = _verify_step(m)
    reader = m.consumption.reader
    real = reader.build_outputs
    refusals: list[str] = []

    def verdict_meanwhile(*args: object, **kwargs: object) -> object:
        with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED) as refused:
            m.trim_step(step, {"A": 1})
        refusals.append(str(refused.value))
        return real(*args, **kwargs)

    reader.build_outputs = verdict_meanwhile  # type: ignore[method-assign]
    served = m.materialize(step, ["A"]).hidden_states["A"]
    assert refusals and "a verdict must come before the step id is handed on" in refusals[0]
    assert m.stats()["trimmed_rows"] == 0
    assert torch.equal(served, torch.cat([truth("A", range(7, 9)), truth("draft", range(9, 12))]))
    assert m.shutdown() == {}


def test_I14_a_verdict_never_undoes_a_stricter_one_that_landed_while_it_was_worked_out(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A second verdict (keep 1) lands while the first (keep 3) is worked out from the untrimmed
    rows: the first is worked out again from what the second kept, and is refused (it would add
    rows back), so the stricter cut stands (before: the first landed over it and served rows whose
    KV slots were already vacated as rejected)."""
    import threading

    m = manager()
    step = _verify_step(m)
    real = consumption_module.trim_rows
    racer: list[threading.Thread] = []

    def second_verdict_meanwhile(*args: object, **kwargs: object) -> object:
        if not racer:
            racer.append(threading.Thread(target=m.trim_step, args=(step, {"A": 1})))
            racer[0].start()
            racer[0].join(30)
            assert not racer[0].is_alive(), "the second verdict waited on the first (a cut worked out under the lock)"
        return real(*args, **kwargs)

    monkeypatch.setattr(consumption_module, "trim_rows", second_verdict_meanwhile)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=f"request 'A' {PHRASE_TRIM} to 3 rows: the step saved 1"):
        m.trim_step(step, {"A": 3})
    assert torch.equal(m.materialize(step, ["A"]).hidden_states["A"], truth("A", range(7, 8)))
    assert m.stats()["trimmed_rows"] == 4  # the second verdict's cut, and nothing after it
    assert m.shutdown() == {}


def test_I11_the_callers_keys_and_counts_run_outside_the_state_lock() -> None:
    """A verdict's counts and a materialize's request ids are the caller's objects: their code
    (``__index__``, ``==``, hashing) runs outside the manager's non-reentrant state lock, so one that
    calls back into the manager finishes instead of deadlocking."""
    import threading

    m = manager()
    step = _verify_step(m)

    class CallsBack:
        def __index__(self) -> int:
            m.stats()
            return 2

    class IdCallsBack(str):
        def __eq__(self, other: object) -> bool:
            m.stats()
            return str.__eq__(self, other)

        __hash__ = str.__hash__

    done: list[torch.Tensor] = []

    def verdict_then_read() -> None:
        m.trim_step(step, {"A": CallsBack()})
        done.append(m.materialize(step, [IdCallsBack("A")]).hidden_states["A"])

    worker = threading.Thread(target=verdict_then_read, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "a caller's object that calls back into the manager deadlocked it"
    assert done and torch.equal(done[0], truth("A", range(7, 9)))
    assert m.shutdown() == {}
