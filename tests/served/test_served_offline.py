"""The cache in vLLM's offline ``LLM`` with its default multiprocess engine (no in-process switch).

Protects: an ``LLM`` built with the omni worker and vLLM's default engine-core process keeps
serving request after request whether or not anything consumes the cache's step ids: without a
delivery connector every step id is discarded in the worker (it used to fill the staging pool
and kill the engine core at the first request); with ``OmniKVConnector`` delivery each
``RequestOutput`` carries ``kv_transfer_params["hidden_states_path"]``, a file vLLM's reader
loads with one row per prompt token. A bad delivery setting is refused at engine start naming
the key, and delivery on a stage whose cache is off is refused too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from vllm_support import engine_start_in_subprocess, require_vllm

pytestmark = pytest.mark.vllm

_SCRIPT = """
import json, os, sys
from omni_cache.harness.vllm_engine.engine import tiny_llama_dir
from omni_cache.harness.served.launch import CONNECTOR
os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)   # vLLM's default: the engine core in its own process
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
from vllm import LLM, SamplingParams
delivery_dir = sys.argv[1]
kwargs = dict(model=tiny_llama_dir(), load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
              block_size=32, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=16 << 20,
              max_model_len=512, worker_cls="omni_cache.integration.vllm_worker.OmniCPUWorker")
if delivery_dir != "-":
    kwargs["kv_transfer_config"] = {**CONNECTOR, "kv_connector_extra_config": {
        "connectors": [], "omni_cache": {"delivery_dir": delivery_dir}}}
llm = LLM(**kwargs)
prompt = list(range(3, 3 + 100))
out = []
for i in range(6):  # more requests than staging_depth (4): nothing outside the worker consumes
    r = llm.generate([{"prompt_token_ids": prompt + [200 + i]}], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    out.append({"params": r.kv_transfer_params, "prompt_tokens": len(r.prompt_token_ids)})
print("RESULT " + json.dumps(out), flush=True)
"""


def _run(delivery: str) -> list[dict]:
    require_vllm()
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, delivery], capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


def test_without_a_connector_the_worker_discards_and_the_engine_keeps_serving() -> None:
    results = _run("-")
    assert len(results) == 6 and all(r["params"] is None for r in results)


def test_with_delivery_each_request_output_names_its_file(tmp_path: Path) -> None:
    import torch
    from served_support import load

    results = _run(str(tmp_path / "files"))
    assert len(results) == 6
    for r in results:
        path = r["params"]["hidden_states_path"]
        assert os.path.dirname(path) == os.path.realpath(tmp_path / "files")
        rows = load(path)
        assert rows["hidden_states"].shape[0] == rows["token_ids"].shape[0] == r["prompt_tokens"] == 101
    assert results[-1]["params"]["hidden_states_cached_tokens"] == 96  # three whole blocks hit
    first, last = load(results[0]["params"]["hidden_states_path"]), load(results[-1]["params"]["hidden_states_path"])
    assert torch.equal(first["hidden_states"][:96], last["hidden_states"][:96])


def test_a_bad_delivery_setting_is_refused_at_engine_start_naming_the_key(tmp_path: Path) -> None:
    config = {"kv_connector": "OmniKVConnector", "kv_connector_module_path": "omni_cache.integration.kv_tier",
              "kv_role": "kv_both", "kv_connector_extra_config": {
                  "connectors": [], "omni_cache": {"delivery_dir": str(tmp_path), "delivery_timeout_s": -1}}}
    line = engine_start_in_subprocess(textwrap.dedent(f"""
        {{**engine_kwargs(tiny_llama_dir(), kv_blocks=24, max_batched_tokens=256, max_model_len=256),
          "kv_transfer_config": {config!r}}}"""), whole_message=True)
    assert line.startswith("REFUSED") and "omni_cache.delivery_timeout_s" in line, line


def test_delivery_on_a_stage_whose_cache_is_off_is_refused(tmp_path: Path) -> None:
    config = {"kv_connector": "OmniKVConnector", "kv_connector_module_path": "omni_cache.integration.kv_tier",
              "kv_role": "kv_both", "kv_connector_extra_config": {
                  "connectors": [], "omni_cache": {"delivery_dir": str(tmp_path)}}}
    line = engine_start_in_subprocess(textwrap.dedent(f"""
        {{**engine_kwargs(tiny_llama_dir(), kv_blocks=24, max_batched_tokens=256, max_model_len=256),
          "enable_prefix_caching": False, "kv_transfer_config": {config!r}}}"""), whole_message=True)
    assert line.startswith("REFUSED") and "delivery_dir" in line and "prefix caching" in line, line
