"""The reference engine's ground truth and its parts: rows, blocks, requests, expectations.

Owns: the ground truth of every per-token row (``truth_rows``: a rolling hash of
the request's token ids up to and including the position, encoded into a few
exact float/int columns), the keys a step carries (``PER_TOKEN_KEYS`` and the
leftover ``LEFTOVER_KEYS``), a tiny prefix-caching block allocator
(``BlockAllocator``: hashes over full blocks, LRU free queue, eviction on
reuse), a request's and a step's bookkeeping (``Req``: waiting -> running <->
preempted -> ended; ``Span``; ``Prepared``: a step after ``new_step_starts`` and
the forward, before ``save_outputs``), and what every later ``materialize`` of a
step must return (``StepExpect``, checked by ``check_outputs``: exactly the
ground truth rows, or a raise for a request in ``not_readable``). The expected
output never depends on the cache: a row is a function of the request's tokens,
so a wrong tenant (I7), a missing prefix (I6), a wrong position or a torn page
(I3, I4) shows up as a wrong value.

tests/reference_model.py's ``Engine`` drives a real manager with these (and
re-exports them: its importers name them from there).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache import HIDDEN_KEY, PrefixCacheEventKind, PrefixCacheWriteLayout, StageCacheOutputs
from omni_cache.runtime.events import PrefixCacheRequestOwner

E = PrefixCacheEventKind
CODES = "mm.codes"  # per-token int64 (immediate unless the policy defers it)
EMBEDS = "mm.embeds"  # per-token float32 (deferred in most policies)
META = "mm.meta"  # leftover: a Python list
LENS = "mm.lens"  # leftover: a 1-D tensor
GRID = "mm.grid"  # leftover: a 2-D tensor that is not token-major
INFO = "mm.info"  # leftover: a dict holding a tensor and a tuple
LEFTOVER_KEYS = (META, LENS, GRID, INFO)
PER_TOKEN_KEYS = (CODES, EMBEDS)
MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK
    return x ^ (x >> 31)


def prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """h[p] depends on tokens[0..p] and p only (a rolling hash)."""
    out, h = [], 0x243F6A8885A308D3
    for p, tok in enumerate(tokens):
        h = _mix(h ^ ((tok * 0x9E3779B97F4A7C15 + p + 1) & MASK))
        out.append(h)
    return out


def truth_rows(hashes: Sequence[int]) -> dict[str, torch.Tensor]:
    """Every per-token key's rows for positions [0, len(hashes)); exact values, never all-zero."""
    hidden = [[h & 0xFFF, (h >> 12) & 0xFFF, (h >> 24) & 0xFFF, p + 1] for p, h in enumerate(hashes)]
    codes = [[(h >> 32) & 0xFFFFFF, p + 7] for p, h in enumerate(hashes)]
    embeds = [[((h >> 40) & 0xFFF) - 2048, ((h >> 52) & 0xFFF) / 8, p + 0.5] for p, h in enumerate(hashes)]
    return {
        HIDDEN_KEY: torch.tensor(hidden, dtype=torch.float32).reshape(-1, 4),
        CODES: torch.tensor(codes, dtype=torch.int64).reshape(-1, 2),
        EMBEDS: torch.tensor(embeds, dtype=torch.float32).reshape(-1, 3),
    }


class BlockAllocator:
    """A KV block allocator with prefix caching over full blocks (vLLM-like)."""

    def __init__(self, num_blocks: int, block_size: int, *, mru: bool = False) -> None:
        self.bs = block_size
        self.mru = mru  # reuse the most recently freed block first: new tenants sooner (I7 stress)
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hash_of: dict[int, int] = {}
        self.block_of: dict[int, int] = {}

    def match(self, block_hashes: Sequence[int]) -> list[int]:
        """Consecutive cached blocks of a prefix (not touched yet)."""
        out = []
        for h in block_hashes:
            b = self.block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def available(self, exclude: Sequence[int] = ()) -> int:
        return len(self.free) - sum(1 for b in set(exclude) if b in self.free)

    def touch(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def take(self, block: int) -> None:
        """Allocate a specific free block (evicting its hash): a new tenant."""
        del self.free[block]
        self._evict(block)
        self.ref[block] = 1

    def allocate(self, n: int) -> list[int]:
        assert len(self.free) >= n, "caller checks available() first"
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=self.mru)
            self._evict(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def _evict(self, b: int) -> None:
        h = self.hash_of.pop(b, None)
        if h is not None and self.block_of.get(h) == b:
            del self.block_of[h]

    def release(self, blocks: Sequence[int]) -> None:
        for b in reversed(blocks):  # tail blocks are evicted first, like vLLM
            self.ref[b] -= 1
            assert self.ref[b] >= 0
            if self.ref[b] == 0:
                self.free[b] = None

    def publish(self, block: int, h: int) -> None:
        if block not in self.hash_of and h not in self.block_of:
            self.hash_of[block] = h
            self.block_of[h] = block


@dataclass
class Req:
    rid: str
    tokens: list[int]
    prompt_len: int
    hashes: list[int]
    rows: dict[str, torch.Tensor]
    state: str = "waiting"  # waiting | running | preempted | ended
    computed: int = 0
    progress: int = 0  # the most positions ever computed (what a resume may re-find)
    blocks: list[int] = field(default_factory=list)
    started: bool = False
    diverged: bool = False
    owner: PrefixCacheRequestOwner | None = None  # this admission (I12)

    @property
    def left(self) -> int:
        return len(self.tokens) - self.computed


@dataclass
class Span:
    req: Req
    out_start: int  # materialize returns positions [out_start, out_end)
    out_end: int
    start: int = 0  # this step's first position (out_start < start: a prefix hit is served)
    resumed: bool = False
    hit_blocks: tuple[int, ...] = ()  # the blocks of the hit this step serves (its planned read)


@dataclass
class StepExpect:
    """What any materialize of this step must return (or raise)."""

    step_id: int
    spans: dict[str, Span]
    leftover: dict[str, Any]
    caches_hidden: bool
    not_readable: frozenset[str] = frozenset()
    where: str = ""
    keys: tuple[str, ...] = PER_TOKEN_KEYS  # the per-token mm keys this step carried
    stale_absent: frozenset[str] = frozenset()  # not_readable hits an older tenant's rows would have "served"
    # (KV slot, key) pins of this step's planned hit reads: while it is unconsumed the manager may
    # keep at most one preserved row per pin (I7's bound), however many tenants rewrite the slots.
    pinned_rows: int = 0

    def must_raise(self, req_ids: Sequence[str]) -> bool:
        return any(r in self.not_readable for r in req_ids)


def on_host(value: Any) -> Any:
    """A deep copy of a leftover value with every tensor on the CPU (what materialize returns)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(on_host(v) for v in value)
    if isinstance(value, dict):
        return {k: on_host(v) for k, v in value.items()}
    return copy.deepcopy(value)


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.device.type == "cpu" and torch.equal(a, b))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_value, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return bool(a == b)


def check_outputs(exp: StepExpect, req_ids: Sequence[str], out: StageCacheOutputs) -> None:
    """Assert ``out`` is exactly the ground truth for ``req_ids`` of step ``exp``."""
    tag = f"step {exp.step_id} ({exp.where})"
    assert isinstance(out, StageCacheOutputs), f"{tag}: materialize returned {type(out).__name__}"
    if not exp.caches_hidden:
        assert out.hidden_states is None, f"{tag}: hidden opt-out policy but hidden_states is not None"
    else:
        assert set(out.hidden_states) == set(req_ids), f"{tag}: hidden for {sorted(out.hidden_states)}"
    for key, per_req in out.mm_outputs.items():  # key-major: mm_outputs[key][req]
        assert set(per_req) == set(req_ids), f"{tag}: mm key {key!r} for {sorted(per_req)} != {sorted(req_ids)}"
    for rid in req_ids:
        span = exp.spans[rid]
        want = {k: v[span.out_start:span.out_end] for k, v in span.req.rows.items()}
        got_mm = out.mm_for(rid)
        assert set(got_mm) == set(exp.keys) | set(exp.leftover), (
            f"{tag}: request {rid} mm keys {sorted(got_mm)}")
        pairs = [(k, got_mm[k]) for k in exp.keys]
        if exp.caches_hidden:
            pairs.append((HIDDEN_KEY, out.hidden_states[rid]))
        for key, got in pairs:
            if not same_value(got, want[key]):
                raise AssertionError(
                    f"{tag}: request {rid} key {key!r} positions [{span.out_start}, {span.out_end}) "
                    f"differ from the ground truth\n got {got}\nwant {want[key]}")
        for key, value in exp.leftover.items():
            assert same_value(got_mm[key], value), f"{tag}: request {rid} leftover {key!r}: {got_mm[key]!r}"


@dataclass
class Prepared:
    """One step after new_step_starts and the forward, before save_outputs (retryable)."""

    sched: list[tuple[Req, int, int, Any]]
    hidden: torch.Tensor
    mm: dict[str, Any]
    total: int
    padded: int
    layout: PrefixCacheWriteLayout
    keys: tuple[str, ...] = PER_TOKEN_KEYS
