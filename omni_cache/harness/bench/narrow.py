"""Bookkeeping per decode step, measured directly: narrow rows, the manager next to its own copies.

Owns: ``OutputFloor`` and ``narrow_bookkeeping`` (the sweep's "bookkeeping" column). The
workload is the sweep's, with every key shrunk to ``NARROW_WIDTH`` columns, so a copy costs
its call and almost nothing per byte. Two things run it, step by step in the same passes
(alternating who goes first, the garbage collector off, every step's outputs checked against
the ground truth at the end of its pass, so the checker's reads stay out of the timed steps):

* the manager, through its public calls;
* ``OutputFloor``: the copies and output tensors the manager itself makes for such a step and
  nothing else -- the step's rows into a staging buffer (``copy_``), the staging rows into the
  pool (``scatter_rows``, as the manager), then per key **one** ``clone`` of the step's rows split into one view
  per request (``split_with_sizes``) and its ``{request: view}`` dict (what materialize returns
  for a decode step; request ids and sizes come from the layout's ``StepRows``, derived when the
  engine built the layout, as the manager's do); a step with a hit falls back to ``RawCopyFloor``'s per-request
  ``index_select`` + ``cat``. Unlike ``RawCopyFloor`` (one clone per request and key, the bench's
  floor), its cost grows with the requests only as the manager's own outputs must.

Per decode step the time of each is the **minimum over the passes** (a load burst only ever
adds time, so the minimum is the least disturbed reading), then the median over the decode
steps. Bookkeeping = manager minus ``OutputFloor`` of the same step: what the manager spends
beyond the copies and the one view and dict entry per request and key it returns, measured in
the same passes rather than subtracted from timers of another run. Upholds nothing at run
time; the checks are the ground truth's (``check_outputs``).
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass, replace

from omni_cache.harness.bench.floor import RawCopyFloor
from omni_cache.harness.bench.runner import (
    ManagerFactory,
    default_manager_factory,
    finish_workload,
    floor_step,
    manager_step,
)
from omni_cache.harness.bench.workload import (
    GroundTruthError,
    Step,
    Workload,
    WorkloadSpec,
    build_workload,
    check_outputs,
)
from omni_cache.runtime.events import layout_rows
from omni_cache.runtime.interface import HIDDEN_KEY, ModelCachePolicy, ReqId, StageCacheOutputs

NARROW_WIDTH = 8
"""Columns of every key in the narrow run: 16 bytes a row in bf16, so copies cost their calls."""


class OutputFloor(RawCopyFloor):
    """``RawCopyFloor``'s save; materialize makes the manager's decode outputs: one clone per key,
    one view per request (``split_with_sizes``), one dict per key. Steps with a hit: the raw floor."""

    def materialize(self, step: Step) -> StageCacheOutputs:
        if step.hit_slots:
            return super().materialize(step)
        assert self._step is step, "floor: materialize of a step that was not the last saved"
        rows = layout_rows(step.layout)  # request ids and sizes, derived when the layout was built
        assert rows is not None, "floor: a bench layout without its StepRows"
        n = step.num_tokens
        out: dict[str, dict[ReqId, object]] = {
            key: dict(zip(rows.req_ids, self.staging[key][:n].clone().split_with_sizes(rows.sizes), strict=True))
            for key in self.keys}
        self._step = None
        hidden = out.pop(HIDDEN_KEY)
        return StageCacheOutputs(hidden, out)


def _read_inputs(step: Step) -> None:
    """Read a step's inputs (outside the timers): its slots, scheduled counts and request ids."""
    step.slots.numpy().tolist()
    tuple(step.events.scheduled_tokens.items())
    tuple(step.req_ids)


def _check_all(workload: Workload, unchecked: list[tuple[Step, StageCacheOutputs, str]]) -> None:
    """Check (and forget) the outputs kept so far against the ground truth."""
    for step, out, who in unchecked:
        check_outputs(workload, step, out, who=who)
    unchecked.clear()


@dataclass
class NarrowResult:
    """µs per decode step at narrow rows (per step the minimum over passes, then the median)."""

    omni_us: float
    floor_us: float  # OutputFloor: the copies and the outputs alone

    @property
    def bookkeeping_us(self) -> float:
        return self.omni_us - self.floor_us


def narrow_spec(spec: WorkloadSpec) -> WorkloadSpec:
    """``spec`` with every key ``NARROW_WIDTH`` columns wide."""
    return replace(spec, hidden_width=NARROW_WIDTH, mm_width=NARROW_WIDTH)


def narrow_bookkeeping(
    spec: WorkloadSpec,
    *,
    passes: int,
    eager: bool = True,
    manager_factory: ManagerFactory | None = None,
    check_between_steps: bool = False,
    warm_inputs: bool = False,
) -> NarrowResult:
    """Run ``narrow_spec(spec)`` ``passes`` times through the manager and ``OutputFloor``,
    interleaved step by step (after one warm-up pass); return their decode-step times.

    Every step's outputs of both are checked against the ground truth: by default at the end
    of each pass (outputs are private copies, so a later step that reuses the staging pages must
    not change them: I4 is checked harder), with ``check_between_steps`` right after each step.
    The checker reads every output row; between steps it evicts the caches by an amount that
    grows with the requests, so the next step finds the runtime's state colder and the reading
    at many requests is dominated by that (and noisy): the default keeps it out of the timed
    steps. ``warm_inputs`` (a control) reads each step's inputs -- its slot tensor, scheduled
    counts and request ids -- right before each side's timed calls, as an engine that has just
    built them would have them in cache."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    workload = build_workload(narrow_spec(spec))
    decode = [i for i, s in enumerate(workload.steps) if s.phase == "decode"]
    if not decode:
        raise ValueError("narrow_bookkeeping needs decode steps")
    floor = OutputFloor(workload.spec)
    manager = (manager_factory or default_manager_factory)(workload.spec.cache_config(), eager)
    omni_min = [float("inf")] * len(workload.steps)
    floor_min = [float("inf")] * len(workload.steps)
    try:
        manager.register_policy(ModelCachePolicy())
        for p in range(passes + 1):  # pass 0 warms up (first touch of the pool and the pages)
            omni_first = p % 2 == 0
            gc.collect()
            gc.disable()
            unchecked: list[tuple[Step, StageCacheOutputs, str]] = []
            try:
                for i, step in enumerate(workload.steps):
                    for who in (("omni", "floor") if omni_first else ("floor", "omni")):
                        if warm_inputs:
                            _read_inputs(step)
                        if who == "omni":
                            ns, out = manager_step(manager, step)
                            unchecked.append((step, out, "omni_cache"))
                            if p:
                                omni_min[i] = min(omni_min[i], sum(ns))
                        else:
                            ns, out = floor_step(floor, step)
                            unchecked.append((step, out, "output floor"))
                            if p:
                                floor_min[i] = min(floor_min[i], sum(ns))
                        if check_between_steps:
                            _check_all(workload, unchecked)
                    del out
                    omni_first = not omni_first
                finish_workload(manager, workload)
            finally:
                gc.enable()
            _check_all(workload, unchecked)
    finally:
        unconsumed = manager.shutdown()
    if unconsumed:
        raise GroundTruthError(f"omni_cache: shutdown reported unconsumed step ids {unconsumed} (I1/I2)")
    med = statistics.median
    return NarrowResult(med(omni_min[i] for i in decode) / 1e3, med(floor_min[i] for i in decode) / 1e3)
