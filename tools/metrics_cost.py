"""Per-step cost of the worker's metrics report, against the cache's own decode step.

Usage: ``python tools/metrics_cost.py [--requests 16] [--rounds 40]``. An eager manager (hidden
2048 bf16, block size 16) runs decode steps of ``--requests`` requests (one token each:
``save_outputs`` then ``discard_step``, as a served worker consumes each step); after each step,
``CacheMetricsReporter.report()`` -- what ``OmniKVConnector.get_kv_connector_stats`` calls once
per engine step -- reads the same numbers a served engine reports. Steps and reports alternate,
round by round; the figures are the medians over the rounds (the first five dropped), and the
ratio is the report's cost over the step's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from omni_cache import PrefixCacheConfig, PrefixCacheRequestEvent, PrefixCacheWriteLayout
from omni_cache.integration.metrics import CacheMetricsReporter
from omni_cache.runtime.errors import ErrorTally
from omni_cache.runtime.manager import OmniPrefixCacheManager

HIDDEN, BS = 2048, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    n = args.requests
    config = PrefixCacheConfig(num_blocks=n * 8, block_size=BS, staging_capacity_tokens=max(n, 64))
    manager = OmniPrefixCacheManager(config, eager=True)
    bridge = SimpleNamespace(hooks=SimpleNamespace(manager=manager, config=config), errors=ErrorTally(),
                             failed=None, delivery=None)
    reporter = CacheMetricsReporter()
    reporter.bind(bridge, output_rank=True)
    reqs = [f"r{i}" for i in range(n)]
    manager.new_step_starts([PrefixCacheRequestEvent(r, "started") for r in reqs])
    hidden = torch.randn(n, HIDDEN, dtype=torch.bfloat16)
    steps: list[float] = []
    reports: list[float] = []
    for position in range(args.rounds + 5):
        slots = torch.tensor([i * 8 * BS + position for i in range(n)], dtype=torch.int64)
        layout = PrefixCacheWriteLayout.packed([(r, position, position + 1) for r in reqs], slots)
        t0 = time.perf_counter()
        step = manager.save_outputs(hidden, {}, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)
        manager.discard_step(step)
        t1 = time.perf_counter()
        reporter.report()
        t2 = time.perf_counter()
        if position >= 5:
            steps.append(t1 - t0)
            reports.append(t2 - t1)
    manager.shutdown()
    step_us, report_us = statistics.median(steps) * 1e6, statistics.median(reports) * 1e6
    print(f"decode step of {n} requests (save_outputs + discard_step): {step_us:.0f} us; "
          f"metrics report: {report_us:.1f} us; report / step: {report_us / step_us:.3f}")


if __name__ == "__main__":
    main()
