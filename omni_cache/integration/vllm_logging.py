"""The cache's log lines in a vLLM process: through vLLM's own handler.

Owns: ``use_vllm_logging``. vLLM configures only its ``vllm`` logger; the cache logs under
``omni_cache``, whose records would otherwise reach no handler in vLLM's engine and worker
processes (warnings go to Python's last-resort stderr printer, informational lines nowhere).
Upholds: nothing (logging only).
"""

from __future__ import annotations

import logging

__all__ = ["use_vllm_logging"]


def use_vllm_logging() -> None:
    """In a vLLM process, the cache's records (logger ``omni_cache``) go out through vLLM's own
    handler, in its format and at its level, beside vLLM's lines (``VLLM_LOGGING_LEVEL``);
    idempotent, and nothing where vLLM has not configured its logger."""
    ours, theirs = logging.getLogger("omni_cache"), logging.getLogger("vllm")
    if not theirs.handlers or any(h in ours.handlers for h in theirs.handlers):
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
