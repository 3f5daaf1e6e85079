"""Per-save cost of the private copy of ``write_layout.slots_cpu`` (int64 per token).

Usage: ``python tools/slot_copy_cost.py [--rounds 30]``. Prints, for decode steps of 8 and 32
requests (one token each) and a 512-token prefill, the cost of the copy itself
(``torch.Tensor.clone`` of n int64), the step's own row copies into a staging page (hidden
2048 bf16 + one per-token mm key 512 bf16, the decode13 widths), and ``save_outputs`` of an
eager manager with the copy and without it (``validation.check_slot_mapping`` swapped for the
uncopied view), interleaved round by round; every figure is the minimum over many short runs
(the box is shared: the minimum is the least disturbed run). The manager's own figures are
the fastest save of each round, then the median over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import torch

from omni_cache import PrefixCacheConfig, PrefixCacheStep, PrefixCacheWriteLayout
from omni_cache.runtime import validation
from omni_cache.runtime.manager import OmniPrefixCacheManager

HIDDEN, MM, BS = 2048, 512, 16


def _best(fn: object, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6  # type: ignore[arg-type]


def _uncopied(slots: torch.Tensor, n: int) -> torch.Tensor:
    """check_slot_mapping without the copy (the same checks; the probe's slots pass them all)."""
    if not (isinstance(slots, torch.Tensor) and slots.is_cpu and slots.dtype == torch.int64
            and len(shape := slots.shape) == 1 and shape[0] >= n):
        raise AssertionError("the probe's slots are valid")
    return slots if shape[0] == n else slots[:n]


_checked = validation.check_slot_mapping


def _save_cost(n: int, copy: bool, steps: int) -> float:
    """The fastest of ``steps`` timed saves (each discarded before the next)."""
    m = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=4096, block_size=BS, staging_depth=2,
                                                 staging_capacity_tokens=max(n, 64)), eager=True)
    reqs = [f"r{i}" for i in range(n)]
    hidden = torch.randn(n, HIDDEN, dtype=torch.bfloat16)
    mm = {"audio.codes": torch.randn(n, MM, dtype=torch.bfloat16)}
    slots = torch.arange(n, dtype=torch.int64) * BS
    layout = PrefixCacheWriteLayout.packed([(r, 0, 1) for r in reqs], slots)
    validation.check_slot_mapping = _checked if copy else _uncopied  # type: ignore[assignment]
    times = []
    try:
        for _ in range(steps):
            m.new_step_starts(PrefixCacheStep((), {r: 1 for r in reqs}))
            t = timeit.default_timer()
            step = m.save_outputs(hidden, mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)
            times.append((timeit.default_timer() - t) * 1e6)
            m.discard_step(step)
    finally:
        validation.check_slot_mapping = _checked  # type: ignore[assignment]
        m.shutdown()
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    for n in (8, 32, 512):
        slots = torch.arange(n, dtype=torch.int64)
        page_h = torch.empty(n, HIDDEN, dtype=torch.bfloat16)
        page_m = torch.empty(n, MM, dtype=torch.bfloat16)
        src_h, src_m = torch.randn(n, HIDDEN, dtype=torch.bfloat16), torch.randn(n, MM, dtype=torch.bfloat16)
        clone = _best(slots.clone, 200, 300)
        rows = _best(lambda ph=page_h, pm=page_m, sh=src_h, sm=src_m: (ph.copy_(sh), pm.copy_(sm)), 50, 300)
        with_copy, without = [], []
        for _ in range(args.rounds):  # interleaved: the same load sees both
            with_copy.append(_save_cost(n, True, 20))
            without.append(_save_cost(n, False, 20))
        a, b = statistics.median(with_copy), statistics.median(without)
        print(f"n={n:4d}: slots clone {clone:5.2f} us; the step's row copies into staging {rows:7.2f} us; "
              f"save_outputs {a:7.1f} us with the copy, {b:7.1f} us without ({a - b:+.1f} us; median over "
              f"{args.rounds} interleaved rounds of each round's fastest of 20 saves)")


if __name__ == "__main__":
    main()
