"""Fault injection through ``omni_cache.runtime.faults.FaultHooks``: a refused save changes nothing.

Each test drives the reference engine (tests/reference_model.py), makes one save (or one
call) fail before anything is registered, and checks the contract:

  I2   a save that cannot claim a page raises the timeout error naming every
       unconsumed step id with the file:line where it was saved; the timed-out
       save changed nothing, so consuming one step frees a page for the retry;
  I4/I5/I10 and input validation: a save interrupted at its claim
       (``on_blocking`` raising) or failing on an uncopyable leftover is rolled
       back (no step id, the page freed, the hit kept for the retry), and every
       malformed input (a hit, a token count, a layout, hidden, a policy, a
       config, a save that breaks the schedule) raises before any state changes,
       after which the run goes on and verifies; a save for a request no event
       announced is kept, not refused.

The write-path faults (I8 sticky failure, I3, I11 committer death) are in test_faults.py.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cache_helpers import settle
from fault_helpers import BOUND_S, make
from reference_model import EMBEDS, Engine, check_outputs

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.errors import PHRASE_NOT_SAVED, PHRASE_SLOT_MAPPING, PHRASE_UNCONSUMED
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.manager import OmniPrefixCacheManager


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_save_without_a_free_page_times_out_naming_unconsumed_steps(eager: bool) -> None:
    m, eng = make(eager, FaultHooks(), depth=2, timeout_s=0.2)
    for i in range(3):
        eng.add_request(i, 1, [i], 0)
    s1, s2 = eng.step([(0, 5)]), eng.step([(0, 5)])
    assert s1 is not None and s2 is not None
    settle(m)
    t0 = time.perf_counter()
    with pytest.raises(OmniPrefixCacheStagingTimeoutError) as info:
        eng.step([(0, 5)])
    waited = time.perf_counter() - t0
    assert 0.19 <= waited < 0.2 + BOUND_S
    msg = str(info.value)
    assert PHRASE_UNCONSUMED in msg and "in-flight writes" in msg
    source = Path(__file__).parents[1] / "reference_model.py"
    lines = source.read_text().splitlines()
    for step in (s1, s2):
        found = re.search(rf"step {step.step_id} saved at (\S+):(\d+)", msg)
        assert found, f"step {step.step_id} is not named with file:line in: {msg}"
        assert Path(found.group(1)) == source and "save_outputs(" in lines[int(found.group(2)) - 1], found
    # The timed-out save changed nothing: consuming one step frees a page for the retry.
    check_outputs(s1, list(s1.spans), m.materialize(s1.step_id, list(s1.spans)))
    m.discard_step(s2.step_id)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_SAVED):
        m.discard_step(s2.step_id)
    m.shutdown()


class InterruptAt(FaultHooks):
    """An interrupt (KeyboardInterrupt) at the first blocking point whose description starts with ``what``."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.armed = False
        self.fired = 0

    def on_blocking(self, what: str) -> None:
        if self.armed and what.startswith(self.what):
            self.armed = False
            self.fired += 1
            raise KeyboardInterrupt(f"injected at: {what}")


def _hit_step_prepared(eng: Engine, m: OmniPrefixCacheManager) -> tuple[str, object]:
    """r0 computes two blocks and finishes; r1 arrives and hits them: its step is prepared, not saved."""
    r0 = eng.add_request(0, 2, [], 0)
    s0 = eng.step([(0, 8)])
    assert s0 is not None
    check_outputs(s0, [r0], m.materialize(s0.step_id, [r0]))
    eng.end(r0, aborted=False)
    r1 = eng.add_request(0, 2, [2, 2], 0)
    prepared = eng.prepare([(0, 9)])
    assert prepared is not None and prepared.sched[0][1] == 8  # an 8-token hit
    return r1, prepared


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
@pytest.mark.parametrize("fault", ["interrupt_at_claim", "leftover_not_copyable"])
def test_a_save_that_fails_before_registering_changes_nothing(eager: bool, fault: str) -> None:
    """A save that raises before its writes are registered is rolled back: no step id is
    issued, the page is given back, and the request's pending hit is kept for the retry."""
    hooks = InterruptAt("save claims a staging slot")
    m, eng = make(eager, hooks, deferred=True)
    r1, prepared = _hit_step_prepared(eng, m)
    before = m.stats()
    if fault == "interrupt_at_claim":
        hooks.armed = True
        with pytest.raises(KeyboardInterrupt):
            eng.save(prepared)
        assert hooks.fired == 1
    else:
        prepared.mm["mm.lock"] = [threading.Lock()]  # a leftover value that cannot be copied
        with pytest.raises(OmniPrefixCacheUnmatchError, match="cannot be copied faithfully") as info:
            eng.save(prepared)  # refused before the claim, chained to the copy's error
        assert isinstance(info.value.__cause__, TypeError), repr(info.value.__cause__)
        del prepared.mm["mm.lock"]
    settle(m)  # async: step 0's pool write may still read its page; it lands and frees the page
    deadline = time.monotonic() + BOUND_S
    while m.stats()["staging"]["slots"]["free"] < m.config.staging_depth:  # the unhold follows the landing
        assert time.monotonic() < deadline, f"a staging page was never given back: {m.stats()['staging']}"
        time.sleep(0.002)
    after = m.stats()
    assert after["saved"] == before["saved"] and after["unconsumed_step_ids"] == before["unconsumed_step_ids"]
    assert after["staging"]["slots"]["free"] == m.config.staging_depth, after["staging"]
    assert after["failed"] is None and after["preserved_rows"] == 0
    s1 = eng.save(prepared)  # the retry serves the hit: positions [0, 9) of r1
    assert s1.spans[r1].out_start == 0
    check_outputs(s1, [r1], m.materialize(s1.step_id, [r1]))
    eng.end_all()
    assert m.shutdown() == {}


# ---- malformed inputs: refused before anything changes; the cache stays usable ----------
def _layout(spans: list[tuple[str, int, int, int]], slots: list[int]) -> PrefixCacheWriteLayout:
    """(req, row_start, row_end, token_start) writes and explicit slots."""
    writes = tuple(PrefixCacheWrite(r, a, b, t, t + b - a) for r, a, b, t in spans)
    return PrefixCacheWriteLayout(writes, max((w.row_end for w in writes), default=0),
                                  torch.tensor(slots, dtype=torch.int64))


def _save(m: OmniPrefixCacheManager, layout: PrefixCacheWriteLayout, *, n: object = None, padded: object = None,
          hidden: object = "rows", mm: dict[str, object] | None = None) -> object:
    rows = layout.total_rows
    n = rows if n is None else n
    return m.save_outputs(torch.ones(max(rows, 1), 4) if hidden == "rows" else hidden, mm or {},
                          num_tokens_unpadded=n, num_tokens_padded=n if padded is None else padded,  # type: ignore[arg-type]
                          write_layout=layout)


def _started(rid: str, hit_start: int, hit_end: int, blocks: tuple[int, ...]) -> PrefixCacheRequestEvent:
    return PrefixCacheRequestEvent(rid, PrefixCacheEventKind.STARTED, hit_start, hit_end, (blocks,), 4)


BAD_INPUTS: dict[str, tuple[Callable[[OmniPrefixCacheManager], object], type[Exception], str]] = {
    "hit not starting at 0": (lambda m: m.new_step_starts([_started("x", 4, 8, (1, 2))]),
                              OmniPrefixCacheUnmatchError, "must start at position 0"),
    "hit ending before 0": (lambda m: m.new_step_starts([_started("x", 0, -4, ())]),
                            OmniPrefixCacheUnmatchError, "hit [0, -4): a prefix hit must not end before position 0"),
    "hit on a block id out of range": (lambda m: m.new_step_starts([_started("x", 0, 4, (999,))]),
                                       OmniPrefixCacheUnmatchError, "outside"),
    "STARTED for a live request": (lambda m: m.new_step_starts([_started("r0", 0, 0, ())]),
                                   OmniPrefixCacheUnmatchError, "still live"),
    "zero tokens": (lambda m: _save(m, _layout([], []), n=0), OmniPrefixCacheUnmatchError, "positive int"),
    "a bool token count": (lambda m: _save(m, _layout([("x", 0, 1, 0)], [60]), n=True),
                           OmniPrefixCacheUnmatchError, "positive int"),
    "padded below unpadded": (lambda m: _save(m, _layout([("x", 0, 2, 0)], [60, 61]), padded=1),
                              OmniPrefixCacheUnmatchError, "positive int"),
    "not a layout": (lambda m: m.save_outputs(torch.ones(1, 4), {}, num_tokens_unpadded=1, num_tokens_padded=1,
                                              write_layout=object()),  # type: ignore[arg-type]
                     TypeError, "PrefixCacheWriteLayout"),
    "slot mapping too short": (lambda m: _save(m, _layout([("x", 0, 2, 0)], [60])),
                               OmniPrefixCacheUnmatchError, PHRASE_SLOT_MAPPING),
    "slot out of range": (lambda m: _save(m, _layout([("x", 0, 1, 0)], [64])),
                          OmniPrefixCacheUnmatchError, "save_outputs: the slot mapping covers KV slots out of range"),
    "overlapping rows": (lambda m: _save(m, _layout([("x", 0, 2, 0), ("y", 1, 3, 0)], [60, 61, 62])),
                         OmniPrefixCacheUnmatchError, "overlaps another"),
    "a request twice": (lambda m: _save(m, _layout([("x", 0, 1, 0), ("x", 1, 2, 1)], [60, 61])),
                        OmniPrefixCacheUnmatchError, "repeats a request"),
    "hidden missing": (lambda m: _save(m, _layout([("x", 0, 1, 0)], [60]), hidden=None),
                       OmniPrefixCacheUnmatchError, "not a 2-D+ tensor"),
    "hidden too short": (lambda m: _save(m, _layout([("x", 0, 2, 0)], [60, 61]), hidden=torch.ones(1, 4)),
                         OmniPrefixCacheUnmatchError, "hidden_states has 1 rows"),
    "mm under the hidden key": (lambda m: _save(m, _layout([("x", 0, 1, 0)], [60]), mm={"hidden": torch.ones(1, 4)}),
                                OmniPrefixCacheUnmatchError, "reserved key"),
    "a policy change after saving": (lambda m: m.register_policy(ModelCachePolicy(needs_full_hidden_states=False)),
                                     OmniPrefixCacheUnmatchError, "register it before the first save"),
    "not a policy": (lambda m: m.register_policy("audio"), TypeError, "ModelCachePolicy"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_malformed_input_raises_and_changes_nothing(case: str) -> None:
    call, exc, phrase = BAD_INPUTS[case]
    m, eng = make(True, FaultHooks())
    r0 = eng.add_request(0, 1, [1, 1], 3)
    s0 = eng.step([(0, 4)])
    assert s0 is not None and r0 in s0.spans
    before = m.stats()
    with pytest.raises(exc, match=re.escape(phrase)):
        call(m)
    after = m.stats()
    for key in ("saved", "unconsumed_step_ids", "writes_written", "live_requests", "hits", "failed"):
        assert after[key] == before[key], (key, before[key], after[key])
    assert after["staging"]["slots"] == before["staging"]["slots"]
    check_outputs(s0, [r0], m.materialize(s0.step_id, [r0]))  # still usable: the run goes on
    s1 = eng.step([(0, 4)])
    assert s1 is not None
    check_outputs(s1, [r0], m.materialize(s1.step_id, [r0]))
    assert m.shutdown() == {}


def test_a_save_that_breaks_the_schedule_is_refused() -> None:
    """The rows of a request must match new_step_starts: its scheduled count, and its hit's end."""
    m, eng = make(True, FaultHooks())
    r0 = eng.add_request(0, 2, [], 0)
    s0 = eng.step([(0, 8)])
    assert s0 is not None
    m.new_step_starts(PrefixCacheStep((_started("y", 0, 8, tuple(eng.reqs[r0].blocks)),), {"y": 2}))
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_SLOT_MAPPING):
        _save(m, _layout([("y", 0, 3, 8)], [40, 41, 42]))  # scheduled 2 tokens, 3 rows
    with pytest.raises(OmniPrefixCacheUnmatchError, match="must continue the hit"):
        _save(m, _layout([("y", 0, 2, 0)], [40, 41]))  # the hit ends at 8; rows start at 0
    assert m.stats()["saved"] == 1 and set(m.stats()["unconsumed_step_ids"]) == {s0.step_id}


def test_manager_refuses_a_config_that_is_not_one() -> None:
    with pytest.raises(TypeError, match="PrefixCacheConfig"):
        OmniPrefixCacheManager({"num_blocks": 4})  # type: ignore[arg-type]


def test_rows_of_an_unannounced_request_still_land() -> None:
    """A save for a request no event announced is kept (not an error); its FINISHED lands its rows."""
    m, _ = make(True, FaultHooks(), deferred=True)
    rows = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    step = _save(m, _layout([("ghost", 0, 2, 0)], [8, 9]), mm={EMBEDS: rows[:, :3].clone()})
    out = m.materialize(step, ["ghost"])  # type: ignore[arg-type]
    assert torch.equal(out.mm_outputs[EMBEDS]["ghost"], rows[:, :3])
    assert m.stats()["deferred_open"] == 1
    m.new_step_starts([PrefixCacheRequestEvent("ghost", PrefixCacheEventKind.FINISHED)])
    assert m.stats()["deferred_open"] == 0 and m.stats()["writes_in_flight"] == 0
    m.shutdown()
