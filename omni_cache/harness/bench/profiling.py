"""Where the manager's time goes, per step: cProfile, and cheap section timers.

Owns: ``profile_manager`` (one warmed-up pass of the bench workload through
the manager under ``cProfile``; ``ProfileRow`` is one function's own and
cumulative µs per step and calls per step) and ``section_times`` (the same
pass with ``perf_counter_ns`` wrappers on named internal calls of one manager
instance -- about 0.3 µs per wrapped call instead of cProfile's inflation of
every Python call). cProfile shows *which* functions; the section timers give
absolute µs per step. Sections nest (a trigger inside ``claim``), so their
times overlap; the report says which contains which. Upholds nothing itself;
the profiled passes are checked against the ground truth like any other.
"""

from __future__ import annotations

import cProfile
import functools
import pstats
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omni_cache.harness.bench import runner as _runner
from omni_cache.harness.bench.runner import ManagerFactory, run_manager_once
from omni_cache.harness.bench.workload import Workload, WorkloadSpec, build_workload
from omni_cache.runtime.interface import ModelCachePolicy


@dataclass
class ProfileRow:
    function: str  # "file:line(name)", the file relative to the package where possible
    calls_per_step: float
    own_us_per_step: float
    cum_us_per_step: float


def _name(func: tuple[str, int, str]) -> str:
    path, line, name = func
    if "omni_cache/" in path:
        path = "omni_cache/" + path.split("omni_cache/", 1)[1]
    elif path == "~":
        return name  # a builtin, e.g. "<method 'index_copy_' of 'torch._C.TensorBase' objects>"
    else:
        path = path.rsplit("/", 1)[-1]
    return f"{path}:{line}({name})"


def profile_manager(
    spec: WorkloadSpec,
    *,
    eager: bool = True,
    top: int = 25,
    decode_only: bool = True,
    manager_factory: ManagerFactory | None = None,
) -> tuple[list[ProfileRow], list[ProfileRow], dict[str, Any]]:
    """Profile one pass (after a warm-up pass); return the top rows by own and by cumulative time.

    With ``decode_only`` the profiled pass drops the two prefill steps after the
    warm-up (they are served, unprofiled, first), so the rows show the per-step
    bookkeeping of decode steps, where it matters most.
    """
    workload = build_workload(spec)
    manager = (manager_factory or _runner.default_manager_factory)(spec.cache_config(), eager)
    manager.register_policy(ModelCachePolicy())
    try:
        run_manager_once(manager, workload)  # warm-up
        prefill = [s for s in workload.steps if s.phase == "prefill"]
        decode = [s for s in workload.steps if s.phase == "decode"]
        profiled = workload
        if decode_only and decode:
            run_manager_once(manager, Workload(spec, workload.req_ids, workload.truth, workload.block_tables,
                                               prefill, _no_finish()))
            profiled = Workload(spec, workload.req_ids, workload.truth, workload.block_tables, decode,
                                workload.finish)
        profiler = cProfile.Profile()
        profiler.enable()
        run_manager_once(manager, profiled, check=False)
        profiler.disable()
    finally:
        manager.shutdown()
    steps = len(profiled.steps)
    stats = pstats.Stats(profiler)
    rows = []
    # typeshed's pstats.Stats omits its ``stats`` dict (function -> call counts and times) and ``total_tt``
    for func, (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(ProfileRow(_name(func), ncalls / steps, tottime / steps * 1e6, cumtime / steps * 1e6))
    by_own = sorted(rows, key=lambda r: r.own_us_per_step, reverse=True)[:top]
    by_cum = sorted(rows, key=lambda r: r.cum_us_per_step, reverse=True)[:top]
    meta = {"batch_size": spec.batch_size, "steps": steps, "mode": "eager" if eager else "async",
            "total_us_per_step": stats.total_tt / steps * 1e6}  # type: ignore[attr-defined]  # not in typeshed either
    return by_own, by_cum, meta


def _no_finish() -> Any:
    from omni_cache.runtime.events import PrefixCacheStep

    return PrefixCacheStep(())


# (path from the manager, attribute): the sections ``section_times`` wraps, when present.
SECTIONS: tuple[tuple[str, str], ...] = (
    ("", "new_step_starts"),
    ("", "save_outputs"),
    ("", "materialize"),
    ("hits", "take"),
    ("scheduling", "register"),
    ("scheduling", "after_save"),
    ("reader", "release"),
    ("", "check_usable"),
    ("reader", "build_outputs"),
    ("reader", "read_hit"),
    ("staging", "claim"),
    ("staging", "save"),
    ("staging", "consume"),
    ("staging", "done_reading"),
    ("staging", "claimed_page"),
    ("staging", "claimed_pages"),
    ("staging", "page_rows"),
    ("staging.machine", "fire"),
    ("book", "register"),
    ("book", "enqueue"),
    ("book.machine", "fire"),
    ("book", "wait"),
    ("committer", "process"),
    ("copies", "copy_into"),
    ("copies", "to_host"),
    ("tenancy", "register"),
    ("tenancy", "plan"),
    ("tenancy", "land_all"),
    ("tenancy", "read"),
    ("pool", "check_slots"),
)


@dataclass
class SectionRow:
    section: str
    calls_per_step: float
    us_per_step: float
    us_per_call: float


def _wrap(fn: Callable[..., Any], acc: list[int]) -> Callable[..., Any]:
    clock = time.perf_counter_ns

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += clock() - t0
            acc[1] += 1

    return timed


def section_times(
    spec: WorkloadSpec,
    *,
    eager: bool = True,
    manager_factory: ManagerFactory | None = None,
) -> tuple[list[SectionRow], dict[str, Any]]:
    """Inclusive µs per decode step of each named internal call (wrapped on one instance)."""
    workload = build_workload(spec)
    manager = (manager_factory or _runner.default_manager_factory)(spec.cache_config(), eager)
    manager.register_policy(ModelCachePolicy())
    accs: dict[str, list[int]] = {}
    try:
        run_manager_once(manager, workload)  # warm-up, unwrapped
        prefill = [s for s in workload.steps if s.phase == "prefill"]
        decode = [s for s in workload.steps if s.phase == "decode"]
        run_manager_once(manager, Workload(spec, workload.req_ids, workload.truth, workload.block_tables,
                                           prefill, _no_finish()))
        for path, attr in SECTIONS:
            owner = manager
            for part in filter(None, path.split(".")):
                owner = getattr(owner, part, None)
            fn = getattr(owner, attr, None) if owner is not None else None
            if fn is None or not callable(fn):
                continue
            name = f"{path}.{attr}" if path else f"manager.{attr}"
            accs[name] = [0, 0]
            setattr(owner, attr, _wrap(fn, accs[name]))
        profiled = Workload(spec, workload.req_ids, workload.truth, workload.block_tables, decode, _no_finish())
        t0 = time.perf_counter_ns()
        times = run_manager_once(manager, profiled, check=False)
        wall = time.perf_counter_ns() - t0
    finally:
        manager.shutdown()
    steps = max(1, len(decode))
    rows = [SectionRow(name, calls / steps, ns / steps / 1e3, ns / calls / 1e3 if calls else 0.0)
            for name, (ns, calls) in accs.items() if calls]
    meta = {"batch_size": spec.batch_size, "steps": steps, "mode": "eager" if eager else "async",
            "timed_us_per_step": times.total_ns / steps / 1e3, "wall_us_per_step": wall / steps / 1e3}
    return rows, meta
