"""The cache's metrics on vLLM's real KV-connector stats classes, without an engine (marker ``vllm``).

Protects: a worker report crosses vLLM's channels intact (pickled by name from the worker,
msgpack-encoded inside ``SchedulerStats`` to the API server); reports aggregate as vLLM
aggregates them (increments add up, the later gauges win, observations join); ours sits beside
the wrapped connectors' stats keyed as ``MultiConnector`` keys them, and a wrapped connector
loaded by module path -- which ``MultiConnector`` cannot rebuild by name -- is rebuilt by the
class ``OmniKVConnector`` resolved; the Prometheus metrics are made with the metric classes
vLLM hands over (so its registry and labels apply), every series of ``metrics.SERIES`` is
there with ``model_name``/``engine`` labels, counters grow by exactly the reported increments,
gauges take the reported values, histograms count every observation, and a connector without
metrics of its own is skipped, never an error in the API server.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import pytest
from test_vllm_gate import _vllm_config, base_kwargs  # noqa: F401  (fixture)
from vllm_support import require_vllm

from omni_cache.integration.metrics import PREFIX, SERIES
from omni_cache.runtime.errors import ERROR_KINDS

pytestmark = pytest.mark.vllm

REPORT_1 = {"counters": {"saved_tokens": 96, "hit_tokens": 64, "hit_requests": 2}, "errors": {"not_readable": 1},
            "gauges": {"staging_depth": 4.0, "pool_bytes": 1024.0, "staging_slots_in_use": 1.0},
            "observations": {"staging_wait_seconds": [0.0, 0.002], "delivery_latency_seconds": [0.01]}}
REPORT_2 = {"counters": {"saved_tokens": 4}, "errors": {}, "gauges": {"staging_slots_in_use": 0.0},
            "observations": {"staging_wait_seconds": [0.0]}}


class _Warnings(logging.Handler):
    """The warnings of ``omni_cache.integration.metrics_vllm``, caught at its own logger (an engine
    built earlier in the process hands the ``omni_cache`` logger vLLM's handler and level, which
    may be above WARNING and keep records from the root logger pytest watches)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.logger = logging.getLogger("omni_cache.integration.metrics_vllm")
        self.level = self.logger.level

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _Warnings:
        self.logger.addHandler(self)
        self.logger.setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def _wrapped(path: str) -> dict[str, Any]:
    return {"kv_connector": "OmniKVConnector", "kv_connector_module_path": "omni_cache.integration.kv_tier",
            "kv_role": "kv_both", "kv_connector_extra_config": {
                "connectors": [{"kv_connector": "CountingExampleConnector", "kv_role": "kv_both",
                                "kv_connector_module_path": "stats_example_connector",
                                "kv_connector_extra_config": {"shared_storage_path": path}},
                               {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                "kv_connector_extra_config": {"shared_storage_path": path}}],
                "omni_cache": {"tier_bytes": 1 << 20}}}


def test_a_report_crosses_vllms_channels_and_aggregates_as_vllm_aggregates() -> None:
    require_vllm()
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from omni_cache.integration.metrics_vllm import OMNI_KEY, combine_stats

    stats = pickle.loads(pickle.dumps(combine_stats(None, REPORT_1)))  # worker -> scheduler: pickled
    assert type(stats).__name__ == "MultiKVConnectorStats" and type(stats[OMNI_KEY]).__name__ == "OmniCacheStats"
    stats = stats.aggregate(combine_stats(None, REPORT_2))
    ours = stats[OMNI_KEY].data
    assert ours["counters"] == {"saved_tokens": 100, "hit_tokens": 64, "hit_requests": 2}
    assert ours["gauges"] == {"staging_depth": 4.0, "pool_bytes": 1024.0, "staging_slots_in_use": 0.0}
    assert ours["observations"]["staging_wait_seconds"] == [0.0, 0.002, 0.0]
    reduced = stats.reduce()[OMNI_KEY]  # vLLM's stats log line
    assert reduced["saved_tokens"] == 100 and reduced["errors"] == 1 and reduced["staging_wait_seconds_count"] == 3
    encoded = MsgpackEncoder().encode(SchedulerStats(kv_connector_stats=stats.to_dict()))  # scheduler -> API server
    decoded = MsgpackDecoder(SchedulerStats).decode(encoded)
    assert decoded.kv_connector_stats == stats.to_dict()
    assert not stats.is_empty()
    stats.reset()
    assert stats.is_empty()


def test_combining_keeps_the_wrapped_connectors_stats_and_adds_ours_only_when_reported() -> None:
    require_vllm()
    from stats_example_connector import SavedRequestsStats
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorStats

    from omni_cache.integration.metrics_vllm import OMNI_KEY, combine_stats

    children = MultiKVConnectorStats(data={"CountingExampleConnector": SavedRequestsStats(data={"saved_requests": 2})})
    assert combine_stats(children, None) is children and combine_stats(None, None) is None
    both = combine_stats(children, REPORT_1)
    assert set(both.data) == {"CountingExampleConnector", OMNI_KEY}


def test_a_module_path_child_is_rebuilt_by_the_class_the_connector_resolved(base_kwargs, tmp_path) -> None:  # noqa: F811
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from omni_cache.integration.metrics_vllm import OMNI_KEY

    data = {"CountingExampleConnector": {"saved_requests": 3}, OMNI_KEY: REPORT_1}
    with pytest.raises(ValueError, match="not registered"):  # why OmniKVConnector rebuilds them itself
        MultiConnector.build_kv_connector_stats(data={"CountingExampleConnector": {"saved_requests": 3}})
    vllm_config = _vllm_config(base_kwargs, kv_transfer_config=_wrapped(str(tmp_path)))
    cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
    cls._get_connector_classes_and_configs(vllm_config)  # what its build_prom_metrics does at start
    rebuilt = cls.build_kv_connector_stats(data=data)
    assert type(rebuilt.data["CountingExampleConnector"]).__name__ == "SavedRequestsStats"
    assert rebuilt.data["CountingExampleConnector"].data == {"saved_requests": 3}
    assert rebuilt.data[OMNI_KEY].data["counters"] == REPORT_1["counters"]
    with _Warnings() as warnings:
        unknown = cls.build_kv_connector_stats(data={"NoSuchConnector": {"x": 1}, OMNI_KEY: REPORT_2})
    assert set(unknown.data) == {OMNI_KEY} and any("NoSuchConnector" in m for m in warnings.messages)
    assert cls.build_kv_connector_stats(None).data == {}


def _bound(registry: Any) -> dict[type, type]:
    """vLLM's metric types, registered in ``registry`` (as vLLM hands its own classes over)."""
    from prometheus_client import Counter, Gauge, Histogram

    def bind(base: type) -> type:
        class Bound(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                if "_labelvalues" not in kwargs:
                    kwargs["registry"] = registry
                super().__init__(*args, **kwargs)

        return Bound

    return {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}


def _samples(registry: Any) -> dict[str, float]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = dict(s.labels)
            assert labels.pop("model_name") == "tiny" and labels.pop("engine") == "0", s
            extra = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def test_the_prometheus_metrics_are_vllms_classes_and_follow_the_reports(base_kwargs, tmp_path) -> None:  # noqa: F811
    from prometheus_client import CollectorRegistry
    from stats_example_connector import SAVED_REQUESTS
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from omni_cache.integration.metrics_vllm import OMNI_KEY

    registry = CollectorRegistry()
    vllm_config = _vllm_config(base_kwargs, kv_transfer_config=_wrapped(str(tmp_path)))
    cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
    prom = cls.build_prom_metrics(vllm_config, _bound(registry), ["model_name", "engine"], {0: ["tiny", "0"]})
    assert set(prom.metrics) == {OMNI_KEY, "CountingExampleConnector"}  # ExampleConnector has no metrics
    before = _samples(registry)
    for series in SERIES:
        total = series.name + ("_total" if series.kind == "counter" else "_count" if series.kind == "histogram" else "")
        keys = [k for k in before if k.startswith(total)]
        assert keys and all(before[k] == 0 for k in keys), (series.name, keys)
    assert {k for k in before if k.startswith(PREFIX + "errors_total")} == {
        f"{PREFIX}errors_total{{kind={kind}}}" for kind in ERROR_KINDS}
    prom.observe({OMNI_KEY: REPORT_1, "CountingExampleConnector": {"saved_requests": 2}}, 0)
    prom.observe({OMNI_KEY: REPORT_2}, 0)
    with _Warnings() as warnings:
        prom.observe({"ExampleConnector": {"anything": 1}}, 0)  # stats without metrics: skipped
    assert any("'ExampleConnector'" in m for m in warnings.messages)
    after = _samples(registry)
    assert after[PREFIX + "saved_tokens_total"] == 100 and after[PREFIX + "hit_tokens_total"] == 64
    assert after[PREFIX + "hit_requests_total"] == 2 and after[PREFIX + "errors_total{kind=not_readable}"] == 1
    assert after[PREFIX + "staging_depth"] == 4 and after[PREFIX + "pool_bytes"] == 1024
    assert after[PREFIX + "staging_slots_in_use"] == 0
    assert after[PREFIX + "staging_wait_seconds_count"] == 3 and after[PREFIX + "staging_wait_seconds_sum"] == 0.002
    assert after[PREFIX + "staging_wait_seconds_bucket{le=0.005}"] == 3
    assert after[PREFIX + "delivery_latency_seconds_count"] == 1
    assert after[SAVED_REQUESTS + "_total"] == 2
    assert after[PREFIX + "delivered_files_total"] == 0
