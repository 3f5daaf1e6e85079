"""A miniature vLLM v1 engine for the integration tests: scheduler and model runner.

Owns: ``FakeScheduler`` (full-block hash prefix caching with vLLM's semantics:
block 0 is the null block, blocks are published when allocated, hits capped at
``num_tokens - 1``, LRU reuse of freed blocks, preemption and resume, abort)
and ``FakeModelRunner`` (calls ``PrefixCacheRunnerHooks`` where vLLM's GPU
model runner would: ``begin_step`` before ``_update_states`` drops finished
requests, ``after_forward`` after the forward, with a ``BlockTableView`` over
its persistent ``InputBatch``). Its forward emits ``fakes_vllm.truth_rows``.

Used to check I4-I9 end to end through the hooks.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from fakes_vllm import (
    WIDTH,
    CachedRequestData,
    InputBatch,
    NewRequestData,
    OmniSchedulerOutput,
    SchedulerOutput,
    token_at,
    truth_codes,
    truth_rows,
)

# --------------------------------------------------------------------------- #
# A miniature prefix-caching scheduler (vLLM v1 semantics, one KV group)
# --------------------------------------------------------------------------- #


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    num_output: int = 0
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    was_preempted: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.num_output

    @property
    def all_token_ids(self) -> list[int]:
        return [token_at(self.prompt_token_ids, p) for p in range(self.num_tokens)]


class FakeScheduler:
    """Full-block hash prefix caching; block 0 is the null block; LRU eviction.

    Like vLLM, full blocks are published in the hash table when they are
    allocated (``cache_at_schedule=True``), a hit is capped at
    ``num_tokens - 1``, freed blocks keep their hash until they are reused, and
    a preempted request is rescheduled no earlier than the next step.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        cache_at_schedule: bool = True,
        report_aborts: bool = True,
    ) -> None:
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cache_at_schedule = cache_at_schedule
        self.report_aborts = report_aborts
        self.free_queue: collections.OrderedDict[int, None] = collections.OrderedDict(
            (b, None) for b in range(1, num_blocks)
        )
        self.ref_cnt = [0] * num_blocks
        self.block_hash: dict[int, tuple[int, ...]] = {}
        self.cached: dict[tuple[int, ...], int] = {}
        self.requests: dict[str, FakeRequest] = {}
        self.waiting: collections.deque[FakeRequest] = collections.deque()
        self.running: list[FakeRequest] = []
        self._finished: set[str] = set()
        self._aborted: set[str] = set()
        self.num_hit_tokens = 0

    # --- request API
    def add_request(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        req = FakeRequest(req_id, list(prompt), max_tokens)
        self.requests[req_id] = req
        self.waiting.append(req)

    def abort(self, req_id: str) -> None:
        req = self.requests.pop(req_id)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._free(req)
        self._finished.add(req_id)
        self._aborted.add(req_id)

    # --- KV blocks
    def _hash_key(self, req: FakeRequest, block_index: int) -> tuple[int, ...]:
        return tuple(req.all_token_ids[: (block_index + 1) * self.block_size])

    def _computed_blocks(self, req: FakeRequest) -> list[int]:
        blocks = []
        for i in range((req.num_tokens - 1) // self.block_size):
            block = self.cached.get(self._hash_key(req, i))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _cache_blocks(self, req: FakeRequest, num_tokens: int) -> None:
        for i in range(num_tokens // self.block_size):
            block = req.block_ids[i]
            if block in self.block_hash:
                continue
            key = self._hash_key(req, i)
            if key in self.cached:
                continue
            self.block_hash[block] = key
            self.cached[key] = block

    def _allocate(self, req: FakeRequest, computed: list[int], num_new: int) -> list[int] | None:
        need = -(-(req.num_computed_tokens + num_new) // self.block_size)
        num_new_blocks = need - len(req.block_ids) - len(computed)
        touched_free = sum(1 for b in computed if self.ref_cnt[b] == 0)
        if num_new_blocks > len(self.free_queue) - touched_free:
            return None
        for b in computed:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
        new_blocks = []
        for _ in range(max(0, num_new_blocks)):
            b, _ = self.free_queue.popitem(last=False)
            key = self.block_hash.pop(b, None)
            if key is not None and self.cached.get(key) == b:
                del self.cached[key]
            self.ref_cnt[b] = 1
            new_blocks.append(b)
        req.block_ids.extend(computed)
        req.block_ids.extend(new_blocks)
        if self.cache_at_schedule:
            self._cache_blocks(req, min(req.num_computed_tokens + num_new, req.num_tokens))
        return new_blocks

    def _free(self, req: FakeRequest) -> None:
        for b in reversed(req.block_ids):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
        req.block_ids = []

    # --- one step
    def schedule(self, *, preempt: Sequence[str] = ()) -> SchedulerOutput:
        for req_id in preempt:
            req = self.requests[req_id]
            self.running.remove(req)
            self._free(req)
            req.num_computed_tokens = 0
            req.was_preempted = True
            self.waiting.appendleft(req)
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData.make_empty()
        for req in list(self.running):
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            new_blocks = self._allocate(req, [], n)
            assert new_blocks is not None, "FakeScheduler: out of blocks for a running request"
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append((list(new_blocks),))
            cached.num_computed_tokens.append(req.num_computed_tokens)
            cached.num_output_tokens.append(req.num_output)
            cached.new_token_ids.append([])
            num_scheduled[req.request_id] = n
            budget -= n
        while self.waiting and budget > 0 and not preempt:
            req = self.waiting[0]
            computed = self._computed_blocks(req)
            req.num_computed_tokens = len(computed) * self.block_size
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self._allocate(req, computed, n) is None:
                req.num_computed_tokens = 0
                break
            self.num_hit_tokens += req.num_computed_tokens
            self.waiting.popleft()
            self.running.append(req)
            if req.was_preempted:
                cached.req_ids.append(req.request_id)
                cached.resumed_req_ids.add(req.request_id)
                cached.new_block_ids.append((list(req.block_ids),))
                cached.num_computed_tokens.append(req.num_computed_tokens)
                cached.num_output_tokens.append(req.num_output)
                cached.new_token_ids.append([])
                cached.all_token_ids[req.request_id] = req.all_token_ids
                req.was_preempted = False
            else:
                new_reqs.append(
                    NewRequestData(
                        req.request_id, list(req.prompt_token_ids), (list(req.block_ids),), req.num_computed_tokens
                    )
                )
            num_scheduled[req.request_id] = n
            budget -= n
        finished, aborted = self._finished, self._aborted
        self._finished, self._aborted = set(), set()
        common = dict(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
            preempted_req_ids=set(preempt),
        )
        so: SchedulerOutput
        if self.report_aborts:
            so = OmniSchedulerOutput(**common, aborted_req_ids=aborted)  # type: ignore[arg-type]
        else:
            so = SchedulerOutput(**common)  # type: ignore[arg-type]
        for req_id, n in num_scheduled.items():  # _update_after_schedule
            self.requests[req_id].num_computed_tokens += n
        return so

    def update_from_output(self, so: SchedulerOutput) -> None:
        for req_id in so.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if not self.cache_at_schedule:
                self._cache_blocks(req, req.num_computed_tokens)
            if req.num_computed_tokens >= req.num_tokens:
                req.num_output += 1
                if req.num_output >= req.max_tokens:
                    self.running.remove(req)
                    del self.requests[req_id]
                    self._free(req)
                    self._finished.add(req_id)


# --------------------------------------------------------------------------- #
# A model runner that calls the hooks where vLLM's GPU model runner would
# --------------------------------------------------------------------------- #


@dataclass
class _ReqState:
    prompt: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeModelRunner:
    """``execute_model(so)``: hooks.begin_step, _update_states, forward, hooks.after_forward.

    The forward writes ``truth_rows`` for every scheduled position, pads the
    batch to a multiple of ``pad_to`` with garbage rows, and (optionally) emits
    a per-token mm key and a leftover list.
    """

    def __init__(
        self,
        hooks: Any,
        *,
        block_size: int,
        max_num_reqs: int = 16,
        max_num_blocks_per_req: int = 64,
        pad_to: int = 8,
        mm_key: str | None = None,
        on_forward: Callable[[], None] | None = None,
    ) -> None:
        self.hooks = hooks
        self.block_size = block_size
        self.pad_to = pad_to
        self.mm_key = mm_key
        self.on_forward = on_forward
        self.requests: dict[str, _ReqState] = {}
        self.input_batch = InputBatch(
            max_num_reqs=max_num_reqs, max_num_blocks_per_req=max_num_blocks_per_req, block_size=block_size
        )

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            if req_id in self.input_batch.req_id_to_index:
                self.input_batch.remove_request(req_id)
        scheduled = set(so.num_scheduled_tokens)
        for req_id in list(self.input_batch.req_id_to_index):
            if req_id not in scheduled:  # preempted: keep the state, drop the row
                self.input_batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            assert new.prompt_token_ids is not None
            self.requests[new.req_id] = _ReqState(
                list(new.prompt_token_ids), list(new.block_ids[0]), new.num_computed_tokens
            )
            self.input_batch.add_request(new.req_id, new.num_computed_tokens, list(new.block_ids[0]))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            blocks = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed:
                state.block_ids = list(blocks[0]) if blocks else []
            elif blocks:
                state.block_ids.extend(blocks[0])
            idx = self.input_batch.req_id_to_index.get(req_id)
            if idx is None:
                self.input_batch.add_request(req_id, state.num_computed_tokens, state.block_ids)
            else:
                self.input_batch.num_computed_tokens_cpu[idx] = state.num_computed_tokens
                if blocks:
                    self.input_batch.block_table[0].append_row(list(blocks[0]), idx)
        self.input_batch.condense()

    def forward(self, so: SchedulerOutput) -> tuple[torch.Tensor, dict[str, Any], int, int]:
        rows = []
        codes = []
        for row, req_id in enumerate(self.input_batch.req_ids[: self.input_batch.num_reqs]):
            n = so.num_scheduled_tokens.get(req_id, 0)
            start = int(self.input_batch.num_computed_tokens_cpu[row])
            prompt = self.requests[req_id].prompt
            rows.append(truth_rows(prompt, start, start + n))
            codes.append(truth_codes(prompt, start, start + n))
        hidden = torch.cat(rows) if rows else torch.empty(0, WIDTH)
        unpadded = hidden.shape[0]
        padded = -(-unpadded // self.pad_to) * self.pad_to
        hidden = torch.cat([hidden, torch.full((padded - unpadded, WIDTH), -7.0)])
        mm: dict[str, Any] = {}
        if self.mm_key is not None:
            code_t = torch.cat(codes) if codes else torch.empty(0, 2, dtype=torch.int64)
            mm[self.mm_key] = torch.cat([code_t, torch.full((padded - unpadded, 2), -1, dtype=torch.int64)])
            mm["meta.batch_size"] = [int(self.input_batch.num_reqs)]
        return hidden, mm, unpadded, padded

    def execute_model(self, so: SchedulerOutput) -> Any:
        self.hooks.begin_step(so)
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return None
        hidden, mm, unpadded, padded = self.forward(so)
        if self.on_forward is not None:
            self.on_forward()
        from omni_cache.integration.block_table import BlockTableView

        view = BlockTableView.from_input_batch(self.input_batch, block_size=self.block_size)
        return self.hooks.after_forward(
            hidden, mm, view=view, num_tokens_unpadded=unpadded, num_tokens_padded=padded
        )
