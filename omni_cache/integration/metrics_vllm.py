"""The cache's metrics in vLLM's KV-connector stats path: the stats object and the Prometheus metrics.

Owns: ``OmniCacheStats`` (a ``KVConnectorStats``: one worker report of
``metrics.CacheMetricsReporter``, pickled from the worker to the scheduler, aggregated by vLLM
and sent to the API server as its ``to_dict()``), ``OmniCachePromMetrics`` (a
``KVConnectorPromMetrics``: the ``vllm:omni_cache_*`` series of ``metrics.SERIES``, made with
the metric classes vLLM hands it -- so vLLM's registry, its multiprocess mode and its
``model_name``/``engine`` labels apply -- and updated by ``observe``) and
``OmniMultiPromMetrics`` (ours beside the wrapped connectors' own, each fed its part of the
stats by key), plus the three functions ``OmniKVConnector`` delegates to:
``combine_stats`` (``get_kv_connector_stats``: a worker's report, or the scheduler side's delivery
failures), ``rebuild_stats`` (its
``build_kv_connector_stats``) and ``build_prom_metrics``. The classes are built on first use
(PEP 562), so importing this module never imports vLLM.

Upholds: stats are keyed as vLLM's ``MultiConnector`` keys them (a wrapped connector by its
class name; ours by ``OMNI_KEY``), and a key is rebuilt into its connector's stats by the class
that made it: ours by ``OmniCacheStats``, a wrapped connector's by the class ``OmniKVConnector``
resolved for that name from its own configuration (a connector loaded by module path is not in
vLLM's registry, where ``MultiConnector`` looks), else vLLM's registry; a name neither knows is
skipped with one warning, never an error in the API server. Counters only ever increase by the
increments the worker handed out; gauges take the reported values (multiprocess mode
``mostrecent``, as vLLM's own gauges).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any, cast

from omni_cache.integration.metrics import ERRORS, SERIES
from omni_cache.runtime.errors import ERROR_KINDS

__all__ = ["OMNI_KEY", "build_prom_metrics", "combine_stats", "rebuild_stats", "remember_child_classes"]

log = logging.getLogger(__name__)

OMNI_KEY = "OmniKVConnector"
"""Our entry in the connector stats (vLLM's ``MultiConnector`` keys entries by class name)."""
_SECTIONS = ("counters", "errors", "gauges", "observations")
# Wrapped connector classes by name, as OmniKVConnector resolved them from its configuration.
_CHILD_CLASSES: dict[str, type] = {}
_warned: set[str] = set()


def remember_child_classes(classes: Iterable[type]) -> None:
    """Record the wrapped connectors' classes by name (``rebuild_stats`` resolves names with it)."""
    for cls in classes:
        _CHILD_CLASSES[cls.__name__] = cls


def _child_class(name: str) -> Any:
    if name in _CHILD_CLASSES:
        return _CHILD_CLASSES[name]
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        return KVConnectorFactory.get_connector_class_by_name(name)
    except ValueError:
        return None


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def combine_stats(children: Any, report: dict[str, Any] | None) -> Any:
    """The worker's ``get_kv_connector_stats``: the wrapped connectors' stats (``children``, a
    ``MultiKVConnectorStats`` or ``None``) plus ours when this worker reported something."""
    if report is None:
        return children
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorStats

    stats = children if isinstance(children, MultiKVConnectorStats) else MultiKVConnectorStats()
    stats[OMNI_KEY] = _build()["OmniCacheStats"](data=report)
    return stats


def rebuild_stats(data: dict[str, Any] | None) -> Any:
    """``build_kv_connector_stats``: the connectors' stats rebuilt from their dicts (see the
    module docstring for how each key is resolved)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorStats

    if data is None:
        return MultiKVConnectorStats()
    rebuilt: dict[str, Any] = {}
    for name, value in data.items():
        if isinstance(value, KVConnectorStats):
            rebuilt[name] = value
        elif name == OMNI_KEY:
            rebuilt[name] = _build()["OmniCacheStats"](data=value)
        elif (cls := _child_class(name)) is None:
            _warn_once(f"stats:{name}", "OmniKVConnector: stats of an unknown connector %r are not logged", name)
        elif (stats := cls.build_kv_connector_stats(data=value)) is not None:
            rebuilt[name] = stats
    return MultiKVConnectorStats(data=rebuilt)


def build_prom_metrics(children: Iterable[tuple[Any, Any]], vllm_config: Any, metric_types: Any,
                       labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> Any:
    """``build_prom_metrics``: each wrapped connector's own metrics (``children``: its class and
    configuration, as ``MultiConnector`` builds them) and ours, in one ``OmniMultiPromMetrics``."""
    built = _build()
    metrics: dict[str, Any] = {}
    for cls, config in children:
        if cls.__name__ in metrics:
            continue
        prom = cls.build_prom_metrics(config, metric_types, labelnames, per_engine_labelvalues)
        if prom is not None:
            metrics[cls.__name__] = prom
    metrics[OMNI_KEY] = built["OmniCachePromMetrics"](vllm_config, metric_types, labelnames, per_engine_labelvalues)
    return built["OmniMultiPromMetrics"](vllm_config, metric_types, labelnames, per_engine_labelvalues, metrics)


def _empty() -> dict[str, Any]:
    return {"counters": {}, "errors": {}, "gauges": {}, "observations": {}}


@functools.cache
def _build() -> dict[str, type]:
    from dataclasses import dataclass

    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.v1.metrics.utils import create_metric_per_engine

    @dataclass
    class OmniCacheStats(KVConnectorStats):
        """One or more worker reports: counter and error increments, gauges, observations."""

        def __post_init__(self) -> None:
            given: dict[str, Any] = cast(dict[str, Any], vars(self).get("data") or {})
            fresh = _empty()
            for section in _SECTIONS:
                fresh[section] = dict(given.get(section) or {})
            fresh["observations"] = {k: list(v) for k, v in fresh["observations"].items()}
            self.data = fresh

        def reset(self) -> None:
            self.data = _empty()

        def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
            """Add a later report: increments add up, gauges take its values, observations join."""
            mine, theirs = self.data, other.data
            for section in ("counters", "errors"):
                for key, n in (theirs.get(section) or {}).items():
                    mine[section][key] = mine[section].get(key, 0) + n
            mine["gauges"].update(theirs.get("gauges") or {})
            for key, values in (theirs.get("observations") or {}).items():
                mine["observations"].setdefault(key, []).extend(values)
            return self

        def reduce(self) -> dict[str, int | float]:
            """The interval in one line of vLLM's stats log: increments, gauges, observation counts and means."""
            out: dict[str, int | float] = dict(self.data["counters"])
            errors = sum(self.data["errors"].values())
            if errors:
                out[ERRORS] = errors
            out.update(self.data["gauges"])
            for key, values in self.data["observations"].items():
                out[f"{key}_count"] = len(values)
                out[f"{key}_mean"] = round(sum(values) / len(values), 6)
            return out

        def is_empty(self) -> bool:
            return not any(self.data[section] for section in _SECTIONS)

    class OmniCachePromMetrics(KVConnectorPromMetrics):
        """The ``vllm:omni_cache_*`` series (``metrics.SERIES``), one child per engine."""

        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self.counters: dict[str, dict[int, Any]] = {}
            self.gauges: dict[str, dict[int, Any]] = {}
            self.histograms: dict[str, dict[int, Any]] = {}
            self.errors: dict[str, dict[int, Any]] = {}
            for series in SERIES:
                if series.key == ERRORS:
                    counter = self._counter_cls(name=series.name, documentation=series.doc,
                                                labelnames=[*labelnames, "kind"])
                    for kind in ERROR_KINDS:
                        self.errors[kind] = create_metric_per_engine(
                            counter, {i: [*v, kind] for i, v in per_engine_labelvalues.items()})
                elif series.kind == "counter":
                    self.counters[series.key] = create_metric_per_engine(
                        self._counter_cls(name=series.name, documentation=series.doc, labelnames=labelnames),
                        per_engine_labelvalues)
                elif series.kind == "gauge":
                    self.gauges[series.key] = create_metric_per_engine(
                        self._gauge_cls(name=series.name, documentation=series.doc, labelnames=labelnames,
                                     multiprocess_mode="mostrecent"), per_engine_labelvalues)
                else:
                    self.histograms[series.key] = create_metric_per_engine(
                        self._histogram_cls(name=series.name, documentation=series.doc, labelnames=labelnames,
                                         buckets=list(series.buckets)), per_engine_labelvalues)

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            data = transfer_stats_data
            for section, metrics in (("counters", self.counters), ("errors", self.errors)):
                for key, n in (data.get(section) or {}).items():
                    if key in metrics and n > 0:
                        metrics[key][engine_idx].inc(n)
            for key, value in (data.get("gauges") or {}).items():
                if key in self.gauges:
                    self.gauges[key][engine_idx].set(value)
            for key, values in (data.get("observations") or {}).items():
                if key in self.histograms:
                    histogram = self.histograms[key][engine_idx]
                    for value in values:
                        histogram.observe(value)

    class OmniMultiPromMetrics(KVConnectorPromMetrics):
        """Each connector's Prometheus metrics fed its own part of the stats (by key)."""

        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]], metrics: dict[str, Any]) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self.metrics = metrics

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for key, data in transfer_stats_data.items():
                prom = self.metrics.get(key)
                if prom is None:  # a wrapped connector with stats but no Prometheus metrics of its own
                    _warn_once(f"prom:{key}", "OmniKVConnector: connector %r reports stats but has no "
                               "Prometheus metrics; they are not exported", key)
                    continue
                prom.observe(data, engine_idx)

    classes = (OmniCacheStats, OmniCachePromMetrics, OmniMultiPromMetrics)
    for cls in classes:  # picklable by name (module __getattr__ finds them)
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return {cls.__name__: cls for cls in classes}


def __getattr__(name: str) -> Any:
    if name in ("OmniCacheStats", "OmniCachePromMetrics", "OmniMultiPromMetrics"):
        return _build()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
