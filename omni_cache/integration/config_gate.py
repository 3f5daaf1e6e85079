"""The configuration gate: may this engine stage run the omni prefix cache?

Owns: ``stage_prefix_cache_config(vllm_config, kv_cache_config)`` (and ``refuse_unservable_config``,
its refusals that read the engine config alone, and ``omni_worker_problem``: is a ``worker_cls`` one that
runs the cache -- it imports the class the config names, as vLLM's workers do), which reads
vLLM's config objects by their field names (never importing vLLM) and returns
the ``PrefixCacheConfig`` for the stage, ``None`` when the cache has nothing to
do, or raises ``OmniPrefixCacheUnmatchError`` naming the one setting that makes
the cache unsound.

Upholds I5 and I6 at their root: the cache is keyed by the KV cache's slots and
trusts the engine's ``num_computed_tokens`` to be a block-aligned *local*
prefix hit. Every configuration under which that is false is refused here:
tokens a KV connector can load into the engine's blocks (decided by
``kv_capability.connector_verdict`` from what the connector class does in its
role, not from the role's name; ``OmniKVConnector`` serves them), speculative decoding
whose verify steps the runner bridge cannot give a verdict before their rows leave (async
scheduling: the sampled tokens stay on the device until the next step; the GPU n-gram
proposer, which rewrites the step's scheduled tokens inside the worker; I14 -- every other
method is accepted: ``spec_decode`` trims each verify step), decode context parallel (tokens are
striped across ranks, so one rank's slots do not hold the prefix; refused as the
reference does), sub-block prefix matching (unaligned hits), and a KV cache with no
full-attention group (no group's slots cover the whole prefix). With several
KV-cache groups (vLLM's hybrid manager: sliding-window and full-attention
layers) the rows are addressed by one full-attention group's slots, the
lowest-id one (``kv_groups.select_output_group``), carried as
``PrefixCacheConfig.output_group_id``.
"""

from __future__ import annotations

import importlib
from typing import Any

from omni_cache.integration.kv_capability import connector_verdict
from omni_cache.integration.kv_groups import select_output_group
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.interface import PrefixCacheConfig

__all__ = ["OMNI_WORKERS", "omni_worker_problem", "refuse_unservable_config", "stage_prefix_cache_config"]

_CONSUMER_ROLES = frozenset({"kv_consumer", "kv_both"})


def _refuse(reason: str) -> OmniPrefixCacheUnmatchError:
    return OmniPrefixCacheUnmatchError(f"omni prefix cache cannot run on this stage: {reason}")


def _is_pooling(model_config: Any) -> bool:
    if model_config is None:
        return False
    if getattr(model_config, "runner_type", None) == "pooling":
        return True
    return getattr(model_config, "pooler_config", None) is not None


def _refuse_loading_connector(kv_transfer_config: Any) -> None:
    """Refuse a KV connector that can load KV into this engine unless ``OmniKVConnector`` wraps it;
    the way out it names is a whole ``kv_transfer_config`` the gate and the wrapper accept."""
    verdict = connector_verdict(kv_transfer_config)
    if not verdict.loads or verdict.wrapped:
        return
    consumer = (f"; it is a KV-consumer stage (kv_transfer_config.kv_role={verdict.role!r})"
                if verdict.role in _CONSUMER_ROLES else "")
    if verdict.remote or verdict.suggestion is None:
        raise _refuse(
            f"KV connector {verdict.name} can load KV into this engine's blocks ({verdict.why}){consumer}: a hit on "
            "it would name rows this cache never saw. Disable prefix caching on this stage, or hand the hidden "
            "states over with the prefill/decode transfer")
    raise _refuse(
        f"KV connector {verdict.name} can load KV into this engine's blocks ({verdict.why}){consumer}: tokens "
        "received through the KV connector cannot be told apart from locally cached ones, so a hit could name "
        "rows this cache never saw. Wrap it in the omni-cache connector, which brings the hidden rows back with "
        f"the KV (docs/kv-tier.md): kv_transfer_config={verdict.suggestion!r} (its other fields unchanged), or "
        "disable prefix caching on this stage"
    )


def _refuse_unverifiable_speculation(vllm_config: Any) -> None:
    """Speculative decoding is served when each verify step gets its verdict before its rows leave
    the worker (``spec_decode``): refuse the two settings where it cannot (I14)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return
    method = getattr(spec, "method", None)
    if method == "ngram_gpu":
        raise _refuse(
            "speculative decoding with the GPU n-gram proposer (speculative_config.method='ngram_gpu') "
            "rewrites each step's scheduled draft tokens inside the worker, after the cache read them, so "
            "the rows of a verify step cannot be matched to its verdict. Use method='ngram' (or another method)")
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if bool(getattr(scheduler, "async_scheduling", False)):
        raise _refuse(
            f"speculative decoding (speculative_config.method={method!r}) with async scheduling "
            "(scheduler_config.async_scheduling=True): the tokens sampled in a verify step stay on the "
            "device until the next step, after that step's rows must already have left the worker, so a "
            "rejected draft token's row could not be cut. Run the stage with async_scheduling=False")


def _dcp_world_size(vllm_config: Any) -> int:
    """vLLM's decode-context-parallel world size (``parallel_config.decode_context_parallel_size``,
    or a ``dcp_world_size`` attribute); 1 when absent."""
    parallel = getattr(vllm_config, "parallel_config", None)
    for source, attr in ((parallel, "decode_context_parallel_size"), (parallel, "dcp_world_size"),
                         (vllm_config, "dcp_world_size")):
        value = getattr(source, attr, None) if source is not None else None
        if value is not None:
            return int(value)
    return 1


OMNI_WORKERS = ("omni_cache.integration.vllm_worker.OmniCPUWorker", "omni_cache.integration.vllm_worker.OmniGPUWorker")
"""The workers that run the cache (``parallel_config.worker_cls``), by qualified name."""


def omni_worker_problem(worker_cls: Any) -> str | None:
    """Why ``worker_cls`` (vLLM's ``parallel_config.worker_cls``: a qualified name or a class) is not
    a worker that runs the cache, or None: one of ``OMNI_WORKERS`` or a subclass of one (which
    carries ``runs_omni_cache``). A name is imported to tell (vLLM imports it in every worker)."""
    cls = worker_cls
    if isinstance(worker_cls, str):
        if worker_cls in OMNI_WORKERS:
            return None
        module, _, name = worker_cls.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name) if module else None
        except (ImportError, AttributeError) as exc:
            return f"worker_cls {worker_cls!r} cannot be imported ({exc})"
    if isinstance(cls, type) and getattr(cls, "runs_omni_cache", False):
        return None
    return f"worker_cls {worker_cls!r} is not omni-cache's worker ({' or '.join(OMNI_WORKERS)}, or a subclass)"


def refuse_unservable_config(vllm_config: Any) -> bool:
    """The gate's refusals that read ``vllm_config`` alone (a KV connector that loads KV unwrapped,
    unverifiable speculative decoding, decode context parallel); False when the cache is off on this
    stage (prefix caching off, a pooling model), True when it will run. The omni workers call it
    before their device starts, so a setting vLLM itself cannot start with on this device (the GPU
    n-gram proposer on a CPU) still gets the cache's one-line refusal first."""
    cache_config = getattr(vllm_config, "cache_config", None)
    if cache_config is None or not bool(getattr(cache_config, "enable_prefix_caching", False)):
        return False
    if _is_pooling(getattr(vllm_config, "model_config", None)):
        return False
    _refuse_loading_connector(getattr(vllm_config, "kv_transfer_config", None))
    _refuse_unverifiable_speculation(vllm_config)
    dcp = _dcp_world_size(vllm_config)
    if dcp > 1:
        raise _refuse(
            f"decode context parallel is enabled (parallel_config.decode_context_parallel_size={dcp}): "
            "each rank holds only a stripe of every block's tokens, so this rank's KV slots do not "
            "address the prefix's rows. Run the stage with decode_context_parallel_size=1 or disable "
            "prefix caching on it"
        )
    return True


def stage_prefix_cache_config(vllm_config: Any, kv_cache_config: Any) -> PrefixCacheConfig | None:
    """The stage's ``PrefixCacheConfig``, ``None``, or a refusal.

    Reads ``vllm_config.cache_config.enable_prefix_caching`` /
    ``hash_block_size``, ``vllm_config.model_config.runner_type`` /
    ``pooler_config`` / ``max_model_len``, ``vllm_config.scheduler_config``,
    ``vllm_config.speculative_config`` (``method``), ``scheduler_config.async_scheduling``,
    ``vllm_config.parallel_config``
    (``decode_context_parallel_size``), ``vllm_config.kv_transfer_config``
    (``kv_connector``, ``kv_role``) and ``kv_cache_config.num_blocks`` /
    ``kv_cache_groups[i].kv_cache_spec`` (its class and ``block_size``).

    Returns ``None`` when prefix caching is off or the stage is a pooling
    model. Raises ``OmniPrefixCacheUnmatchError`` for a KV connector that can load
    KV into this engine (unless ``OmniKVConnector`` wraps it), speculative decoding with async
    scheduling or the GPU n-gram proposer, decode
    context parallel, sub-block prefix matching and a KV cache with no full-attention group
    (the message names every group and its spec); the config's ``output_group_id`` is the
    chosen group. Raises ``ValueError`` when
    ``kv_cache_config`` lacks what sizing needs.
    """
    if not refuse_unservable_config(vllm_config):
        return None
    cache_config = vllm_config.cache_config
    model_config = getattr(vllm_config, "model_config", None)
    try:
        output = select_output_group(kv_cache_config)
    except LookupError as exc:
        raise _refuse(str(exc)) from None
    block_size = output.block_size
    hash_block_size = getattr(cache_config, "hash_block_size", None)
    if hash_block_size is not None and int(hash_block_size) != int(block_size):
        raise _refuse(
            f"sub-block prefix matching is enabled (cache_config.hash_block_size={hash_block_size} "
            f"but the KV block size of output group {output.group_id} is {block_size}): hits are only "
            "served block aligned. Leave hash_block_size unset or equal to the block size"
        )
    num_blocks = getattr(kv_cache_config, "num_blocks", None)
    if num_blocks is None:
        raise ValueError("stage_prefix_cache_config: kv_cache_config has no num_blocks")
    return PrefixCacheConfig.from_vllm_config(
        num_blocks=int(num_blocks),
        block_size=int(block_size),
        scheduler_config=getattr(vllm_config, "scheduler_config", None),
        model_config=model_config,
        output_group_id=output.group_id,
    )
