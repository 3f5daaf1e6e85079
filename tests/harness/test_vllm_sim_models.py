"""The run-time-built thinker models of ``--model`` (no vLLM needed).

``sim_model`` names the choices for an unknown model; ``model_dir`` writes the
model's ``config.json`` (the hybrid one: 3 sliding-window layers, window 64,
then 1 full-attention layer); ``model_engine_kwargs`` sizes the KV memory per
model (the hybrid layout's groups share one pool of one-layer pages); the CLI
refuses ``--model`` without ``--engine vllm`` and an unknown model, exit 2.
"""

from __future__ import annotations

import json
import os

import pytest

from omni_cache.cli import main
from omni_cache.harness.vllm_engine.engine import KV_BLOCK_BYTES, VllmSimConfig
from omni_cache.harness.vllm_engine.models import MODELS, model_dir, model_engine_kwargs, sim_model


def test_an_unknown_model_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'gemma' \(choose from hybrid, llama, wide\)"):
        sim_model("gemma")
    with pytest.raises(ValueError, match="unknown model"):
        VllmSimConfig(model="gemma")
    assert VllmSimConfig().model == "llama"


def test_the_hybrid_model_dir_holds_its_config(tmp_path) -> None:
    path = model_dir("hybrid", str(tmp_path))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == 64
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]


def test_engine_kwargs_size_the_kv_memory_per_model() -> None:
    llama = model_engine_kwargs("llama", kv_blocks=48)
    assert llama["kv_cache_memory_bytes"] == 48 * KV_BLOCK_BYTES == 48 * 2 * 2 * 32 * 64 * 4
    hybrid = model_engine_kwargs("hybrid", kv_blocks=48)
    # one pool of one-layer pages: the preset's 48 blocks plus one running request's three windows
    # (3 blocks each), never below the 52 vLLM needs to start a 512-token request
    assert hybrid["kv_cache_memory_bytes"] == (48 + 9) * (2 * 32 * 64 * 4)
    assert model_engine_kwargs("hybrid", kv_blocks=24)["kv_cache_memory_bytes"] == 52 * (2 * 32 * 64 * 4)
    assert hybrid["disable_hybrid_kv_cache_manager"] is False
    assert os.path.isfile(os.path.join(hybrid["model"], "config.json"))
    wide = model_engine_kwargs("wide", kv_blocks=48)  # 16 layers, 2 KV heads of 128
    assert wide["kv_cache_memory_bytes"] == 48 * 16 * 2 * 32 * 2 * 128 * 4
    assert set(MODELS) == {"llama", "hybrid", "wide"}


@pytest.mark.parametrize("argv", [["simulate", "--model", "hybrid"], ["simulate", "--engine", "vllm", "--model", "x"]])
def test_the_cli_refuses_a_misplaced_or_unknown_model(argv, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--model" in err and "Traceback" not in err
