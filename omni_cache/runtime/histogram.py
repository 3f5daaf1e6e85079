"""Durations, kept bounded: the claim-wait history behind ``stats()`` and the observations
handed to metrics.

Owns: ``WaitHistogram`` and ``ObservationLog``. A ``WaitHistogram``'s memory and the cost of a
percentile are constant in the number of recorded values (a fixed array of buckets, 2**(1/8)
apart: about 9% resolution from 1 microsecond to about 3 hours), so a long run's ``stats()``
neither grows nor slows down; the maximum is kept exactly. An ``ObservationLog`` holds the
values recorded since its last ``take`` -- at most ``capacity`` of them, the oldest dropped
(and counted) beyond that -- so a reader that takes them now and then (a metrics report per
engine step) sees every value once, and one that never reads costs a fixed amount of memory.

Upholds the observability half of I2 (the waits behind bounded staging are
reported) without an unbounded history. Not thread-safe: the owner locks.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

_BASE_S = 1e-6  # upper bound of bucket 0: every wait up to one microsecond
_PER_DOUBLING = 8
_NUM_BUCKETS = 8 * 34  # up to 1e-6 * 2**34 s (about 4.8 hours); longer waits land in the last bucket


class WaitHistogram:
    """Counts of durations in log-spaced buckets, plus the exact count and maximum."""

    __slots__ = ("buckets", "count", "max_s")

    def __init__(self) -> None:
        self.buckets = [0] * _NUM_BUCKETS
        self.count = 0
        self.max_s = 0.0

    @staticmethod
    def _bucket(seconds: float) -> int:
        if not seconds > _BASE_S:  # also NaN and negatives: bucket 0
            return 0
        return min(_NUM_BUCKETS - 1, math.ceil(math.log2(seconds / _BASE_S) * _PER_DOUBLING))

    @staticmethod
    def _upper(bucket: int) -> float:
        return _BASE_S * float(2.0 ** (bucket / _PER_DOUBLING))  # float ** float is typed Any (complex)

    def record(self, seconds: float) -> None:
        self.buckets[self._bucket(seconds)] += 1
        self.count += 1
        if seconds > self.max_s:
            self.max_s = seconds

    def percentiles(self, qs: Sequence[float]) -> list[float]:
        """Nearest-rank percentiles, each the upper bound of its bucket (never above the maximum).

        A reported value is at least the true percentile and at most ~9% above it.
        """
        if not self.count:
            return [0.0 for _ in qs]
        ranks = [max(1, math.ceil(q * self.count)) for q in qs]
        out: list[float] = [self.max_s] * len(qs)
        seen = 0
        pending = sorted(range(len(qs)), key=lambda i: ranks[i])
        for bucket, n in enumerate(self.buckets):
            if not n:
                continue
            seen += n
            while pending and ranks[pending[0]] <= seen:
                out[pending.pop(0)] = min(self._upper(bucket), self.max_s)
            if not pending:
                break
        return out

    def footprint(self) -> int:
        """How many numbers the history stores (constant)."""
        return len(self.buckets) + 2


class ObservationLog:
    """The values recorded since the last ``take``: at most ``capacity``, the oldest dropped first.

    ``record`` is the deque's own ``append`` (no Python line per value: it sits on the per-step
    path); the owner counts what it recorded, and ``dropped(recorded)`` says how many of those
    were pushed out unread."""

    __slots__ = ("_values", "record", "taken")

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"ObservationLog: capacity must be >= 1, got {capacity}")
        self._values: collections.deque[float] = collections.deque(maxlen=capacity)
        self.record = self._values.append
        self.taken = 0  # values handed out by ``take`` so far

    @property
    def capacity(self) -> int:
        return self._values.maxlen or 0

    def take(self) -> tuple[float, ...]:
        """Every value recorded since the last ``take`` (oldest first), and forget them."""
        values = tuple(self._values)
        self._values.clear()
        self.taken += len(values)
        return values

    def dropped(self, recorded: int) -> int:
        """Of ``recorded`` values (the owner's count), how many were pushed out unread."""
        return recorded - self.taken - len(self._values)

    def __len__(self) -> int:
        return len(self._values)
