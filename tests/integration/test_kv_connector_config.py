"""The KV-connector configuration, walked and checked without vLLM (fakes with vLLM's field names).

The gate walks ``MultiConnector`` and ``OmniKVConnector`` children at any depth: a prefill/decode
transfer consumer anywhere under the wrapper is refused (no tier of this engine holds its rows).
Every refusal that suggests a configuration suggests one the product accepts: the suggestion is
read back out of the message and fed to the gate and to the wrapper's settings. A malformed
configuration is one ``OmniPrefixCacheUnmatchError`` naming its key, never a traceback.
"""

from __future__ import annotations

import ast
from types import SimpleNamespace
from typing import Any

import pytest
from fakes_vllm import VllmConfig, kv_cache_config

from omni_cache.integration import stage_prefix_cache_config
from omni_cache.integration.connector_settings import tier_settings
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError

EXAMPLE = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}


def _omni(*children: dict[str, Any], role: str = "kv_both", **settings: Any) -> dict[str, Any]:
    extra: dict[str, Any] = {"connectors": list(children)}
    if settings:
        extra["omni_cache"] = settings
    return {"kv_connector": "OmniKVConnector", "kv_connector_module_path": "omni_cache.integration.kv_tier",
            "kv_role": role, "kv_connector_extra_config": extra}


def _multi(*children: dict[str, Any], role: str = "kv_both") -> dict[str, Any]:
    return {"kv_connector": "MultiConnector", "kv_role": role, "kv_connector_extra_config": {"connectors": list(children)}}


def _gate(transfer: Any) -> Any:
    return stage_prefix_cache_config(VllmConfig(kv_transfer_config=transfer), kv_cache_config(8, 16))  # type: ignore[arg-type]


def _suggested(message: str) -> dict[str, Any]:
    """The ``kv_transfer_config={...}`` literal a refusal prints."""
    start = message.index("kv_transfer_config={") + len("kv_transfer_config=")
    depth = 0
    for end in range(start, len(message)):
        depth += {"{": 1, "}": -1}.get(message[end], 0)
        if depth == 0:
            return ast.literal_eval(message[start:end + 1])
    raise AssertionError(f"no complete suggestion in {message!r}")


# ----------------------------------------------------------------- nested at any depth
NIXL_CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}


@pytest.mark.parametrize("transfer", [
    _omni(_multi(NIXL_CONSUMER)),
    _omni(_multi(EXAMPLE, _multi(NIXL_CONSUMER))),
    _multi(_omni(_multi(NIXL_CONSUMER))),
    _omni(_multi({"kv_connector": "MooncakeConnector"}), role="kv_consumer"),  # the role is inherited
], ids=["omni[multi[nixl]]", "omni[multi[example,multi[nixl]]]", "multi[omni[multi[nixl]]]", "inherited-role"])
def test_a_transfer_consumer_under_the_wrapper_is_refused_at_any_depth(transfer: dict[str, Any]) -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="another engine computed") as info:
        _gate(transfer)
    assert "kv_transfer_config=" not in str(info.value)  # wrapping it again is no way out


def test_a_producer_transfer_connector_nested_under_the_wrapper_is_accepted() -> None:
    assert _gate(_omni(_multi({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, EXAMPLE),
                       role="kv_producer")) is not None


def test_an_unwrapped_loader_nested_in_multi_connectors_is_refused() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="MultiConnector child: OffloadingConnector loads"):
        _gate(_multi({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"},
                     _multi({"kv_connector": "OffloadingConnector"}, role="kv_producer"), role="kv_producer"))


def test_two_wrappers_in_one_tree_are_refused() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="2 OmniKVConnector connectors are configured"):
        _gate(_multi(_omni(EXAMPLE), _omni(EXAMPLE)))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="at most one may be"):
        _gate(_omni(_omni(EXAMPLE)))


# ----------------------------------------------------------------- every suggestion is accepted
REFUSED_WITH_A_SUGGESTION = {
    "example-producer": {"kv_connector": "ExampleConnector", "kv_role": "kv_producer",
                         "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}},
    "offloading-both": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
    "lmcache-consumer": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_consumer"},
    "users-module": {"kv_connector": "MyConnector", "kv_connector_module_path": "my.module", "kv_role": "kv_both"},
    "multi[mooncake,offloading]": _multi({"kv_connector": "MooncakeConnector"},
                                         {"kv_connector": "OffloadingConnector"}, role="kv_producer"),
    "multi[omni[example],offloading]": _multi(_omni(EXAMPLE, tier_bytes=1 << 20),
                                              {"kv_connector": "OffloadingConnector"}),
    "multi[multi[example]]": _multi(_multi(EXAMPLE)),
}


@pytest.mark.parametrize("transfer", list(REFUSED_WITH_A_SUGGESTION.values()), ids=list(REFUSED_WITH_A_SUGGESTION))
def test_each_configuration_a_refusal_suggests_is_accepted(transfer: dict[str, Any]) -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="can load KV") as info:
        _gate(transfer)
    suggestion = _suggested(str(info.value))
    assert suggestion["kv_connector"] == "OmniKVConnector"
    assert suggestion["kv_connector_module_path"] == "omni_cache.integration.kv_tier"
    assert _gate(suggestion) is not None  # the gate accepts it
    tier_settings(suggestion["kv_connector_extra_config"])  # and so do the wrapper's settings
    names = [c["kv_connector"] for c in suggestion["kv_connector_extra_config"]["connectors"]]
    assert "OmniKVConnector" not in names and "MultiConnector" not in names  # one wrapper, flat
    # a restart's store hits blocks the new tier never held: recomputed, not failed (vLLM's default)
    assert suggestion["kv_load_failure_policy"] == "recompute"


def test_a_suggestion_keeps_the_users_own_load_failure_policy() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError) as info:
        _gate({**REFUSED_WITH_A_SUGGESTION["example-producer"], "kv_load_failure_policy": "fail"})
    assert _suggested(str(info.value))["kv_load_failure_policy"] == "fail"


def test_a_suggestion_keeps_the_wrappers_own_settings() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError) as info:
        _gate(REFUSED_WITH_A_SUGGESTION["multi[omni[example],offloading]"])
    extra = _suggested(str(info.value))["kv_connector_extra_config"]
    assert extra["omni_cache"] == {"tier_bytes": 1 << 20}
    assert [c["kv_connector"] for c in extra["connectors"]] == ["ExampleConnector", "OffloadingConnector"]


# ----------------------------------------------------------------- malformed: one refusal naming the key
MALFORMED = {
    "multi-connectors-str": (_multi() | {"kv_connector_extra_config": {"connectors": "ExampleConnector"}},
                             r"\['connectors'\] must be a list"),
    "multi-connectors-dict": (_multi() | {"kv_connector_extra_config": {"connectors": EXAMPLE}},
                              r"\['connectors'\] must be a list"),
    "omni-connectors-str": (_omni() | {"kv_connector_extra_config": {"connectors": "ExampleConnector"}},
                            r"\['connectors'\] must be a list"),
    "omni-connectors-dict": (_omni() | {"kv_connector_extra_config": {"connectors": EXAMPLE}},
                             r"\['connectors'\] must be a list"),
    "connector-entry-str": (_multi() | {"kv_connector_extra_config": {"connectors": ["ExampleConnector"]}},
                            r"\['connectors'\]\[0\] must be a dict naming its 'kv_connector'"),
    "nested-connectors-str": (_multi(_omni() | {"kv_connector_extra_config": {"connectors": "ExampleConnector"}}),
                              r"\['connectors'\]\[0\]\.kv_connector_extra_config\['connectors'\] must be a list"),
    "omni_cache-str": (_omni(EXAMPLE) | {"kv_connector_extra_config": {"connectors": [EXAMPLE], "omni_cache": "big"}},
                       r"\['omni_cache'\] must be a dict"),
    "tier_dir-int": (_omni(EXAMPLE, tier_dir=5), r"\['tier_dir'\] must be a directory path"),
    "tier_dir-empty": (_omni(EXAMPLE, tier_dir=""), r"\['tier_dir'\] must be a directory path"),
    "tier_bytes-str": (_omni(EXAMPLE, tier_bytes="1G"), r"\['tier_bytes'\] must be a non-negative int"),
    "extra-str": (_omni() | {"kv_connector_extra_config": "big"}, r"kv_connector_extra_config must be a dict"),
    "wrapped-child-extra-str": (_omni(EXAMPLE | {"kv_connector_extra_config": "x"}),
                                r"\['connectors'\]\[0\]\.kv_connector_extra_config must be a dict"),
    "multi-child-extra-str": (_multi(EXAMPLE | {"kv_connector_extra_config": "x"}),
                              r"\['connectors'\]\[0\]\.kv_connector_extra_config must be a dict"),
}


@pytest.mark.parametrize(("transfer", "key"), list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_configuration_is_one_refusal_naming_the_key(transfer: dict[str, Any], key: str) -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match=key) as info:
        _gate(transfer)
    assert str(info.value).startswith("omni prefix cache cannot run on this stage")
    assert "\n" not in str(info.value)


def test_the_tier_budget_defaults_to_256_mib() -> None:
    assert tier_settings({"connectors": [EXAMPLE]})["tier_bytes"] == 256 << 20


@pytest.mark.parametrize(("budget", "accepted"), [(0, True), (1, True), (-1, False)])
def test_a_tier_budget_of_zero_bytes_is_accepted_and_a_negative_one_refused(budget: int, accepted: bool) -> None:
    """``tier_bytes`` 0 is a tier that keeps nothing (every reload recomputes); below 0 is refused."""
    extra = {"connectors": [EXAMPLE], "omni_cache": {"tier_bytes": budget}}
    if accepted:
        assert tier_settings(extra)["tier_bytes"] == budget
    else:
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"\['tier_bytes'\] must be a non-negative int, got -1"):
            tier_settings(extra)


@pytest.mark.parametrize("extra", [{"connectors": "ExampleConnector"}, {"connectors": EXAMPLE},
                                   {"connectors": [EXAMPLE], "omni_cache": "big"},
                                   {"connectors": [EXAMPLE], "omni_cache": {"tier_dir": 5}}, "big"])
def test_the_wrappers_own_settings_refuse_the_same(extra: Any) -> None:
    """``OmniKVConnector.__init__`` reads them first (vLLM builds the connector before the gate runs)."""
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"kv_connector_extra_config"):
        tier_settings(extra)


# ----------------------------------------------------------------- the verdict itself
@pytest.mark.parametrize(("transfer", "name", "loads", "wrapped"), [
    (_omni(EXAMPLE), "OmniKVConnector", True, True),
    (_multi(_omni(EXAMPLE)), "OmniKVConnector", True, True),
    ({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}, "MooncakeConnector", False, False),
    (_multi({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}, role="kv_producer"),
     "MultiConnector", False, False),
    (EXAMPLE, "ExampleConnector", True, False),
], ids=["omni[example]", "multi[omni[example]]", "mooncake-producer", "multi[mooncake-producer]", "example"])
def test_the_verdict_names_the_loader_and_whether_the_wrapper_serves_it(
        transfer: dict[str, Any], name: str, loads: bool, wrapped: bool) -> None:
    """``connector_verdict`` (public: ``ConnectorVerdict``) says whether KV can enter this engine's blocks
    and whether it does so through ``OmniKVConnector``: a wrapped tree is a wrapped loader, a
    send-only tree loads nothing and is not wrapped, an unwrapped loader is named unwrapped."""
    from omni_cache.integration.kv_capability import connector_verdict

    verdict = connector_verdict(transfer)
    assert (verdict.name, verdict.loads, verdict.wrapped) == (name, loads, wrapped)


def test_tier_plans_address_the_output_group_of_a_hybrid_layout() -> None:
    """The connector names the blocks of the group the cache reads rows by (the full-attention one, as
    the config gate picks it) at that group's block size; one group, or none known yet: group 0."""
    from omni_cache.integration.kv_tier import _group_ids, _output_group

    def spec(name: str, block_size: int) -> object:
        return type(name, (), {"block_size": block_size, "sliding_window": 64})()

    hybrid = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec("SlidingWindowSpec", 32))] * 3
                             + [SimpleNamespace(kv_cache_spec=spec("FullAttentionSpec", 32))])
    engine = SimpleNamespace(cache_config=SimpleNamespace(block_size=16))
    assert _output_group(hybrid, engine) == (3, 32)
    assert _output_group(None, engine) == (0, 16)
    assert _output_group(SimpleNamespace(kv_cache_groups=hybrid.kv_cache_groups[3:]), engine) == (0, 16)
    groups = ([0, 0, 31], [0, 0, 41], [0, 0, 51], [10, 11, 12])
    assert _group_ids(groups, 3) == [10, 11, 12] and _group_ids(groups[:1], 3) == []
