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

Upholds I5/I6 at their root for KV connectors: a hit whose KV came from a
connector names blocks whose rows this cache never wrote, so the gate refuses
every loading configuration that ``OmniKVConnector`` does not wrap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["OMNI_CONNECTOR", "ConnectorVerdict", "connector_verdict"]

OMNI_CONNECTOR = "OmniKVConnector"
"""``kv_transfer_config.kv_connector`` of the omni-cache wrapper."""

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
    configured one); ``why``: one clause saying why it loads."""

    name: str | None
    role: str | None
    loads: bool
    wrapped: bool
    why: str = ""
    remote: bool = False  # the KV comes from another engine: no tier of this engine holds its rows


def _get(config: Any, field: str) -> Any:
    if isinstance(config, dict):
        return config.get(field)
    return getattr(config, field, None)


def _role_verdict(name: str, role: str | None) -> tuple[bool, str]:
    if role in _CONSUMER_ROLES:
        return True, f"its kv_role={role!r} receives KV"
    if name in _PRODUCER_NEVER_LOADS:
        return False, ""
    return True, (f"{name} loads KV into this engine's blocks in every role (kv_role={role!r} does not stop "
                  "it: it reloads prefixes it stored)")


def connector_verdict(kv_transfer_config: Any) -> ConnectorVerdict:
    """Whether the configured KV connector can load KV into this engine (see the module docstring)."""
    if kv_transfer_config is None:
        return ConnectorVerdict(None, None, False, False)
    name = _get(kv_transfer_config, "kv_connector")
    role = _get(kv_transfer_config, "kv_role")
    if name is None:
        return ConnectorVerdict(None, role, False, False)
    name = str(name)
    if name == OMNI_CONNECTOR:
        extra = _get(kv_transfer_config, "kv_connector_extra_config") or {}
        for child in list(_get(extra, "connectors") or ()):
            child_name, child_role = _get(child, "kv_connector"), _get(child, "kv_role") or role
            if child_name in _REMOTE_TRANSFER and child_role in _CONSUMER_ROLES:
                return ConnectorVerdict(str(child_name), child_role, True, False, (
                    f"as {child_role!r} it receives KV another engine computed, whose hidden rows no tier of this "
                    f"engine stored, even under {OMNI_CONNECTOR}"), remote=True)
        return ConnectorVerdict(name, role, True, True)
    if name == "MultiConnector":
        extra = _get(kv_transfer_config, "kv_connector_extra_config") or {}
        children = [connector_verdict({**child, "kv_role": _get(child, "kv_role") or role})
                    for child in list(_get(extra, "connectors") or ())]
        loading = [v for v in children if v.loads]
        if not loading:
            return ConnectorVerdict(name, role, False, False)
        worst = next((v for v in loading if not v.wrapped), loading[0])  # an unwrapped loader decides
        return ConnectorVerdict(worst.name, worst.role, True, worst.wrapped, f"a MultiConnector child: {worst.why}")
    loads, why = _role_verdict(name, role)
    return ConnectorVerdict(name, role, loads, False, why)
