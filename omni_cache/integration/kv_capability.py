"""What a configured vLLM KV connector can do to this engine's KV cache: may it load?

Owns: ``ConnectorVerdict`` and ``connector_verdict(kv_transfer_config)``, the
config gate's answer to "can KV arrive in this engine's blocks from outside its
own forward passes?". It reads ``kv_connector``, ``kv_role`` and
``kv_connector_extra_config`` by field name (never importing vLLM) and decides
from what each connector class does with its role, read from vLLM 0.32's
sources, not from the role's name:

- ``OmniKVConnector`` (``omni_cache.integration.kv_tier``) wraps the user's
  connector and brings the hidden rows back with the KV: served, any role --
  except a wrapped prefill/decode transfer connector (Nixl, Mooncake, MoRIIO,
  P2pNccl) as a consumer: that KV was computed by another engine, so no tier of
  this engine holds its rows (``remote``).
- Connectors that never load in ``kv_producer`` role: ``MooncakeConnector``
  (its scheduler builds receive metadata only when ``not is_kv_producer``),
  ``MoRIIOConnector`` (the producer side only sends) and the Nixl connectors
  (they load only for requests whose ``kv_transfer_params`` ask for a remote
  prefill, ``do_remote_prefill``, which a prefill/decode router sends to the
  decode instance, not to the producer).
- Every other connector may load whatever its role: ``ExampleConnector`` loads
  from its disk store in every role, offload tiers (``OffloadingConnector``,
  ``SimpleCPUOffloadConnector``, ``LMCacheConnectorV1`` whose lookup client may
  support producer reuse) reload evicted prefixes, and an unknown class is
  assumed to load.
- ``MultiConnector`` loads if any of its ``connectors`` does.

The tree is walked at any depth (``MultiConnector`` and ``OmniKVConnector``
children, each child's ``kv_role`` defaulting to its parent's): a transfer
consumer anywhere, wrapped or not, is ``remote``; an unwrapped loader anywhere
is refused with ``suggestion``, one ``OmniKVConnector`` over every leaf, which
the gate and the wrapper's settings accept; more than one ``OmniKVConnector``
is refused; a malformed tree (``connectors`` not a list of dicts naming their
``kv_connector``, malformed wrapper settings) is refused naming the key.

Upholds I5/I6 at their root for KV connectors: a hit whose KV came from a
connector names blocks whose rows this cache never wrote, so the gate refuses
every loading configuration that ``OmniKVConnector`` does not wrap.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omni_cache.integration.connector_settings import tier_settings
from omni_cache.integration.kv_nesting import STAGE_REFUSAL, connector_configs
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError

__all__ = ["OMNI_CONNECTOR", "OMNI_MODULE", "ConnectorVerdict", "connector_configs", "connector_verdict"]

OMNI_CONNECTOR = "OmniKVConnector"
"""``kv_transfer_config.kv_connector`` of the omni-cache wrapper."""
OMNI_MODULE = "omni_cache.integration.kv_tier"
"""Its ``kv_connector_module_path``."""
SETTINGS_KEY = "omni_cache"  # connector_settings.SETTINGS_KEY: the wrapper's own settings in its extra config

_PRODUCER_NEVER_LOADS = frozenset({
    "MooncakeConnector", "MoRIIOConnector", "NixlConnector", "NixlPullConnector", "NixlPushConnector",
})
_CONSUMER_ROLES = frozenset({"kv_consumer", "kv_both"})
# Prefill/decode transfer connectors: as consumers they receive KV another engine computed.
_REMOTE_TRANSFER = _PRODUCER_NEVER_LOADS | {"P2pNcclConnector"}


@dataclass(frozen=True)
class ConnectorVerdict:
    """``loads``: KV may enter this engine's blocks through the connector; ``wrapped``: through
    ``OmniKVConnector``, which serves such hits; ``name``: the connector class that loads (or the
    configured one); ``why``: one clause saying why it loads; ``suggestion``: for an unwrapped
    loader, the ``kv_transfer_config`` that wraps it (accepted by the gate and the wrapper)."""

    name: str | None
    role: str | None
    loads: bool
    wrapped: bool
    why: str = ""
    remote: bool = False  # the KV comes from another engine: no tier of this engine holds its rows
    suggestion: dict[str, Any] | None = None


@dataclass(frozen=True)
class _Leaf:
    """A connector that is neither ``MultiConnector`` nor the wrapper, where it sits in the tree."""

    name: str
    role: str | None
    wrapped: bool  # under OmniKVConnector
    nested: bool  # a MultiConnector's (or the wrapper's) child
    config: dict[str, Any]  # its config as the suggestion repeats it (role resolved)


def _refuse(message: str) -> OmniPrefixCacheUnmatchError:
    return OmniPrefixCacheUnmatchError(f"{STAGE_REFUSAL}{message}")


def _get(config: Any, field: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(field)
    return getattr(config, field, None)


def _role_verdict(name: str, role: str | None) -> tuple[bool, str]:
    if role in _CONSUMER_ROLES:
        return True, f"its kv_role={role!r} receives KV"
    if name in _PRODUCER_NEVER_LOADS:
        return False, ""
    return True, (f"{name} loads KV into this engine's blocks in every role (kv_role={role!r} does not stop "
                  "it: it reloads prefixes it stored)")


def _extra(config: Any, where: str) -> Mapping[str, Any]:
    extra = _get(config, "kv_connector_extra_config")
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise _refuse(f"{where}.kv_connector_extra_config must be a dict, got {type(extra).__name__} {extra!r}")
    return extra


def _as_dict(config: Any, role: str | None) -> dict[str, Any]:
    out = dict(config) if isinstance(config, Mapping) else {
        f: _get(config, f) for f in ("kv_connector", "kv_connector_module_path", "kv_connector_extra_config")
        if _get(config, f)}
    if role is not None:
        out["kv_role"] = role
    return out


def _walk(config: Any, role: str | None, where: str, under_omni: bool, nested: bool,
          leaves: list[_Leaf], omni: list[Mapping[str, Any]]) -> None:
    """Every leaf connector of the tree at ``config`` (depth first, in ``connectors`` order)."""
    name = str(_get(config, "kv_connector"))
    role = _get(config, "kv_role") or role
    if name in (OMNI_CONNECTOR, "MultiConnector"):
        extra = _extra(config, where)
        children = connector_configs(extra, f"{where}.kv_connector_extra_config")
        if name == OMNI_CONNECTOR:
            tier_settings(extra)  # the wrapper's own settings: a malformed one is refused here too
            omni.append(extra)
        for i, child in enumerate(children):
            _walk(child, role, f"{where}.kv_connector_extra_config['connectors'][{i}]",
                  under_omni or name == OMNI_CONNECTOR, True, leaves, omni)
        return
    _extra(config, where)  # a leaf's own settings: vLLM hands them to its constructor, which reads a dict
    leaves.append(_Leaf(name, role, under_omni, nested, _as_dict(config, role)))


def _suggest(role: str | None, leaves: list[_Leaf], omni: list[Mapping[str, Any]], policy: Any) -> dict[str, Any]:
    """One ``OmniKVConnector`` over every leaf in order (a ``MultiConnector`` flattened: the first
    loader still loads, every child still saves), keeping an existing wrapper's settings and the
    user's ``kv_load_failure_policy``; without one, ``"recompute"``: vLLM's default ``"fail"`` fails
    every request that hits a block of the store whose hidden rows the tier does not hold (a store
    older than this process), where recompute computes them again."""
    extra: dict[str, Any] = {"connectors": [leaf.config for leaf in leaves]}
    settings = next((o.get(SETTINGS_KEY) for o in omni if o.get(SETTINGS_KEY)), None)
    if settings:
        extra[SETTINGS_KEY] = dict(settings)
    out: dict[str, Any] = {"kv_connector": OMNI_CONNECTOR, "kv_connector_module_path": OMNI_MODULE}
    if role is not None:
        out["kv_role"] = role
    out["kv_load_failure_policy"] = policy if policy is not None else "recompute"
    out["kv_connector_extra_config"] = extra
    return out


def connector_verdict(kv_transfer_config: Any) -> ConnectorVerdict:
    """Whether the configured KV connector can load KV into this engine (see the module docstring).

    Walks ``MultiConnector`` and ``OmniKVConnector`` children at any depth; raises
    ``OmniPrefixCacheUnmatchError`` naming the key for a malformed tree (``connectors`` not a list of
    dicts, ``kv_connector_extra_config`` or the wrapper's settings malformed) and for more than one
    ``OmniKVConnector`` in it."""
    if kv_transfer_config is None:
        return ConnectorVerdict(None, None, False, False)
    name = _get(kv_transfer_config, "kv_connector")
    role = _get(kv_transfer_config, "kv_role")
    if name is None:
        return ConnectorVerdict(None, role, False, False)
    leaves: list[_Leaf] = []
    omni: list[Mapping[str, Any]] = []
    _walk(kv_transfer_config, None, "kv_transfer_config", False, False, leaves, omni)
    if len(omni) > 1:
        raise _refuse(f"{len(omni)} {OMNI_CONNECTOR} connectors are configured (one inside another, or "
                      f"several MultiConnector children): at most one may be; list every connector in one "
                      f"{OMNI_CONNECTOR}'s kv_connector_extra_config['connectors']")
    for leaf in leaves:  # KV another engine computed: no wrapper of this engine holds its rows
        if leaf.name in _REMOTE_TRANSFER and leaf.role in _CONSUMER_ROLES:
            return ConnectorVerdict(leaf.name, leaf.role, True, False, (
                f"as {leaf.role!r} it receives KV another engine computed, whose hidden rows no tier of this "
                f"engine stored" + (f", even under {OMNI_CONNECTOR}" if leaf.wrapped else "")), remote=True)
    for leaf in leaves:
        loads, why = _role_verdict(leaf.name, leaf.role)
        if loads and not leaf.wrapped:
            return ConnectorVerdict(leaf.name, leaf.role, True, False,
                                    f"a MultiConnector child: {why}" if leaf.nested else why,
                                    suggestion=_suggest(role, leaves, omni,
                                                       _get(kv_transfer_config, "kv_load_failure_policy")))
    if omni:
        return ConnectorVerdict(str(name) if name == OMNI_CONNECTOR else OMNI_CONNECTOR, role, True, True)
    return ConnectorVerdict(str(name), role, False, False)
