"""The dummy-weight thinker models a real-engine run can use, built at run time.

Owns: ``SimModel`` (a model's ``config.json``, how its KV memory is sized and the
engine options it needs), ``MODELS`` (``llama``: a 2-layer Llama, one KV-cache
group; ``wide``: a 16-layer Llama of width 1024 whose forward dominates a step on a CPU;
``hybrid``: a 4-layer Gemma 3 text model, three sliding-window layers
with window 64 and one full-attention layer, which vLLM's hybrid KV-cache
manager gives four KV-cache groups), ``sim_model`` (a name to its model, with
one error line for a bad name), ``model_dir`` (a directory holding only the
``config.json``; weights are ``load_format="dummy"``) and
``model_engine_kwargs`` (the ``LLM`` arguments a model needs), ``talker_config`` (the
``pipeline``'s talker of a thinker: a 2-layer Llama of its width). Every command
that builds a real thinker (``simulate --engine vllm``, and later ``pipeline``)
takes ``--model`` through these. vLLM is not imported here.

Upholds nothing (input generation only); the ``hybrid`` model is
what exercises the output KV-cache group of spec/contract.md section 7.1.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_MODEL", "MODELS", "SimModel", "model_dir", "model_engine_kwargs", "sim_model", "talker_config",
           "talker_kv_bytes_per_block"]

BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
_FP32 = 4


@dataclass(frozen=True)
class SimModel:
    """A tiny dummy-weight model. ``kv_bytes_per_block``: bytes of one KV block id in the
    engine's pool; ``window_pool_blocks``: pool blocks added to the blocks the workload preset
    asks for (``pool_blocks``). A hybrid layout's groups share one pool: the full-attention
    group gets the preset's blocks, and the sliding-window groups hold their window's blocks
    (``window / block_size + 1`` each) of one running request beside them, so the preset's
    pressure (its preemptions) stays; ``min_pool_blocks`` is the floor vLLM checks at engine start
    (one request of the model's full length with its sliding-window reservations). Sized per preset block instead (4 pool blocks each), the pool held
    the windows of every running request with room to spare and ``mixed`` never preempted."""

    name: str
    description: str
    config: dict[str, Any]
    kv_bytes_per_block: int
    window_pool_blocks: int = 0
    min_pool_blocks: int = 0
    engine_options: dict[str, Any] = field(default_factory=dict)

    def pool_blocks(self, kv_blocks: int) -> int:
        """The engine's pool blocks for ``kv_blocks`` blocks of a workload preset (never below
        ``min_pool_blocks``, what vLLM needs to start with the presets' 512-token model length)."""
        return max(kv_blocks + self.window_pool_blocks, self.min_pool_blocks)

    def kv_cache_memory_bytes(self, kv_blocks: int) -> int:
        return self.pool_blocks(kv_blocks) * self.kv_bytes_per_block


TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 256,
    "num_hidden_layers": 2, "vocab_size": 512, "torch_dtype": "float32",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
}

# The realistic-width thinker: its forward dominates a step on a CPU (``omni-cache pipeline --model wide``).
WIDE_LLAMA: dict[str, Any] = {
    **TINY_LLAMA, "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
    "intermediate_size": 2816, "num_hidden_layers": 16,
}
# The talker of a thinker of width ``w`` (``talker_config``): a 2-layer Llama of the same width, so the
# projection between the stages stays the identity.
_TALKER_LAYERS = 2

SLIDING_WINDOW = 64
TINY_GEMMA3: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 128,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 256,
    "num_hidden_layers": 4, "vocab_size": 512, "torch_dtype": "float32",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "query_pre_attn_scalar": 64, "sliding_window": SLIDING_WINDOW,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True,
}


def _kv_bytes(layers_per_block: int, kv_heads: int, head_dim: int) -> int:
    """(K, V) x tokens x kv heads x head dim x fp32, times the layers one block id spans."""
    return layers_per_block * 2 * BLOCK_SIZE * kv_heads * head_dim * _FP32


MODELS: dict[str, SimModel] = {
    "llama": SimModel(
        "llama", "2-layer Llama (full attention only: one KV-cache group)", TINY_LLAMA,
        kv_bytes_per_block=_kv_bytes(2, 1, 64),
    ),
    "wide": SimModel(
        "wide",
        "16-layer Llama of width 1024 (8 heads, 2 KV heads, MLP 2816): its forward, tens to hundreds of ms a "
        "prefill step on 2 cores, dominates the step",
        WIDE_LLAMA,
        kv_bytes_per_block=_kv_bytes(16, 2, 128),
    ),
    "hybrid": SimModel(
        "hybrid",
        f"4-layer Gemma 3 text model: 3 sliding-window layers (window {SLIDING_WINDOW}) and 1 "
        "full-attention layer; vLLM's hybrid KV-cache manager gives 4 KV-cache groups",
        TINY_GEMMA3,
        # One KV-cache tensor per layer slot shared by the groups: a block id is one layer's page.
        kv_bytes_per_block=_kv_bytes(1, 1, 64),
        # 3 sliding-window groups x (a 64-token window: 2 blocks, + 1 being filled) of one request
        window_pool_blocks=3 * (SLIDING_WINDOW // BLOCK_SIZE + 1),
        # vLLM's engine-start check: one 512-token request (16 full-attention blocks) plus what it
        # reserves for each sliding-window group, about (window - 1 + a 256-token step) / block size
        # + 1 = 11 blocks; 49 in all was refused (an estimated 480-token limit), so one block more
        # per group: 52 (measured, vLLM 0.32)
        min_pool_blocks=512 // BLOCK_SIZE + 3 * (-(-(SLIDING_WINDOW - 1 + 256) // BLOCK_SIZE) + 2),
        engine_options={"disable_hybrid_kv_cache_manager": False},
    ),
}
DEFAULT_MODEL = "llama"


def talker_config(name: str = DEFAULT_MODEL) -> dict[str, Any]:
    """The talker of model ``name``'s thinker: a 2-layer Llama of the thinker's width (the tiny
    Llama itself for the 128-wide thinkers)."""
    width = int(sim_model(name).config["hidden_size"])
    if width == TINY_LLAMA["hidden_size"]:
        return dict(TINY_LLAMA)
    heads = width // 128
    return {**TINY_LLAMA, "hidden_size": width, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 4), "intermediate_size": 2 * width,
            "num_hidden_layers": _TALKER_LAYERS}


def talker_kv_bytes_per_block(name: str = DEFAULT_MODEL) -> int:
    """KV bytes of one block of model ``name``'s talker (``talker_config``)."""
    c = talker_config(name)
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return _kv_bytes(c["num_hidden_layers"], c["num_key_value_heads"], head_dim)


def sim_model(name: str) -> SimModel:
    """The model called ``name``; ``ValueError`` (one line, the choices) for another name."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r} (choose from {', '.join(sorted(MODELS))})") from None


def model_engine_kwargs(name: str, *, kv_blocks: int) -> dict[str, Any]:
    """``LLM(...)`` arguments that model ``name`` needs: ``model`` (a fresh ``model_dir``), the KV
    memory for ``kv_blocks`` preset blocks and its engine options (the caller's other options
    come from ``vllm_sim.engine.engine_kwargs``)."""
    model = sim_model(name)
    return {"model": model_dir(name), "kv_cache_memory_bytes": model.kv_cache_memory_bytes(kv_blocks),
            **model.engine_options}


def model_dir(name: str = DEFAULT_MODEL, path: str | None = None) -> str:
    """A model directory holding only the ``config.json`` of model ``name`` (weights:
    ``load_format="dummy"``); one made here (no ``path``) is removed when this process exits."""
    model = sim_model(name)
    if path is None:
        path = tempfile.mkdtemp(prefix=f"omni-cache-tiny-{model.name}-")
        atexit.register(shutil.rmtree, path, True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config, f)
    return path
