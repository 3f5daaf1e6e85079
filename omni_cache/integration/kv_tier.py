"""``OmniKVConnector``: the user's vLLM KV connector(s), plus hidden rows that follow their KV.

Owns: the scheduler-side bookkeeping of which blocks the wrapped connector
fills with external KV (per request: the local hit it was offered and the
external tokens the scheduler allocated for) and which blocks finished requests
leave behind (their full blocks, by block hash), and ``OmniTierMetadata``, the
connector metadata that carries the children's metadata plus a
``tier_apply.TierPlan`` to the worker each step. On the worker side it owns the
``TierApplier`` (the ``HiddenTier`` host store under a byte budget, optionally a
safetensors directory) that the runner bridge applies at the top of each step.

Configure it with ``kv_transfer_config = {"kv_connector": "OmniKVConnector",
"kv_connector_module_path": "omni_cache.integration.kv_tier", "kv_role": ...,
"kv_connector_extra_config": {"connectors": [<the user's connector config>],
"omni_cache": {"tier_bytes": N, "tier_dir": PATH}}}`` (or as one of the ``connectors`` of vLLM's
``MultiConnector``). ``connector_settings.tier_settings`` checks that configuration wherever it is read (the
connector's construction, vLLM's class-level calls before it, the config gate): a malformed one
is one ``OmniPrefixCacheUnmatchError`` naming the key. It is vLLM's
``MultiConnector`` underneath, so every KV call (load, save, finished,
load errors, handshakes, stats, HMA) is delegated to the wrapped connectors
exactly as ``MultiConnector`` does; only ``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``request_finished(_all_groups)`` and
``build_connector_meta`` add to it, and the stats path carries the cache's metrics
beside the wrapped connectors' (``get_kv_connector_stats``, ``build_kv_connector_stats``,
``build_prom_metrics``: ``omni_cache.integration.metrics_vllm``; the worker's
``metrics.CacheMetricsReporter`` makes the reports). The class is built on first attribute
access (PEP 562), so importing this module never imports vLLM.

Upholds contract section 4.10 on the scheduler side: a load names, for each
block the connector fills, the block hash vLLM computed for the request's tokens
there (content identity) and the block id it was given now (the new slots); a
store names the full blocks a finished request computed (``num_computed_tokens
// block_size``, never a partial block), by the same hash. An engine whose
``parallel_config.worker_cls`` is not omni-cache's worker (or a subclass) is refused
at start on both sides: nothing there would apply a plan or write a file.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

from omni_cache.integration.connector_settings import SETTINGS_KEY, tier_settings
from omni_cache.integration.delivery import DeliveryPlan, DeliveryResult, RowDelivery
from omni_cache.integration.delivery_sched import DeliveryScheduler
from omni_cache.integration.kv_nesting import omni_connector
from omni_cache.integration.metrics import CacheMetricsReporter
from omni_cache.integration.ranks import data_parallel_replica, vllm_worker_rank
from omni_cache.integration.tier_apply import TierApplier, TierLoad, TierPlan, TierStore
from omni_cache.integration.vllm_logging import use_vllm_logging

log = logging.getLogger(__name__)

__all__ = ["SETTINGS_KEY", "tier_settings", "worker_delivery", "worker_tier_applier"]

def _without_hybrid_manager(vllm_config: Any, kv_cache_config: Any) -> Any:
    """``vllm_config`` as ``MultiConnector`` may see it with children that lack HMA support.

    vLLM enables its hybrid KV-cache manager for this class (it subclasses ``SupportsHMA`` through
    ``MultiConnector``), and ``MultiConnector`` then refuses children without HMA support. With one
    KV-cache group the hybrid manager changes nothing, so the children get a copy that says it is
    off; with several groups the refusal stands when there is a child (delivery alone has none)."""
    import copy

    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    sched = vllm_config.scheduler_config
    if sched.disable_hybrid_kv_cache_manager or MultiConnector.all_children_support_hma(vllm_config.kv_transfer_config):
        return vllm_config
    groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or ()) if kv_cache_config is not None else 1
    children = (vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get("connectors")
    if groups > 1 and children:  # delivery alone has no child to lack the support
        raise ValueError(
            f"OmniKVConnector: the KV cache has {groups} KV-cache groups and a wrapped connector lacks hybrid "
            "KV-cache manager support; set disable_hybrid_kv_cache_manager=True")
    config = copy.copy(vllm_config)
    config.scheduler_config = copy.copy(sched)
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    return config


def _output_group(kv_cache_config: Any, vllm_config: Any) -> tuple[int, int]:
    """(group id, block size) of the KV-cache group whose blocks address the rows: the config gate's
    choice on a layout of several groups (``kv_groups.select_output_group``), else group 0 at the
    engine's block size (a layout with no qualifying group is refused by the gate at worker start)."""
    from omni_cache.integration.kv_groups import select_output_group

    if kv_cache_config is not None and len(getattr(kv_cache_config, "kv_cache_groups", None) or ()) > 1:
        with contextlib.suppress(LookupError, ValueError):
            group = select_output_group(kv_cache_config)
            return group.group_id, group.block_size
    return 0, int(vllm_config.cache_config.block_size)


def _refuse_foreign_worker(vllm_config: Any) -> None:
    """The connector carries the rows of omni-cache's worker (its runner bridge applies the tier plans
    and writes the delivery's files): beside any other worker every request's delivery would fail and
    no tier plan would be applied, so it is refused at engine start, naming the setting. Read on both
    sides; a config without ``parallel_config`` (a test's stand-in) has no worker to check."""
    from omni_cache.integration.config_gate import OMNI_WORKERS, omni_worker_problem

    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None:
        return
    problem = omni_worker_problem(getattr(parallel, "worker_cls", "auto"))
    if problem is not None:
        raise ValueError(f"OmniKVConnector: parallel_config.{problem}: the connector serves the rows of "
                         f"omni-cache's worker; run the engine with worker_cls={OMNI_WORKERS[0]} (OmniGPUWorker "
                         "on a GPU), as `omni-cache serve` does")


def _group_ids(block_ids: Any, group: int) -> list[int]:
    """The block ids of KV-cache group ``group`` (``[]`` when the request has fewer groups)."""
    return list(block_ids[group]) if group < len(block_ids) else []


@functools.cache
def _build() -> dict[str, type]:
    from dataclasses import dataclass, field

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
        MultiKVConnectorMetadata,
        MultiKVConnectorWorkerMetadata,
    )

    from omni_cache.integration.metrics_vllm import (
        OMNI_KEY,
        build_prom_metrics,
        combine_stats,
        rebuild_stats,
        remember_child_classes,
    )
    from omni_cache.runtime.tier import HiddenTier

    @dataclass
    class OmniTierMetadata(MultiKVConnectorMetadata):
        """The wrapped connectors' metadata plus this step's tier plan and delivery plan."""

        omni_tier: TierPlan = field(default_factory=TierPlan)
        omni_delivery: DeliveryPlan = field(default_factory=DeliveryPlan)

    @dataclass
    class OmniWorkerMetadata(MultiKVConnectorWorkerMetadata):
        """The wrapped connectors' worker metadata plus this step's delivery outcomes (the
        output rank's; other ranks report none, and aggregation keeps every outcome once)."""

        omni_results: tuple[DeliveryResult, ...] = ()

        def aggregate(self, other: Any) -> Any:
            children = super().aggregate(other)
            extra = other.omni_results if isinstance(other, OmniWorkerMetadata) else ()
            return OmniWorkerMetadata(metadata=children.metadata, omni_results=self.omni_results + extra)

    class OmniKVConnector(MultiConnector):
        """See ``omni_cache.integration.kv_tier``."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            use_vllm_logging()
            settings = tier_settings(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
            _refuse_foreign_worker(vllm_config)
            super().__init__(_without_hybrid_manager(vllm_config, kv_cache_config), role, kv_cache_config)
            # The KV-cache group whose blocks address the rows (hybrid layouts: the full-attention one, as
            # the config gate picks it), and its block size: tier plans name that group's blocks.
            self._omni_group, self._omni_block_size = _output_group(kv_cache_config, vllm_config)
            # Scheduler side (the scheduler thread only): req -> local hit offered to the connector.
            self._omni_local: dict[str, int] = {}
            self._omni_loads: list[TierLoad] = []
            self._omni_stores: dict[str, list[TierStore]] = {}  # by request: recorded once per finish
            self.omni_tier_applier: TierApplier | None = None
            self.omni_delivery: RowDelivery | None = None
            self.omni_delivery_sched: DeliveryScheduler | None = None
            self.omni_metrics: CacheMetricsReporter | None = None
            # Worker side, with speculative decoding (vLLM then finalizes the connector after it took the
            # step's stats and built its metadata): whether this step's wait_for_save came first, and the
            # stats and metadata taken before it, which wait_for_save completes.
            self._omni_deferred = getattr(vllm_config, "speculative_config", None) is not None
            self._omni_waited = False
            self._omni_open_meta: Any = None
            self._omni_open_stats: Any = None
            delivery = settings["delivery"]
            if role == KVConnectorRole.WORKER:
                if delivery is not None:  # first: a refused claim leaves nothing else built
                    # only the output rank delivers, so only it takes the directory (one claim per DP replica)
                    replica = data_parallel_replica(getattr(vllm_config, "parallel_config", None))
                    self.omni_delivery = RowDelivery(delivery, claim=vllm_worker_rank().is_output_rank,
                                                     replica=replica)
                try:
                    tier = HiddenTier(settings["tier_bytes"], settings["tier_dir"])
                except OSError as exc:  # its spill directory cannot be made: refused at start, naming it
                    raise ValueError(f"OmniKVConnector: omni_cache.tier_dir {settings['tier_dir']!r} cannot hold "
                                     f"the tier's spill files: {exc}") from exc
                self.omni_tier_applier = TierApplier(tier, self._omni_block_size)
                self.omni_metrics = CacheMetricsReporter(self.omni_delivery, self.omni_tier_applier)
            else:
                if delivery is not None:
                    self.omni_delivery_sched = DeliveryScheduler(delivery)
                policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", None)
                if self.sub_connectors and policy == "fail":
                    log.warning("omni-cache: kv_load_failure_policy is 'fail' beside a wrapped KV connector: a hit "
                                "of its store whose hidden rows the tier does not hold (after a restart, or a store "
                                "that ignores cache_salt) fails that request; set kv_transfer_config "
                                "kv_load_failure_policy='recompute' to compute such blocks again (docs/kv-tier.md)")

        @classmethod
        def _get_connector_classes_and_configs(cls, vllm_config: Any) -> Any:
            """No wrapped connector is fine here (delivery only): ``MultiConnector`` needs the key. vLLM
            calls this before it builds the connector (the KV-cache layout): malformed settings are
            refused here first, naming the key."""
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
            tier_settings(extra)
            if extra.get("connectors") is None:
                extra["connectors"] = []
            children = super()._get_connector_classes_and_configs(vllm_config)
            remember_child_classes(cls for cls, _ in children)  # their stats are rebuilt by name
            return children

        # ---------------------------------------------------------- metrics (metrics_vllm)
        def get_kv_connector_stats(self) -> Any:
            """The wrapped connectors' stats plus this worker's cache report (output rank only); on the
            scheduler side, the delivery failures the scheduler itself wrote (vLLM adds them in)."""
            children = super().get_kv_connector_stats()
            if self.omni_delivery_sched is not None:
                failures = self.omni_delivery_sched.take_failures()
                return combine_stats(children, {"counters": {"delivery_failures": failures}} if failures else None)
            if self.omni_metrics is None or not self.omni_metrics.reporting:
                return children
            if self._omni_deferred and not self._omni_waited:  # before this step's wait: report it there
                stats = combine_stats(children, {})
                self._omni_open_stats = stats[OMNI_KEY]
                return stats
            return combine_stats(children, self.omni_metrics.report())

        @classmethod
        def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
            return rebuild_stats(data)

        @classmethod
        def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                               per_engine_labelvalues: dict[int, list[object]]) -> Any:
            return build_prom_metrics(cls._get_connector_classes_and_configs(vllm_config), vllm_config,
                                      metric_types, labelnames, per_engine_labelvalues)

        # ---------------------------------------------------------- scheduler side
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            result = super().get_num_new_matched_tokens(request, num_computed_tokens)
            self._omni_local[request.request_id] = int(num_computed_tokens)
            return result

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            local = self._omni_local.pop(request.request_id, 0)
            if num_external_tokens <= 0:
                return
            bs = self._omni_block_size
            ids = _group_ids(blocks.get_block_ids(), self._omni_group)
            hashes = request.block_hashes
            for index in range(local // bs, min((local + num_external_tokens) // bs, len(hashes), len(ids))):
                self._omni_loads.append(TierLoad(request.request_id, index, bytes(hashes[index]), int(ids[index])))

        def _omni_record_finish(self, request: Any, block_ids: list[int]) -> None:
            n = min(len(request.block_hashes), int(request.num_computed_tokens) // self._omni_block_size,
                    len(block_ids))
            self._omni_local.pop(request.request_id, None)
            self._omni_stores[request.request_id] = [
                TierStore(request.request_id, bytes(request.block_hashes[i]), int(block_ids[i])) for i in range(n)]

        def _omni_params(self, request: Any, delay: bool, params: dict[str, Any] | None) -> Any:
            if self.omni_delivery_sched is None:
                return delay, params
            ours = self.omni_delivery_sched.finish(request)
            if ours is None:
                return delay, params
            if params:  # a wrapped connector's parameters travel beside ours (vLLM's merge rule)
                clash = set(params) & set(ours)
                if clash:  # NOTE: logged and ours kept: raising here would end the engine, not one request
                    log.error("OmniKVConnector: request %r: the wrapped connector's kv_transfer_params keys %s "
                              "clash with the delivery's; the delivery's are returned", request.request_id,
                              sorted(clash))
                ours.update({k: v for k, v in params.items() if k not in clash})  # same object: an outcome
                # due this step still completes it
            return delay, ours

        def request_finished(self, request: Any, blocks: list[int]) -> tuple[bool, dict[str, Any] | None]:
            self._omni_record_finish(request, blocks)
            return self._omni_params(request, *super().request_finished(request, blocks))

        def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> Any:
            self._omni_record_finish(request, _group_ids(block_ids, self._omni_group))
            if not self.sub_connectors and len(block_ids) > 1:  # delivery alone on several groups: no child
                return self._omni_params(request, False, None)  # to ask (vLLM's MultiConnector wants one group)
            return self._omni_params(request, *super().request_finished_all_groups(request, block_ids))

        def build_connector_meta(self, scheduler_output: Any) -> OmniTierMetadata:
            inner = super().build_connector_meta(scheduler_output)
            stores = tuple(s for per_req in self._omni_stores.values() for s in per_req)
            plan = TierPlan(stores=stores, loads=tuple(self._omni_loads))
            self._omni_stores, self._omni_loads = {}, []
            delivery = (self.omni_delivery_sched.build_plan(scheduler_output)
                        if self.omni_delivery_sched is not None else DeliveryPlan())
            return OmniTierMetadata(metadata=inner.metadata, extra_async_saves=inner.extra_async_saves,
                                    omni_tier=plan, omni_delivery=delivery)

        def update_connector_output(self, connector_output: Any) -> None:
            meta = connector_output.kv_connector_worker_meta
            if self.omni_delivery_sched is not None:
                self.omni_delivery_sched.absorb(meta.omni_results if isinstance(meta, OmniWorkerMetadata) else ())
            super().update_connector_output(connector_output)

        # ---------------------------------------------------------- worker side
        def get_block_ids_with_load_errors(self) -> set[int]:
            """The wrapped connectors' failed blocks plus the blocks whose rows this worker's tier
            could not restore this step (evicted, damaged, foreign): a failed KV load to vLLM, whose
            ``kv_load_failure_policy`` recomputes them (the forward computes the rows) or fails the
            request -- never zeros, never the rows of the block's previous tenant."""
            failed = set(super().get_block_ids_with_load_errors())
            if self.omni_tier_applier is not None:
                failed |= self.omni_tier_applier.take_load_errors()
            return failed

        def wait_for_save(self) -> None:
            super().wait_for_save()
            if self.omni_delivery is not None:
                self.omni_delivery.finish_step()  # this step's files, bounded: their outcome goes out now
            open_meta, self._omni_open_meta = self._omni_open_meta, None
            open_stats, self._omni_open_stats = self._omni_open_stats, None
            # Taken before this wait (speculative decoding): complete them now, before the runner's output leaves.
            if open_meta is not None and self.omni_delivery is not None:
                open_meta.omni_results = open_meta.omni_results + self.omni_delivery.take_results()
            if open_stats is not None and self.omni_metrics is not None \
                    and (report := self.omni_metrics.report()) is not None:
                open_stats.aggregate(type(open_stats)(data=report))
            self._omni_waited = open_meta is None and open_stats is None

        def build_connector_worker_meta(self) -> Any:
            inner = super().build_connector_worker_meta()
            waited, self._omni_waited = self._omni_waited, False  # this step's order is known now
            if self.omni_delivery is None:
                return inner
            opens = self._omni_deferred and not waited
            results = self.omni_delivery.take_results()
            if not results and not opens and inner is None:
                return inner
            # NOTE: the children's metadata goes out as ours even without outcomes: vLLM folds the ranks'
            # metadata in rank order with the first one's ``aggregate``, and only ours keeps the outcomes
            # of another rank (pipeline parallel: the output rank is the last stage, not the first).
            children = inner.metadata if inner is not None else (None,) * len(self.sub_connectors)
            meta = OmniWorkerMetadata(metadata=children, omni_results=results)
            if opens:
                # NOTE: with speculative decoding vLLM builds this step's metadata before it waits for
                # the saves (sample_tokens finalizes the connector after the draft model): the step's
                # files are done, and their outcomes added to this same object, in wait_for_save; the
                # runner's output carries it to the scheduler only after that.
                self._omni_open_meta = meta
            return meta

        def shutdown(self) -> None:
            try:
                super().shutdown()
            finally:
                try:
                    if self.omni_delivery is not None:
                        self.omni_delivery.shutdown()
                finally:
                    if self.omni_tier_applier is not None:  # its spill files die with this worker
                        self.omni_tier_applier.close()

    classes = (OmniKVConnector, OmniTierMetadata, OmniWorkerMetadata)
    for cls in classes:  # picklable by name (module __getattr__ finds them)
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return {cls.__name__: cls for cls in classes}


def worker_tier_applier() -> TierApplier | None:
    """The ``TierApplier`` of this worker's ``OmniKVConnector`` (``None`` when vLLM runs another connector)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    return getattr(omni_connector(get_kv_transfer_group()), "omni_tier_applier", None)


def worker_delivery() -> RowDelivery | None:
    """The ``RowDelivery`` of this worker's ``OmniKVConnector`` (``None`` without one, or without delivery)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    return getattr(omni_connector(get_kv_transfer_group()), "omni_delivery", None)


def __getattr__(name: str) -> Any:
    if name in ("OmniKVConnector", "OmniTierMetadata", "OmniWorkerMetadata"):
        return _build()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
