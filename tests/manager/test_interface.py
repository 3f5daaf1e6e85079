"""The seed's interface: names, config validation and sizing, the model policy, errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import omni_cache
from omni_cache import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
    StageCacheOutputs,
    WriteSchedule,
    is_hidden_key,
    without_hidden,
)


def test_every_seed_and_design_name_is_public() -> None:
    names = ["TensorName", "ReqId", "Tid", "StepId", "HIDDEN_KEY", "is_hidden_key", "without_hidden", "WriteSchedule", "PrefixCacheConfig", "StageCacheOutputs", "ModelCachePolicy", "OmniPrefixCacheUnmatchError", "OmniPrefixCacheStagingTimeoutError", "PrefixCacheEventKind", "PrefixCacheRequestEvent", "PrefixCacheStep", "PrefixCacheWrite", "PrefixCacheWriteLayout"]
    import omni_cache.runtime.interface as interface

    for name in names:
        assert hasattr(omni_cache, name), name
    for name in names[:13]:
        assert hasattr(interface, name), name
    assert issubclass(OmniPrefixCacheStagingTimeoutError, OmniPrefixCacheUnmatchError)
    assert issubclass(OmniPrefixCacheUnmatchError, RuntimeError)
    assert {WriteSchedule.JOIN_NEXT_STEP, WriteSchedule.JOIN_ON_FINISH} == set(WriteSchedule)


def test_hidden_identity() -> None:
    assert is_hidden_key(HIDDEN_KEY) and not is_hidden_key("audio.codes")
    assert without_hidden([HIDDEN_KEY, "a.b", "c"]) == {"a.b", "c"}


def test_config_defaults_and_validation() -> None:
    cfg = PrefixCacheConfig(num_blocks=10, block_size=16)
    assert (cfg.gpu_staging_bytes, cfg.staging_depth, cfg.staging_capacity_tokens) == (512 << 20, 4, 1024)
    assert (cfg.staging_claim_timeout_s, cfg.copy_chunk_bytes, cfg.num_slots) == (30.0, 16 << 20, 160)
    bad = [
        dict(num_blocks=0), dict(block_size=-1), dict(staging_depth=0), dict(staging_capacity_tokens=0),
        dict(gpu_staging_bytes=0), dict(copy_chunk_bytes=0), dict(staging_claim_timeout_s=0),
        dict(staging_claim_timeout_s=float("inf")), dict(num_blocks=True), dict(block_size=1.5),
    ]
    for override in bad:
        kwargs = {"num_blocks": 10, "block_size": 16, **override}
        with pytest.raises(ValueError, match=next(iter(override))):
            PrefixCacheConfig(**kwargs)  # type: ignore[arg-type]


def test_from_vllm_config_sizing_order() -> None:
    sched = SimpleNamespace(max_num_batched_tokens=16384, max_model_len=4096)
    cfg = PrefixCacheConfig.from_vllm_config(num_blocks=8, block_size=16, scheduler_config=sched)
    assert cfg.staging_capacity_tokens == 16384 and cfg.staging_depth == 4  # never clamped
    sched = SimpleNamespace(max_num_batched_tokens=None, max_model_len=4096)
    assert PrefixCacheConfig.from_vllm_config(num_blocks=8, block_size=16, scheduler_config=sched).staging_capacity_tokens == 4096
    model = SimpleNamespace(max_model_len=2048)
    assert PrefixCacheConfig.from_vllm_config(num_blocks=8, block_size=16, model_config=model).staging_capacity_tokens == 2048
    assert PrefixCacheConfig.from_vllm_config(num_blocks=8, block_size=16).staging_capacity_tokens == 1024
    zero = SimpleNamespace(max_num_batched_tokens=0)  # refused, never clamped to 1
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        PrefixCacheConfig.from_vllm_config(num_blocks=8, block_size=16, scheduler_config=zero)


def test_policy_semantics() -> None:
    policy = ModelCachePolicy(deferred_keys=frozenset({"audio.embeds"}))
    assert policy.hidden_key == HIDDEN_KEY
    assert policy.get_hit_keys(["z.mm", HIDDEN_KEY, "a.mm"]) == [HIDDEN_KEY, "a.mm", "z.mm"]
    assert policy.skip_immediate_mm(HIDDEN_KEY) and policy.skip_immediate_mm("audio.embeds")
    assert not policy.skip_immediate_mm("audio.codes")
    assert policy.schedule_for("audio.embeds") is WriteSchedule.JOIN_ON_FINISH
    opt_out = ModelCachePolicy(needs_full_hidden_states=False)
    assert opt_out.hidden_key is None and opt_out.get_hit_keys([HIDDEN_KEY, "b", "a"]) == ["a", "b"]
    with pytest.raises(OmniPrefixCacheUnmatchError, match="mm_outputs_written_in_sample"):
        ModelCachePolicy(mm_outputs_written_in_sample=True)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="deferred_keys"):
        ModelCachePolicy(deferred_keys=frozenset({HIDDEN_KEY}))


def test_policy_from_legacy_model_attributes() -> None:
    plain = ModelCachePolicy.from_model(object())
    assert plain == ModelCachePolicy()
    model = SimpleNamespace(requires_full_prefix_cached_hidden_states=False,
                            deferred_prefix_cache_mm_keys=["audio.embeds"], mm_outputs_written_in_sample=True)
    policy = ModelCachePolicy.from_model(model)
    assert policy.hidden_key is None and policy.deferred_keys == frozenset({"audio.embeds"})
    assert policy.mm_outputs_written_in_sample
    with pytest.raises(OmniPrefixCacheUnmatchError):
        ModelCachePolicy.from_model(SimpleNamespace(mm_outputs_written_in_sample=True))


def test_adapter_values_are_immutable_snapshots() -> None:
    blocks = [1, 2]
    event = PrefixCacheRequestEvent("r", PrefixCacheEventKind.STARTED, 0, 32, blocks)
    blocks.append(3)
    assert event.block_ids == ((1, 2),) and event.group0_block_ids == (1, 2)
    grouped = PrefixCacheRequestEvent("r", "resumed", block_ids=[[4], [5]])
    assert grouped.kind is PrefixCacheEventKind.RESUMED and grouped.block_ids == ((4,), (5,))
    step = PrefixCacheStep([event], {"r": 3})
    assert list(step) == [event] and len(step) == 1
    live = torch.arange(4)
    layout = PrefixCacheWriteLayout((PrefixCacheWrite("r", 0, 4, 32, 36),), 4, live)
    live.fill_(9)
    assert layout.slots_cpu.tolist() == [0, 1, 2, 3] and layout.slots_cpu.dtype == torch.int64
    with pytest.raises(ValueError):
        PrefixCacheWrite("r", 0, 4, 0, 3)
    with pytest.raises(AttributeError):
        event.hit_end = 0  # type: ignore[misc]
    assert StageCacheOutputs(None, {}).hidden_states is None
