"""The synthetic engine of ``omni-cache bench``: requests, steps and ground truth.

Owns: ``WorkloadSpec`` (the shape of the run), ``Workload`` (the precomputed
steps: events, write layouts and the forward's outputs, plus the ground-truth
rows of every request) and ``check_outputs``, the ground-truth checker every
materialized step goes through.

The workload: hidden width 2048 bf16 plus one
per-token mm key of width 512, block size 16, 4096 blocks, prompts of 512
tokens. The first half of the requests (misses) prefill in step 0; the second
half start in step 1 with a prefix hit of 256 tokens on the blocks of an
earlier request (a "donor") and prefill only their last 256 prompt tokens;
then every request decodes one token per step for ``decode_steps`` steps; the
run ends with FINISHED for every request (so the next repeat reuses the same
KV blocks: tenant succession, as in a long-running server).

A row's ground truth is a function of (request, position); a hit request shares
its donor's rows for the hit positions, which is what makes the cached rows
the right answer. ``check_outputs`` compares every row of every key of every
request that materialize returns, so it catches I4 (a snapshot that changed),
I6 (hit rows served as zeros) and I7 (a newer tenant's rows) violations, as
well as any plain bug in the merge.

Upholds nothing itself: ``check_outputs`` checks I4, I6 and I7 from outside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache.runtime.events import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.interface import HIDDEN_KEY, PrefixCacheConfig, ReqId, StageCacheOutputs, TensorName

MM_KEY: TensorName = "mm.codes"
"""The bench's one per-token mm key (immediate, not deferred)."""


class GroundTruthError(AssertionError):
    """A materialized row differs from the ground truth (or a row is missing)."""


@dataclass(frozen=True)
class WorkloadSpec:
    """The shape of one synthetic run at one batch size."""

    batch_size: int
    hidden_width: int = 2048
    mm_width: int = 512
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    num_blocks: int = 4096
    prompt_tokens: int = 512
    hit_tokens: int = 256
    decode_steps: int = 200
    seed: int = 0
    # The decode13 shape: one prefill step per request, in order; request i (odd i) hits
    # ``hit_tokens`` of request i-1's blocks. False: all misses prefill in step 0, all hits in step 1.
    staggered: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.hit_tokens % self.block_size or not 0 <= self.hit_tokens < self.prompt_tokens:
            raise ValueError(
                f"hit_tokens={self.hit_tokens} must be a block multiple below prompt_tokens={self.prompt_tokens}"
            )
        if self.decode_steps < 0:
            raise ValueError(f"decode_steps must be >= 0, got {self.decode_steps}")
        if self.blocks_needed > self.num_blocks:
            raise ValueError(
                f"{self.batch_size} requests need {self.blocks_needed} KV blocks; num_blocks is {self.num_blocks}"
            )

    @property
    def num_misses(self) -> int:
        return self.batch_size - self.batch_size // 2

    @property
    def num_hits(self) -> int:
        return self.batch_size // 2

    @property
    def seq_len(self) -> int:
        return self.prompt_tokens + self.decode_steps

    @property
    def blocks_per_request(self) -> int:
        return -(-self.seq_len // self.block_size)

    @property
    def blocks_needed(self) -> int:
        shared = self.hit_tokens // self.block_size
        return self.batch_size * self.blocks_per_request - self.num_hits * shared

    @property
    def max_step_tokens(self) -> int:
        """The largest step (the misses' prefill): the staging capacity it needs."""
        if self.staggered:
            return max(self.prompt_tokens, self.batch_size)
        return max(
            self.num_misses * self.prompt_tokens,
            self.num_hits * (self.prompt_tokens - self.hit_tokens),
            self.batch_size,
        )

    @property
    def total_tokens(self) -> int:
        return (
            self.num_misses * self.prompt_tokens
            + self.num_hits * (self.prompt_tokens - self.hit_tokens)
            + self.decode_steps * self.batch_size
        )

    @property
    def keys(self) -> tuple[TensorName, ...]:
        return (HIDDEN_KEY, MM_KEY)

    def widths(self) -> dict[TensorName, int]:
        return {HIDDEN_KEY: self.hidden_width, MM_KEY: self.mm_width}

    def cache_config(self) -> PrefixCacheConfig:
        """The manager's config: staging sized to the largest step (as max_num_batched_tokens)."""
        return PrefixCacheConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            staging_capacity_tokens=self.max_step_tokens,
        )


@dataclass
class Step:
    """One scheduler step, precomputed: what the engine hands the cache, and what it must get back."""

    index: int
    phase: str  # "prefill" or "decode"
    events: PrefixCacheStep
    layout: PrefixCacheWriteLayout
    # The forward's per-token outputs: key -> [num_tokens, width] (hidden under HIDDEN_KEY).
    outputs: dict[TensorName, torch.Tensor]
    req_ids: tuple[ReqId, ...]
    # Per request: (request index, first position, end position) materialize must return.
    expect: dict[ReqId, tuple[int, int, int]]
    # The KV slots of a hit (first step after it) -- what the raw-copy floor reads.
    hit_slots: dict[ReqId, torch.Tensor] = field(default_factory=dict)
    # The layout's slot mapping (``layout.slots_cpu``, never None here), for the floor.
    slots: torch.Tensor = field(kw_only=True)

    @property
    def num_tokens(self) -> int:
        return self.layout.total_rows


@dataclass
class Workload:
    """Every step of one run, its closing events, and the ground truth."""

    spec: WorkloadSpec
    req_ids: tuple[ReqId, ...]
    # key -> [batch_size, seq_len, width]: the true row of every (request, position).
    truth: dict[TensorName, torch.Tensor]
    block_tables: list[list[int]]
    steps: list[Step]
    finish: PrefixCacheStep

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.steps)


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_workload(spec: WorkloadSpec) -> Workload:
    """Precompute the whole run (outside every timer)."""
    gen = torch.Generator().manual_seed(spec.seed)
    b, bs = spec.batch_size, spec.block_size
    req_ids = tuple(f"req-{i}" for i in range(b))
    if spec.staggered:  # odd requests hit the previous one's blocks; every request prefills alone
        misses, hits = list(range(0, b, 2)), list(range(1, b, 2))
        donor = {h: h - 1 for h in hits}
    else:
        misses, hits = list(range(spec.num_misses)), list(range(spec.num_misses, b))
        donor = {h: misses[j % len(misses)] for j, h in enumerate(hits)}
    if not spec.hit_tokens:
        donor = {}

    # Ground truth: random rows; a hit request shares its donor's rows for the hit positions.
    truth: dict[TensorName, torch.Tensor] = {}
    for key, width in spec.widths().items():
        rows = torch.randn((b, spec.seq_len, width), generator=gen).to(spec.dtype)
        for h, d in donor.items():
            rows[h, : spec.hit_tokens] = rows[d, : spec.hit_tokens]
        truth[key] = rows

    # KV blocks from a shuffled free list (as after churn); a hit shares its donor's first blocks.
    free = torch.randperm(spec.num_blocks, generator=gen).tolist()
    shared = spec.hit_tokens // bs
    tables: list[list[int]] = [[] for _ in range(b)]
    for r in range(b):
        if r in donor:
            tables[r] = tables[donor[r]][:shared] + [free.pop() for _ in range(spec.blocks_per_request - shared)]
        else:
            tables[r] = [free.pop() for _ in range(spec.blocks_per_request)]

    def make_step(index: int, phase: str, events: list[PrefixCacheRequestEvent],
                  spans: list[tuple[int, int, int]], first_after_hit: set[int]) -> Step:
        names = [(req_ids[r], s, e) for r, s, e in spans]
        slots = torch.tensor([x for r, s, e in spans for x in _slots(tables[r], s, e, bs)], dtype=torch.int64)
        layout = PrefixCacheWriteLayout.packed(names, slots)
        if layout.slots_cpu is None:
            raise ValueError("a bench layout without its slot mapping")
        outputs = {key: torch.cat([t[r, s:e] for r, s, e in spans]) for key, t in truth.items()}
        expect = {req_ids[r]: (r, 0 if r in first_after_hit else s, e) for r, s, e in spans}
        hit_slots = {
            req_ids[r]: torch.tensor(_slots(tables[r], 0, spec.hit_tokens, bs), dtype=torch.int64)
            for r in first_after_hit
        }
        scheduled = {req_ids[r]: e - s for r, s, e in spans}
        return Step(index, phase, PrefixCacheStep(tuple(events), scheduled), layout, outputs,
                    tuple(n for n, _, _ in names), expect, hit_slots, slots=layout.slots_cpu)

    started = PrefixCacheEventKind.STARTED
    if spec.staggered:
        return _staggered(spec, req_ids, truth, tables, donor, make_step)
    steps = [
        make_step(0, "prefill",
                  [PrefixCacheRequestEvent(req_ids[r], started, block_ids=(tuple(tables[r]),),
                                           scheduled_tokens=spec.prompt_tokens) for r in misses],
                  [(r, 0, spec.prompt_tokens) for r in misses], set())
    ]
    if hits:
        steps.append(make_step(
            1, "prefill",
            [PrefixCacheRequestEvent(req_ids[r], started, hit_start=0, hit_end=spec.hit_tokens,
                                     block_ids=(tuple(tables[r]),),
                                     scheduled_tokens=spec.prompt_tokens - spec.hit_tokens) for r in hits],
            [(r, spec.hit_tokens, spec.prompt_tokens) for r in hits], set(hits)))
    for d in range(spec.decode_steps):
        pos = spec.prompt_tokens + d
        steps.append(make_step(len(steps), "decode", [], [(r, pos, pos + 1) for r in range(b)], set()))
    finish = PrefixCacheStep(tuple(
        PrefixCacheRequestEvent(rid, PrefixCacheEventKind.FINISHED) for rid in req_ids))
    return Workload(spec, req_ids, truth, tables, steps, finish)


def _staggered(spec: WorkloadSpec, req_ids: tuple[ReqId, ...], truth: dict[TensorName, torch.Tensor],
               tables: list[list[int]], donor: dict[int, int], make_step: Any) -> Workload:
    """One prefill step per request (a hit request prefills only its suffix), then the decodes."""
    started, hit = PrefixCacheEventKind.STARTED, spec.hit_tokens
    steps: list[Step] = []
    for r in range(spec.batch_size):
        start = hit if r in donor else 0
        event = PrefixCacheRequestEvent(req_ids[r], started, hit_start=0, hit_end=start,
                                        block_ids=(tuple(tables[r]),), scheduled_tokens=spec.prompt_tokens - start)
        steps.append(make_step(r, "prefill", [event], [(r, start, spec.prompt_tokens)],
                               {r} if r in donor else set()))
    for d in range(spec.decode_steps):
        pos = spec.prompt_tokens + d
        steps.append(make_step(len(steps), "decode", [], [(r, pos, pos + 1) for r in range(spec.batch_size)], set()))
    finish = PrefixCacheStep(tuple(
        PrefixCacheRequestEvent(rid, PrefixCacheEventKind.FINISHED) for rid in req_ids))
    return Workload(spec, req_ids, truth, tables, steps, finish)


def _first_bad_row(got: torch.Tensor, want: torch.Tensor) -> int:
    bad = (got != want).reshape(got.shape[0], -1).any(dim=1).nonzero()
    return int(bad[0]) if bad.numel() else -1


def _served(out: StageCacheOutputs, key: TensorName, req_id: ReqId) -> Any:
    """What ``out`` holds for ``req_id`` under ``key``; KeyError or TypeError when it holds nothing."""
    if key == HIDDEN_KEY:
        if out.hidden_states is None:
            raise TypeError("materialize returned no hidden states")
        return out.hidden_states[req_id]
    return out.mm_outputs[key][req_id]


def check_outputs(workload: Workload, step: Step, out: StageCacheOutputs, *, who: str = "omni_cache") -> int:
    """Compare every row ``out`` holds for ``step`` with the ground truth; return rows checked.

    Raises ``GroundTruthError`` naming the step, request, key and first bad
    position on any difference in shape, dtype or value, or a missing request.
    """
    checked = 0
    for req_id, (r, start, end) in step.expect.items():
        for key in workload.spec.keys:
            where = f"{who}: step {step.index} ({step.phase}) request {req_id!r} key {key!r}"
            try:
                got = _served(out, key, req_id)
            except (KeyError, TypeError) as exc:
                raise GroundTruthError(f"{where}: missing from the materialized outputs ({exc!r})") from exc
            want = workload.truth[key][r, start:end]
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise GroundTruthError(
                    f"{where}: expected positions [{start}, {end}) as {tuple(want.shape)} {want.dtype}, "
                    f"got {shape}")
            if not torch.equal(got, want):
                row = _first_bad_row(got, want)
                raise GroundTruthError(
                    f"{where}: row {row} (position {start + row}) differs from the ground truth "
                    f"(expected positions [{start}, {end}))")
            checked += end - start
    return checked
