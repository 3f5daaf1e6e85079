"""Shared set-up of the tests that run the real vLLM CPU engine (marker ``vllm``).

``require_vllm()`` imports vLLM or skips -- only outside CI: under ``CI=true`` a
missing vLLM fails (CI installs the ``[vllm]`` extra). Any other import error
(e.g. the CUDA torchvision that breaks ``import vllm`` on the CPU torch) is
never a skip. ``small_llm`` builds the tiny dummy-weight Llama engine with
the omni worker installed; one engine serves a whole test module.
``engine_start_in_subprocess`` starts an engine in a fresh process and says
whether the config gate refused it, and after how many steps.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
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
    from omni_cache.harness.vllm_engine.engine import (
        engine_kwargs,
        prepare_vllm_env,
        stdout_to_stderr,
        tiny_llama_dir,
    )

    prepare_vllm_env()
    from vllm import LLM

    with stdout_to_stderr():
        return LLM(**engine_kwargs(tiny_llama_dir(), kv_blocks=kv_blocks, max_batched_tokens=256,
                                   max_model_len=512, **overrides))


def shutdown_llm(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def engine_start_in_subprocess(llm_kwargs: str, setup: str = "", *, whole_message: bool = False) -> str:
    """Start ``LLM(**<llm_kwargs>)`` in a fresh process (after the ``setup`` code; ``engine_kwargs``,
    ``prepare_vllm_env`` and ``tiny_llama_dir`` are imported) and return one line:
    ``REFUSED <exception type> steps <steps begun> <message>`` (the message's first line, or the whole
    message on one line) or ``STARTED``; the process's stderr tail when it printed neither."""
    require_vllm()
    message = '" ".join(str(exc).split())' if whole_message else "str(exc).splitlines()[0]"
    script = "\n".join([
        "from omni_cache.integration import vllm_bridge",
        "from omni_cache.harness.vllm_engine.engine import engine_kwargs, prepare_vllm_env, tiny_llama_dir",
        "prepare_vllm_env()",
        "steps = []",
        "real = vllm_bridge.VllmRunnerBridge.begin_step",
        "vllm_bridge.VllmRunnerBridge.begin_step = lambda self, so: (steps.append(so), real(self, so))",
        textwrap.dedent(setup),
        "from vllm import LLM",
        "try:",
        f"    LLM(**{llm_kwargs})",
        "except Exception as exc:",
        f'    print("REFUSED", type(exc).__name__, "steps", len(steps), {message})',
        "else:",
        '    print("STARTED")',
    ])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    return next((ln for ln in proc.stdout.splitlines() if ln.startswith(("REFUSED", "STARTED"))), proc.stderr[-2000:])
