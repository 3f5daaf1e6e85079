"""What landing rows at their KV slots costs: torch's ``index_copy_`` against ``scatter_rows``.

Usage: ``python tools/scatter_cost.py [--rounds 7] [--save] [--json]``. For each width (2048 and 512, the
decode13 widths; 128, the tiny Llama's), dtype (bf16, fp32) and row count (1 and 8: decode steps;
512: a prefill step, its slots in runs of 16 as a KV block's), it times the scatter of that many
rows into a pool of 65,536 slots three ways, interleaved round by round: ``index_copy_``, the
numpy assignment ``scatter_rows`` takes for large writes (views included), and ``scatter_rows``
itself (which picks one of the two by ``SCATTER_NUMPY_MIN_BYTES``). Every figure is the minimum
over ``--rounds`` runs of many calls (the box is shared: the minimum is the least disturbed run);
every way's result is checked bit for bit against ``index_copy_``'s first. Exit 1 if one differs.

``--save`` also times an eager manager's ``save_outputs`` of one request's 512-token prefill step
(hidden 2048 bf16 plus one mm key of 512 bf16, the decode13 widths; the landing is inline) with the
tenancy landing through ``scatter_rows`` and through plain ``index_copy_`` (swapped in for that run
only), alternating round by round: each round's fastest of 10 saves, then the median over rounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import timeit
from collections.abc import Callable

import torch

from omni_cache.runtime.block_pool import SAME_SIZE_INT, SCATTER_NUMPY_MIN_BYTES, scatter_rows

NUM_SLOTS, BLOCK = 65_536, 16


def _slots(n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` distinct slots: one per random block for a decode step, whole blocks for a prefill."""
    if n <= 8:
        return (torch.randperm(NUM_SLOTS // BLOCK, generator=gen)[:n] * BLOCK).to(torch.int64)
    blocks = torch.randperm(NUM_SLOTS // BLOCK, generator=gen)[: -(-n // BLOCK)]
    return (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:n].to(torch.int64)


def _index_copy(dst: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, slots_np: object = None) -> None:
    """The landing as torch alone makes it (``slots_np``: ``scatter_rows``' signature, unused)."""
    dst.index_copy_(0, slots, rows)


def _numpy_only(dst: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    bits = SAME_SIZE_INT[rows.element_size()]
    dst.view(bits).numpy()[slots.numpy()] = rows.view(bits).numpy()


def measure(rounds: int) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(0)
    out: list[dict[str, object]] = []
    for dtype in (torch.bfloat16, torch.float32):
        for width in (2048, 512, 128):
            pool = torch.zeros(NUM_SLOTS, width, dtype=dtype)
            for n in (1, 8, 512):
                rows = torch.randn(n, width, generator=gen).to(dtype)
                slots = _slots(n, gen)
                args = (pool, slots, rows)
                ways = {"index_copy_": functools.partial(_index_copy, *args),
                        "numpy": functools.partial(_numpy_only, *args),
                        "scatter_rows": functools.partial(scatter_rows, *args)}
                expected = None
                for name, fn in ways.items():  # the same bits every way
                    pool.zero_()
                    fn()
                    got = pool[slots].clone()
                    if int(pool.count_nonzero()) != int(got.count_nonzero()):  # nothing outside the slots
                        raise SystemExit(f"scatter_cost: {name} wrote outside its slots ({dtype}, {width}, {n})")
                    if expected is None:
                        expected = got
                    elif not torch.equal(got.view(SAME_SIZE_INT[rows.element_size()]),
                                         expected.view(SAME_SIZE_INT[rows.element_size()])):
                        raise SystemExit(f"scatter_cost: {name} differs from index_copy_ ({dtype}, {width}, {n})")
                number = 2000 if n <= 8 else 100
                best = dict.fromkeys(ways, float("inf"))
                for _ in range(rounds):
                    for name, fn in ways.items():
                        best[name] = min(best[name], timeit.timeit(fn, number=number) / number * 1e6)
                out.append({"dtype": str(dtype).replace("torch.", ""), "width": width, "rows": n,
                            "bytes": rows.nbytes, "path": "numpy" if rows.nbytes >= SCATTER_NUMPY_MIN_BYTES
                            else "index_copy_", **{f"{k}_us": round(v, 2) for k, v in best.items()}})
    return out


def _prefill_saves(scatter: Callable[..., None], saves: int) -> float:
    """The fastest of ``saves`` eager saves of a fresh 512-token request each (µs), the tenancy
    landing its rows through ``scatter``."""
    from omni_cache import (
        ModelCachePolicy,
        OmniPrefixCacheManager,
        PrefixCacheConfig,
        PrefixCacheEventKind,
        PrefixCacheRequestEvent,
        PrefixCacheStep,
        PrefixCacheWriteLayout,
    )
    from omni_cache.runtime import tenancy

    n, hidden, mm = 512, torch.randn(512, 2048).to(torch.bfloat16), torch.randn(512, 512).to(torch.bfloat16)
    m = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=4096, block_size=BLOCK, staging_capacity_tokens=n),
                               eager=True)
    m.register_policy(ModelCachePolicy())
    kept = tenancy.scatter_rows
    tenancy.scatter_rows = scatter  # type: ignore[assignment]
    best = float("inf")
    try:
        for i in range(saves):
            req = f"r{i}"
            first = (i % 8) * (n // BLOCK)  # a fresh run of blocks, reused every 8 saves (new tenants)
            m.new_step_starts(PrefixCacheStep((PrefixCacheRequestEvent(req, PrefixCacheEventKind.STARTED),), {req: n}))
            layout = PrefixCacheWriteLayout.packed([(req, 0, n)], torch.arange(first * BLOCK, first * BLOCK + n))
            t = timeit.default_timer()
            step = m.save_outputs(hidden, {"mm.codes": mm}, num_tokens_unpadded=n, num_tokens_padded=n,
                                  write_layout=layout)
            best = min(best, (timeit.default_timer() - t) * 1e6)
            m.discard_step(step)
            m.new_step_starts(PrefixCacheStep((PrefixCacheRequestEvent(req, PrefixCacheEventKind.FINISHED),), {}))
    finally:
        tenancy.scatter_rows = kept
        m.shutdown()
    return best


def save_ab(rounds: int) -> dict[str, float]:
    """Median over ``rounds`` alternating rounds of each variant's fastest prefill save (µs)."""
    got: dict[str, list[float]] = {"scatter_rows": [], "index_copy_": []}
    for r in range(rounds):
        order = ("scatter_rows", "index_copy_") if r % 2 == 0 else ("index_copy_", "scatter_rows")
        for name in order:
            got[name].append(_prefill_saves(scatter_rows if name == "scatter_rows" else _index_copy, 10))
    return {name: statistics.median(v) for name, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--save", action="store_true", help="also time a prefill save both ways")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        print(f"scatter_cost: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    results = measure(args.rounds)
    saves = save_ab(args.rounds) if args.save else None
    if args.json:
        print(json.dumps({"scatter": results, "prefill_save_us": saves}, indent=2))
    else:
        print(f"{'dtype':9} {'width':>5} {'rows':>4} {'path':>11} {'index_copy_':>12} {'numpy':>8} {'scatter_rows':>13}")
        for r in results:
            print(f"{r['dtype']:9} {r['width']:>5} {r['rows']:>4} {r['path']:>11} {r['index_copy__us']:>10.2f}us "
                  f"{r['numpy_us']:>6.2f}us {r['scatter_rows_us']:>11.2f}us")
    if saves is not None and not args.json:
        print(f"save_outputs of a 512-token prefill step (median of {args.rounds} rounds' fastest of 10): "
              f"{saves['scatter_rows']:.1f} us landing through scatter_rows, {saves['index_copy_']:.1f} us "
              "through index_copy_")
    print(f"scatter_cost: OK: {len(results)} cases, each way bit for bit equal to index_copy_"
          + (", and a prefill save timed both ways" if saves is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
