"""Rules of the manager's stateful test that drive two rare states on purpose.

Owns ``RareStateRules``, mixed into tests/manager/test_manager_stateful.py's ``ManagerMachine``
(it uses the machine's manager, engine, expectations and helpers):

  rewrite_planned_blocks       an unconsumed step keeps its planned hit while new tenants
                               rewrite the hit's blocks (each consumed at once: staging keeps
                               room); with the invariant ``preserved_rows_bounded`` (after
                               every rule): the manager keeps at most one preserved row per
                               planned (KV slot, key) pin still alive (I7's bound)
  shutdown_with_a_waiting_save with a committer thread and every page held by an unconsumed
                               step, a save waits for a page and ``shutdown`` begins: the save
                               is refused with the contract error, nothing is left queued, the
                               unconsumed steps are reported (contract 4.6); the run goes on
                               with a fresh manager
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from reference_model import check_outputs, prefix_hashes, truth_rows

from omni_cache import OmniPrefixCacheUnmatchError, PrefixCacheWriteLayout
from omni_cache.runtime.errors import PHRASE_SHUT_DOWN
from omni_cache.verify.traces import validate_trace

BS = 4
CAPACITY = 16


class RareStateRules:
    """Rules and an invariant over ``ManagerMachine``'s state (see the module docstring)."""

    m: Any
    engine: Any
    cfg: Any
    expect: dict[int, Any]
    reading: dict[int, int]
    recorder: Any
    started_with: dict[str, bool]
    builder: Any
    MODE: str
    CHECK_WITH_TLC: bool
    TLC_VERDICTS: Any

    def _planned_hit_blocks(self) -> list[tuple[int, tuple[int, ...]]]:
        """(step id, hit blocks) of every unconsumed step's planned hit read."""
        return [(step_id, sp.hit_blocks) for step_id, exp in sorted(self.expect.items())
                for _, sp in sorted(exp.spans.items()) if sp.hit_blocks]

    @precondition(lambda self: self._can_save() and self._planned_hit_blocks())
    @rule(i=st.integers(0, 63), tenants=st.integers(2, 4))
    def rewrite_planned_blocks(self, i: int, tenants: int) -> None:
        """An unconsumed step keeps its planned hit while new tenants rewrite the hit's blocks, each
        consumed at once (staging keeps room: a legal engine). Every planned row stays readable
        (materialize of the kept step still serves it) and the manager keeps at most one preserved
        row per planned (KV slot, key) pin after every tenant (I7's bound)."""
        m = self.m
        assert m is not None
        candidates = self._planned_hit_blocks()
        _, blocks = candidates[i % len(candidates)]
        blocks = blocks[: CAPACITY // BS]  # one step computes them all
        for rid in self.engine.holders(blocks):  # they finish: their blocks go back to the free list
            self.engine.end(rid, aborted=False)
        for k in range(tenants):
            made = self._rule(lambda: self.engine.rewrite_blocks(blocks))
            if made is None:  # a block is still held (e.g. by the kept step's own request): no reuse
                return
            rid, exp = made
            assert exp is not None
            self._rule(lambda e=exp, r=rid: check_outputs(e, [r], m.materialize(e.step_id, [r])))
            self.engine.end(rid, aborted=False)
            self._check_preserved_bounded()
            event(f"rewrite: {min(k + 1, 3)}+ tenants rewrote an unconsumed step's planned blocks")

    def _check_preserved_bounded(self) -> None:
        """I7's bound: preserved rows <= the pins of every planned read still alive. The pins are
        summed before the manager is read, and the builder only drops plans meanwhile."""
        m = self.m
        assert m is not None
        pins = sum(e.pinned_rows for e in list(self.expect.values())) + sum(list(self.reading.values()))
        preserved = m.stats()["preserved_rows"]
        assert preserved <= pins, (
            f"{preserved} preserved rows for {pins} planned (KV slot, key) pins: rows must be kept only "
            "where a planned read still needs them, one version per pin (I7)")

    @precondition(lambda self: self.MODE != "eager" and self.m is not None
                  and len(self.expect) == self.cfg.staging_depth)
    @rule()
    def shutdown_with_a_waiting_save(self) -> None:
        """Contract 4.6 with a committer thread: every page holds an unconsumed step, a save waits
        for one, and ``shutdown`` begins. The waiting save is refused with the contract error, no
        write is left queued, and the unconsumed steps are reported; the run goes on with a fresh
        manager (this one's step ids are then another manager's)."""
        m = self.m
        assert m is not None
        self.builder.drain()  # the builder is idle: only this rule's threads touch the manager
        width = truth_rows(prefix_hashes([1]))["hidden"].shape[1]
        layout = PrefixCacheWriteLayout.packed([("probe", 0, 1)], torch.zeros(1, dtype=torch.int64))
        outcome: list[BaseException | int] = []

        def probe() -> None:
            try:
                outcome.append(m.save_outputs(torch.zeros(1, width, device=self.engine.device), {}, num_tokens_unpadded=1,
                                              num_tokens_padded=1, write_layout=layout))
            except BaseException as exc:
                outcome.append(exc)

        saver = threading.Thread(target=probe, daemon=True)
        saver.start()
        deadline = time.monotonic() + 20.0
        while m.staging._num_waiting == 0 and saver.is_alive():  # every page is held: it must wait
            assert time.monotonic() < deadline, "the save never waited for a staging page"
            time.sleep(0.001)
        assert saver.is_alive(), f"the save did not wait with every page held by an unconsumed step: {outcome}"
        unconsumed = m.shutdown()
        saver.join(20.0)
        assert not saver.is_alive(), "the waiting save was still running after shutdown returned"
        [result] = outcome
        assert isinstance(result, OmniPrefixCacheUnmatchError), f"a save was accepted during shutdown: {result}"
        assert PHRASE_SHUT_DOWN in str(result) and "before this save claimed a staging slot" in str(result), result
        assert set(unconsumed) == set(self.expect), (sorted(unconsumed), sorted(self.expect))
        stats = m.stats()
        assert stats["write_queue"] == 0, stats  # no write queued without a committer
        assert {w.state for w in m.book.live()} <= {"pending"}, m.book.describe_in_flight()  # open deferred only
        validate_trace(self.recorder, tlc=self.CHECK_WITH_TLC, verdicts=self.TLC_VERDICTS)
        event("shutdown: a save waiting for a staging page was refused")
        self._start(**self.started_with)  # a fresh engine too: the old one's requests die with it

    @invariant()
    def preserved_rows_bounded(self) -> None:
        if self.m is not None:
            self._check_preserved_bounded()
