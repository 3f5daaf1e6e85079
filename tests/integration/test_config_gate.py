"""stage_prefix_cache_config over fakes with vLLM's config field names.

None when prefix caching is off or the stage pools; a clear refusal for every
configuration that would make a hit unsound (I5/I6 at their root); else
PrefixCacheConfig.from_vllm_config sized from the KV cache and the scheduler.
"""

from __future__ import annotations

import pytest
from fakes_vllm import (
    CacheConfig,
    FullAttentionSpec,
    KVTransferConfig,
    MambaSpec,
    MLAAttentionSpec,
    ModelConfig,
    SchedulerConfig,
    SlidingWindowSpec,
    SpeculativeConfig,
    VllmConfig,
    kv_cache_config,
)

from omni_cache import OmniPrefixCacheUnmatchError, PrefixCacheConfig
from omni_cache.integration import stage_prefix_cache_config


def test_plain_generate_stage_gets_a_config() -> None:
    cfg = stage_prefix_cache_config(
        VllmConfig(scheduler_config=SchedulerConfig(max_num_batched_tokens=3000)), kv_cache_config(500, 16)
    )
    assert cfg == PrefixCacheConfig(num_blocks=500, block_size=16, staging_capacity_tokens=3000)


def test_block_size_comes_from_the_kv_cache_group_spec() -> None:
    cfg = stage_prefix_cache_config(VllmConfig(), kv_cache_config(64, 32, MLAAttentionSpec(32)))
    assert cfg is not None and (cfg.num_blocks, cfg.block_size) == (64, 32)


def test_prefix_caching_off_gives_none() -> None:
    vc = VllmConfig(cache_config=CacheConfig(enable_prefix_caching=False), speculative_config=SpeculativeConfig())
    assert stage_prefix_cache_config(vc, kv_cache_config(8, 16)) is None


@pytest.mark.parametrize("model_config", [ModelConfig(runner_type="pooling"), ModelConfig(pooler_config=object())])
def test_pooling_stage_gives_none(model_config: ModelConfig) -> None:
    assert stage_prefix_cache_config(VllmConfig(model_config=model_config), kv_cache_config(8, 16)) is None


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_kv_consumer_stage_is_refused(role: str) -> None:
    vc = VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role=role))
    with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"KV-consumer stage \(kv_transfer_config.kv_role='{role}'\)"):
        stage_prefix_cache_config(vc, kv_cache_config(8, 16))


def test_kv_consumer_is_read_from_fields_without_the_property() -> None:
    class RawTransferConfig:
        kv_connector = "LMCacheConnectorV1"
        kv_role = "kv_consumer"

    vc = VllmConfig(kv_transfer_config=RawTransferConfig())  # type: ignore[arg-type]
    with pytest.raises(OmniPrefixCacheUnmatchError, match="cannot be told apart"):
        stage_prefix_cache_config(vc, kv_cache_config(8, 16))


def test_kv_producer_stage_is_accepted() -> None:
    vc = VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer"))
    assert stage_prefix_cache_config(vc, kv_cache_config(8, 16)) is not None


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3", "mtp", "suffix"])
def test_speculative_decoding_is_accepted_where_each_verify_step_gets_a_verdict(method: str) -> None:
    """I14: the runner bridge trims every verify step (tests/integration/test_spec_decode_bridge.py)."""
    vc = VllmConfig(speculative_config=SpeculativeConfig(method=method))
    assert stage_prefix_cache_config(vc, kv_cache_config(8, 16)) is not None


def test_speculative_decoding_with_the_gpu_ngram_proposer_is_refused() -> None:
    vc = VllmConfig(speculative_config=SpeculativeConfig(method="ngram_gpu"))
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"GPU n-gram proposer \(speculative_config.method='ngram_gpu'\)"):
        stage_prefix_cache_config(vc, kv_cache_config(8, 16))


def test_speculative_decoding_with_async_scheduling_is_refused() -> None:
    class AsyncScheduler(SchedulerConfig):
        async_scheduling = True

    vc = VllmConfig(speculative_config=SpeculativeConfig(method="ngram"), scheduler_config=AsyncScheduler())
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"async scheduling \(scheduler_config.async_scheduling=True\)"):
        stage_prefix_cache_config(vc, kv_cache_config(8, 16))
    assert stage_prefix_cache_config(VllmConfig(scheduler_config=AsyncScheduler()), kv_cache_config(8, 16)) is not None


def test_sub_block_prefix_matching_is_refused() -> None:
    vc = VllmConfig(cache_config=CacheConfig(hash_block_size=8))
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"sub-block prefix matching.*hash_block_size=8"):
        stage_prefix_cache_config(vc, kv_cache_config(8, 16))
    same = VllmConfig(cache_config=CacheConfig(hash_block_size=16))
    assert stage_prefix_cache_config(same, kv_cache_config(8, 16)) is not None


def test_a_hybrid_layout_is_addressed_by_its_full_attention_group() -> None:
    kv = kv_cache_config(8, 16, SlidingWindowSpec(16), SlidingWindowSpec(16), FullAttentionSpec(16),
                         SlidingWindowSpec(16))
    cfg = stage_prefix_cache_config(VllmConfig(), kv)
    assert cfg is not None and (cfg.output_group_id, cfg.block_size, cfg.num_blocks) == (2, 16, 8)


def test_of_several_full_attention_groups_the_lowest_id_is_chosen() -> None:
    kv = kv_cache_config(8, 16, SlidingWindowSpec(16), MLAAttentionSpec(16), FullAttentionSpec(16))
    cfg = stage_prefix_cache_config(VllmConfig(), kv)
    assert cfg is not None and cfg.output_group_id == 1


def test_the_output_group_block_size_is_used() -> None:
    kv = kv_cache_config(8, 16, SlidingWindowSpec(64), FullAttentionSpec(32))
    cfg = stage_prefix_cache_config(VllmConfig(), kv)
    assert cfg is not None and (cfg.output_group_id, cfg.block_size) == (1, 32)


def test_no_kv_cache_group_is_refused() -> None:
    kv = kv_cache_config(8, 16)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"0 KV-cache group\(s\) \(none\)"):
        stage_prefix_cache_config(VllmConfig(), type(kv)(8, [], []))


@pytest.mark.parametrize("specs", [(SlidingWindowSpec(16),), (MambaSpec(16),),
                                   (SlidingWindowSpec(16), SlidingWindowSpec(16), MambaSpec(16))])
def test_a_layout_without_a_full_attention_group_is_refused(specs) -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="none is a prefix-cacheable full-attention group") as info:
        stage_prefix_cache_config(VllmConfig(), kv_cache_config(8, 16, *specs))
    message = str(info.value)
    assert f"{len(specs)} KV-cache group(s)" in message
    for i, spec in enumerate(specs):  # every group is named with its spec
        assert f"group {i}: {type(spec).__name__}(block_size=16)" in message


def test_missing_sizing_fields_raise_value_error() -> None:
    kv = kv_cache_config(8, 16)
    kv.num_blocks = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match="kv_cache_config has no num_blocks"):
        stage_prefix_cache_config(VllmConfig(), kv)


@pytest.mark.parametrize("connector", ["ExampleConnector", "OffloadingConnector", "LMCacheConnectorV1",
                                       "SomeUsersConnector"])
def test_a_producer_whose_connector_still_loads_is_refused(connector: str) -> None:
    vc = VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role="kv_producer"))
    with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"KV connector {connector} can load KV") as info:
        stage_prefix_cache_config(vc, kv_cache_config(8, 16))
    assert "'kv_connector': 'OmniKVConnector'" in str(info.value)  # the way out, named
    assert f"'connectors': [{{'kv_connector': '{connector}'" in str(info.value)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
def test_the_omni_connector_wrapper_is_accepted_in_every_role(role: str) -> None:
    class Wrapped:
        kv_connector = "OmniKVConnector"
        kv_role = role
        kv_connector_extra_config = {"connectors": [{"kv_connector": "ExampleConnector"}]}  # noqa: RUF012

    vc = VllmConfig(kv_transfer_config=Wrapped())  # type: ignore[arg-type]
    assert stage_prefix_cache_config(vc, kv_cache_config(8, 16)) is not None


def test_a_multi_connector_loads_if_any_child_loads() -> None:
    class Multi:
        kv_connector = "MultiConnector"
        kv_role = "kv_producer"

        def __init__(self, children: list[dict]) -> None:
            self.kv_connector_extra_config = {"connectors": children}

    mooncake = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}
    assert stage_prefix_cache_config(VllmConfig(kv_transfer_config=Multi([mooncake])),  # type: ignore[arg-type]
                                     kv_cache_config(8, 16)) is not None
    wrapped = {"kv_connector": "OmniKVConnector", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "ExampleConnector"}]}}
    unwrapped = {"kv_connector": "OffloadingConnector"}
    for children in ([mooncake, unwrapped], [wrapped, unwrapped], [unwrapped, wrapped]):
        with pytest.raises(OmniPrefixCacheUnmatchError, match="MultiConnector child: OffloadingConnector loads"):
            stage_prefix_cache_config(VllmConfig(kv_transfer_config=Multi(children)),  # type: ignore[arg-type]
                                      kv_cache_config(8, 16))
    assert stage_prefix_cache_config(VllmConfig(kv_transfer_config=Multi([mooncake, wrapped])),  # type: ignore[arg-type]
                                     kv_cache_config(8, 16)) is not None


@pytest.mark.parametrize("child", ["NixlConnector", "MooncakeConnector", "P2pNcclConnector"])
def test_a_wrapped_prefill_decode_consumer_is_still_refused(child: str) -> None:
    class Wrapped:
        kv_connector = "OmniKVConnector"
        kv_role = "kv_consumer"
        kv_connector_extra_config = {"connectors": [{"kv_connector": child}]}  # noqa: RUF012

    with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"KV connector {child} can load KV .*another engine") as info:
        stage_prefix_cache_config(VllmConfig(kv_transfer_config=Wrapped()), kv_cache_config(8, 16))  # type: ignore[arg-type]
    assert "Wrap it" not in str(info.value)
    Wrapped.kv_role = "kv_producer"  # the prefill side: sends only
    assert stage_prefix_cache_config(VllmConfig(kv_transfer_config=Wrapped()), kv_cache_config(8, 16)) is not None
