"""``omni-cache selfcheck``: one miss and one hit round trip through the public API.

Owns nothing; prints each protocol call it makes and what came back, and exits
non-zero if any returned row differs from what was saved.

Upholds nothing itself: it checks one miss and one hit through the public API.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "selfcheck", help="one save -> materialize round trip (a miss, then a hit) through the public API"
    )
    parser.add_argument("--async", dest="use_async", action="store_true",
                        help="use the committer thread (eager=False) instead of inline copies")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from omni_cache import (
        ModelCachePolicy,
        PrefixCacheConfig,
        PrefixCacheEventKind,
        PrefixCacheRequestEvent,
        PrefixCacheWriteLayout,
    )
    from omni_cache.runtime.manager import OmniPrefixCacheManager

    bs, width = 16, 64
    cfg = PrefixCacheConfig(num_blocks=64, block_size=bs, staging_depth=2, staging_capacity_tokens=256)
    manager = OmniPrefixCacheManager(cfg, eager=not args.use_async)
    manager.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio.embeds"})))
    mode = "eager (inline copies)" if manager.eager else "async (committer thread)"
    print(f"config: {cfg}\nmode: {mode}")

    def rows(seed: int, n: int, w: int) -> torch.Tensor:
        return torch.randn(n, w, generator=torch.Generator().manual_seed(seed))

    def step_slots(blocks: list[int], start: int, end: int) -> torch.Tensor:
        return torch.tensor([blocks[p // bs] * bs + p % bs for p in range(start, end)])

    ok = True
    # 1. request A: a 48-token prompt on blocks 3,4,5 -- a miss
    manager.new_step_starts([PrefixCacheRequestEvent("A", PrefixCacheEventKind.STARTED, scheduled_tokens=48)])
    hidden_a, codes_a, embeds_a = rows(1, 48, width), rows(2, 48, 4), rows(3, 48, 8)
    layout = PrefixCacheWriteLayout.packed([("A", 0, 48)], step_slots([3, 4, 5], 0, 48))
    step = manager.save_outputs(hidden_a, {"audio.codes": codes_a, "audio.embeds": embeds_a, "meta": ["A"]},
                                num_tokens_unpadded=48, num_tokens_padded=48, write_layout=layout)
    out = manager.materialize(step, ["A"])
    got = out.hidden_states["A"] if out.hidden_states else None
    good = got is not None and torch.equal(got, hidden_a)
    ok &= good
    print(f"step {step}: A miss, saved 48 rows -> materialize hidden {tuple(got.shape) if got is not None else None} "
          f"{'OK' if good else 'MISMATCH'}; mm keys {sorted(out.mm_for('A'))}")
    # 2. A finishes (its deferred rows land); B hits A's first 32 tokens and computes 8 more
    manager.new_step_starts([
        PrefixCacheRequestEvent("A", PrefixCacheEventKind.FINISHED),
        PrefixCacheRequestEvent("B", PrefixCacheEventKind.STARTED, hit_end=32, block_ids=((3, 4, 9),),
                                scheduled_tokens=8),
    ])
    hidden_b, codes_b, embeds_b = rows(4, 8, width), rows(5, 8, 4), rows(6, 8, 8)
    layout = PrefixCacheWriteLayout.packed([("B", 32, 40)], step_slots([3, 4, 9], 32, 40))
    step = manager.save_outputs(hidden_b, {"audio.codes": codes_b, "audio.embeds": embeds_b},
                                num_tokens_unpadded=8, num_tokens_padded=8, write_layout=layout)
    out = manager.materialize(step, ["B"])
    expect = {
        "hidden": torch.cat([hidden_a[:32], hidden_b]),
        "audio.codes": torch.cat([codes_a[:32], codes_b]),
        "audio.embeds": torch.cat([embeds_a[:32], embeds_b]),
    }
    got_all = {"hidden": out.hidden_states["B"] if out.hidden_states else None, **out.mm_for("B")}
    for key, want in expect.items():
        value = got_all.get(key)
        good = isinstance(value, torch.Tensor) and torch.equal(value, want)
        ok &= good
        print(f"step {step}: B hit 32 + 8 new -> {key} {tuple(value.shape) if value is not None else None} "
              f"{'OK' if good else 'MISMATCH'}")
    report = manager.shutdown()
    stats = manager.stats()
    print(f"hits {stats['hits']} ({stats['hit_tokens']} tokens), misses {stats['misses']}, "
          f"pool bytes {stats['pool_bytes']}, unconsumed at shutdown {report or 'none'}")
    print("selfcheck " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1
