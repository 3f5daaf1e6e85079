"""Speculative decoding in the real-engine jobs: the methods, their tiny draft models, the traps.

Owns: ``METHODS`` (what ``--speculative`` takes: ``ngram``, vLLM's prompt-lookup proposer;
``draft``, a tiny draft model; ``eagle``, a tiny EAGLE head), ``speculative_config`` (vLLM's
``speculative_config`` for a method, its draft model or head built at run time as the thinker
is: a ``config.json`` and dummy weights), ``draft_kv_layers`` (the attention layers a method
adds to every KV block: the engine's KV memory grows by them, so the workload keeps its
blocks and its preemptions), and the workload's traps: ``probe_chains`` (the tokens the
thinker generates after a one-token prompt) and ``trapped`` (a prompt rewritten so the n-gram
proposer proposes tokens the thinker rejects).

Why traps: the thinkers here have dummy weights, under which the next token depends (in
practice) on the current token only: greedy decoding runs a fixed chain ``x -> a -> b -> ...``
into a short cycle, so n-gram drafts taken from the generated tokens are always accepted. A
prompt that holds ``x a b z1 z2`` and ends with ``x`` makes the proposer, after the thinker
generates ``a``, propose ``b z1 z2``: ``b`` is accepted, ``z1`` rejected; ``c d c y1`` (``c d``:
the chain's cycle) gets ``y1`` proposed and rejected whenever the cycle comes round. The
draft model (hidden size 64) is unrelated to the thinker: its drafts are rejected, nearly
all. The runs count what happened (vLLM's own counters) and promise rejections.

Upholds nothing (inputs and engine options).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from omni_cache.harness.vllm_engine.models import DEFAULT_MODEL, TINY_LLAMA

__all__ = ["CHAIN_TOKENS", "METHODS", "NUM_SPECULATIVE_TOKENS", "check_speculative", "draft_kv_layers",
           "draft_model_dir", "eagle_head_dir", "probe_chains", "speculative_config", "trapped"]

METHODS = ("ngram", "draft", "eagle")
NUM_SPECULATIVE_TOKENS = 3
CHAIN_TOKENS = 6  # tokens generated after a probe's one-token prompt

# A 1-layer Llama of hidden size 64: dummy weights unrelated to the thinker's (other shapes).
TINY_DRAFT: dict[str, Any] = {**TINY_LLAMA, "hidden_size": 64, "num_attention_heads": 1, "num_key_value_heads": 1,
                              "intermediate_size": 128, "num_hidden_layers": 1}
# vLLM's EAGLE head for a Llama target: one decoder layer over [embedding, target hidden state].
TINY_EAGLE: dict[str, Any] = {**TINY_LLAMA, "architectures": ["EagleLlamaForCausalLM"], "num_hidden_layers": 1}


def _model_dir(config: dict[str, Any], prefix: str, path: str | None) -> str:
    if path is None:
        path = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, path, True)
    else:
        os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def check_speculative(cfg: Any) -> None:
    """Raise ``ValueError`` (one line for the CLI) for a ``--speculative`` run the jobs do not make:
    an unknown method, or with another model, worker processes or a KV connector."""
    method = getattr(cfg, "speculative", None)
    if method is None:
        return
    if method not in METHODS:
        raise ValueError(f"--speculative must be one of {', '.join(METHODS)}, got {method!r}")
    model = getattr(cfg, "model", DEFAULT_MODEL)
    if model != DEFAULT_MODEL:
        raise ValueError(f"--speculative runs the {DEFAULT_MODEL} thinker: not --model {model}")
    if getattr(cfg, "tp", 1) * getattr(cfg, "pp", 1) > 1:
        raise ValueError("--speculative runs the thinker in this process: not with --tp/--pp")
    if getattr(cfg, "kv_connector", None) is not None:
        raise ValueError("--speculative does not combine with --kv-connector")


def draft_model_dir(path: str | None = None) -> str:
    """A directory with the draft model's ``config.json`` (removed at exit when made here)."""
    return _model_dir(TINY_DRAFT, "omni-cache-tiny-draft-", path)


def eagle_head_dir(path: str | None = None) -> str:
    """A directory with the EAGLE head's ``config.json`` (removed at exit when made here)."""
    return _model_dir(TINY_EAGLE, "omni-cache-tiny-eagle-", path)


def speculative_config(method: str, path: str | None = None) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for ``method`` (its draft model or head built in ``path``)."""
    k = NUM_SPECULATIVE_TOKENS
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    if method == "draft":
        return {"method": "draft_model", "model": draft_model_dir(path), "num_speculative_tokens": k}
    if method == "eagle":
        return {"method": "eagle", "model": eagle_head_dir(path), "num_speculative_tokens": k}
    raise ValueError(f"unknown speculative method {method!r} (choose from {', '.join(METHODS)})")


def draft_kv_layers(method: str | None) -> int:
    """Attention layers the method adds to each KV block (its draft model's or head's); every
    such layer has the thinker's per-layer KV shape (1 KV head of 64), so one KV-cache group."""
    return 1 if method in ("draft", "eagle") else 0


def probe_chains(generate: Callable[[list[list[int]], int], list[list[int]]], starts: Sequence[int]) -> dict[int, list[int]]:
    """``x -> [x, tokens the thinker generates after the prompt [x]]`` for each start token;
    ``generate(prompts, max_tokens)`` runs the engine (greedy)."""
    outputs = generate([[x] for x in starts], CHAIN_TOKENS)
    return {x: [x, *out] for x, out in zip(starts, outputs, strict=True)}


def _other(rng: random.Random, avoid: set[int], vocab: int, first: int) -> int:
    while True:
        t = rng.randrange(first, vocab)
        if t not in avoid:
            return t


def trapped(prompt: Sequence[int], chain: Sequence[int], *, keep: int, vocab: int, first_token: int) -> list[int]:
    """``prompt`` with its tail after ``keep`` tokens rewritten to hold the traps and end with
    ``chain[0]``; its length unchanged when the tail is long enough (else it grows a little).

    The traps (``chain = [x, a, b, c, ...]`` ends in a cycle ``... p q``): ``t x a b z1 z2``
    (after ``a``, the 2-gram ``x a`` proposes ``b z1 z2``; ``z1 != c``) and ``p q p y1 y2`` (the
    3-gram ``p q p`` proposes ``y1 y2``; ``y1 != q``), then ``r x``. Deterministic in
    ``prompt`` and ``chain``, so an exact repeat of a prompt stays one."""
    x, a, b, c = chain[0], chain[1], chain[2], chain[3]
    p, q = chain[-2], chain[-1]
    rng = random.Random(hash((tuple(prompt), tuple(chain))) & 0xFFFFFFFF)
    t = _other(rng, {x, a, b, p, q}, vocab, first_token)
    z1 = _other(rng, {c, x, a, b}, vocab, first_token)
    z2 = _other(rng, {x}, vocab, first_token)
    y1 = _other(rng, {q, p, x}, vocab, first_token)
    y2 = _other(rng, {x}, vocab, first_token)
    r = _other(rng, {t, x, a}, vocab, first_token)
    tail = [t, x, a, b, z1, z2, p, q, p, y1, y2, r, x]
    head = list(prompt[: max(keep, len(prompt) - len(tail))])
    return head + tail
