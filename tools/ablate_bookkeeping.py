#!/usr/bin/env python3
"""Where a decode step's bookkeeping grows with the requests: the sweep's narrow measurement with
one per-request piece of the runtime switched off at a time (a diagnostic, never a result).

Owns: the ablations and their table. Each ablation replaces one piece of work that touches every
request of a decode step with nothing, for the run only (monkeypatched in this process; the
working tree is not written), then measures ``narrow.narrow_bookkeeping`` at two numbers of
requests, alternating with the unchanged runtime round by round. The growth one piece costs is
the unchanged growth minus the ablated growth. Every output is still checked against the ground
truth, so an ablation that would serve wrong rows on this workload fails the run instead:

* ``range check``: ``PrefixBlockPool.check_slots`` returns the slots unchecked (range and repeats);
* ``scheduled copy``: ``new_step_starts`` keeps the step's scheduled-count dict instead of a copy;
* ``scheduled check``: ``check_scheduled`` compares nothing;
* ``version writes``: a decode step (one row per request) registers no tenancy versions (its rows
  are never read by a hit in this workload; a prefill step still registers them).

An ablation removes a check or a record an invariant needs (I5, I6, I7): this tool exists to
measure their cost, and nothing in the package can switch them off.

    .venv/bin/python tools/ablate_bookkeeping.py --requests 1 128 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import omni_cache.runtime.manager as manager_module
from omni_cache.harness.bench.narrow import narrow_bookkeeping
from omni_cache.harness.bench.sweep import SWEEP_SHAPE
from omni_cache.harness.bench.workload import WorkloadSpec
from omni_cache.runtime.block_pool import PrefixBlockPool
from omni_cache.runtime.scheduling import WriteScheduler


def _unchecked_slots(self: PrefixBlockPool, slots: Any, **_checks: Any) -> Any:
    return slots.numpy()


def _no_scheduled_check(scheduled: Any, rows: Any) -> None:
    return None


@contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextmanager
def _scheduled_copy() -> Iterator[None]:
    real_dict = dict

    def keep(arg: Any = (), /, **kw: Any) -> Any:
        return arg if not kw and type(arg) is real_dict else real_dict(arg, **kw)

    # A module global ``dict`` shadows the builtin in the manager module only: its copy of a
    # step's scheduled counts (``dict(step.scheduled_tokens)``) becomes the step's own dict.
    assert "dict" not in vars(manager_module), "the manager module defines dict: ablation bug"
    manager_module.dict = keep  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del manager_module.dict  # type: ignore[attr-defined]


@contextmanager
def _version_writes() -> Iterator[None]:
    real = WriteScheduler.register

    def register(self: WriteScheduler, schedule: Any, step_id: Any, slots: Any, slots_np: Any,
                 source: Any, staging_slot: Any, req_ids: Any, registered: Any, sigs: Any) -> Any:
        if len(slots_np) != len(req_ids):  # not a decode step: unchanged
            return real(self, schedule, step_id, slots, slots_np, source, staging_slot, req_ids, registered, sigs)
        self.tenancy.register = lambda *a, **k: set()  # type: ignore[method-assign]
        try:
            return real(self, schedule, step_id, slots, slots_np, source, staging_slot, req_ids, registered, sigs)
        finally:
            del self.tenancy.register  # the class's method again

    with _patched(WriteScheduler, "register", register):
        yield


ABLATIONS: dict[str, Callable[[], Any]] = {
    "range check": lambda: _patched(PrefixBlockPool, "check_slots", _unchecked_slots),
    "scheduled copy": _scheduled_copy,
    "scheduled check": lambda: _patched(manager_module, "check_scheduled", _no_scheduled_check),
    "version writes": _version_writes,
}


def measure(requests: list[int], num_blocks: int, passes: int, decode_steps: int) -> dict[int, float]:
    shape = {**SWEEP_SHAPE, "decode_steps": decode_steps}
    return {b: narrow_bookkeeping(WorkloadSpec(batch_size=b, num_blocks=num_blocks, **shape),
                                  passes=passes).bookkeeping_us for b in requests}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs=2, default=[1, 128], metavar=("FEW", "MANY"))
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--decode-steps", type=int, default=SWEEP_SHAPE["decode_steps"])
    args = parser.parse_args(argv)
    few, many = args.requests
    if not 1 <= few < many or min(args.rounds, args.passes, args.decode_steps) < 1:
        print("ablate_bookkeeping: need 1 <= FEW < MANY and --rounds, --passes, --decode-steps >= 1", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[int, float]]] = {name: [] for name in ("none", *ABLATIONS)}
    for r in range(args.rounds):
        for name in runs:
            if name == "none":
                runs[name].append(measure([few, many], args.num_blocks, args.passes, args.decode_steps))
            else:
                with ABLATIONS[name]():
                    runs[name].append(measure([few, many], args.num_blocks, args.passes, args.decode_steps))
            print(f"round {r + 1}/{args.rounds}: {name} done", file=sys.stderr)
    med = {name: {b: statistics.median(x[b] for x in xs) for b in (few, many)} for name, xs in runs.items()}
    base_growth = med["none"][many] - med["none"][few]
    print(f"bookkeeping µs per decode step (median of {args.rounds} rounds; {args.num_blocks} blocks)")
    print(f"{'ablated':<18}{few:>10}{many:>10}{'growth':>10}{'its growth':>12}")
    for name, m in med.items():
        growth = m[many] - m[few]
        share = "" if name == "none" else f"{base_growth - growth:>12.1f}"
        print(f"{name:<18}{m[few]:>10.1f}{m[many]:>10.1f}{growth:>10.1f}{share}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
