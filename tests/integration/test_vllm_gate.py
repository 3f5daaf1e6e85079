"""The config gate refuses unsound stages on vLLM's real config objects (marker ``vllm``).

Each refusal is tried on a ``VllmConfig`` built by vLLM's own ``EngineArgs``
(speculative decoding with the GPU n-gram proposer, a KV-consumer role, decode context
parallel; speculative decoding with ngram or a draft model is accepted) or a real
``KVCacheConfig`` (a sliding-window-only layout; a hybrid one is accepted), through the same bridge call the
model runner makes at KV-cache initialisation; a control config passes. One
refusal is also tried at a real engine start (in a subprocess): the engine
fails to start with the gate's message, before any step.
"""

from __future__ import annotations

import dataclasses

import pytest
from vllm_support import engine_start_in_subprocess, require_vllm

from omni_cache.integration.vllm_bridge import VllmRunnerBridge
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def base_kwargs():
    require_vllm()
    from omni_cache.harness.vllm_engine.engine import engine_kwargs, prepare_vllm_env, tiny_llama_dir

    prepare_vllm_env()
    kwargs = engine_kwargs(tiny_llama_dir(), kv_blocks=24, max_batched_tokens=256, max_model_len=512)
    kwargs.pop("worker_cls")
    return kwargs


def _vllm_config(base_kwargs, **extra):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**{**base_kwargs, **extra}).create_engine_config()


def _kv_cache_config(num_groups: int = 1):
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full)]
    if num_groups > 1:
        window = SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32,
                                   sliding_window=64)
        groups.append(KVCacheGroupSpec(["model.layers.1.self_attn.attn"], window))
    return KVCacheConfig(num_blocks=24, kv_cache_tensors=[], kv_cache_groups=groups)


def _gate(vllm_config, kv_cache_config):
    bridge = VllmRunnerBridge.from_vllm_config(vllm_config)
    bridge.on_kv_cache_initialized(vllm_config, kv_cache_config)
    return bridge.hooks.config


def test_the_real_control_config_passes(base_kwargs) -> None:
    config = _gate(_vllm_config(base_kwargs), _kv_cache_config())
    assert config is not None and (config.block_size, config.num_blocks) == (32, 24)
    assert config.staging_capacity_tokens == 256  # max_num_batched_tokens, from the real scheduler config


@pytest.mark.parametrize(
    ("extra", "phrase"),
    [
        (dict(speculative_config={"method": "ngram_gpu", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 2}), "GPU n-gram proposer"),
        (dict(kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_consumer"}), "KV-consumer"),
        (dict(decode_context_parallel_size=2, tensor_parallel_size=2), "decode context parallel"),
    ],
    ids=["gpu-ngram", "kv-consumer", "dcp"],
)
def test_the_gate_refuses_real_engine_configs(base_kwargs, extra, phrase) -> None:
    vllm_config = _vllm_config(base_kwargs, **extra)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=phrase) as info:
        _gate(vllm_config, _kv_cache_config())
    assert "cannot run on this stage" in str(info.value)


class _DeviceStarted(Exception):
    """Raised by a stand-in for vLLM's own ``init_device``: the worker got past the cache's checks."""


@pytest.mark.parametrize("worker", ["OmniCPUWorker", "OmniGPUWorker"])
def test_the_omni_workers_refuse_before_their_device_starts(base_kwargs, monkeypatch, worker: str) -> None:
    """vLLM's CPU runner cannot even start the GPU n-gram proposer (it pins memory): the omni workers
    run the gate's config-only refusals before vLLM's own ``init_device``, so the user gets the cache's
    one-line refusal, not vLLM's traceback; an accepted config goes on to vLLM's start."""
    import omni_cache.integration.vllm_worker as workers

    cls = getattr(workers, worker)

    def started(self) -> None:
        raise _DeviceStarted

    monkeypatch.setattr(cls.__mro__[1], "init_device", started)
    refused = object.__new__(cls)
    refused.vllm_config = _vllm_config(base_kwargs, speculative_config={
        "method": "ngram_gpu", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 2})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="GPU n-gram proposer"):
        refused.init_device()
    accepted = object.__new__(cls)
    accepted.vllm_config = _vllm_config(base_kwargs)
    with pytest.raises(_DeviceStarted):
        accepted.init_device()


def test_the_gate_accepts_speculative_decoding_on_real_engine_configs(base_kwargs, tmp_path) -> None:
    """I14: ngram and a draft model pass (the bridge gives every verify step its verdict)."""
    from omni_cache.harness.vllm_engine.speculative import draft_model_dir

    for spec in ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 2},
                 {"method": "draft_model", "model": draft_model_dir(str(tmp_path)), "num_speculative_tokens": 2}):
        vllm_config = _vllm_config(base_kwargs, speculative_config=spec)
        bridge = VllmRunnerBridge.from_vllm_config(vllm_config)
        bridge.on_kv_cache_initialized(vllm_config, _kv_cache_config())
        assert bridge.hooks.config is not None and bridge.speculative, spec


def test_the_gate_takes_the_full_attention_group_of_several(base_kwargs) -> None:
    vllm_config = _vllm_config(base_kwargs)
    config = _gate(vllm_config, _kv_cache_config(num_groups=2))
    assert config is not None and config.output_group_id == 0  # full attention is group 0 here
    one_window = dataclasses.replace(_kv_cache_config(2), kv_cache_groups=_kv_cache_config(2).kv_cache_groups[1:])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="none is a prefix-cacheable full-attention group"):
        _gate(vllm_config, one_window)


def test_a_refused_config_fails_at_engine_start_before_any_step() -> None:
    line = engine_start_in_subprocess(
        'engine_kwargs(tiny_llama_dir(), kv_blocks=24, max_batched_tokens=256, max_model_len=512, '
        'kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_consumer", '
        '"kv_connector_extra_config": {"shared_storage_path": "/tmp/omni-cache-gate-test"}})')
    assert line.startswith("REFUSED OmniPrefixCacheUnmatchError steps 0"), line
    assert "KV-consumer" in line
