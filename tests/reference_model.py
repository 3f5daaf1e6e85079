"""A plain-Python reference engine for the manager tests: ``Engine``, one scheduler step at a time.

Owns: ``Engine``, which drives a real ``OmniPrefixCacheManager`` one scheduler step at a time
(the request lifecycle, waiting -> running <-> preempted -> ended, over tests/reference_truth.py's
``BlockAllocator`` and ground truth) and returns a ``StepExpect``: what every later ``materialize``
of that step must return (``check_outputs``). A step may omit one per-token key (``omit``): a KV
slot has one tenant for all keys, so a later hit that needs a key the slot's tenant did not write
must raise "is not readable" (I6/I7; ``Engine.slot_keys`` tracks each slot's tenant's keys).

Request identity (I12, I13): every request is an admission with its own
``PrefixCacheRequestOwner``; ``reuse_id`` gives a finished or a live request's
id to a new admission (a live one is REPLACED; a stale terminal of the old owner
may follow), and every step carries a ``sequence`` so ``replay_last_step`` can
send it again, which must change nothing; ``start_and_abort`` begins an admission and
aborts it in one step. ``deliver`` is how a step reaches the manager: ``new_step_starts``
itself, or tests/adapter_transport.py's scheduler outputs through the adapter.

``Engine(..., device=...)`` builds every tensor it hands the manager (each step's rows, padding
and leftovers) on that device, CPU by default; what a materialize must return stays on the CPU
(the cache serves host rows). The stateful machines pass tests/cache_helpers.py's
``machine_device()``, so ``OMNI_CACHE_TEST_DEVICE=cuda`` runs them with CUDA tensors.

Re-exports tests/reference_truth.py's names, so the tests import the whole reference from here.
Used by tests/manager/test_manager_stateful.py (Hypothesis), tests/manager/test_soak.py
(threads) and tests/manager/test_faults.py, test_faults_rollback.py (fault injection).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from cache_helpers import slot_of
from reference_truth import (
    CODES,
    EMBEDS,
    GRID,
    INFO,
    LEFTOVER_KEYS,
    LENS,
    META,
    PER_TOKEN_KEYS,
    BlockAllocator,
    E,
    Prepared,
    Req,
    Span,
    StepExpect,
    check_outputs,
    on_host,
    prefix_hashes,
    truth_rows,
)

from omni_cache import (
    HIDDEN_KEY,
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.events import PrefixCacheRequestOwner

__all__ = ["CODES", "EMBEDS", "GRID", "INFO", "LEFTOVER_KEYS", "LENS", "META", "PER_TOKEN_KEYS", "BlockAllocator",
           "E", "Engine", "Prepared", "Req", "Span", "StepExpect", "check_outputs", "prefix_hashes", "truth_rows"]


class Engine:
    """A random engine's bookkeeping around a real manager (engine thread only)."""

    def __init__(self, manager: Any, config: PrefixCacheConfig, policy: ModelCachePolicy,
                 *, pass_hidden_when_opted_out: bool = True, mru: bool = False,
                 device: str | torch.device = "cpu") -> None:
        self.m = manager
        self.device = torch.device(device)  # where the step tensors handed to the manager live
        self.cfg = config
        self.bs = config.block_size
        self.policy = policy
        self.pass_hidden = policy.needs_full_hidden_states or pass_hidden_when_opted_out
        manager.register_policy(policy)
        self.alloc = BlockAllocator(config.num_blocks, self.bs, mru=mru)
        self.reqs: dict[str, Req] = {}  # every request ever (expectations keep references)
        self.active: dict[str, Req] = {}  # the ones not ended (scans stay short in long runs)
        self.terminal: list[PrefixCacheRequestEvent] = []
        self.written = bytearray(config.num_slots)  # slots any save has written (I6 bookkeeping)
        # slot -> the keys its tenant (the last save that wrote it) carried; a hit needing another is absent (I7)
        self.slot_keys: list[frozenset[str]] = [frozenset()] * config.num_slots
        self.ever_keys: list[frozenset[str]] = [frozenset()] * config.num_slots  # any tenant's keys, ever
        self.n_reqs = 0
        self.n_admissions = 0
        self.controls: list[PrefixCacheRequestEvent] = []  # REPLACED controls for the next step (I12)
        # rid -> how its REPLACED control is built when held until the new admission's first schedule:
        # "held_complete" (the control carries that step's lookup) or "held_default" (built with the
        # default lookup_complete=True, a miss: only the adapter, whose new request carries the hit).
        self.held: dict[str, str] = {}
        self.bursts: list[PrefixCacheRequestEvent] = []  # sent with the next step, in this order
        self.deliver = manager.new_step_starts  # how a step reaches the manager (tests/adapter_transport.py)
        self.late: list[PrefixCacheRequestEvent] = []  # stale terminals, sent once the new admission runs
        self.admitted: dict[str, PrefixCacheRequestOwner | None] = {}  # the manager's live ids, per I12
        self.sequence = 0  # of the last step sent (I13)
        self.last_step: PrefixCacheStep | None = None
        g = prefix_hashes(range(64))
        self.bases = [[(g[i * 7 + j] >> 5) % 5 for j in range(4 * self.bs)] for i in range(3)]

    # ---- requests -----------------------------------------------------------
    def add_request(self, base: int, shared_blocks: int, extra: Sequence[int], decode: int,
                    rid: str | None = None) -> str:
        if rid is None:
            rid = f"r{self.n_reqs}"
            self.n_reqs += 1
        self.n_admissions += 1
        prompt = self.bases[base % 3][: shared_blocks * self.bs] + list(extra)
        if not prompt:
            prompt = [base % 5]
        tokens = list(prompt)
        for _ in range(decode):  # greedy: the next token is a function of the prefix
            tokens.append(prefix_hashes(tokens)[-1] % 5)
        hashes = prefix_hashes(tokens)
        self.reqs[rid] = self.active[rid] = Req(rid, tokens, len(prompt), hashes, truth_rows(hashes),
                                                owner=PrefixCacheRequestOwner(self.n_admissions))
        return rid

    def reuse_id(self, live: bool, i: int, arrival: tuple[int, int, Sequence[int], int],
                 stale_terminal: bool, control: str = "pending") -> str | None:
        """A new admission takes an existing request id (I12).

        ``live``: the id of a request that has not ended; it is REPLACED (a control
        with the new owner, lookup pending, goes out with the next step -- or, for
        ``control`` "held_complete"/"held_default", with the new admission's first
        scheduled step) and its admission ends without a terminal event. Otherwise the id of an ended one;
        ``stale_terminal`` then re-sends the old admission's terminal with its old
        owner, which must not end the new admission.
        """
        pool = [r for r, q in self.active.items()] if live else \
            [r for r, q in self.reqs.items() if q.state == "ended" and r not in self._unsent()]
        if not pool:
            return None
        rid = pool[i % len(pool)]
        old = self.reqs[rid]
        if live:
            self._end_for_reuse(rid)
        self.add_request(*arrival, rid=rid)
        new = self.reqs[rid]
        if live and control != "pending":
            self.held[rid] = control
        elif live:
            self.controls.append(PrefixCacheRequestEvent(rid, E.REPLACED, owner=new.owner, lookup_complete=False))
        elif stale_terminal:  # arrives after the new admission started: it must not end it
            self.late.append(PrefixCacheRequestEvent(rid, E.FINISHED, owner=old.owner))
        return rid

    def _unsent(self) -> set[str]:
        """Ids an unsent start-and-abort admitted: a scheduler output holds one admission of an id
        per step, so none is admitted again before the step goes out."""
        return {e.req_id for e in self.bursts}

    def _end_for_reuse(self, rid: str) -> None:
        """The live admission of ``rid`` ends so that a new owner can take the id: its held control
        goes out, its blocks go back to the allocator."""
        old = self.reqs[rid]
        self._release_held(rid)
        if old.state == "running":
            self.alloc.release(old.blocks)
        old.blocks, old.state = [], "ended"
        self.active.pop(rid, None)

    def _release_held(self, rid: str) -> None:
        """A held control goes out with the next step after all (its admission ends or is replaced
        before its first schedule)."""
        if self.held.pop(rid, None) is not None:
            self.controls.append(PrefixCacheRequestEvent(rid, E.REPLACED, owner=self.reqs[rid].owner,
                                                         lookup_complete=False))

    def start_and_abort(self, arrival: tuple[int, int, Sequence[int], int], replace: bool, i: int,
                        terminal_first: bool, lookup_complete: bool) -> str | None:
        """A new admission begins and is aborted in one step, before any token of it is scheduled
        (I12: each event applies to the admission it names, whatever its position in the step).

        ``replace``: a live request's id is REPLACED by the new owner (the old admission ends by
        the control) and the new owner is ABORTED; else a new request is STARTED (with the hit
        the allocator would give it) and ABORTED. Either way nothing of it stays live.
        """
        if replace:
            pool = [r for r in self.active if r not in self._unsent()]
            if not pool:
                return None
            rid = pool[i % len(pool)]
            self._end_for_reuse(rid)
            self.add_request(*arrival, rid=rid)
            q = self.reqs[rid]
            first = PrefixCacheRequestEvent(rid, E.REPLACED, owner=q.owner, lookup_complete=lookup_complete)
        else:
            rid = self.add_request(*arrival)
            q = self.reqs[rid]
            hit = self.alloc.match(self.block_hashes(q, min(q.prompt_len, len(q.tokens) - 1) // self.bs * self.bs))
            first = PrefixCacheRequestEvent(rid, E.STARTED, 0, len(hit) * self.bs, (tuple(hit),) if hit else (),
                                            owner=q.owner)
        q.state = "ended"
        self.active.pop(rid, None)
        abort = PrefixCacheRequestEvent(rid, E.ABORTED, owner=q.owner)
        self.bursts.extend([abort, first] if terminal_first else [first, abort])
        return rid

    def send(self, events: Sequence[PrefixCacheRequestEvent], counts: dict[str, int]) -> None:
        """``new_step_starts`` of one step, numbered (I13)."""
        step = PrefixCacheStep(tuple(events), counts, self.sequence + 1)
        self.deliver(step)
        self.sequence, self.last_step = step.sequence, step  # only once applied
        self._track_admissions(step.events)

    def _track_admissions(self, events: Sequence[PrefixCacheRequestEvent]) -> None:
        """The live ids the manager must hold after ``events`` (I12: each event applies to the
        admission it names -- terminal events first, except those of an owner another event of
        the step carries, which end it after them; an event older than a terminal of its id in
        the step belongs to an admission that ended before that one)."""
        live = self.admitted
        terminal = (E.FINISHED, E.ABORTED)
        named = {(e.req_id, e.owner) for e in events if e.kind not in terminal and e.owner is not None}
        newest_end: dict[str, PrefixCacheRequestOwner] = {}  # a terminal of a newer owner ends older ones
        for e in events:
            if e.kind in terminal and e.owner is not None and not (e.req_id in newest_end
                                                                   and e.owner < newest_end[e.req_id]):
                newest_end[e.req_id] = e.owner

        def end(e: PrefixCacheRequestEvent) -> None:
            cur = live.get(e.req_id)
            if not (e.owner is not None and cur is not None and e.owner < cur):
                live.pop(e.req_id, None)

        later = [e for e in events if e.kind in terminal and e.owner is not None and (e.req_id, e.owner) in named]
        for e in events:
            if e.kind in terminal and e not in later:
                end(e)
        for e in events:
            if e.kind in (E.FINISHED, E.ABORTED):
                continue
            cur = live.get(e.req_id)
            if e.req_id in live and e.owner is not None and cur is not None and e.owner < cur:
                continue
            if e.owner is not None and e.req_id in newest_end and e.owner < newest_end[e.req_id]:
                continue  # its admission ended before the step's newer owner of the id did
            if e.kind in (E.REPLACED, E.STARTED) or e.req_id not in live:
                live[e.req_id] = e.owner
        for e in later:
            end(e)

    def replay_last_step(self) -> bool:
        """Send the last step again (same sequence): the manager must change nothing (I13)."""
        if self.last_step is None:
            return False
        self.deliver(self.last_step)
        return True

    def live(self, *states: str) -> list[str]:
        return [r for r, q in self.active.items() if q.state in states]

    def finish_done(self) -> int:
        """Finish every running request that has computed all its tokens."""
        done = [r for r, q in self.active.items() if q.state == "running" and q.left == 0]
        for rid in done:
            self.end(rid, aborted=False)
        return len(done)

    def end(self, rid: str, *, aborted: bool) -> None:
        q = self.reqs[rid]
        if q.state == "ended":
            return
        self._release_held(rid)
        if q.state == "running":
            self.alloc.release(q.blocks)
        q.blocks = []
        q.state = "ended"
        self.active.pop(rid, None)
        self.terminal.append(PrefixCacheRequestEvent(rid, E.ABORTED if aborted else E.FINISHED, owner=q.owner))

    def preempt(self, rid: str) -> None:
        q = self.reqs[rid]
        assert q.state == "running"
        self.alloc.release(q.blocks)
        q.blocks, q.computed, q.state = [], 0, "preempted"

    def block_hashes(self, q: Req, upto: int) -> list[int]:
        return [q.hashes[(k + 1) * self.bs - 1] for k in range(upto // self.bs)]

    # ---- one scheduler step -------------------------------------------------
    def schedule(self, picks: Sequence[tuple[int, int]]) -> list[tuple[Req, int, int, Any]]:
        """Choose requests and token counts; allocate blocks. Returns (req, start, n, event)."""
        cands = [q for q in self.active.values() if q.left > 0]
        budget = self.cfg.staging_capacity_tokens
        out: list[tuple[Req, int, int, Any]] = []
        chosen: set[str] = set()
        for idx, size in picks:
            if not cands or budget <= 0:
                break
            q = cands[idx % len(cands)]
            if q.rid in chosen:
                continue
            hit_blocks: list[int] = []
            start = q.computed
            if q.state != "running":
                seen = q.prompt_len if q.state == "waiting" else q.progress
                limit = min(seen, len(q.tokens) - 1) // self.bs
                hit_blocks = self.alloc.match(self.block_hashes(q, limit * self.bs))
                start = len(hit_blocks) * self.bs
            n = min(size, len(q.tokens) - start, budget) if start < q.prompt_len else 1
            n = min(n, q.prompt_len - start) if start < q.prompt_len else n
            have = len(hit_blocks) if q.state != "running" else len(q.blocks)
            need = max(0, math.ceil((start + n) / self.bs) - have)
            if self.alloc.available(hit_blocks) < need:
                continue
            chosen.add(q.rid)
            budget -= n
            if q.state == "running":
                q.blocks += self.alloc.allocate(need)
                event = PrefixCacheRequestEvent(q.rid, E.EXTENDED, scheduled_tokens=n, owner=q.owner)
            else:
                self.alloc.touch(hit_blocks)
                q.blocks = hit_blocks + self.alloc.allocate(need)
                kind = E.RESUMED if q.started else E.STARTED
                event = PrefixCacheRequestEvent(q.rid, kind, 0, start, (tuple(q.blocks),), n, owner=q.owner)
                q.started, q.state, q.computed = True, "running", start
            # vLLM caches a block's hash when it is allocated for the tokens that fill it, so a
            # request scheduled later in this very step may already hit it.
            for k in range(start // self.bs, (start + n) // self.bs):
                self.alloc.publish(q.blocks[k], q.hashes[(k + 1) * self.bs - 1])
            out.append((q, start, n, event))
        return out

    def slot_of(self, q: Req, pos: int) -> int:
        return slot_of(q.blocks, pos, self.bs)

    def step(self, picks: Sequence[tuple[int, int]], *, pad: int = 0, leftover: bool = False,
             padded_mm: bool = False, order: int = 0, forced: Any = None, omit: int = 0) -> StepExpect | None:
        """new_step_starts + forward + save_outputs. None when nothing was scheduled."""
        prepared = self.prepare(picks, pad=pad, leftover=leftover, padded_mm=padded_mm, order=order,
                                forced=forced, omit=omit)
        return None if prepared is None else self.save(prepared)

    def prepare(self, picks: Sequence[tuple[int, int]], *, pad: int = 0, leftover: bool = False,
                padded_mm: bool = False, order: int = 0, forced: Any = None, omit: int = 0,
                computed: dict[str, dict[str, torch.Tensor]] | None = None) -> Prepared | None:
        """Schedule, tell the manager (new_step_starts) and run the 'forward' of one step.

        ``omit`` 1 or 2 leaves ``PER_TOKEN_KEYS[omit - 1]`` out of this step's mm outputs, 3 leaves
        every per-token mm key out (with hidden opted out, a step that writes no key at all: its
        slots' tenant still changes, so a later hit on them is absent). ``computed`` gives the
        rows the forward computes for a request instead of its ground truth (a verify step's
        rejected drafts: tests/manager_verify_rules.py).
        """
        late = [e for e in self.late if self.reqs[e.req_id].started]  # before this step schedules
        self.late = [e for e in self.late if e not in late]
        sched = forced if forced is not None else self.schedule(picks)
        for q, _, _, e in sched:  # a held control goes out with its admission's first scheduled step
            mode = self.held.pop(q.rid, None) if e.kind is E.STARTED else None
            if mode == "held_complete":
                self.controls.append(PrefixCacheRequestEvent(q.rid, E.REPLACED, 0, e.hit_end, e.block_ids,
                                                             owner=e.owner))
            elif mode is not None:  # "held_default": built with the defaults, a complete miss
                self.controls.append(PrefixCacheRequestEvent(q.rid, E.REPLACED, owner=e.owner))
        events = [*self.controls, *self.terminal, *late, *self.bursts, *(e for *_, e in sched)]
        self.terminal, self.controls, self.bursts = [], [], []
        counts = {q.rid: n for q, _, n, _ in sched}
        if not sched:
            if events:
                self.send(events, {})
            return None
        self.send(events, counts)
        if order:  # batch order need not be arrival order
            sched = sched[order % len(sched):] + sched[: order % len(sched)]
        spans = [(q.rid, s, s + n) for q, s, n, _ in sched]
        slots = torch.tensor([self.slot_of(q, p) for q, s, n, _ in sched for p in range(s, s + n)],
                             dtype=torch.int64)
        total = len(slots)
        padded = total + pad
        computed = computed or {}
        dev = self.device
        live = {k: torch.cat([computed.get(q.rid, q.rows)[k][s:s + n] for q, s, n, _ in sched]).to(dev)
                for k in (HIDDEN_KEY, *PER_TOKEN_KEYS)}
        junk = {k: torch.full((pad, *v.shape[1:]), -99, dtype=v.dtype, device=dev) for k, v in live.items()}
        hidden = torch.cat([live[HIDDEN_KEY], junk[HIDDEN_KEY]])
        keys = () if omit == 3 else tuple(k for i, k in enumerate(PER_TOKEN_KEYS) if i != omit - 1)
        mm: dict[str, Any] = {k: torch.cat([live[k], junk[k]]) if padded_mm else live[k]
                              for k in keys}
        if leftover:
            mm[META] = [total, "meta", [pad]]
            mm[LENS] = torch.tensor([n for *_, n, _ in sched], dtype=torch.int64, device=dev)
            mm[GRID] = torch.arange(2 * (padded + 1), dtype=torch.float32, device=dev).reshape(padded + 1, 2)
            mm[INFO] = {"rows": torch.tensor([total, padded], device=dev), "ids": tuple(q.rid for q, *_ in sched)}
        layout = PrefixCacheWriteLayout.packed(spans, slots)
        if order % 2:  # the writes' order is free; rows are what count
            layout = PrefixCacheWriteLayout(tuple(reversed(layout.writes)), layout.total_rows, layout.slots_cpu)
        return Prepared(sched, hidden, mm, total, padded, layout, keys)

    def save(self, p: Prepared) -> StepExpect:
        """save_outputs of a prepared step; the engine's bookkeeping moves only if it succeeds."""
        left = {k: on_host(p.mm[k]) for k in LEFTOVER_KEYS if k in p.mm}
        step_id = self.m.save_outputs(p.hidden if self.pass_hidden else None, p.mm,
                                      num_tokens_unpadded=p.total, num_tokens_padded=p.padded,
                                      write_layout=p.layout)
        # The next forward reuses the live buffers: a snapshot must not see this (I4).
        p.hidden.fill_(-5)
        for value in p.mm.values():
            if isinstance(value, torch.Tensor):
                value.fill_(-5)
            elif isinstance(value, dict):
                value["rows"].fill_(-5)
                value["junk"] = True
            else:
                value.append("junk")
        exp = StepExpect(step_id, {}, left, self.policy.needs_full_hidden_states,
                         where=", ".join(f"{q.rid}[{s},{s + n})" for q, s, n, _ in p.sched), keys=p.keys)
        # The keys this step writes: the tenant's keys of every slot it writes (one tenant for all keys).
        tenant_keys = frozenset(p.keys) | ({HIDDEN_KEY} if self.policy.needs_full_hidden_states else set())
        for q, s, n, event in p.sched:
            hit = event.kind in (E.STARTED, E.RESUMED) and event.hit_end > 0
            hit_blocks = tuple(event.group0_block_ids[: event.hit_end // self.bs]) if hit else ()
            exp.spans[q.rid] = Span(q, 0 if hit else s, s + n, s, event.kind == E.RESUMED, hit_blocks)
            exp.pinned_rows += len(hit_blocks) * self.bs * len(tenant_keys)
            q.computed = s + n
            q.progress = max(q.progress, q.computed)
            for pos in range(s, s + n):
                self.written[self.slot_of(q, pos)] = 1
                self.slot_keys[self.slot_of(q, pos)] = tenant_keys
                self.ever_keys[self.slot_of(q, pos)] |= tenant_keys
        # A hit is planned after this step's writes are registered: it needs every key this step
        # carries at every hit slot, from that slot's tenant (I6/I7).
        absent = {q.rid for q, s, _, event in p.sched if event.kind in (E.STARTED, E.RESUMED) and event.hit_end > 0
                  and any(not tenant_keys <= self.slot_keys[self.slot_of(q, pos)] for pos in range(s))}
        exp.not_readable = frozenset(q.rid for q, *_ in p.sched if q.diverged) | absent
        # Of those, hits whose missing key an older tenant of the slot did write (what a stale read would serve).
        exp.stale_absent = frozenset(
            q.rid for q, s, *_ in p.sched if q.rid in absent
            and any((tenant_keys - self.slot_keys[self.slot_of(q, pos)]) & self.ever_keys[self.slot_of(q, pos)]
                    for pos in range(s)))
        return exp

    # ---- a hit the cache cannot serve (the KV cache and the omni cache diverged) ----
    def unwritten_free_block(self) -> int | None:
        for b in self.alloc.free:
            if not all(self.written[b * self.bs:(b + 1) * self.bs]):
                return b
        return None

    def diverged_step(self, n: int) -> StepExpect | None:
        """STARTED with a hit on a block no write ever filled: materialize must raise (I6)."""
        b = self.unwritten_free_block()
        need = math.ceil((self.bs + n) / self.bs) - 1
        if b is None or self.alloc.available([b]) < need + 1:
            return None
        rid = self.add_request(0, 0, [1] * (self.bs + n), 0)
        q = self.reqs[rid]
        self.alloc.take(b)
        q.blocks = [b, *self.alloc.allocate(need)]
        q.started, q.state, q.computed, q.diverged = True, "running", self.bs, True
        event = PrefixCacheRequestEvent(rid, E.STARTED, 0, self.bs, (tuple(q.blocks),), n)
        exp = self.step([], forced=[(q, self.bs, n, event)])
        self.end(rid, aborted=True)
        return exp

    # ---- new tenants of chosen blocks (I7's bound on preserved rows) ----------
    def rewrite_blocks(self, blocks: Sequence[int]) -> tuple[str, StepExpect | None] | None:
        """A new request takes exactly ``blocks`` (all free: their cached hashes are evicted) and one
        step computes every position of them: a new tenant of each of their KV slots. Returns the
        request id and the step's expectation; None when a block is still held."""
        if any(self.alloc.ref[b] for b in blocks):
            return None
        n = len(blocks) * self.bs
        rid = self.add_request(0, 0, [(7 * self.n_reqs + k) % 5 for k in range(n)], 0)
        q = self.reqs[rid]
        for b in blocks:
            self.alloc.take(b)
        q.blocks = list(blocks)
        q.started, q.state, q.computed = True, "running", 0
        for k, b in enumerate(blocks):  # their new hashes, as a normal step publishes them
            self.alloc.publish(b, q.hashes[(k + 1) * self.bs - 1])
        event = PrefixCacheRequestEvent(rid, E.STARTED, 0, 0, (tuple(blocks),), n, owner=q.owner)
        return rid, self.step([], forced=[(q, 0, n, event)])

    def holders(self, blocks: Sequence[int]) -> list[str]:
        """The live requests whose block tables hold any of ``blocks``."""
        wanted = set(blocks)
        return [r for r, q in self.active.items() if wanted & set(q.blocks)]

    def end_all(self) -> None:
        """Terminate every request and tell the manager (the end of a run)."""
        for rid in list(self.active):
            self.end(rid, aborted=False)
        if self.terminal or self.controls or self.late or self.bursts:
            self.send([*self.controls, *self.terminal, *self.late, *self.bursts], {})
            self.terminal, self.controls, self.late, self.bursts = [], [], [], []

