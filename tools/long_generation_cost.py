#!/usr/bin/env python3
"""What a save costs late in a long generation with a key written on finish (a diagnostic).

One request decodes ``--steps`` one-token steps with a hidden key and a deferred (``JOIN_ON_FINISH``)
key, under a budget that keeps every deferred write open until the request ends (the talker's
codes of a long answer). Each save is timed; the tool prints the median of the first and of the
last ``--window`` saves and their ratio. A per-step cost that grows with the request's age (a
scan of its open writes, say) shows as a ratio well above 1; the ratio of a flat cost stays near
1 on a quiet machine. Every step is consumed (``discard_step``) and the run ends with the
request's writes landed and nothing unconsumed, or it fails.

    .venv/bin/python tools/long_generation_cost.py --steps 3000
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="decode steps of the one request (>= 4 x window)")
    parser.add_argument("--window", type=int, default=200, help="saves in each of the two medians (>= 10)")
    parser.add_argument("--width", type=int, default=256, help="hidden width (the deferred key is 16 wide)")
    args = parser.parse_args(argv)
    if args.window < 10 or args.steps < 4 * args.window or args.width < 16:
        print("long_generation_cost: need --window >= 10, --steps >= 4 x --window and --width >= 16",
              file=sys.stderr)
        return 2

    import torch

    from omni_cache import ModelCachePolicy, OmniPrefixCacheManager, PrefixCacheConfig, PrefixCacheWriteLayout
    from omni_cache.runtime.events import PrefixCacheEventKind, PrefixCacheRequestEvent

    block_size = 16
    blocks = args.steps // block_size + 1
    config = PrefixCacheConfig(num_blocks=blocks, block_size=block_size, staging_depth=4,
                               staging_capacity_tokens=64, gpu_staging_bytes=1 << 40)
    manager = OmniPrefixCacheManager(config, eager=True)
    manager.register_policy(ModelCachePolicy(deferred_keys=frozenset({"codes"})))
    manager.new_step_starts([PrefixCacheRequestEvent("a", PrefixCacheEventKind.STARTED,
                                                     block_ids=[list(range(blocks))])])
    hidden = torch.randn(1, args.width)
    times: list[int] = []
    gc.disable()
    try:
        for position in range(args.steps):
            layout = PrefixCacheWriteLayout.packed([("a", position, position + 1)], torch.tensor([position]))
            start = time.perf_counter_ns()
            step_id = manager.save_outputs(hidden, {"codes": hidden[:, :16].clone()}, num_tokens_unpadded=1,
                                           num_tokens_padded=1, write_layout=layout)
            times.append(time.perf_counter_ns() - start)
            manager.discard_step(step_id)
        open_writes = manager.stats()["deferred_open"]
        manager.new_step_starts([PrefixCacheRequestEvent("a", PrefixCacheEventKind.FINISHED)])
    finally:
        gc.enable()
        unconsumed = manager.shutdown()
    stats = manager.stats()
    landed = stats["writes_written"]  # each step's immediate write and its deferred one
    if open_writes != args.steps or stats["deferred_open"] or stats["writes_in_flight"] or unconsumed \
            or stats["failed"] is not None or landed != 2 * args.steps:
        print(f"long_generation_cost: FAILED: {open_writes} open writes before the finish (expected {args.steps}), "
              f"{stats['deferred_open']} open and {stats['writes_in_flight']} in flight after it, {landed} writes "
              f"landed (expected {2 * args.steps}), failure {stats['failed']!r}, unconsumed {unconsumed}",
              file=sys.stderr)
        return 1
    first = statistics.median(times[: args.window]) / 1e3
    last = statistics.median(times[-args.window:]) / 1e3
    print(f"one request, {args.steps} one-token saves (hidden {args.width} + a deferred key, every write open "
          f"until the finish, all {args.steps} landed at it): median save of the first {args.window} "
          f"{first:.1f} µs, of the last {args.window} {last:.1f} µs, last / first {last / first:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
