"""Which KV-cache group addresses the cache's rows (the output group).

Owns: ``select_output_group(kv_cache_config) -> OutputGroup`` and
``describe_groups``. Reads vLLM's ``KVCacheConfig.kv_cache_groups[i]
.kv_cache_spec`` by class name and field names, never importing vLLM.

Upholds I5 at its root for hybrid layouts. vLLM's hybrid KV-cache manager
gives a model whose layers mix attention types one KV-cache group per type
(and per layer count), each with its own block table. Only a full-attention
group's block table holds a real block for every position of a request:
a sliding-window group frees (nulls) the blocks that fall out of the window, a
chunked-local group those of past chunks, an R-SWA group the gap between the
prompt and the decode window. The cache keys rows by the slots of one group,
so it must be a full-attention group: then the slots of positions ``[0,
num_computed_tokens)`` of a hit all name blocks that hold that prefix (vLLM's
``HybridKVCacheCoordinator.find_longest_cache_hit`` reconciles one hit length
for all groups and truncates every full-attention group's hit blocks to it;
see spec/contract.md section 7a).

The rule, when several groups qualify: the lowest group id. That is the group
vLLM's coordinator itself takes as its dense reference group
(``full_attention_group_id``: the first group id of the first full-attention
spec, groups kept in id order). All qualifying groups hold the same hit length
and the same positions, so any would do; one fixed rule keeps the choice
reproducible across ranks and restarts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["OutputGroup", "describe_groups", "select_output_group"]

# FullAttentionSpec subclasses whose block table does NOT cover every position.
_GAPPED_FULL_SPECS = frozenset({"RSWASpec"})


@dataclass(frozen=True)
class OutputGroup:
    """The chosen group: its id, its spec's block size (the manager block size) and spec class name."""

    group_id: int
    block_size: int
    spec_name: str
    num_groups: int


def _class_names(spec: Any) -> set[str]:
    return {cls.__name__ for cls in type(spec).__mro__}


def _inner_specs(spec: Any) -> list[Any]:
    """The per-layer specs of vLLM's ``UniformTypeKVCacheSpecs`` (one group, one attention type)."""
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, dict) else [spec]


def covers_every_position(spec: Any) -> bool:
    """True for vLLM's ``FullAttentionSpec`` and its subclasses (MLA, sinks) except R-SWA,
    whose decode evicts gap blocks; ``UniformTypeKVCacheSpecs`` when all its layers are such."""
    specs = _inner_specs(spec)
    return bool(specs) and all(
        "FullAttentionSpec" in (names := _class_names(s)) and not names & _GAPPED_FULL_SPECS for s in specs
    )


def _prefix_cacheable(spec: Any) -> bool:
    flag = getattr(spec, "prefix_cacheable", True)
    return bool(flag) if isinstance(flag, bool) else True


def _usable(group: Any) -> bool:
    spec = getattr(group, "kv_cache_spec", None)
    if spec is None or not covers_every_position(spec) or not _prefix_cacheable(spec):
        return False
    if bool(getattr(group, "is_eagle_group", False)):  # draft layers (speculative decoding is refused anyway)
        return False
    role = getattr(group, "role", None)
    return role is None or str(getattr(role, "value", role)) == "default"


def describe_groups(groups: list[Any]) -> str:
    """``group 0: SlidingWindowSpec(block_size=32, sliding_window=64), ...`` for messages."""
    parts = []
    for i, group in enumerate(groups):
        spec = getattr(group, "kv_cache_spec", None)
        fields = [f"block_size={getattr(spec, 'block_size', None)}"]
        for attr in ("sliding_window", "attention_chunk_size", "rswa_window"):
            value = getattr(spec, attr, None)
            if value is not None:
                fields.append(f"{attr}={value}")
        parts.append(f"group {i}: {type(spec).__name__}({', '.join(fields)})")
    return "; ".join(parts)


def select_output_group(kv_cache_config: Any) -> OutputGroup:
    """The lowest-id KV-cache group whose block table covers every position of a request.

    Raises ``LookupError`` (the gate turns it into its refusal) when no group qualifies,
    with the groups and their specs in the message, and ``ValueError`` when the group has
    no ``block_size``.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    for group_id, group in enumerate(groups):
        if _usable(group):
            spec = group.kv_cache_spec
            block_size = getattr(spec, "block_size", None)
            if block_size is None:
                raise ValueError(f"select_output_group: kv_cache_groups[{group_id}].kv_cache_spec has no block_size")
            return OutputGroup(group_id, int(block_size), type(spec).__name__, len(groups))
    listed = describe_groups(groups) if groups else "none"
    raise LookupError(
        f"the KV cache has {len(groups)} KV-cache group(s) ({listed}) and none is a prefix-cacheable "
        "full-attention group: the cache addresses rows by the slots of one group whose block table "
        "covers every position of a prompt, and sliding-window, chunked-local and R-SWA groups free "
        "the blocks of positions outside their window. Serve this model with at least one "
        "full-attention layer, or disable prefix caching on this stage"
    )
