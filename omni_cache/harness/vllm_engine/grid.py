"""What ``--tp``, ``--pp``, ``--check-ranks`` and ``--kv-connector`` allow for the tiny thinker (``simulate`` and ``pipeline``).

Owns: ``MAX_WORKERS``, ``KV_CONNECTORS``, ``check_parallel_config`` and
``check_kv_connector`` (each a ``ValueError`` with one line for the CLI). Kept apart from ``vllm_sim.parallel`` so that the run's
config (``vllm_sim.engine``) can validate itself without importing the
worker-process run. Upholds nothing (argument checks).
"""

from __future__ import annotations

from typing import Any

from omni_cache.harness.vllm_engine.models import DEFAULT_MODEL, TINY_LLAMA

__all__ = ["KV_CONNECTORS", "MAX_WORKERS", "check_kv_connector", "check_parallel_config"]

MAX_WORKERS = 8
KV_CONNECTORS = ("example",)  # vllm_sim.tier_run: ExampleConnector under OmniKVConnector


def check_parallel_config(cfg: Any) -> None:
    """Raise ``ValueError`` (one line for the CLI) for a grid the tiny model cannot run."""
    layers, heads = TINY_LLAMA["num_hidden_layers"], TINY_LLAMA["num_attention_heads"]
    if cfg.tp < 1 or cfg.pp < 1:
        raise ValueError(f"--tp and --pp must be at least 1, got --tp {cfg.tp} --pp {cfg.pp}")
    if cfg.tp * cfg.pp > MAX_WORKERS:
        raise ValueError(f"--tp {cfg.tp} x --pp {cfg.pp} = {cfg.tp * cfg.pp} workers; at most {MAX_WORKERS}")
    if heads % cfg.tp:
        raise ValueError(f"--tp {cfg.tp} does not divide the model's {heads} attention heads (use 1 or 2)")
    if cfg.pp > layers:
        raise ValueError(f"--pp {cfg.pp} exceeds the model's {layers} layers")
    model = getattr(cfg, "model", DEFAULT_MODEL)
    if model != DEFAULT_MODEL and cfg.tp * cfg.pp > 1:
        raise ValueError(f"--model {model} runs on one worker: --tp and --pp take the {DEFAULT_MODEL} model only")
    if getattr(cfg, "check_ranks", False) and cfg.tp < 2:
        raise ValueError("--check-ranks compares the TP ranks' caches: it needs --tp 2 or more")


def check_kv_connector(cfg: Any) -> None:
    """Raise ``ValueError`` (one line) for a ``--kv-connector`` run (``simulate --engine vllm`` or
    ``pipeline``) that cannot show the tier: the connector needs the llama thinker in this process and,
    in ``pipeline``, a later run to load into (``repeats``; a config without it is one run with two phases)."""
    name = getattr(cfg, "kv_connector", None)
    if name is None:
        return
    if name not in KV_CONNECTORS:
        raise ValueError(f"--kv-connector must be one of {', '.join(KV_CONNECTORS)}, got {name!r}")
    model = getattr(cfg, "model", DEFAULT_MODEL)
    if cfg.tp * cfg.pp > 1:
        raise ValueError(f"--kv-connector runs the thinker in this process: not with --tp {cfg.tp} --pp {cfg.pp}")
    if model != DEFAULT_MODEL:
        raise ValueError(f"--kv-connector runs the {DEFAULT_MODEL} thinker (one KV-cache group): not --model {model}")
    if getattr(cfg, "repeats", 2) < 2:
        raise ValueError("--kv-connector needs --repeats 2 or more: a run's prefixes come back through the "
                         "connector in the runs after it")
