"""The CUDA bench (``omni-cache bench --device cuda``): what a save costs the engine at serving sizes.

Owns: the GPU measurements, all timed with CUDA events except the engine thread's own clock:

- ``measure_d2h_bandwidth``: pinned device-to-host copies on a side stream (the ceiling a
  save's copy is judged against, measured in the same run);
- ``StandInForward``: a stand-in for the model's forward, ``layers`` rounds of an H -> 4H and a
  4H -> H bf16 matmul (16·T·H² FLOP per layer, about the MLP work of a layer of that width);
- ``CopyTimer``: timing events around each copy the manager puts on its side stream (it
  shadows the public ``CopyEngine.copy_into`` of one manager; nothing else changes);
- ``run_case``: one (hidden width, step tokens) case: alternating repeats of a baseline
  engine loop (forward, the sampler's host sync) and the same loop with the cache
  (``new_step_starts`` and ``save_outputs`` on the engine thread, ``materialize`` on a builder
  thread one step behind), on a manager with ``eager=False`` (pinned pages, side-stream copies,
  the committer thread). It reports the save's time on the engine thread, the copy's time on
  the side stream against the bandwidth, and how much of each step's copy ran while the next
  step's forward did.

Every step's rows are checked: an exact per-row checksum of the forward's output (taken on the
device) must equal the same checksum of what ``materialize`` returned, or the run raises
``GpuBenchError``. Each step is a new request whose KV slots cycle through a pool of four
steps' worth of blocks, so slots get new tenants as in serving.

Upholds nothing itself; the per-step check catches I4 (the snapshot) and I7 (a wrong tenant's
rows) violations from outside.
"""

from __future__ import annotations

import gc
import queue
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from omni_cache.runtime.events import PrefixCacheEventKind, PrefixCacheRequestEvent, PrefixCacheWriteLayout
from omni_cache.runtime.interface import PrefixCacheConfig
from omni_cache.runtime.manager import OmniPrefixCacheManager

BLOCK_SIZE = 16
# Layers of the stand-in forward by hidden width (the thinkers these widths come from); others: 32.
STANDIN_LAYERS = {2048: 36, 4096: 32}
REFERENCE_BYTES = 256 << 20  # the large copy whose bandwidth is the run's ceiling


class GpuBenchError(RuntimeError):
    """A materialized step differed from the forward's output, or the run could not be measured."""


def standin_layers(hidden: int) -> int:
    return STANDIN_LAYERS.get(hidden, 32)


def overlap_ms(a: tuple[float, float], b: tuple[float, float]) -> float:
    """How long intervals ``a`` and ``b`` (start, end; ms) overlap; 0 when they do not."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def classify_copy(copy: tuple[float, float], next_forward: tuple[float, float]) -> str:
    """Where a step's copy ran relative to the next step's forward (both in ms from one reference):
    ``before`` it started (in the engine's gap between forwards), ``inside`` it, ``partly`` (it
    began before and ended inside), or ``after`` its end (the next save may wait for it)."""
    if copy[1] <= next_forward[0]:
        return "before"
    if copy[1] > next_forward[1]:
        return "after"
    return "inside" if copy[0] >= next_forward[0] else "partly"


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise GpuBenchError(f"no CUDA device: torch {torch.__version__} sees none")


def measure_d2h_bandwidth(nbytes: int, repeats: int = 10, warmup: int = 3) -> float:
    """Median GB/s (1e9 bytes/s) of ``nbytes`` copied device -> pinned host on a side stream."""
    _require_cuda()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    times: list[float] = []
    for i in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    if not torch.equal(dst[:4096], src[:4096].cpu()):
        raise GpuBenchError("the bandwidth probe's copy did not land")
    return nbytes / (statistics.median(times) / 1e3) / 1e9


class StandInForward:
    """``layers`` rounds of x @ up (H -> 4H), then @ down (4H -> H), bf16, on the current stream."""

    def __init__(self, hidden: int, layers: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.hidden, self.layers = hidden, layers
        # Scaled so that activations keep unit variance through the layers (no inf or NaN).
        self.up = (torch.randn(hidden, 4 * hidden, device="cuda", generator=gen) / hidden**0.5).to(dtype)
        self.down = (torch.randn(4 * hidden, hidden, device="cuda", generator=gen) / (4 * hidden) ** 0.5).to(dtype)

    def flop(self, tokens: int) -> int:
        return 16 * tokens * self.hidden * self.hidden * self.layers

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.layers):
            x = (x @ self.up) @ self.down
        return x


def row_checksums(rows: torch.Tensor) -> torch.Tensor:
    """An exact per-row checksum of 2-byte rows (int64, on the rows' device): the bits of each
    element weighted by its column, so a wrong, moved or stale row changes its row's sum. The
    products fit int32 for widths up to 65,535; the sum is int64."""
    bits = rows.contiguous().view(torch.int16).to(torch.int32)
    weights = torch.arange(1, rows.shape[1] + 1, dtype=torch.int32, device=rows.device)
    return (bits * weights).sum(dim=1, dtype=torch.int64)


@dataclass
class _CopyRecord:
    start: Any
    end: Any
    nbytes: int


class CopyTimer:
    """Timing events around every copy ``manager.copies`` puts on its side stream.

    NOTE: an instance attribute shadows ``CopyEngine.copy_into`` for every holder of that one
    engine (the save path, the committer, the reader), so the cache runs its own code
    unchanged; the start event is recorded after the side stream waits for the forward's
    event, so the interval is the copy itself. ``close`` restores the method.
    """

    def __init__(self, manager: OmniPrefixCacheManager) -> None:
        self.copies = manager.copies
        self.records: list[_CopyRecord] = []
        inner = self.copies.copy_into
        stream = self.copies.stream

        def timed_copy_into(dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Any:
            if not src.is_cuda:
                return inner(dst, src, after)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                if after is not None:
                    stream.wait_event(after)
                start.record(stream)
            event = inner(dst, src, after)
            end.record(stream)
            self.records.append(_CopyRecord(start, end, src.nbytes))
            return event

        setattr(self.copies, "copy_into", timed_copy_into)  # noqa: B010 (shadows the method: see NOTE)

    def close(self) -> None:
        vars(self.copies).pop("copy_into", None)


@dataclass
class CaseResult:
    """One case's medians (ms unless named otherwise) and its checks."""

    hidden: int
    tokens: int
    dtype: str
    layers: int
    step_bytes: int
    steps: int
    repeats: int
    forward_flop: int
    forward_ms_base: float | None = None  # the stand-in forward (events), baseline loop
    forward_ms_cache: float | None = None  # the same forward while the cache copies
    step_ms_base: float | None = None  # the engine thread's step (wall), baseline loop
    step_ms_cache: float | None = None
    save_ms: float | None = None  # save_outputs on the engine thread: the critical path
    save_ms_p90: float | None = None
    save_ms_max: float | None = None
    new_step_starts_ms: float | None = None
    copy_ms: float | None = None  # the save's device->host copy on the side stream (events)
    copy_gbps: float | None = None
    d2h_gbps_same_size: float | None = None  # pinned D2H of the step's bytes, measured alone
    copy_vs_floor: float | None = None  # copy_ms / (step bytes at the measured bandwidth)
    overlap_fraction: float | None = None  # median share of a copy that ran during the next forward
    copy_placement: dict[str, int] = field(default_factory=dict)  # before / inside / partly / after
    materialize_ms: float | None = None  # on the builder thread (off the critical path)
    rows_checked: int = 0

    @property
    def save_share_of_step(self) -> float | None:
        if self.save_ms is None or not self.step_ms_base:
            return None
        return self.save_ms / self.step_ms_base

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["save_share_of_step"] = self.save_share_of_step
        return doc


class CheckingBuilder:
    """Materializes step ids on its own thread (``jobs``: step id, request, the forward's row
    checksums on the host), timing each call; ``finish`` checks every materialized step against
    its checksums after the run (the check stays off the timed loop) and raises the first error."""

    def __init__(self, manager: OmniPrefixCacheManager) -> None:
        self.manager = manager
        self.jobs: queue.Queue[tuple[int, str, torch.Tensor] | None] = queue.Queue()
        self.errors: list[BaseException] = []
        self.materialize_ms: list[float] = []
        self.rows_checked = 0
        self._served: list[tuple[int, str, torch.Tensor | None, torch.Tensor]] = []
        self.thread = threading.Thread(target=self._run, name="gpu-bench-builder", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            step_id, rid, want = job
            try:
                t0 = time.perf_counter_ns()
                out = self.manager.materialize(step_id, [rid])
                self.materialize_ms.append((time.perf_counter_ns() - t0) / 1e6)
                self._served.append((step_id, rid, None if out.hidden_states is None else out.hidden_states[rid],
                                     want))
            except BaseException as exc:
                self.errors.append(exc)

    def finish(self, timeout_s: float = 120.0) -> None:
        self.jobs.put(None)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise GpuBenchError(f"the builder thread did not finish within {timeout_s:.0f}s")
        if self.errors:
            raise self.errors[0]
        for step_id, rid, got, want in self._served:
            if got is None:
                raise GpuBenchError(f"step {step_id} ({rid}): materialize returned no hidden states")
            if got.device.type != "cpu" or not torch.equal(row_checksums(got), want):
                raise GpuBenchError(f"step {step_id} ({rid}): materialized rows differ from the forward's "
                                    f"output (device {got.device}, {got.shape[0]} rows)")
            self.rows_checked += got.shape[0]
        self._served.clear()


@dataclass
class _Loop:
    """One run of the engine loop: per-step host times and device events."""

    step_ms: list[float] = field(default_factory=list)
    save_ms: list[float] = field(default_factory=list)
    starts_ms: list[float] = field(default_factory=list)
    forwards: list[tuple[Any, Any]] = field(default_factory=list)


def _engine_loop(forward: StandInForward, x: torch.Tensor, steps: int, warmup: int, tokens: int,
                 manager: OmniPrefixCacheManager | None, builder: CheckingBuilder | None, tag: str) -> _Loop:
    """``warmup + steps`` engine steps; the cache's calls only when ``manager`` is given.

    A step, as the runner bridge orders it: ``new_step_starts``, the forward (queued), the save
    right after it (the host runs ahead of the GPU, so the copy waits on the forward's event),
    then the sampler's work and its host sync; the builder materializes the step meanwhile."""
    loop = _Loop()
    blocks_per_step = tokens // BLOCK_SIZE
    compute = torch.cuda.current_stream()
    prev_rid: str | None = None
    for k in range(warmup + steps):
        rid = f"{tag}-{k}"
        t0 = time.perf_counter_ns()
        t_starts = t_save = 0
        if manager is not None:
            events = [PrefixCacheRequestEvent(rid, PrefixCacheEventKind.STARTED, scheduled_tokens=tokens)]
            if prev_rid is not None:
                events.insert(0, PrefixCacheRequestEvent(prev_rid, PrefixCacheEventKind.FINISHED))
            manager.new_step_starts(events)
            t_starts = time.perf_counter_ns() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        hidden = forward(x.roll(k, 0))  # a new request's rows: every step's rows differ
        end.record(compute)
        step_id = None
        if manager is not None:
            first = (k % 4) * blocks_per_step  # four steps' worth of blocks, reused: new tenants
            slots = torch.arange(first * BLOCK_SIZE, first * BLOCK_SIZE + tokens, dtype=torch.int64)
            layout = PrefixCacheWriteLayout.packed([(rid, 0, tokens)], slots)
            t1 = time.perf_counter_ns()
            step_id = manager.save_outputs(hidden, {}, num_tokens_unpadded=tokens, num_tokens_padded=tokens,
                                           write_layout=layout)
            t_save = time.perf_counter_ns() - t1
        want = row_checksums(hidden)  # stands in for the sampler's work on the forward's output
        compute.synchronize()  # the sampler's host sync (the engine reads the sampled tokens)
        want_cpu = want.cpu()
        if builder is not None and step_id is not None:
            builder.jobs.put((step_id, rid, want_cpu))
        step_ns = time.perf_counter_ns() - t0
        del hidden
        prev_rid = rid
        if k >= warmup:
            loop.step_ms.append(step_ns / 1e6)
            loop.save_ms.append(t_save / 1e6)
            loop.starts_ms.append(t_starts / 1e6)
            loop.forwards.append((start, end))
    torch.cuda.synchronize()
    return loop


def run_case(hidden: int, tokens: int, *, steps: int = 12, warmup: int = 3, repeats: int = 3,
             layers: int | None = None, d2h_gbps: float | None = None, seed: int = 0,
             progress: Callable[[str], None] | None = None) -> CaseResult:
    """Baseline and cache loops, alternating, ``repeats`` times each; medians over every timed step."""
    _require_cuda()
    if tokens % BLOCK_SIZE:
        raise ValueError(f"step tokens must be a multiple of the block size {BLOCK_SIZE}, got {tokens}")
    layers = layers or standin_layers(hidden)
    dtype = torch.bfloat16
    forward = StandInForward(hidden, layers, dtype, seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
    step_bytes = tokens * hidden * 2
    result = CaseResult(hidden, tokens, "bfloat16", layers, step_bytes, steps, repeats, forward.flop(tokens))
    config = PrefixCacheConfig(num_blocks=4 * (tokens // BLOCK_SIZE), block_size=BLOCK_SIZE, staging_depth=4,
                               staging_capacity_tokens=tokens, staging_claim_timeout_s=60.0)
    base_fwd: list[float] = []
    cache_fwd: list[float] = []
    base_step: list[float] = []
    cache_step: list[float] = []
    saves: list[float] = []
    starts: list[float] = []
    copies: list[float] = []
    overlaps: list[float] = []
    placement = {"before": 0, "inside": 0, "partly": 0, "after": 0}
    materialize: list[float] = []
    for r in range(repeats):
        for with_cache in ((False, True) if r % 2 == 0 else (True, False)):  # alternate who goes first
            gc.collect()
            if not with_cache:
                loop = _engine_loop(forward, x, steps, warmup, tokens, None, None, f"base{r}")
                base_step += loop.step_ms
                base_fwd += [s.elapsed_time(e) for s, e in loop.forwards]
                continue
            manager = OmniPrefixCacheManager(config, eager=False)
            if not manager.use_cuda:
                raise GpuBenchError("the manager did not take its CUDA path (use_cuda is False)")
            timer = CopyTimer(manager)
            builder = CheckingBuilder(manager)
            try:
                loop = _engine_loop(forward, x, steps, warmup, tokens, manager, builder, f"cache{r}")
                builder.finish()
            finally:
                builder.jobs.put(None)  # the builder thread ends, also when the loop raised
                timer.close()
                unconsumed = manager.shutdown()
            if unconsumed:
                raise GpuBenchError(f"step ids left unconsumed: {sorted(unconsumed)}")
            if len(timer.records) != warmup + steps:
                raise GpuBenchError(f"{len(timer.records)} side-stream copies for {warmup + steps} saves: "
                                    "the saves did not take the stream path")
            cache_step += loop.step_ms
            saves += loop.save_ms
            starts += loop.starts_ms
            cache_fwd += [s.elapsed_time(e) for s, e in loop.forwards]
            materialize += builder.materialize_ms[warmup:]
            result.rows_checked += builder.rows_checked
            timed = timer.records[warmup:]
            ref = loop.forwards[0][0]
            for i, rec in enumerate(timed):
                copies.append(rec.start.elapsed_time(rec.end))
                if i + 1 < len(loop.forwards):
                    nxt = loop.forwards[i + 1]
                    c = (ref.elapsed_time(rec.start), ref.elapsed_time(rec.end))
                    f = (ref.elapsed_time(nxt[0]), ref.elapsed_time(nxt[1]))
                    placement[classify_copy(c, f)] += 1
                    overlaps.append(overlap_ms(c, f) / max(c[1] - c[0], 1e-9))
        if progress is not None:
            progress(f"hidden {hidden} x {tokens} tokens: repeat {r + 1}/{repeats} done")
    result.forward_ms_base, result.forward_ms_cache = median(base_fwd), median(cache_fwd)
    result.step_ms_base, result.step_ms_cache = median(base_step), median(cache_step)
    result.save_ms = median(saves)
    if saves:
        ordered = sorted(saves)
        result.save_ms_p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        result.save_ms_max = ordered[-1]
    result.new_step_starts_ms = median(starts)
    result.copy_ms = median(copies)
    if result.copy_ms:
        result.copy_gbps = step_bytes / (result.copy_ms / 1e3) / 1e9
    result.d2h_gbps_same_size = measure_d2h_bandwidth(step_bytes)
    if d2h_gbps and result.copy_ms:
        result.copy_vs_floor = result.copy_ms / (step_bytes / (d2h_gbps * 1e9) * 1e3)
    result.overlap_fraction = median(overlaps)
    result.copy_placement = placement
    result.materialize_ms = median(materialize)
    return result


@dataclass
class GpuBenchResult:
    device: str
    torch_version: str
    d2h_gbps: float
    reference_bytes: int
    cases: list[CaseResult]
    config: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "torch": self.torch_version, "d2h_gbps_pinned": self.d2h_gbps,
                "d2h_reference_bytes": self.reference_bytes, "config": self.config,
                "cases": [c.to_json() for c in self.cases]}


def run_gpu_bench(hidden_sizes: list[int], step_tokens: list[int], *, steps: int = 12, warmup: int = 3,
                  repeats: int = 3, layers: int | None = None, seed: int = 0,
                  progress: Callable[[str], None] | None = None) -> GpuBenchResult:
    """The pinned D2H ceiling first, then every (hidden, tokens) case."""
    _require_cuda()
    d2h = measure_d2h_bandwidth(REFERENCE_BYTES)
    if progress is not None:
        progress(f"pinned device-to-host: {d2h:,.1f} GB/s ({REFERENCE_BYTES >> 20} MiB, median of 10)")
    cases = [run_case(h, t, steps=steps, warmup=warmup, repeats=repeats, layers=layers, d2h_gbps=d2h, seed=seed,
                      progress=progress)
             for h in hidden_sizes for t in step_tokens]
    config = {"steps": steps, "warmup": warmup, "repeats": repeats, "block_size": BLOCK_SIZE,
              "staging_depth": 4, "eager": False, "layers": layers or "by width"}
    return GpuBenchResult(torch.cuda.get_device_name(), torch.__version__, d2h, REFERENCE_BYTES, cases, config)
