"""What a ``simulate --engine vllm`` run promises beyond its checks, and the refusals.

Owns: ``kv_space_override`` (the environment setting that silently changes the
engine's KV-cache size, refused before the engine starts), ``kv_block_problem``
(the engine's KV-block count must be the one the run asked for: the preset's
sizing is what makes it preempt) and ``preemption_problem`` (a preset that
promises preemptions, run as the preset, never reports OK without any). A
problem is recorded on the result as ``incomplete`` (exit 3): the checks ran
clean but the run did less than it said it would. Upholds nothing (what a
run promises).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from omni_cache.harness.vllm_engine.models import sim_model
from omni_cache.harness.vllm_engine.workload import PRESETS

__all__ = ["NotRun", "asked_kv_blocks", "kv_block_problem", "kv_space_override", "preemption_problem"]

KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's CPU platform: overrides kv_cache_memory_bytes when set


class NotRun(Exception):
    """The workload was not run (the reason is in ``result.incomplete``)."""


def asked_kv_blocks(cfg: Any) -> int:
    return int(cfg.kv_blocks or PRESETS[cfg.preset].kv_blocks)


def kv_space_override(environ: Mapping[str, str] | None = None,
                      hint: str = "use --num-blocks to change the KV cache") -> str | None:
    """One line refusing the run when ``VLLM_CPU_KVCACHE_SPACE`` is set, else ``None``; ``hint``
    ends it (the way the command changes its KV cache)."""
    env = os.environ if environ is None else environ
    value = env.get(KV_SPACE_ENV, "")
    if value == "":
        return None
    return (f"{KV_SPACE_ENV}={value} is set: vLLM's CPU engine then sizes its KV cache from it ({value} GiB) "
            f"instead of the preset's block count, so the preset's preemptions would not happen; unset it ({hint})")


def kv_block_problem(cfg: Any, got: int, res: Any, blocks: int | None = None) -> bool:
    """Record (and return True) when the engine's KV-block count is not the asked one
    (``blocks``: the run's own block count where it sizes the engine itself, else the preset's;
    the engine reports pool blocks: the model's ``pool_blocks`` of the asked blocks)."""
    asked = sim_model(getattr(cfg, "model", "llama")).pool_blocks(asked_kv_blocks(cfg) if blocks is None else blocks)
    if got == asked:
        return False
    cause = kv_space_override()
    res.incomplete.append(
        f"the engine got {got} KV blocks, the run asked for {asked}; the workload was not run"
        + (f" ({cause})" if cause else " (something changed kv_cache_memory_bytes)"))
    return True


def preemption_problem(cfg: Any, res: Any, *, preset_plan: bool = True) -> bool:
    """Record (and return True) when the preset promises preemptions, was run as
    the preset (its workload, KV blocks, requests and token budget) and had none."""
    preset = PRESETS[cfg.preset]
    as_preset = preset_plan and (cfg.kv_blocks in (None, preset.kv_blocks) and cfg.requests in (None, preset.requests)
                 and cfg.max_batched_tokens in (None, preset.max_batched_tokens))
    if not preset.promises_preemptions or not as_preset or res.incomplete or res.preemptions > 0:
        return False
    res.incomplete.append(f"preset {cfg.preset} promises preemptions (a {preset.kv_blocks}-block KV cache under "
                          "its load) but the engine preempted none")
    return True
