"""Rules of the manager's stateful test that run verify steps of speculative decoding (I14).

Owns ``VerifyStepRules``, mixed into tests/manager/test_manager_stateful.py's ``ManagerMachine`` (it
uses the machine's manager, reference engine, expectations and helpers):

  verify_step          decoding requests are scheduled with ``k`` draft tokens each, ``a`` of
                       them accepted: the "forward" computes the request's ground-truth rows
                       for its sampled token and the accepted drafts, and rows of another token
                       sequence for the rejected drafts (and drafts past the request's end);
                       blocks are hashed only up to the request's known tokens, as vLLM does;
                       ``trim_step`` gives the verdict before the step id is handed on. The
                       expectation holds the kept rows only; the cut slots are vacant until the
                       request's next step rewrites them (the newer write wins, I7)
  hit_before_rewrite   a decoding request with a readable prefix runs a verify step whose
                       drafts fill the rest of a block, all rejected; then an engine that
                       misbehaves hits that block before the request rewrote it (vLLM never
                       does: the block holds draft positions, so it is not hashed):
                       materialize raises "is not readable", never the rejected rows
  bad_verdict          a verdict naming a request outside the step, keeping more rows than the
                       step saved, or coming after the step was consumed: the documented phrase,
                       and nothing changes (the step still verifies whole later)

A served rejected row shows up as a wrong value: the reference's rows are a function of the
request's tokens, and a rejected draft's token is one no request has (``DRAFT_TOKEN``).
"""

from __future__ import annotations

import math
from typing import Any

import hypothesis.strategies as st
from hypothesis import event
from hypothesis.stateful import Bundle, precondition, rule
from reference_model import PER_TOKEN_KEYS, E, Req, StepExpect, check_outputs, prefix_hashes, truth_rows
from thread_helpers import expect_error

from omni_cache import HIDDEN_KEY, PrefixCacheRequestEvent
from omni_cache.runtime.errors import PHRASE_NOT_SAVED, PHRASE_OUTSIDE_SNAPSHOT, PHRASE_TRIM

BS = 4
CAPACITY = 16
DRAFT_TOKEN = 7  # the reference's tokens are 0..4: a draft of this token is always rejected

PENDING = Bundle("pending")  # the machine's bundle of saved, unconsumed step ids (same name, same bundle)
# (candidate index, draft tokens k, accepted a) per scheduled request.
VERIFY_PICKS = st.lists(st.tuples(st.integers(0, 31), st.integers(1, 4), st.integers(0, 4)), min_size=1, max_size=3)


class VerifyStepRules:
    """Verify-step rules over ``ManagerMachine``'s state (see the module docstring)."""

    engine: Any
    m: Any
    cfg: Any
    expect: dict[int, StepExpect]

    def _verify_cut(self) -> dict[str, set[int]]:
        """rid -> positions a verdict cut that the request has not rewritten yet (its blocks hold
        them: a running request that was not preempted since)."""
        engine, cut = getattr(self, "_cut", (None, {}))
        if engine is not self.engine:  # a fresh manager and engine (a rule restarted them)
            cut = {}
        self._cut = (self.engine, cut)
        for rid in list(cut):
            q = self.engine.reqs[rid]
            if q.state != "running":
                del cut[rid]
                continue
            cut[rid] = {p for p in cut[rid] if p >= q.computed}
        return cut

    @precondition(lambda self: self._can_save())  # type: ignore[attr-defined]
    @rule(target=PENDING, picks=VERIFY_PICKS, order=st.integers(0, 3))
    def verify_step(self, picks: list[tuple[int, int, int]], order: int) -> object:
        return self._saved(self._rule(lambda: self._verify(picks, order)))  # type: ignore[attr-defined]

    def _verify(self, picks: list[tuple[int, int, int]], order: int) -> StepExpect | None:
        eng = self.engine
        cands = [q for q in eng.active.values()
                 if q.state == "running" and q.prompt_len <= q.computed < len(q.tokens)]
        if not cands:
            return None
        budget, chosen = CAPACITY, set()
        sched: list[tuple[Req, int, int, PrefixCacheRequestEvent]] = []
        keep: dict[str, int] = {}
        computed: dict[str, dict[str, Any]] = {}
        progress: dict[str, int] = {}
        for idx, k, a in picks:
            q = cands[idx % len(cands)]
            start, n = q.computed, 1 + k
            need = max(0, math.ceil((start + n) / BS) - len(q.blocks))
            if q.rid in chosen or n > budget or eng.alloc.available() < need:
                continue
            chosen.add(q.rid)
            budget -= n
            q.blocks += eng.alloc.allocate(need)  # the drafts' slots too (vLLM's lookahead)
            keep[q.rid] = 1 + min(a, k, len(q.tokens) - start - 1)
            # vLLM caches blocks only up to the request's token count: its sampled token at start.
            for b in range(start // BS, (start + 1) // BS):
                eng.alloc.publish(q.blocks[b], q.hashes[(b + 1) * BS - 1])
            tokens = q.tokens[: start + keep[q.rid]] + [DRAFT_TOKEN] * (n - keep[q.rid])
            computed[q.rid] = truth_rows(prefix_hashes(tokens))
            progress[q.rid] = q.progress
            sched.append((q, start, n, PrefixCacheRequestEvent(q.rid, E.EXTENDED, scheduled_tokens=n,
                                                               owner=q.owner)))
        if not sched:
            return None
        exp = eng.save(eng.prepare([], forced=sched, order=order, computed=computed))
        self.m.trim_step(exp.step_id, keep)  # the verdict, before the step id is handed on
        cut = self._verify_cut()
        for q, start, n, _ in sched:
            kept = keep[q.rid]
            exp.spans[q.rid].out_end = start + kept
            q.computed = start + kept
            q.progress = max(progress[q.rid], q.computed)
            for pos in range(start + kept, start + n):  # vacated: a hit there is absent
                eng.slot_keys[eng.slot_of(q, pos)] = frozenset()
            cut.setdefault(q.rid, set()).update(range(start + kept, start + n))
            event(f"verify: {'all accepted' if kept == n else 'none accepted' if kept == 1 else 'some accepted'}")
        return exp

    @precondition(lambda self: self._can_save())  # type: ignore[attr-defined]
    @rule(target=PENDING, i=st.integers(0, 63))
    def hit_before_rewrite(self, i: int) -> object:
        return self._saved(self._rule(lambda: self._early_hit(i)))  # type: ignore[attr-defined]

    def _readable_prefix(self, q: Req, end: int, vacant: set[int]) -> bool:
        """Every slot of positions ``[0, end)`` holds a row of every key a hit needs, but ``vacant``."""
        eng = self.engine
        needs = frozenset(eng.policy.get_hit_keys((HIDDEN_KEY, *PER_TOKEN_KEYS)))
        return all(p in vacant or (eng.written[eng.slot_of(q, p)] and needs <= eng.slot_keys[eng.slot_of(q, p)])
                   for p in range(end))

    def _early_hit(self, i: int) -> StepExpect | None:
        """A decoding request whose prefix is readable runs a verify step whose drafts fill the
        rest of a block and are all rejected (materialized at once); then another request hits
        the request's prefix through that block. Every slot of the hit holds a row of every key
        it needs but the vacated ones: only the vacate makes the hit unreadable (without it the
        rejected rows would be served)."""
        eng = self.engine
        cands = [q for q in eng.active.values()
                 if q.state == "running" and q.prompt_len <= q.computed < len(q.tokens)]
        options = [q for q in cands if self._readable_prefix(q, q.computed, set())]
        if not options or eng.alloc.available() < 3:
            return None
        q = options[i % len(options)]
        c = q.computed
        k = BS - 1 - c % BS or BS  # the drafts reach the end of a block after position c
        exp = self._verify([(cands.index(q), k, 0)], 0)
        if exp is None:
            return None
        check_outputs(exp, [q.rid], self.m.materialize(exp.step_id, [q.rid]))
        vacant = self._verify_cut().get(q.rid, set())
        hit_end = (c + k + 1) // BS * BS
        assert vacant and self._readable_prefix(q, hit_end, vacant), (c, k, sorted(vacant))
        prompt = [*q.tokens[:hit_end], 1]
        rid = eng.add_request(0, 0, prompt + [1] * (hit_end + 1 - len(prompt)), 0)
        early = eng.reqs[rid]
        eng.alloc.touch(q.blocks[: hit_end // BS])
        early.blocks = [*q.blocks[: hit_end // BS], *eng.alloc.allocate(1)]
        early.started, early.state, early.computed, early.diverged = True, "running", hit_end, True
        ev = PrefixCacheRequestEvent(rid, E.STARTED, 0, hit_end, (tuple(early.blocks),), 1, owner=early.owner)
        out = eng.step([], forced=[(early, hit_end, 1, ev)])
        eng.end(rid, aborted=True)
        event("verify: a hit on a vacated slot before the rewrite")
        return out

    @rule(step_id=PENDING, kind=st.sampled_from(["outside", "too_many", "consumed"]))
    def bad_verdict(self, step_id: int, kind: str) -> None:
        exp = self.expect.get(step_id)
        if exp is None:  # handed on already, or saved by a manager shut down since
            return
        m = self.m
        rid = sorted(exp.spans)[0]
        if kind == "outside":
            call, phrase = (lambda: m.trim_step(step_id, {"ghost": 0})), PHRASE_OUTSIDE_SNAPSHOT
        elif kind == "too_many":
            span = exp.spans[rid]
            rows = span.out_end - span.start
            call, phrase = (lambda: m.trim_step(step_id, {rid: rows + 1})), PHRASE_TRIM
        else:
            call, phrase = (lambda: m.trim_step(-step_id, {rid: 0})), PHRASE_NOT_SAVED
        self._rule(lambda: expect_error(phrase, call))  # type: ignore[attr-defined]

