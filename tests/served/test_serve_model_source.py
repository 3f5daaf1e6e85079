"""``omni-cache serve``'s MODEL: one vLLM could not load is refused in one line before vLLM starts.

Protected: a path that does not exist, a string that is no model id, a model id that is neither in
the Hugging Face cache nor on a hub that answers (``HF_HUB_OFFLINE``, an unreachable endpoint) exit 2
with one ``error:`` line naming MODEL, before torch, numpy or vLLM are imported (vLLM would retry the
hub for half a minute, then end in a traceback). A built-in model, an existing directory and a
cached model id are served (``--dry-run`` prints the command), offline too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_cache.harness.served.launch import BUILTIN
from omni_cache.harness.served.model_source import model_problem

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="omni-cache serve needs vLLM installed (the [vllm] extra)")

_RUN = """
import json, sys
from omni_cache.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("EXIT", code, json.dumps(sorted(m for m in ("torch", "numpy", "vllm") if m in sys.modules)))
"""


def _serve(model: str, tmp_path: Path, **env: str) -> tuple[int, list[str], str, str]:
    """``omni-cache serve MODEL --dry-run`` in a fresh process with an empty Hugging Face cache of its
    own: (exit code, modules imported, stdout, stderr)."""
    hf_home = tmp_path / "hf"
    base = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT",
                                                              "HF_HUB_CACHE", "VLLM_USE_MODELSCOPE")}
    done = subprocess.run([sys.executable, "-c", _RUN, "serve", model, "--dry-run"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120,
                          env={**base, "HF_HOME": str(hf_home), "TMPDIR": str(tmp_path), **env})
    last = [line for line in done.stdout.splitlines() if line.startswith("EXIT ")][-1].split(maxsplit=2)
    return int(last[1]), json.loads(last[2]), done.stdout, done.stderr


def _one_error(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-2000:]
    return errors[0]


@pytest.mark.parametrize(("model", "env", "phrase"), [
    ("./no-such-model", {}, "no such file or directory"),
    ("/no/such/model/dir", {}, "no such file or directory"),
    ("~/no-such-model", {}, "no such file or directory"),
    ("a b", {}, "is neither a path nor a Hugging Face model id"),
    ("org/no-such-model", {"HF_HUB_OFFLINE": "1"}, "is not in the Hugging Face cache"),
    ("org/no-such-model", {"HF_ENDPOINT": "http://127.0.0.1:1"}, "cannot be reached to fetch it"),
])
def test_a_model_vllm_could_not_load_is_one_line_exit_2_before_torch(model: str, env: dict[str, str], phrase: str,
                                                                       tmp_path: Path) -> None:
    code, modules, _, stderr = _serve(model, tmp_path, **env)
    assert (code, modules) == (2, []), stderr[-2000:]
    line = _one_error(stderr)
    assert f"MODEL {model!r}" in line and phrase in line and "tiny-llama" in line, line
    assert "usage: omni-cache serve" in stderr


def test_a_cached_model_id_and_a_local_directory_are_served_offline(tmp_path: Path) -> None:
    snapshot = tmp_path / "hf" / "hub" / "models--org--cached-model" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")
    local = tmp_path / "my-model"
    local.mkdir()
    for model in ("org/cached-model", str(local)):
        code, _, stdout, stderr = _serve(model, tmp_path, HF_HUB_OFFLINE="1")
        assert code == 0, stderr[-2000:]
        assert f"--model {model} " in stdout, stdout


def test_builtin_models_never_ask_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # an import of it would raise
    assert all(model_problem(name, BUILTIN) is None for name in BUILTIN)
