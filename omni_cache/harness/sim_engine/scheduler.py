"""A vLLM-v1-style scheduler: token budget, chunked prefill, preemption, resume.

Owns: the waiting queue and the running list, and every request's status,
progress and block table. Per step (``schedule``):

1. aborts due this step end their requests (blocks freed; ``ABORTED`` is
   reported if the cache has seen the request);
2. running requests first, in order: each gets ``min(remaining, budget)``
   tokens (decode = 1, a long prefill is chunked); if its blocks do not fit,
   the last running request is preempted (blocks freed, progress reset, back
   to the front of the waiting queue) until they do;
3. if nothing was preempted, waiting requests in order: the allocator's hit
   (``find_hit``) is taken, the rest is scheduled within the budget, and the
   request is reported ``STARTED`` (first time) or ``RESUMED`` with that hit;
4. every scheduled request publishes its full blocks (``cache_full_blocks``),
   so a later request of the same step can hit them, as in vLLM v1
   (``publish="schedule"``); with ``publish="forward"`` blocks are published
   after the step's forward instead (vLLM v0's "computed blocks": no
   same-step hits).

``update_from_output`` advances progress, samples the next token of requests
whose known tokens are all computed (``truth.next_token``), and finishes the
ones that reached ``max_tokens`` (``FINISHED`` is reported at the next step,
before any new request of that step: the terminal-first order of spec/protocol.md).

Upholds nothing itself: it produces the inputs of I5 (hits are whole blocks and carry the
request's block table) and of I7/I9 (preemption frees blocks that other
tenants then reuse; aborted requests' blocks are freed while their rows are
still in flight).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from omni_cache.harness.sim_engine.allocator import BlockAllocator
from omni_cache.harness.sim_engine.request import RequestStatus, SimRequest
from omni_cache.harness.sim_engine.truth import next_token
from omni_cache.runtime.events import PrefixCacheEventKind

PUBLISH_MODES = ("schedule", "forward")


@dataclass(frozen=True)
class ScheduledChunk:
    """Positions ``[token_start, token_end)`` of ``req`` computed this step."""

    req: SimRequest
    token_start: int
    token_end: int
    hit: int | None
    """The hit of the STARTED/RESUMED this chunk follows (its first step), else None."""

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass
class SchedulerOutput:
    step: int
    terminal: list[tuple[SimRequest, PrefixCacheEventKind]] = field(default_factory=list)
    started: list[tuple[SimRequest, PrefixCacheEventKind, int]] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[SimRequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class SchedulerStats:
    preemptions: int = 0
    resumes: int = 0
    finished: int = 0
    aborted: int = 0
    aborted_unseen: int = 0
    chunked_prefills: int = 0
    same_step_hits: int = 0
    """Hits on blocks published earlier in the same step (computed by the same forward)."""
    prefill_tokens: int = 0
    decode_tokens: int = 0


class Scheduler:
    """FCFS scheduler over a ``BlockAllocator`` with a per-step token budget."""

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int = 64,
        vocab_size: int = 32000,
        publish: str = "schedule",
    ) -> None:
        if max_num_batched_tokens <= 0 or max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if publish not in PUBLISH_MODES:
            raise ValueError(f"publish must be one of {PUBLISH_MODES}, got {publish!r}")
        # "schedule": blocks are findable once scheduled (vLLM v1; same-step hits);
        # "forward": once their forward ran (vLLM v0 "computed" blocks).
        self.publish = publish
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.waiting: collections.deque[SimRequest] = collections.deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        # Terminal events not yet reported (finished at the last update, aborted).
        self._terminal: list[tuple[SimRequest, PrefixCacheEventKind]] = []
        self._published_now: set[int] = set()
        self.stats = SchedulerStats()
        self.on_abort: Callable[[SimRequest], None] | None = None
        """Called with every aborted request (the workload ends its conversation)."""

    # ---- requests ----------------------------------------------------------------
    def add_request(self, req: SimRequest) -> None:
        capacity = self.allocator.num_blocks * self.block_size
        if req.max_num_tokens > capacity:
            raise ValueError(
                f"request {req.req_id} may hold {req.max_num_tokens} tokens; the KV cache holds {capacity}"
            )
        if req.req_id in self.requests:
            raise ValueError(f"duplicate request id {req.req_id}")
        self.requests[req.req_id] = req
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: SimRequest) -> None:
        """End ``req`` now; reported ``ABORTED`` at this step if the cache saw it."""
        if req.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._free(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.ABORTED
        self.stats.aborted += 1
        if self.on_abort is not None:
            self.on_abort(req)
        if req.started:
            self._terminal.append((req, PrefixCacheEventKind.ABORTED))
        else:
            self.stats.aborted_unseen += 1

    def _free(self, req: SimRequest) -> None:
        self.allocator.free(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0

    def _preempt(self, req: SimRequest, out: SchedulerOutput) -> None:
        self._free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.pending_hit = None
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        self.stats.preemptions += 1

    @property
    def pending_terminal(self) -> bool:
        return bool(self._terminal)

    def take_terminal(self) -> list[tuple[SimRequest, PrefixCacheEventKind]]:
        """Terminal events not yet reported (the end of a run delivers them)."""
        out, self._terminal = self._terminal, []
        return out

    def _publish(self, req: SimRequest, num_tokens: int, *, now: str = "schedule") -> None:
        if now != self.publish:
            return
        before = req.num_cached_blocks
        req.num_cached_blocks = self.allocator.cache_full_blocks(
            req.block_ids, req.block_hashes, req.num_cached_blocks, num_tokens // self.block_size
        )
        self._published_now.update(req.block_ids[before:req.num_cached_blocks])

    # ---- one step -------------------------------------------------------------------
    def schedule(self, step: int) -> SchedulerOutput:
        out = SchedulerOutput(step)
        # Blocks published during this call: a hit on one is a same-step hit.
        self._published_now = set()
        for req in [r for r in (*self.running, *self.waiting) if r.abort_at_step is not None and r.abort_at_step <= step]:
            self.abort(req)
        out.terminal, self._terminal = self._terminal, []
        budget = self.max_num_batched_tokens

        # Running requests first (decodes and the rest of chunked prefills).
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = self.allocator.blocks_needed(len(req.block_ids), req.num_computed_tokens + n)
            scheduled = True
            while not self.allocator.can_allocate(need):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            req.block_ids.extend(self.allocator.allocate(need))
            self._publish(req, req.num_computed_tokens + n)
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, req.num_computed_tokens + n, None))
            budget -= n
            i += 1

        # Then waiting requests (preempted ones sit at the front), unless we preempted.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit_blocks = self.allocator.find_hit(req.block_hashes, req.num_tokens)
            hit = len(hit_blocks) * self.block_size
            n = min(req.num_tokens - hit, budget)
            need = self.allocator.blocks_needed(len(hit_blocks), hit + n)
            if not self.allocator.can_allocate(need, hit_blocks):
                break
            self.waiting.popleft()
            self.allocator.touch(hit_blocks)
            req.block_ids = [*hit_blocks, *self.allocator.allocate(need)]
            req.num_cached_blocks = len(hit_blocks)
            req.num_computed_tokens = hit
            self.allocator.stats.queries += req.num_tokens
            self.allocator.stats.hits += hit
            if self._published_now.intersection(hit_blocks):
                self.stats.same_step_hits += 1
            kind = PrefixCacheEventKind.RESUMED if req.started else PrefixCacheEventKind.STARTED
            if req.started:
                self.stats.resumes += 1
            req.started = True
            req.status = RequestStatus.RUNNING
            req.pending_hit = hit
            self.running.append(req)
            self._publish(req, hit + n)
            out.started.append((req, kind, hit))
            out.chunks.append(ScheduledChunk(req, hit, hit + n, hit))
            budget -= n
        return out

    def update_from_output(self, out: SchedulerOutput) -> list[SimRequest]:
        """Advance every scheduled request; returns those that finished."""
        finished: list[SimRequest] = []
        for chunk in out.chunks:
            req = chunk.req
            req.num_computed_tokens = chunk.token_end
            req.pending_hit = None
            self._publish(req, chunk.token_end, now="forward")
            if chunk.token_start < req.num_prompt_tokens:
                self.stats.prefill_tokens += min(chunk.token_end, req.num_prompt_tokens) - chunk.token_start
                self.stats.decode_tokens += max(0, chunk.token_end - req.num_prompt_tokens)
                if chunk.token_end < req.num_prompt_tokens:
                    self.stats.chunked_prefills += 1
            else:
                self.stats.decode_tokens += chunk.num_tokens
            if chunk.token_end < req.num_tokens:
                continue  # a prefill chunk: nothing sampled yet
            req.append_output(next_token(req.truth_hashes[chunk.token_end - 1], self.vocab_size))
            if len(req.output) >= req.max_tokens:
                self.running.remove(req)
                self._free(req)
                req.status = RequestStatus.FINISHED
                self.stats.finished += 1
                self._terminal.append((req, PrefixCacheEventKind.FINISHED))
                finished.append(req)
        return finished
