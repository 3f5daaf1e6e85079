"""``OmniKVConnector`` on vLLM's real classes, without an engine (marker ``vllm``).

The scheduler half is driven by hand with vLLM's own ``ExampleConnector`` as
the wrapped child (its disk store in a temp dir): the blocks it fills beyond
the local hit become tier loads with the request's block hashes and *new*
block ids, a finished request's full blocks become stores, and the metadata
(the child's, plus the plan) survives pickling, the scheduler/worker channel
under multiprocessing. Also, on CPU: vLLM's ``OffloadingConnector`` and
``LMCacheConnectorV1`` import (they cannot run here: the first refuses
non-CUDA platforms, the second needs the ``lmcache`` package), expose the
hooks the wrapper builds on with the signatures it calls, and are refused by
the gate unless wrapped.
"""

from __future__ import annotations

import inspect
import pickle
from types import SimpleNamespace

import pytest
from test_vllm_gate import _vllm_config, base_kwargs  # noqa: F401  (fixture)
from vllm_support import require_vllm

from omni_cache.harness.served.launch import WORKER_CLS
from omni_cache.integration.kv_capability import connector_verdict
from omni_cache.integration.tier_apply import TierLoad, TierStore

pytestmark = pytest.mark.vllm
BS = 32


def _wrapped(path: str, role: str = "kv_both") -> dict:
    return {"kv_connector": "OmniKVConnector", "kv_connector_module_path": "omni_cache.integration.kv_tier",
            "kv_role": role, "kv_connector_extra_config": {
                "connectors": [{"kv_connector": "ExampleConnector", "kv_role": role,
                                "kv_connector_extra_config": {"shared_storage_path": path}}],
                "omni_cache": {"tier_bytes": 1 << 20}}}


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def test_scheduler_half_names_new_blocks_by_hash_and_stores_finished_full_blocks(base_kwargs, tmp_path) -> None:  # noqa: F811
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vllm_config = _vllm_config(base_kwargs, worker_cls=WORKER_CLS, kv_transfer_config=_wrapped(str(tmp_path)))
    cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
    assert cls.__name__ == "OmniKVConnector"
    conn = cls(vllm_config, KVConnectorRole.SCHEDULER, None)
    assert conn.omni_tier_applier is None  # the tier lives on the worker side only
    example = conn.sub_connectors[0]
    prompt = list(range(3, 3 + 4 * BS + 10))  # ExampleConnector stores/looks up 4 full blocks of it
    import torch

    example._generate_foldername_debug(torch.tensor(prompt[: 4 * BS]), [], create_folder=True)  # "stored"
    hashes = [bytes([i]) * 8 for i in range(5)]
    req = SimpleNamespace(request_id="r", prompt_token_ids=prompt, mm_features=[], block_hashes=hashes,
                          num_computed_tokens=0, all_token_ids=prompt)
    assert conn.get_num_new_matched_tokens(req, BS) == (3 * BS, False)  # 1 local block, 3 external
    ids = [7, 11, 12, 13, 20]
    conn.update_state_after_alloc(req, _Blocks(ids), 3 * BS)
    new_req = SimpleNamespace(req_id="r", prompt_token_ids=prompt, mm_features=[], block_ids=(ids,))
    so = SimpleNamespace(scheduled_new_reqs=[new_req],
                         scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set()),
                         num_scheduled_tokens={"r": 10})
    meta = pickle.loads(pickle.dumps(conn.build_connector_meta(so)))
    assert type(meta).__name__ == "OmniTierMetadata" and len(meta.metadata) == 1
    assert [r.is_store for r in meta.metadata[0].requests] == [False]  # the child's own load
    assert meta.omni_tier.loads == tuple(TierLoad("r", i, hashes[i], ids[i]) for i in (1, 2, 3))
    assert meta.omni_tier.stores == ()
    req.num_computed_tokens = 4 * BS + 9  # finished: 4 full blocks computed
    conn.request_finished(req, ids)
    after = conn.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={}))
    assert after.omni_tier.stores == tuple(TierStore("r", hashes[i], ids[i]) for i in range(4))
    assert after.omni_tier.loads == ()
    again = conn.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={}))
    assert not again.omni_tier  # each instruction is sent once


@pytest.mark.parametrize(("module", "name"), [
    ("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector", "OffloadingConnector"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector", "LMCacheConnectorV1"),
])
def test_gpu_tier_connectors_expose_the_hooks_the_wrapper_builds_on(module: str, name: str) -> None:
    require_vllm()
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, KVConnectorBase_V1)
    wanted = {"get_num_new_matched_tokens": ["request", "num_computed_tokens"],
              "update_state_after_alloc": ["request", "blocks", "num_external_tokens"],
              "request_finished": ["request", "block_ids"], "build_connector_meta": ["scheduler_output"]}
    for hook, params in wanted.items():
        assert list(inspect.signature(getattr(cls, hook)).parameters)[1:] == params, (name, hook)
    for role in ("kv_producer", "kv_both"):
        verdict = connector_verdict({"kv_connector": name, "kv_role": role})
        assert verdict.loads and not verdict.wrapped, (name, role)
    assert connector_verdict({"kv_connector": "MultiConnector", "kv_role": "kv_producer",
                              "kv_connector_extra_config": {"connectors": [{"kv_connector": name}]}}).loads


def test_the_wrapped_connectors_get_each_steps_worker_output(base_kwargs, tmp_path) -> None:  # noqa: F811
    """``update_connector_output`` reaches every wrapped connector (vLLM's MultiConnector hands it on):
    the wrapper reads its own outcomes from the output and must not keep the children's from them."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.outputs import KVConnectorOutput

    vllm_config = _vllm_config(base_kwargs, worker_cls=WORKER_CLS, kv_transfer_config=_wrapped(str(tmp_path)))
    cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
    conn = cls(vllm_config, KVConnectorRole.SCHEDULER, None)
    seen: list[object] = []
    for child in conn.sub_connectors:
        child.update_connector_output = seen.append  # type: ignore[method-assign]
    output = KVConnectorOutput(finished_sending={"a"})
    conn.update_connector_output(output)
    assert len(seen) == len(conn.sub_connectors) == 1
    assert seen[0].finished_sending == {"a"}  # type: ignore[attr-defined]


def test_a_hybrid_layout_with_a_wrapped_connector_lacking_hma_is_refused(base_kwargs, tmp_path) -> None:  # noqa: F811
    """With several KV-cache groups the hybrid manager matters: a wrapped connector without its
    support (ExampleConnector) is refused at construction, naming the setting that turns it off."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vllm_config = _vllm_config(base_kwargs, worker_cls=WORKER_CLS, kv_transfer_config=_wrapped(str(tmp_path)))
    assert not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
    with pytest.raises(ValueError, match=r"2 KV-cache groups .* set disable_hybrid_kv_cache_manager=True"):
        cls(vllm_config, KVConnectorRole.SCHEDULER, SimpleNamespace(kv_cache_groups=[object(), object()]))


def test_the_wrappers_records_go_out_through_vllms_log_handler(base_kwargs, tmp_path) -> None:  # noqa: F811
    """In the engine-core process (where no worker bridge runs under vLLM's multiprocess engine) the
    wrapper itself routes the cache's log records (logger ``omni_cache``) to vLLM's handler."""
    import logging

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    ours, theirs = logging.getLogger("omni_cache"), logging.getLogger("vllm")
    probe = logging.NullHandler()  # stands for the handler vLLM configures outside pytest
    vllm_config = _vllm_config(base_kwargs, worker_cls=WORKER_CLS, kv_transfer_config=_wrapped(str(tmp_path)))
    cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
    saved, level = list(ours.handlers), ours.level
    for handler in saved:
        ours.removeHandler(handler)
    theirs.addHandler(probe)
    try:
        cls(vllm_config, KVConnectorRole.SCHEDULER, None)
        assert probe in ours.handlers
        assert ours.level == theirs.level
    finally:
        theirs.removeHandler(probe)
        for handler in list(ours.handlers):
            ours.removeHandler(handler)
        for handler in saved:
            ours.addHandler(handler)
        ours.setLevel(level)


def _hybrid_kv_cache_config(block_size: int) -> SimpleNamespace:
    """Three sliding-window groups, then the full-attention group (the output group, 3)."""
    def spec(name: str) -> object:
        return type(name, (), {"block_size": block_size, "sliding_window": 2 * block_size})()

    groups = [SimpleNamespace(kv_cache_spec=spec("SlidingWindowSpec")) for _ in range(3)]
    return SimpleNamespace(kv_cache_groups=[*groups, SimpleNamespace(kv_cache_spec=spec("FullAttentionSpec"))],
                           num_blocks=64)


def test_on_a_hybrid_layout_tier_plans_name_the_output_groups_blocks(base_kwargs, tmp_path) -> None:  # noqa: F811
    """Rows are addressed by the output group (the full-attention one): a finished request's stores name
    its blocks there, never a sliding-window group's (whose leading blocks are null block 0). Delivery
    alone (no wrapped connector) is not refused for the layout: there is no child to lack HMA support."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    transfer = {"kv_connector": "OmniKVConnector", "kv_connector_module_path": "omni_cache.integration.kv_tier",
                "kv_role": "kv_both", "kv_connector_extra_config": {"omni_cache": {"delivery_dir": str(tmp_path)}}}
    vllm_config = _vllm_config(base_kwargs, worker_cls=WORKER_CLS, kv_transfer_config=transfer)
    cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
    conn = cls(vllm_config, KVConnectorRole.SCHEDULER, _hybrid_kv_cache_config(BS))
    groups = ([0, 0, 31, 32], [0, 0, 41, 42], [0, 0, 51, 52], [10, 11, 12, 13])
    hashes = [bytes([i]) * 8 for i in range(4)]
    req = SimpleNamespace(request_id="r", prompt_token_ids=list(range(4 * BS)), mm_features=[], block_hashes=hashes,
                          num_computed_tokens=4 * BS, all_token_ids=list(range(4 * BS)), kv_transfer_params=None,
                          sampling_params=None)
    conn.request_finished_all_groups(req, groups)
    meta = conn.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={}))
    assert meta.omni_tier.stores == tuple(TierStore("r", hashes[i], groups[3][i]) for i in range(4))


def test_pipeline_parallel_aggregation_keeps_the_output_ranks_delivery_outcomes(monkeypatch) -> None:
    """vLLM folds the workers' metadata in rank order with the first one's ``aggregate``; with pipeline
    parallelism the output rank is the last stage. A rank without outcomes still sends its wrapped
    connectors' metadata as ours, so the output rank's outcomes survive the fold."""
    from copy import copy

    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
        MultiKVConnectorWorkerMetadata,
    )
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

    from omni_cache.integration import kv_tier
    from omni_cache.integration.delivery import DeliveryResult

    class ChildMeta(KVConnectorWorkerMetadata):  # a wrapped connector's own worker metadata
        def aggregate(self, other: object) -> ChildMeta:
            return self

    child = ChildMeta()
    monkeypatch.setattr(MultiConnector, "build_connector_worker_meta",
                        lambda self: MultiKVConnectorWorkerMetadata(metadata=(child,)))
    first_stage = object.__new__(kv_tier.OmniKVConnector)  # a PP rank without the cache: no outcomes
    first_stage._connectors = [object()]
    first_stage._omni_waited, first_stage._omni_deferred = False, False
    first_stage.omni_delivery = SimpleNamespace(take_results=lambda: ())
    ours = first_stage.build_connector_worker_meta()
    assert isinstance(ours, kv_tier.OmniWorkerMetadata) and ours.omni_results == () and ours.metadata == (child,)
    result = DeliveryResult("r", "/d/r.safetensors", None, 10)
    last_stage = kv_tier.OmniWorkerMetadata(metadata=(child,), omni_results=(result,))
    outputs = []
    for meta in (ours, last_stage):
        out = copy(EMPTY_MODEL_RUNNER_OUTPUT)
        out.kv_connector_output = KVConnectorOutput(kv_connector_worker_meta=meta)
        outputs.append(out)
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs, output_rank=1)
    assert merged.kv_connector_output.kv_connector_worker_meta.omni_results == (result,)


@pytest.mark.parametrize(("policy", "warned"), [("fail", True), ("recompute", False)])
def test_a_failing_load_policy_beside_a_wrapped_connector_is_warned_about(base_kwargs, tmp_path, caplog,  # noqa: F811
                                                                          policy: str, warned: bool) -> None:
    """A plain ``vllm serve`` user wrapping a connector keeps vLLM's default ``"fail"``: one warning
    at start says which requests it fails and what to set (the launcher sets ``"recompute"``)."""
    import logging

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vllm_config = _vllm_config(base_kwargs, worker_cls=WORKER_CLS, kv_transfer_config={**_wrapped(str(tmp_path)),
                                                                "kv_load_failure_policy": policy})
    cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
    with caplog.at_level(logging.WARNING, logger="omni_cache"):
        cls(vllm_config, KVConnectorRole.SCHEDULER, None)
    lines = [r.getMessage() for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]
    assert len(lines) == int(warned), lines
    if warned:
        assert "kv_load_failure_policy='recompute'" in lines[0]
