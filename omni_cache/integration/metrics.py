"""The cache's metrics: which series a served engine exposes, and what the worker reports each step.

Owns: ``SERIES`` (every ``vllm:omni_cache_*`` series: its name by vLLM's conventions -- ``vllm:``
plus snake_case, counters declared without ``_total``, the unit as a suffix -- its type, unit,
meaning and histogram buckets; the Prometheus side, the docs and ``check-server`` all read this
one table), ``cache_sources`` (the raw numbers one worker's cache has: the manager's ``stats()``,
the delivery's and the tier's counters, the contained errors by kind) and
``CacheMetricsReporter`` (the worker half of vLLM's KV-connector stats path: once per engine
step ``OmniKVConnector.get_kv_connector_stats`` asks it for a report -- the counters' increments
since the last report, the gauges' current values and the histogram observations recorded since
then -- which vLLM carries to the scheduler and on to the API server's ``/metrics``;
``omni_cache.integration.metrics_vllm`` is the vLLM half). No vLLM import.

Upholds: the values on ``/metrics`` are the worker's own numbers. A counter's increments add up
to the cumulative value ``cache_sources`` reads at the last report (each increment is handed out
once, so it reaches exactly one API server: vLLM sums counters across them), a gauge is the value
at the last report, and every histogram observation is handed out once. Only the output rank
reports (TP rank 0 of the last pipeline stage, the rank whose cache serves the rows); every other
rank reports nothing, so nothing is counted twice when vLLM aggregates the workers' stats.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omni_cache.runtime.errors import ERROR_KINDS

__all__ = ["ERRORS", "PREFIX", "SERIES", "CacheMetricsReporter", "Series", "bind_worker_metrics",
           "cache_sources", "series_named", "worker_metrics"]

log = logging.getLogger(__name__)

PREFIX = "vllm:omni_cache_"
ERRORS = "errors"  # the counter labelled by ``kind`` (``ERROR_KINDS``)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class Series:
    """One ``/metrics`` series. ``key`` names it in the worker's report; ``name`` is its full name."""

    key: str
    kind: str  # "counter", "gauge" or "histogram"
    unit: str
    doc: str
    source: str  # where the worker reads it (docs/metrics.md prints this)
    buckets: tuple[float, ...] = ()

    @property
    def name(self) -> str:
        return PREFIX + self.key


SERIES: tuple[Series, ...] = (
    Series("saved_tokens", "counter", "tokens",
           "Tokens whose per-token rows (hidden states, per-token multimodal outputs) the cache saved.",
           "stats()['saved_rows']"),
    Series("hit_tokens", "counter", "tokens",
           "Prompt tokens of prefix-cache hits whose rows the cache serves from its pool.",
           "stats()['hit_tokens']"),
    Series("hit_requests", "counter", "requests",
           "Requests admitted with a prefix-cache hit the cache serves rows for.", "stats()['hits']"),
    Series(ERRORS, "counter", "errors",
           "Contract errors the served engine contained (its requests failed, the engine kept serving), "
           f"by kind: {', '.join(ERROR_KINDS)}.",
           "the runner bridge's and the delivery's ErrorTally"),
    Series("failed_writes", "counter", "writes", "Pool writes that ended failed (the first failure fails the cache).",
           "stats()['writes_failed']"),
    Series("tier_stores", "counter", "blocks", "Blocks whose rows went to the hidden-state tier.",
           "TierApplier.summary()['tier_stored_blocks']"),
    Series("tier_loads", "counter", "blocks",
           "Blocks a KV connector loaded that the tier was asked to restore rows for.",
           "tier_restored_blocks + tier_load_failures"),
    Series("tier_restores", "counter", "blocks", "Blocks whose rows the tier restored into the pool.",
           "stats()['tier_restores']"),
    Series("tier_evictions", "counter", "blocks", "Tier entries evicted from host memory by its byte budget.",
           "TierApplier.summary()['tier_evictions']"),
    Series("tier_load_failures", "counter", "blocks",
           "Loads the tier could not serve (the block's rows are not readable: no rows served).",
           "TierApplier.summary()['tier_load_failures']"),
    Series("delivered_files", "counter", "files", "Hidden-state files written and published.",
           "RowDelivery.counters['files']"),
    Series("delivered_bytes", "counter", "bytes", "Bytes of the published hidden-state files.",
           "RowDelivery.counters['bytes']"),
    Series("delivery_failures", "counter", "requests",
           "Requests whose hidden-state file was not delivered (hidden_states_error).",
           "RowDelivery.counters['failures'] + DeliveryScheduler.take_failures()"),
    Series("staging_slots_in_use", "gauge", "slots", "Staging slots not free (claimed, saved or being read).",
           "staging depth - stats()['staging']['slots']['free']"),
    Series("staging_depth", "gauge", "slots", "Staging slots in all (staging_depth).",
           "stats()['staging']['depth']"),
    Series("pool_bytes", "gauge", "bytes", "Host bytes of the prefix block pool, all keys.",
           "sum(stats()['pool_bytes'].values())"),
    Series("staging_bytes", "gauge", "bytes", "Host bytes of the staging pages, all keys.",
           "sum(stats()['staging']['page_bytes'].values())"),
    Series("writes_in_flight", "gauge", "writes", "Pool writes registered and not yet landed.",
           "stats()['writes_in_flight']"),
    Series("tier_bytes", "gauge", "bytes", "Host bytes the hidden-state tier holds.",
           "TierApplier.summary()['tier_bytes']"),
    Series("staging_wait_seconds", "histogram", "seconds",
           "Time each save waited for a free staging slot (0 when one was free).",
           "OmniPrefixCacheManager.take_staging_waits()", _WAIT_BUCKETS),
    Series("delivery_latency_seconds", "histogram", "seconds",
           "Time from a file's hand-off to the writer until it was published.",
           "RowDelivery.take_latencies()", _LATENCY_BUCKETS),
)
_BY_KEY = {s.key: s for s in SERIES}


def series_named(key: str) -> Series:
    return _BY_KEY[key]


def cache_sources(bridge: Any, delivery: Any = None, tier: Any = None) -> dict[str, Any]:
    """One worker's raw numbers (plain values, for any RPC channel): its manager's ``stats()``
    (``None`` before the first step or on a rank without a cache), ``delivery``'s counters and
    ``tier``'s summary (the worker's ``OmniKVConnector`` parts; ``None`` without them), the
    contained errors by kind and whether the cache failed for good."""
    manager = bridge.hooks.manager
    errors = bridge.errors.counts()
    if delivery is not None:
        for kind, n in delivery.errors.counts().items():
            errors[kind] += n
    config = bridge.hooks.config
    return {"manager": manager.stats() if manager is not None else None,
            "staging_depth": config.staging_depth if config is not None else 0,
            "delivery": dict(delivery.counters) if delivery is not None else None,
            "tier": tier.summary() if tier is not None else None,
            "errors": errors, "failed": bridge.failed}


def _cumulative(sources: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, int], dict[str, float]]:
    """(counters, errors by kind, gauges) now, from ``cache_sources``."""
    stats = sources["manager"] or {}
    tier = sources["tier"] or {}
    delivery = sources["delivery"] or {}
    depth = int(stats["staging"]["depth"]) if stats else int(sources["staging_depth"])
    counters = {
        "saved_tokens": stats.get("saved_rows", 0), "hit_tokens": stats.get("hit_tokens", 0),
        "hit_requests": stats.get("hits", 0), "failed_writes": stats.get("writes_failed", 0),
        "tier_restores": stats.get("tier_restores", 0),
        "tier_stores": tier.get("tier_stored_blocks", 0),
        "tier_loads": tier.get("tier_restored_blocks", 0) + tier.get("tier_load_failures", 0),
        "tier_evictions": tier.get("tier_evictions", 0), "tier_load_failures": tier.get("tier_load_failures", 0),
        "delivered_files": delivery.get("files", 0), "delivered_bytes": delivery.get("bytes", 0),
        "delivery_failures": delivery.get("failures", 0),
    }
    gauges = {
        "staging_slots_in_use": depth - int(stats["staging"]["slots"]["free"]) if stats else 0,
        "staging_depth": depth,
        "pool_bytes": sum(stats["pool_bytes"].values()) if stats else 0,
        "staging_bytes": sum(stats["staging"]["page_bytes"].values()) if stats else 0,
        "writes_in_flight": stats.get("writes_in_flight", 0), "tier_bytes": tier.get("tier_bytes", 0),
    }
    return ({k: int(v) for k, v in counters.items()}, dict(sources["errors"]),
            {k: float(v) for k, v in gauges.items()})


class CacheMetricsReporter:
    """The worker's report per engine step (see the module docstring); the engine thread only."""

    def __init__(self, delivery: Any = None, tier: Any = None) -> None:
        self.delivery = delivery  # the connector's RowDelivery (None without delivery)
        self.tier = tier  # the connector's TierApplier
        self._bridge: Any = None
        self._output_rank = False
        self._sent_counters: dict[str, int] = {}
        self._sent_errors: dict[str, int] = {}
        self._sent_gauges: dict[str, float] | None = None
        self.failed: str | None = None  # why reports stopped (a report raised)

    def bind(self, bridge: Any, *, output_rank: bool) -> None:
        """The runner bridge whose cache this worker reports; only an ``output_rank`` reports."""
        self._bridge = bridge
        self._output_rank = output_rank

    @property
    def reporting(self) -> bool:
        """Whether this worker reports: the output rank of an engine whose cache is on (until a
        report fails)."""
        return (self._bridge is not None and self._output_rank and self._bridge.hooks.config is not None
                and self.failed is None)

    def sources(self) -> dict[str, Any]:
        """``cache_sources`` of the bound bridge and this connector's delivery and tier."""
        return cache_sources(self._bridge, self.delivery, self.tier)

    def report(self) -> dict[str, Any] | None:
        """What changed since the last report, or ``None`` (nothing did, or this rank does not report):
        ``counters`` and ``errors`` (increments), ``gauges`` (current values), ``observations``
        (histogram values recorded since the last report). Plain values only: vLLM pickles the
        report to the scheduler and msgpack-encodes it to the API server. A report that fails
        is logged with its traceback and ends this worker's reports (``failed``); metrics never
        take the engine down."""
        if not self.reporting:
            return None
        try:
            return self._report()
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            log.exception("omni-cache metrics: a report failed; this worker reports no more cache metrics")
            return None

    def _report(self) -> dict[str, Any] | None:
        counters, errors, gauges = _cumulative(self.sources())
        manager, delivery = self._bridge.hooks.manager, self.delivery
        observations = {
            "staging_wait_seconds": list(manager.take_staging_waits()) if manager is not None else [],
            "delivery_latency_seconds": list(delivery.take_latencies()) if delivery is not None else [],
        }
        deltas = _increments(counters, self._sent_counters)
        error_deltas = _increments(errors, self._sent_errors)
        observed = {k: v for k, v in observations.items() if v}
        if not deltas and not error_deltas and not observed and gauges == self._sent_gauges:
            return None
        self._sent_counters, self._sent_errors, self._sent_gauges = counters, errors, gauges
        return {"counters": deltas, "errors": error_deltas, "gauges": gauges, "observations": observed}


def _increments(now: Mapping[str, int], sent: Mapping[str, int]) -> dict[str, int]:
    return {k: v - sent.get(k, 0) for k, v in now.items() if v != sent.get(k, 0)}


def bind_worker_metrics(bridge: Any) -> CacheMetricsReporter | None:
    """Bind ``bridge`` to this worker's ``OmniKVConnector`` reporter (``None`` when vLLM runs no
    such connector: then no cache series reach ``/metrics``)."""
    from omni_cache.integration.ranks import vllm_worker_rank

    reporter = worker_metrics()
    if reporter is not None:
        reporter.bind(bridge, output_rank=vllm_worker_rank().is_output_rank)
    return reporter


def worker_metrics() -> CacheMetricsReporter | None:
    """The reporter of this worker's ``OmniKVConnector`` (``None`` without vLLM or such a connector)."""
    try:
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            get_kv_transfer_group,
            has_kv_transfer_group,
        )
    except ImportError:
        return None
    if not has_kv_transfer_group():
        return None
    reporter = getattr(get_kv_transfer_group(), "omni_metrics", None)
    return reporter if isinstance(reporter, CacheMetricsReporter) else None
