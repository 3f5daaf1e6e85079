"""The ``OmniKVConnector``'s own settings, ``kv_connector_extra_config["omni_cache"]``, checked.

Owns: ``SETTINGS_KEY`` (where the settings sit in the connector's extra config), ``tier_settings``
(the hidden-state tier's ``tier_bytes`` and ``tier_dir``, the delivery settings of
``delivery_settings``, the keys nobody reads, and what the wrapped connectors may be beside
delivery) and ``refuse``, the error a malformed setting raises. No torch, no
vLLM: ``omni-cache serve`` runs ``tier_settings`` on the server's configuration before anything
heavy is imported, and the connector runs it again wherever vLLM reads the configuration
(construction, class-level calls, the config gate), with the same messages.

Upholds: a malformed setting is one ``OmniPrefixCacheUnmatchError`` naming its key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from omni_cache.integration.delivery_settings import DELIVERY_KEYS, DeliverySettings, directory_problem
from omni_cache.integration.kv_nesting import STAGE_REFUSAL, connector_configs
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError

__all__ = ["SETTINGS_KEY", "refuse", "tier_settings"]

SETTINGS_KEY = "omni_cache"
"""``kv_connector_extra_config[SETTINGS_KEY]``: the tier's settings."""
_DEFAULT_TIER_BYTES = 256 << 20


def refuse(message: str) -> OmniPrefixCacheUnmatchError:
    """The refusal of an ``OmniKVConnector`` setting (the stage cannot run)."""
    return OmniPrefixCacheUnmatchError(f"{STAGE_REFUSAL}OmniKVConnector: {message}")


# vLLM's connectors that answer a finished request with a hidden-states file, as delivery does.
_HIDDEN_STATES_CONNECTORS = frozenset({"ExampleHiddenStatesConnector"})
# The connectors whose ``kv_connector_extra_config["connectors"]`` lists wrapped connectors.
_WRAPPERS = frozenset({"MultiConnector", "OmniKVConnector"})


def _hidden_states_connector(extra: Any, where: str) -> str | None:
    """Where in ``extra``'s wrapped connectors (at any depth of MultiConnector nesting) one of
    ``_HIDDEN_STATES_CONNECTORS`` is configured, or ``None``."""
    for i, child in enumerate(connector_configs(extra, where)):
        here = f"{where}['connectors'][{i}]"
        if child["kv_connector"] in _HIDDEN_STATES_CONNECTORS:
            return f"{child['kv_connector']} ({here})"
        nested = child.get("kv_connector_extra_config")  # a wrapper's children; a leaf's settings are its own
        if child["kv_connector"] in _WRAPPERS and isinstance(nested, Mapping) and (found := _hidden_states_connector(
                nested, f"{here}['kv_connector_extra_config']")) is not None:
            return found
    return None


def tier_settings(extra: Any) -> dict[str, Any]:
    """The tier settings in ``kv_connector_extra_config`` (``tier_bytes``, ``tier_dir``), checked: a
    malformed value is one ``OmniPrefixCacheUnmatchError`` naming its key."""
    where = "kv_connector_extra_config"
    if not isinstance(extra, Mapping):
        raise refuse(f"{where} must be a dict, got {type(extra).__name__} {extra!r}")
    raw = extra.get(SETTINGS_KEY)
    if raw is not None and not isinstance(raw, Mapping):
        raise refuse(f"{where}['{SETTINGS_KEY}'] must be a dict such as {{'tier_bytes': {_DEFAULT_TIER_BYTES}}}, "
                     f"got {type(raw).__name__} {raw!r}")
    settings = dict(raw or {})
    unknown = set(settings) - {"tier_bytes", "tier_dir"} - DELIVERY_KEYS
    if unknown:
        raise refuse(f"unknown {where}['{SETTINGS_KEY}'] keys {sorted(unknown)}")
    budget = settings.get("tier_bytes", _DEFAULT_TIER_BYTES)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise refuse(f"{where}['{SETTINGS_KEY}']['tier_bytes'] must be a non-negative int, got {budget!r}")
    tier_dir = settings.get("tier_dir")
    if tier_dir is not None and (not isinstance(tier_dir, (str, os.PathLike)) or not os.fspath(tier_dir)):
        raise refuse(f"{where}['{SETTINGS_KEY}']['tier_dir'] must be a directory path (a non-empty str), "
                     f"got {tier_dir!r}")
    if tier_dir is not None and (problem := directory_problem(tier_dir)) is not None:
        raise refuse(f"{where}['{SETTINGS_KEY}']['tier_dir'] {os.fspath(tier_dir)!r} {problem}")
    try:
        delivery = DeliverySettings.from_settings(settings)
    except ValueError as exc:
        raise refuse(str(exc)) from None
    if delivery is not None and (other := _hidden_states_connector(extra, where)) is not None:
        raise refuse(
            f"omni_cache.delivery_dir and the wrapped {other} both deliver hidden states (each answers a finished "
            "request with kv_transfer_params['hidden_states_path']): configure one of them")
    if not connector_configs(extra, where) and delivery is None:
        raise refuse(
            f"{where}['connectors'] must list the KV connector(s) it wraps, "
            "e.g. [{'kv_connector': 'ExampleConnector', 'kv_role': 'kv_both', 'kv_connector_extra_config': {...}}], "
            "or omni_cache.delivery_dir must name where the hidden-state files go (or both)")
    return {"tier_bytes": budget, "tier_dir": tier_dir, "delivery": delivery}
