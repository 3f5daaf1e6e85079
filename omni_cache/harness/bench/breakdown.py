"""Where each microsecond of a decode step goes: exclusive time per category, measured.

Owns: ``step_breakdown``. It runs the bench workload through one manager
(warm-up pass, then the prefill steps), then instruments that instance and runs
the decode steps with ``perf_counter_ns`` timers whose time is *exclusive*: a
timed call's time minus the time of the timed calls inside it, so the
categories add up to the instrumented step time with nothing counted twice.

Categories (what is timed, on the instance or for the measured pass only):

  validation        ``validate_save``, ``check_scheduled``, ``validate_hit``,
                    ``classify_outputs``, ``copy_leftovers``, slot/row/capacity checks,
                    ``check_usable``
  state machine     ``TableMachine.fire`` of the staging and the write machine
  locks             acquire + release of every runtime lock (state, staging,
                    write book, pool leaf lock, drain lock), via timing proxies
                    installed through the manager's ``wrap_locks`` seam
  staging slots     claim/save/consume/done_reading/hold/unhold/page views
  tenancy           register/plan/unplan/land_all/read (versions and pins)
  write book        register/enqueue/pop/fire/get/wait and the committer's
                    kick/drain/process
  copies            every ``Tensor.copy_``, ``index_copy_``, ``index_select``,
                    ``clone`` and ``torch.cat`` during the pass (torch patched
                    for the pass only, then restored), and the landing's
                    ``scatter_rows``
  output views      ``Tensor.split_with_sizes`` and ``reader.per_request``: the one
                    tensor per request and key that materialize returns (views of the
                    step's private copy) and its entry in the key's dict
  output assembly   ``StepReader.build_outputs`` / ``read_hit`` themselves
  manager glue      the rest of ``new_step_starts``/``save_outputs``/``materialize``, the
                    write scheduling (``WriteScheduler.register``/``after_save``/``flush``),
                    the pending hits and ``StepReader.release``

Each timer costs about a microsecond, part of which lands in its caller's
exclusive time; that part is calibrated (a timed no-op called from a timed
loop) and removed from each caller per timed child call. The report gives the
sum of the categories next to the same decode steps run without timers (and
with them), so the reader sees how well they agree. Upholds nothing.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from omni_cache.harness.bench import runner as _runner
from omni_cache.harness.bench.runner import ManagerFactory, run_manager_once
from omni_cache.harness.bench.workload import Workload, WorkloadSpec, build_workload
from omni_cache.runtime.interface import ModelCachePolicy

CATEGORIES: tuple[str, ...] = ("validation", "state machine", "locks", "staging slots", "tenancy",
                               "write book", "copies", "output views", "output assembly", "manager glue")
# Not bookkeeping: the copies themselves, and making the one tensor per request and key that
# materialize must return (views of the step's private copy).
NOT_BOOKKEEPING: frozenset[str] = frozenset({"copies", "output views"})

# (category, path from the manager, attributes)
_METHODS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("validation", "", ("check_usable",)),
    ("validation", "pool", ("check_slots", "check_sigs")),
    ("validation", "staging", ("check_sigs", "check_capacity")),
    ("state machine", "staging.machine", ("fire",)),
    ("state machine", "book.machine", ("fire",)),
    ("staging slots", "staging", ("claim", "save", "consume", "done_reading", "hold", "unhold",
                                  "claimed_pages", "pages_rows", "abort")),
    ("tenancy", "tenancy", ("register", "plan", "unplan", "land_all", "read", "prepare_keys")),
    ("write book", "book", ("register", "enqueue", "start_next", "fire", "get", "wait", "check_failed",
                            "queue_length")),
    ("write book", "committer", ("kick", "drain", "process")),
    ("output assembly", "reader", ("build_outputs", "read_hit")),
    ("manager glue", "", ("new_step_starts", "save_outputs", "materialize")),
    ("manager glue", "scheduling", ("register", "after_save", "flush")),
    ("manager glue", "reader", ("release",)),
    ("manager glue", "hits", ("take", "hit_keys", "slots_of")),
)
# Module globals of omni_cache.runtime.manager, patched for the pass only.
_MANAGER_GLOBALS: tuple[tuple[str, str], ...] = (
    ("validation", "validate_save"), ("validation", "validate_hit"), ("validation", "classify_outputs"),
    ("validation", "copy_leftovers"), ("manager glue", "plan_events"), ("manager glue", "caller_location"),
    ("validation", "check_scheduled"),
)
# Module globals of omni_cache.runtime.reader, patched for the pass only.
_READER_GLOBALS: tuple[tuple[str, str], ...] = (("output views", "per_request"),)
# Module globals of omni_cache.runtime.tenancy (the landing's scatter), patched for the pass only.
_TENANCY_GLOBALS: tuple[tuple[str, str], ...] = (("copies", "scatter_rows"),)
_TENSOR_COPIES: tuple[str, ...] = ("copy_", "index_copy_", "index_select", "clone")
_TENSOR_VIEWS: tuple[str, ...] = ("split_with_sizes",)


class _Clock:
    """Exclusive-time accounting over nested timed calls (one thread: the bench runs eager).

    A timer's own cost falls partly outside the child's measured interval, into its
    caller's; ``overhead_ns`` (calibrated by ``calibrate``) is that cost per timed child
    call, and ``corrected`` removes it from each caller's category.
    """

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.child_calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[int]] = []
        self.overhead_ns = 0.0

    def wrap(self, fn: Callable[..., Any], category: str) -> Callable[..., Any]:
        clock, stack, ns, calls, child_calls = (time.perf_counter_ns, self._stack, self.ns, self.calls,
                                                self.child_calls)

        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [0, 0]  # [ns of timed children, number of timed children]
            stack.append(frame)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - t0
                stack.pop()
                ns[category] += elapsed - frame[0]
                child_calls[category] += frame[1]
                calls[category] += 1
                if stack:
                    stack[-1][0] += elapsed
                    stack[-1][1] += 1

        return timed

    def calibrate(self, rounds: int = 5, n: int = 2000) -> float:
        """Median ns a timed child call adds to its caller's exclusive time."""
        import statistics

        samples = []
        for _ in range(rounds):
            probe = _Clock()
            noop = probe.wrap(lambda: None, "child")

            def timed_children(f: Callable[[], None] = noop) -> None:
                for _ in range(n):
                    f()

            def plain_children(f: Callable[[], None] = lambda: None) -> None:
                for _ in range(n):
                    f()

            probe.wrap(timed_children, "parent")()
            t0 = time.perf_counter_ns()
            plain_children()
            plain = time.perf_counter_ns() - t0
            samples.append(max(0.0, (probe.ns["parent"] - plain) / n))
        self.overhead_ns = statistics.median(samples)
        return self.overhead_ns

    def corrected(self, category: str) -> float:
        return max(0.0, self.ns.get(category, 0) - self.child_calls.get(category, 0) * self.overhead_ns)


class _TimedLock:
    """A lock proxy whose acquire and release are timed as ``locks``."""

    def __init__(self, inner: Any, clock: _Clock) -> None:
        self._inner = inner
        self.acquire = clock.wrap(inner.acquire, "locks")
        self.release = clock.wrap(inner.release, "locks")

    def __enter__(self) -> Any:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def locked(self) -> bool:
        return bool(self._inner.locked())

    def _is_owned(self) -> bool:  # threading.Condition's ownership test, without an extra acquire
        return bool(self._inner.locked())


def _resolve(manager: Any, path: str) -> Any:
    owner = manager
    for part in filter(None, path.split(".")):
        owner = getattr(owner, part)
    return owner


def _drop_instance_attr(owner: Any, attr: str) -> None:
    """Undo a wrapper set on the instance: the class's method shows through again."""
    if attr in vars(owner):
        delattr(owner, attr)


def _instrument(manager: Any, clock: _Clock) -> tuple[Callable[[], None], Callable[[], None]]:
    """Wrap the instance's methods, swap its locks, patch globals and torch; return the undo of
    all but the locks, and the undo of the locks (run after it)."""
    import omni_cache.runtime.manager as manager_module
    import omni_cache.runtime.reader as reader_module
    import omni_cache.runtime.tenancy as tenancy_module

    undo: list[Callable[[], None]] = []
    for category, path, attrs in _METHODS:
        owner = _resolve(manager, path)
        for attr in attrs:
            fn = getattr(owner, attr)
            setattr(owner, attr, clock.wrap(fn, category))
            undo.append(functools.partial(_drop_instance_attr, owner, attr))
    for module, names in ((manager_module, _MANAGER_GLOBALS), (reader_module, _READER_GLOBALS),
                          (tenancy_module, _TENANCY_GLOBALS)):
        for category, name in names:
            fn = getattr(module, name)
            setattr(module, name, clock.wrap(fn, category))
            undo.append(functools.partial(setattr, module, name, fn))
    # Locks: the state lock's inner lock, the staging and write-book locks with their
    # conditions, the pool's leaf lock and the committer's drain lock.
    undo_locks = manager.wrap_locks(lambda lock: _TimedLock(lock, clock))
    for tensor_methods, category in ((_TENSOR_COPIES, "copies"), (_TENSOR_VIEWS, "output views")):
        for name in tensor_methods:
            original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, clock.wrap(original, category))
            undo.append(functools.partial(setattr, torch.Tensor, name, original))
    original_cat = torch.cat
    setattr(torch, "cat", clock.wrap(original_cat, "copies"))  # noqa: B010 (patched for the pass only)
    undo.append(functools.partial(setattr, torch, "cat", original_cat))

    def restore() -> None:
        for fn in reversed(undo):
            fn()

    return restore, undo_locks


@dataclass
class BreakdownRow:
    category: str
    us_per_step: float
    calls_per_step: float
    share: float  # of the instrumented step time


@dataclass
class Breakdown:
    batch_size: int
    steps: int
    rows: list[BreakdownRow]
    measured_us_per_step: float  # the sum of the categories (timer cost removed from callers)
    plain_us_per_step: float  # the same decode steps, same manager, no timers (median of passes)
    instrumented_us_per_step: float  # the timed steps as the runner saw them, timers included

    @property
    def bookkeeping_us_per_step(self) -> float:
        """Everything but the copies and the per-request output views (instrumented)."""
        return sum(r.us_per_step for r in self.rows if r.category not in NOT_BOOKKEEPING)

    def to_json(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "steps": self.steps,
                "measured_us_per_step": self.measured_us_per_step,
                "instrumented_us_per_step": self.instrumented_us_per_step,
                "plain_us_per_step": self.plain_us_per_step,
                "bookkeeping_us_per_step": self.bookkeeping_us_per_step,
                "rows": [vars(r) for r in self.rows]}


def step_breakdown(
    spec: WorkloadSpec, *, passes: int = 3, manager_factory: ManagerFactory | None = None
) -> Breakdown:
    """Exclusive µs per decode step by category (eager mode; median over ``passes`` timed passes)."""
    import statistics

    workload = build_workload(spec)
    manager = (manager_factory or _runner.default_manager_factory)(spec.cache_config(), True)
    manager.register_policy(ModelCachePolicy())
    prefill = [s for s in workload.steps if s.phase == "prefill"]
    decode = [s for s in workload.steps if s.phase == "decode"]
    if not decode:
        raise ValueError("step_breakdown needs decode steps")
    nothing = _finish_nothing()

    def pass_of(steps: list[Any], finish: Any) -> Workload:
        return Workload(spec, workload.req_ids, workload.truth, workload.block_tables, steps, finish)

    plain: list[float] = []
    per_pass: list[tuple[dict[str, float], dict[str, int], int]] = []
    try:
        run_manager_once(manager, workload)  # warm-up (checked)
        for _ in range(passes):
            run_manager_once(manager, pass_of(prefill, nothing))
            plain_times = run_manager_once(manager, pass_of(decode, workload.finish), check=False)
            plain.append(sum(map(sum, plain_times.step_ns)))
            run_manager_once(manager, pass_of(prefill, nothing))
            clock = _Clock()
            clock.calibrate()
            restore, restore_locks = _instrument(manager, clock)
            try:
                times = run_manager_once(manager, pass_of(decode, nothing), check=False)
            finally:
                restore()
                restore_locks()
            run_manager_once(manager, pass_of([], workload.finish))
            corrected = {cat: clock.corrected(cat) for cat in CATEGORIES}
            per_pass.append((corrected, dict(clock.calls), sum(map(sum, times.step_ns))))
    finally:
        manager.shutdown()
    steps = len(decode)
    med = statistics.median
    instrumented = med(t for _, _, t in per_pass) / steps / 1e3
    total = sum(med(ns.get(cat, 0) for ns, _, _ in per_pass) for cat in CATEGORIES) / steps / 1e3
    rows = []
    for cat in CATEGORIES:
        us = med(ns.get(cat, 0) for ns, _, _ in per_pass) / steps / 1e3
        calls = med(c.get(cat, 0) for _, c, _ in per_pass) / steps
        rows.append(BreakdownRow(cat, us, calls, us / total if total else 0.0))
    return Breakdown(spec.batch_size, steps, rows, total, med(plain) / steps / 1e3, instrumented)


def _finish_nothing() -> Any:
    from omni_cache.runtime.events import PrefixCacheStep

    return PrefixCacheStep(())


def breakdown_table(results: list[Breakdown]) -> Any:
    from rich.table import Table

    table = Table(title="per decode step, exclusive µs by category (measured: perf_counter_ns timers, eager, "
                        "median of passes)", title_justify="left")
    table.add_column("category", justify="left")
    for b in results:
        table.add_column(f"µs @ {b.batch_size} req", justify="right")
        table.add_column("calls", justify="right")
    for i, cat in enumerate(CATEGORIES):
        cells = []
        for b in results:
            row = b.rows[i]
            cells += [f"{row.us_per_step:,.1f} ({row.share:.0%})", f"{row.calls_per_step:,.0f}"]
        table.add_row(cat, *cells)
    table.add_row("= sum (timer cost removed)", *[c for b in results for c in (f"{b.measured_us_per_step:,.1f}", "")])
    table.add_row("bookkeeping (all but copies, views)",
                  *[c for b in results for c in (f"{b.bookkeeping_us_per_step:,.1f}", "")])
    table.add_row("same steps, no timers", *[c for b in results for c in (f"{b.plain_us_per_step:,.1f}", "")])
    table.add_row("same steps, timers on", *[c for b in results for c in (f"{b.instrumented_us_per_step:,.1f}", "")])
    return table
