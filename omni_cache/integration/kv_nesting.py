"""Where ``OmniKVConnector`` and its per-step metadata sit in vLLM's KV-connector tree.

Owns: ``omni_metadata(metadata)``, the ``OmniTierMetadata`` inside a step's
``scheduler_output.kv_connector_metadata`` wherever vLLM nests it, and
``omni_connector(connector)``, the ``OmniKVConnector`` instance inside the
worker's KV-transfer group wherever it sits. The wrapper may be the configured
connector itself, or a child (at any depth) of vLLM's ``MultiConnector``, which
nests each child's metadata in ``MultiKVConnectorMetadata.metadata`` (a tuple,
in the order of its ``connectors``) and exposes its children as
``sub_connectors``. Duck-typed on those field names: no vLLM import. Also
``connector_configs(extra, where)``: a wrapper's or MultiConnector's ``connectors`` list,
checked (the gate and the wrapper's own settings both read it).

Upholds contract section 4.10 where vLLM nests the wrapper: a tier plan is never
silently dropped (a reloaded block would keep its previous tenant's rows, I7). A
tree holds at most one ``OmniKVConnector`` (the config gate refuses more,
``kv_capability``); finding two here raises ``OmniPrefixCacheUnmatchError``, so a
plan is never applied by the wrong tier.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError

__all__ = ["connector_configs", "omni_connector", "omni_metadata"]

STAGE_REFUSAL = "omni prefix cache cannot run on this stage: "


def _walk(node: Any, is_ours: Any, children: Any) -> Iterator[Any]:
    if node is None:
        return
    if is_ours(node):
        yield node
        return
    for child in children(node):
        yield from _walk(child, is_ours, children)


def _one(found: list[Any], what: str) -> Any:
    if len(found) > 1:
        raise OmniPrefixCacheUnmatchError(
            f"omni prefix cache: {len(found)} OmniKVConnector {what} in one KV-connector tree; at most one "
            "OmniKVConnector may be configured")
    return found[0] if found else None


def _meta_children(node: Any) -> Any:
    nested = getattr(node, "metadata", None)
    return nested if isinstance(nested, (tuple, list)) else ()


def omni_metadata(metadata: Any) -> Any:
    """The node of ``metadata`` that carries the omni plans (``omni_tier``, ``omni_delivery``), or ``None``."""
    return _one(list(_walk(metadata, lambda m: hasattr(m, "omni_tier") or hasattr(m, "omni_delivery"),
                           _meta_children)), "metadata")


def omni_connector(connector: Any) -> Any:
    """The ``OmniKVConnector`` instance in ``connector``'s tree (``sub_connectors``), or ``None``."""
    return _one(list(_walk(connector, lambda c: hasattr(c, "omni_tier_applier"),
                           lambda c: getattr(c, "sub_connectors", None) or ())), "instances")


def connector_configs(extra: Any, where: str) -> list[Mapping[str, Any]]:
    """``extra['connectors']`` (``where`` names ``extra``): a list of connector configs, each a dict
    naming its ``kv_connector``; ``[]`` when absent. Anything else is refused, naming the key."""
    key = f"{where}['connectors']"
    children = extra.get("connectors") if isinstance(extra, Mapping) else None
    if children is None:
        return []
    if not isinstance(children, (list, tuple)):
        raise OmniPrefixCacheUnmatchError(
            f"{STAGE_REFUSAL}{key} must be a list of connector configs (dicts such as {{'kv_connector': "
            f"'ExampleConnector', 'kv_role': 'kv_both'}}), got {type(children).__name__} {children!r}")
    for i, child in enumerate(children):
        if not isinstance(child, Mapping) or not isinstance(child.get("kv_connector"), str):
            raise OmniPrefixCacheUnmatchError(
                f"{STAGE_REFUSAL}{key}[{i}] must be a dict naming its 'kv_connector' (a class name), got {child!r}")
    return list(children)
