"""``OmniKVConnector``'s delivery wiring on vLLM's own classes, without an engine (vLLM installed).

Protected first: a request's outcome crosses the engine's process boundaries intact and reaches
*its* output -- the scheduler's plan and the worker's outcomes survive pickling (the channels of
vLLM's multiprocess engine), vLLM's own ``KVOutputAggregator`` keeps the output rank's outcomes
when other tensor-parallel ranks report nothing or only a wrapped connector's metadata
(``OmniWorkerMetadata.aggregate``), and a request that finishes in the step its file is written
gets the path and row counts in the very dict ``request_finished_all_groups`` returned (vLLM
serialises it after ``update_connector_output``), beside a wrapped connector's own entries (a clash
keeps ours and is logged, naming the request: it never ends the engine). ``request_finished_all_groups`` reaches the scheduler half once per request even
though ``MultiConnector`` routes it through ``request_finished``. Also: a delivery-only connector
(no wrapped connector) builds on both sides, ``wait_for_save`` ends the delivery's step,
``build_connector_worker_meta`` reports nothing when there is nothing to report (with speculative
decoding, whose metadata is built before ``wait_for_save``, the step's outcomes fill it there), and
``shutdown`` releases the lock files. Each test skips cleanly without vLLM (the [vllm] extra).
"""

from __future__ import annotations

import copy
import fcntl
import logging
import os
import pickle
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cache_helpers import manager, save, started
from vllm_support import require_vllm

from omni_cache.integration.config_gate import OMNI_WORKERS
from omni_cache.integration.delivery import DeliveryPlan, DeliveryResult, RowDelivery


@pytest.fixture(scope="module")
def vllm() -> SimpleNamespace:
    require_vllm()
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
        MultiKVConnectorWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput

    from omni_cache.integration import kv_tier

    return SimpleNamespace(KVTransferConfig=KVTransferConfig, KVConnectorFactory=KVConnectorFactory,
                           KVOutputAggregator=KVOutputAggregator, Role=KVConnectorRole, MultiConnector=MultiConnector,
                           MultiWorkerMeta=MultiKVConnectorWorkerMetadata, KVConnectorOutput=KVConnectorOutput,
                           kv_tier=kv_tier)


def _config(vllm: SimpleNamespace, directory: str, **delivery: Any) -> SimpleNamespace:
    """What the connector reads of a ``VllmConfig``: vLLM's real ``KVTransferConfig``, the rest plain."""
    transfer = vllm.KVTransferConfig(
        kv_connector="OmniKVConnector", kv_connector_module_path="omni_cache.integration.kv_tier", kv_role="kv_both",
        kv_connector_extra_config={"omni_cache": {"delivery_dir": directory, **delivery}})
    return SimpleNamespace(kv_transfer_config=transfer, cache_config=SimpleNamespace(block_size=4),
                           scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False))


def _pair(vllm: SimpleNamespace, tmp_path: Path, *, speculative: bool = False, **delivery: Any) -> tuple[Any, Any]:
    """The scheduler-side and the worker-side connector of one engine (each builds from its own copy);
    ``speculative``: the engine decodes speculatively (vLLM then defers the connector's finalize)."""
    config = _config(vllm, str(tmp_path), **delivery)
    if speculative:
        config.speculative_config = SimpleNamespace(method="ngram", num_speculative_tokens=3)
    cls = vllm.KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    assert cls is vllm.kv_tier.OmniKVConnector
    return cls(copy.deepcopy(config), vllm.Role.SCHEDULER, None), cls(copy.deepcopy(config), vllm.Role.WORKER, None)


def _so(*new: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=list(new), num_scheduled_tokens={n.req_id: 4 for n in new},
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set()))


def _new(req_id: str, **params: Any) -> SimpleNamespace:
    extra = {"kv_transfer_params": params} if params else None
    return SimpleNamespace(req_id=req_id, prompt_token_ids=[5, 6, 7, 8], sampling_params=SimpleNamespace(extra_args=extra))


def _request(req_id: str, outputs: int = 1) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=[5, 6, 7, 8], all_token_ids=[5, 6, 7, 8, *range(outputs)],
                           num_computed_tokens=3 + outputs, block_hashes=[b"h" * 8], status=SimpleNamespace(name="X"))


def _rank_output(vllm: SimpleNamespace, meta: Any) -> SimpleNamespace:
    return SimpleNamespace(kv_connector_output=vllm.KVConnectorOutput(kv_connector_worker_meta=meta))


def _worker_step(worker: Any, meta: Any, m: Any, *, deferred: bool = False, stats: list[Any] | None = None) -> Any:
    """The worker's step: the plan, the forward's save, the delivery's consume, vLLM's connector
    calls at the end of the forward (``deferred``: speculative decoding's order, the metadata built
    before ``wait_for_save``, which sample_tokens calls after the draft model); returns what the
    worker reports, pickled and back (after both calls: the runner's output leaves only then);
    ``stats`` gets the connector's stats of the step, taken where vLLM takes them, pickled and back."""
    delivery: RowDelivery = worker.omni_delivery
    plan = pickle.loads(pickle.dumps(meta)).omni_delivery
    delivery.begin_step(plan, {t.req_id: [5, 6, 7, 8] for t in plan.targets})
    m.new_step_starts([started(t.req_id) for t in plan.targets])
    spans = [(t.req_id, [i + 1], 0, 4) for i, t in enumerate(plan.targets)]
    step_id, _ = save(m, spans)
    delivery.consume(m, step_id, [(r, s, e) for r, _, s, e in spans])
    if not deferred:
        worker.wait_for_save()
    taken = worker.get_kv_connector_stats()
    built = worker.build_connector_worker_meta()
    if deferred:
        worker.wait_for_save()
    if stats is not None:
        stats.append(pickle.loads(pickle.dumps(taken)))
    return pickle.loads(pickle.dumps(built))


# ------------------------------------------------------------------------------------- set-up
def test_a_delivery_only_connector_builds_on_both_sides(vllm, tmp_path: Path) -> None:
    sched, worker = _pair(vllm, tmp_path)
    assert sched.omni_delivery_sched is not None and sched.omni_delivery is None and sched.omni_tier_applier is None
    assert isinstance(worker.omni_delivery, RowDelivery) and worker.omni_delivery_sched is None
    assert worker.omni_delivery.settings.delivery_dir == os.path.realpath(tmp_path) and sched.sub_connectors == []
    assert worker.build_connector_worker_meta() is None  # nothing to report: no metadata at all
    worker.shutdown()


def _replica_config(rank: int, *, dense: bool) -> Any:
    """vLLM's own ``ParallelConfig`` of DP replica ``rank`` of 2, as its engine core holds it: a dense
    model's replica runs as an independent engine (vLLM resets its ``data_parallel_rank`` to 0 and
    keeps the replica in ``data_parallel_index``), a MoE model's keeps its rank."""
    from vllm.config import ParallelConfig

    config = ParallelConfig(data_parallel_size=2, data_parallel_rank=rank, worker_cls=OMNI_WORKERS[0])
    config.data_parallel_index = rank
    if dense:
        config.reconfigure_for_independent_dp_rank()
        assert config.data_parallel_rank == 0 and config.data_parallel_index == rank
    return config


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "moe"])
def test_the_worker_side_claims_the_directory_for_its_data_parallel_replica(vllm, tmp_path: Path,
                                                                            dense: bool) -> None:
    """Each DP replica's output rank holds its own claim on the shared directory; a second server's
    replica of the same rank is refused at start, naming the setting."""
    from omni_cache.integration.delivery_files import CLAIM_NAME, DeliveryDirInUse, claim_name

    def worker(rank: int) -> Any:
        config = _config(vllm, str(tmp_path))
        config.parallel_config = _replica_config(rank, dense=dense)
        return vllm.kv_tier.OmniKVConnector(config, vllm.Role.WORKER, None)

    first, second = worker(0), worker(1)
    assert (tmp_path / CLAIM_NAME).exists() and (tmp_path / claim_name(1)).exists()
    with pytest.raises(DeliveryDirInUse, match=r"omni_cache\.delivery_dir: .* another running server"):
        worker(1)
    for replica in (first, second):
        replica.shutdown()
    worker(1).shutdown()  # given back at shutdown


def test_the_plan_and_the_outcomes_survive_the_process_channels(vllm, tmp_path: Path) -> None:
    sched, _ = _pair(vllm, tmp_path)
    meta = sched.build_connector_meta(_so(_new("a"), _new("b", include_output_tokens=True)))
    again = pickle.loads(pickle.dumps(meta))
    assert type(again) is vllm.kv_tier.OmniTierMetadata and again.omni_delivery == meta.omni_delivery
    assert [t.req_id for t in again.omni_delivery.targets] == ["a", "b"]
    outcome = vllm.kv_tier.OmniWorkerMetadata(metadata=(), omni_results=(DeliveryResult("a", "/p", None, 4, 2),))
    assert pickle.loads(pickle.dumps(outcome)) == outcome


# ------------------------------------------------------------------------ outcomes to outputs
def test_a_request_finishing_as_its_file_is_written_gets_the_path_in_its_own_dict(vllm, tmp_path: Path) -> None:
    sched, worker = _pair(vllm, tmp_path)
    m = manager(eager=True)
    meta = sched.build_connector_meta(_so(_new("a"), _new("b")))
    reported = _worker_step(worker, meta, m)
    other_rank = None  # tensor-parallel rank 1 holds no cache and reports nothing
    merged = vllm.KVOutputAggregator(1).aggregate([_rank_output(vllm, reported), _rank_output(vllm, other_rank)])
    delay, params = sched.request_finished_all_groups(_request("a"), ([7],))  # finished in this very step
    assert (delay, params) == (False, {"hidden_states_path": meta.omni_delivery.targets[0].path})
    sched.update_connector_output(merged.kv_connector_output)  # vLLM calls it after request_finished
    assert params == {"hidden_states_path": meta.omni_delivery.targets[0].path, "hidden_states_num_tokens": 4,
                      "hidden_states_cached_tokens": 0}
    # b finishes a step later: its outcome was kept for it
    assert sched.request_finished_all_groups(_request("b", outputs=2), ([8],))[1]["hidden_states_num_tokens"] == 4
    # nothing dropped or left to write; both files' holds end (their outputs named them)
    assert sched.build_connector_meta(_so()).omni_delivery == DeliveryPlan(told=("a", "b"))
    assert os.path.exists(params["hidden_states_path"]) and m.stats()["unconsumed_step_ids"] == {}
    worker.shutdown()
    m.shutdown()


def test_with_speculative_decoding_the_outcomes_fill_the_metadata_built_before_the_wait(vllm, tmp_path: Path) -> None:
    """vLLM defers the connector's finalize past the draft model when it decodes speculatively: the
    step's metadata is built before ``wait_for_save`` ends the delivery's step, and the outcomes of
    that step's files must still reach the scheduler with it. A step without a forward keeps vLLM's
    usual order (wait, then build) and reports nothing when there is nothing to report."""
    from omni_cache.integration.metrics_vllm import OMNI_KEY
    from omni_cache.runtime.errors import ErrorTally

    sched, worker = _pair(vllm, tmp_path, speculative=True)
    m = manager(eager=True)
    worker.omni_metrics.bind(SimpleNamespace(hooks=SimpleNamespace(manager=m, config=m.config), errors=ErrorTally(),
                                             failed=None), output_rank=True)
    meta = sched.build_connector_meta(_so(_new("a")))
    stats: list[Any] = []
    reported = _worker_step(worker, meta, m, deferred=True, stats=stats)
    assert [r.req_id for r in reported.omni_results] == ["a"]
    # the cache's metrics of the step, taken before the wait too, carry the step's file
    assert stats[0][OMNI_KEY].data["counters"]["delivered_files"] == 1
    merged = vllm.KVOutputAggregator(1).aggregate([_rank_output(vllm, reported)])
    _, params = sched.request_finished_all_groups(_request("a"), ([7],))
    sched.update_connector_output(merged.kv_connector_output)
    assert params["hidden_states_num_tokens"] == 4 and os.path.exists(params["hidden_states_path"])
    worker.wait_for_save()  # a step with no forward (kv_connector_no_forward): vLLM's usual order
    assert worker.get_kv_connector_stats() is None  # reported at once: nothing changed
    assert worker.build_connector_worker_meta() is None
    worker.shutdown()
    m.shutdown()


def test_an_include_output_tokens_request_is_handed_to_the_worker_once(vllm, tmp_path: Path) -> None:
    sched, _ = _pair(vllm, tmp_path)
    sched.build_connector_meta(_so(_new("a", include_output_tokens=True)))
    _, params = sched.request_finished_all_groups(_request("a", outputs=3), ([7],))
    assert params["hidden_states_num_tokens"] == 6
    plan = sched.build_connector_meta(_so()).omni_delivery
    assert plan.finished == (("a", (5, 6, 7, 8, 0, 1)),) and not plan.dropped


def test_a_wrapped_connectors_params_travel_beside_ours_and_a_clash_keeps_ours(
    vllm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    sched, worker = _pair(vllm, tmp_path)
    theirs: dict[str, Any] = {"remote_engine_id": "prefill-0", "remote_block_ids": [7]}
    monkeypatch.setattr(vllm.MultiConnector, "request_finished", lambda self, request, blocks: (True, dict(theirs)))
    m = manager(eager=True)
    meta = sched.build_connector_meta(_so(_new("a"), _new("b")))
    reported = _worker_step(worker, meta, m)
    delay, params = sched.request_finished_all_groups(_request("a"), ([7],))
    assert delay and params == {"hidden_states_path": meta.omni_delivery.targets[0].path, **theirs}
    sched.update_connector_output(vllm.KVConnectorOutput(kv_connector_worker_meta=reported))
    assert params["hidden_states_num_tokens"] == 4 and params["remote_engine_id"] == "prefill-0"
    theirs["hidden_states_path"] = "/elsewhere.safetensors"
    with caplog.at_level(logging.ERROR):
        _, params = sched.request_finished_all_groups(_request("b"), ([8],))
    assert params["hidden_states_path"] == meta.omni_delivery.targets[1].path and params["remote_block_ids"] == [7]
    assert "request 'b'" in caplog.text and "['hidden_states_path'] clash" in caplog.text, caplog.text
    worker.shutdown()
    m.shutdown()


def test_aggregation_keeps_every_outcome_once_and_the_childrens_metadata(vllm) -> None:
    omni = vllm.kv_tier.OmniWorkerMetadata
    child = SimpleNamespace(aggregate=lambda other: ("merged", other))
    a, b = DeliveryResult("a", "/a", None, 4), DeliveryResult("b", None, "disk full")
    with_child = omni(metadata=(child, None), omni_results=(a,))
    plain = vllm.MultiWorkerMeta(metadata=("theirs", "rank 1"))
    merged = with_child.aggregate(plain)
    assert type(merged) is omni and merged.omni_results == (a,) and merged.metadata == (("merged", "theirs"), "rank 1")
    both = omni(metadata=(), omni_results=(a,)).aggregate(omni(metadata=(), omni_results=(b,)))
    assert both.omni_results == (a, b)
    # vLLM's aggregator, in rank order: the output rank's outcomes stay, whatever the others report
    for others in ([None], [plain], [None, plain]):
        outputs = [_rank_output(vllm, with_child), *(_rank_output(vllm, o) for o in others)]
        result = vllm.KVOutputAggregator(len(outputs)).aggregate(outputs).kv_connector_output
        assert result.kv_connector_worker_meta.omni_results == (a,)


def test_shutdown_releases_the_lock_files_of_open_deliveries(vllm, tmp_path: Path) -> None:
    sched, worker = _pair(vllm, tmp_path)
    plan = sched.build_connector_meta(_so(_new("a"))).omni_delivery
    worker.omni_delivery.begin_step(plan, {"a": [5, 6, 7, 8]})
    lock = plan.targets[0].path + ".lock"
    fd = os.open(lock, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        worker.shutdown()
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a reader is not left waiting for ever
    finally:
        os.close(fd)


def test_without_a_kv_transfer_group_there_is_no_delivery_or_tier(vllm) -> None:
    assert vllm.kv_tier.worker_delivery() is None and vllm.kv_tier.worker_tier_applier() is None


@pytest.mark.parametrize("worker_cls", ["vllm.v1.worker.cpu_worker.CPUWorker", "auto", "no.such.Worker", "json.JSONDecoder"])
def test_the_connector_beside_a_worker_that_runs_no_cache_is_refused_at_start(vllm, tmp_path: Path,
                                                                              worker_cls: str) -> None:
    """Beside any worker but omni-cache's, no runner applies a tier plan or writes a file: every
    request's delivery would fail. Both sides refuse at engine start, naming the setting."""
    from vllm.config import ParallelConfig

    config = _config(vllm, str(tmp_path))
    config.parallel_config = ParallelConfig(worker_cls=worker_cls)
    for role in (vllm.Role.SCHEDULER, vllm.Role.WORKER):
        with pytest.raises(ValueError, match=rf"OmniKVConnector: parallel_config.worker_cls '{re.escape(worker_cls)}' "
                                             r"(is not omni-cache's worker|cannot be imported).*worker_cls=omni_cache"):
            vllm.kv_tier.OmniKVConnector(copy.deepcopy(config), role, None)
    from omni_cache.integration.delivery_files import CLAIM_NAME

    assert not (tmp_path / CLAIM_NAME).exists()  # refused before the worker side claimed the directory
    for ours in OMNI_WORKERS:
        config.parallel_config = ParallelConfig(worker_cls=ours)
        vllm.kv_tier.OmniKVConnector(copy.deepcopy(config), vllm.Role.WORKER, None).shutdown()


def test_delivery_failures_the_scheduler_writes_reach_the_metrics_once(vllm, tmp_path: Path) -> None:
    """A request that ended before its file (here: aborted) is told ``hidden_states_error`` by the
    scheduler; the worker never hears of it, so the scheduler side's stats carry it (vLLM adds them to
    the worker's), counted once."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorStats

    sched, worker = _pair(vllm, tmp_path)
    sched.build_connector_meta(_so(_new("a")))
    aborted = _request("a")
    aborted.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert "hidden_states_error" in sched.request_finished_all_groups(aborted, ([7],))[1]
    taken = sched.get_kv_connector_stats()
    assert isinstance(taken, MultiKVConnectorStats) and taken["OmniKVConnector"].data["counters"] == {"delivery_failures": 1}
    assert sched.get_kv_connector_stats() is None  # counted once
    worker.shutdown()
