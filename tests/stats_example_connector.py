"""vLLM's ``ExampleConnector`` with stats and Prometheus metrics of its own, for tests.

``CountingExampleConnector`` is the real ``ExampleConnector`` (KV saved to and loaded from a
directory) that also counts the requests whose KV it saved, reports the count through vLLM's
KV-connector stats path (``SavedRequestsStats``) and exports it as
``vllm:example_saved_requests`` (``SavedRequestsProm``). Loaded by module path
(``kv_connector_module_path: "stats_example_connector"``), so it is not in vLLM's connector
registry: the wrapped connector whose stats ``OmniKVConnector`` must rebuild by the class it
resolved, and whose metrics must reach ``/metrics`` beside the cache's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

SAVED_REQUESTS = "vllm:example_saved_requests"


@dataclass
class SavedRequestsStats(KVConnectorStats):
    """Requests whose KV the connector saved, since the last report."""

    def __post_init__(self) -> None:
        self.data = {"saved_requests": int(self.data.get("saved_requests", 0))}

    def reset(self) -> None:
        self.data = {"saved_requests": 0}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data["saved_requests"] += int(other.data.get("saved_requests", 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data["saved_requests"]


class SavedRequestsProm(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls(name=SAVED_REQUESTS, documentation="Requests whose KV ExampleConnector saved.",
                                    labelnames=labelnames)
        self.saved = create_metric_per_engine(counter, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self.saved[engine_idx].inc(transfer_stats_data["saved_requests"])


class CountingExampleConnector(ExampleConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.saved_requests = 0

    def wait_for_save(self) -> None:
        super().wait_for_save()
        meta = self._get_connector_metadata()
        self.saved_requests += sum(1 for request in meta.requests if request.is_store)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not self.saved_requests:
            return None
        stats = SavedRequestsStats(data={"saved_requests": self.saved_requests})
        self.saved_requests = 0
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return SavedRequestsStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics:
        return SavedRequestsProm(vllm_config, metric_types, labelnames, per_engine_labelvalues)
