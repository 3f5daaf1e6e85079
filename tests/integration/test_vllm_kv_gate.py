"""The gate decides from what the configured KV connector can do, on vLLM's real configs (marker ``vllm``).

Each case is a ``VllmConfig`` built by vLLM's own ``EngineArgs`` and passed through
the bridge call the model runner makes at KV-cache initialisation: a producer
whose connector never loads (Mooncake) is accepted, ``ExampleConnector`` as a
``kv_producer`` (it still loads from its disk store) and as ``kv_both`` are
refused with one message naming the connector and the wrapper, and the same
``kv_both`` configuration wrapped in ``OmniKVConnector`` is accepted. The
``kv_producer`` hole is also tried at a real engine start (a subprocess): the
engine fails before any step. (The wrapped configuration starting and serving
is ``test_vllm_kv_tier``.)
"""

from __future__ import annotations

import ast

import pytest
from test_vllm_gate import _gate, _kv_cache_config, _vllm_config, base_kwargs  # noqa: F401  (fixture)
from vllm_support import engine_start_in_subprocess

from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError

pytestmark = pytest.mark.vllm

EXAMPLE = {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": "/nonexistent"}}


def test_a_producer_whose_connector_never_loads_is_accepted(base_kwargs) -> None:  # noqa: F811
    config = _gate(_vllm_config(base_kwargs, kv_transfer_config={"kv_connector": "MooncakeConnector",
                                                                  "kv_role": "kv_producer"}), _kv_cache_config())
    assert config is not None


@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
def test_example_connector_is_refused_in_every_role(base_kwargs, role: str) -> None:  # noqa: F811
    vllm_config = _vllm_config(base_kwargs, kv_transfer_config={**EXAMPLE, "kv_role": role})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="KV connector ExampleConnector can load KV") as info:
        _gate(vllm_config, _kv_cache_config())
    text = str(info.value)
    assert "'kv_connector': 'OmniKVConnector'" in text and "omni_cache.integration.kv_tier" in text
    assert text.count("\n") == 0  # one message
    start = text.index("kv_transfer_config=") + len("kv_transfer_config=")
    end = text.index(" (its other fields unchanged)")
    suggestion = ast.literal_eval(text[start:end])  # the way out it prints, fed back in on vLLM's own config
    assert _gate(_vllm_config(base_kwargs, kv_transfer_config=suggestion), _kv_cache_config()) is not None


def test_example_connector_wrapped_in_the_omni_connector_is_accepted(base_kwargs) -> None:  # noqa: F811
    wrapped = {"kv_connector": "OmniKVConnector", "kv_connector_module_path": "omni_cache.integration.kv_tier",
               "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [{**EXAMPLE, "kv_role": "kv_both"}]}}
    assert _gate(_vllm_config(base_kwargs, kv_transfer_config=wrapped), _kv_cache_config()) is not None


def test_the_kv_producer_hole_is_refused_at_engine_start(tmp_path) -> None:
    store = {"shared_storage_path": str(tmp_path)}
    line = engine_start_in_subprocess(
        "engine_kwargs(tiny_llama_dir(), kv_blocks=24, max_batched_tokens=256, max_model_len=512, "
        f"kv_transfer_config={{'kv_connector': 'ExampleConnector', 'kv_role': 'kv_producer', "
        f"'kv_connector_extra_config': {store!r}}})")
    assert line.startswith("REFUSED OmniPrefixCacheUnmatchError steps 0"), line
    assert "KV connector ExampleConnector can load KV" in line and "OmniKVConnector" in line


@pytest.mark.parametrize(("extra", "key"), [
    ({"connectors": "ExampleConnector"}, "['connectors'] must be a list"),
    ({"connectors": [{**EXAMPLE, "kv_role": "kv_both"}], "omni_cache": "big"}, "['omni_cache'] must be a dict"),
    ({"connectors": [{**EXAMPLE, "kv_role": "kv_both"}], "omni_cache": {"tier_dir": 5}}, "['tier_dir'] must be"),
], ids=["connectors-str", "omni_cache-str", "tier_dir-int"])
def test_a_malformed_wrapper_config_is_one_refusal_at_engine_start(tmp_path, extra, key: str) -> None:
    """vLLM builds the connector (``OmniKVConnector.__init__`` reads its settings) before the gate runs:
    either way the engine start fails with one refusal naming the key, before any step."""
    extra = {**extra}
    if isinstance(extra["connectors"], list):
        extra["connectors"] = [{**EXAMPLE, "kv_role": "kv_both",
                                "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}]
    transfer = {"kv_connector": "OmniKVConnector", "kv_connector_module_path": "omni_cache.integration.kv_tier",
                "kv_role": "kv_both", "kv_connector_extra_config": extra}
    line = engine_start_in_subprocess(
        f"engine_kwargs(tiny_llama_dir(), kv_blocks=24, max_batched_tokens=256, max_model_len=512, "
        f"kv_transfer_config={transfer!r})", whole_message=True)
    assert line.startswith("REFUSED"), line
    assert key in line and "omni prefix cache cannot run on this stage" in line, line
