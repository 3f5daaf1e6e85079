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


def _serve(model: str, tmp_path: Path, *extra: str, **env: str) -> tuple[int, list[str], str, str]:
    """``omni-cache serve MODEL --dry-run`` in a fresh process with an empty Hugging Face cache of its
    own: (exit code, modules imported, stdout, stderr)."""
    hf_home = tmp_path / "hf"
    base = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT",
                                                              "HF_HUB_CACHE", "VLLM_USE_MODELSCOPE")}
    done = subprocess.run([sys.executable, "-c", _RUN, "serve", model, "--dry-run", *extra], capture_output=True,
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
    (local / "config.json").write_text("{}")
    mistral = tmp_path / "mistral-model"
    mistral.mkdir()
    (mistral / "params.json").write_text("{}")
    gguf = tmp_path / "model.Q4.gguf"
    gguf.write_bytes(b"GGUF\x03\x00")
    blob = tmp_path / "sha256-0123"  # a GGUF file without the suffix (Ollama's blobs)
    blob.write_bytes(b"GGUF\x03\x00")
    for model in ("org/cached-model", str(local), str(mistral), str(gguf), str(blob)):
        code, _, stdout, stderr = _serve(model, tmp_path, HF_HUB_OFFLINE="1")
        assert code == 0, stderr[-2000:]
        assert f"--model {model} " in stdout, stdout


def test_an_existing_path_that_holds_no_model_is_refused(tmp_path: Path) -> None:
    """A directory without a checkpoint's config, or a plain file, is refused before vLLM starts
    (vLLM would fail after its slow start)."""
    empty = tmp_path / "no-model"
    empty.mkdir()
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    for model, phrase in ((empty, "is a directory with no config.json or params.json"),
                          (notes, "is a file, not a model directory")):
        code, _, _, stderr = _serve(str(model), tmp_path, HF_HUB_OFFLINE="1")
        line = _one_error(stderr)
        assert code == 2 and f"MODEL {str(model)!r}" in line and phrase in line, stderr[-2000:]
    # the server names the config itself: the directory needs none of its own
    for extra in (["--hf-config-path", str(tmp_path)], ["--config-format=mistral"]):
        code, _, stdout, stderr = _serve(str(empty), tmp_path, *extra, HF_HUB_OFFLINE="1")
        assert code == 0 and f"--model {empty} " in stdout, stderr[-2000:]


def test_builtin_models_never_ask_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # an import of it would raise
    assert all(model_problem(name, BUILTIN) is None for name in BUILTIN)


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """In-process checks: an empty Hugging Face cache, no offline or ModelScope setting."""
    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_USE_MODELSCOPE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path


def test_the_servers_token_and_revision_reach_the_hub(empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private model served with ``--hf-token`` is asked for with that token (and revision)."""
    import huggingface_hub

    asked: list[dict[str, object]] = []
    monkeypatch.setattr(huggingface_hub, "model_info", lambda model, **kw: asked.append({"model": model, **kw}))
    assert model_problem("org/private", BUILTIN, token="hf_x", revision="v2") is None
    assert asked == [{"model": "org/private", "revision": "v2", "token": "hf_x", "timeout": 10.0}]


def test_a_hub_that_does_not_know_the_model_is_one_line(empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    def hub_error(kind: type[Exception], text: str) -> Exception:
        """The hub's error as ``model_info`` raises it (built without an HTTP response)."""
        exc = kind.__new__(kind)
        Exception.__init__(exc, text)
        return exc

    def unknown(model: str, **_: object) -> None:
        raise hub_error(RepositoryNotFoundError, "404 Client Error.\n\nRepository Not Found")

    monkeypatch.setattr(huggingface_hub, "model_info", unknown)
    line = model_problem("org/typo", BUILTIN)
    assert line is not None and "the Hugging Face hub has no such model" in line and "\n" not in line

    def gated(model: str, **_: object) -> None:
        raise hub_error(GatedRepoError, "403 Client Error.\n\nAccess to model org/gated is restricted")

    monkeypatch.setattr(huggingface_hub, "model_info", gated)
    assert model_problem("org/gated", BUILTIN) is None  # it exists: vLLM asks for the token


@pytest.mark.parametrize(("model", "served"), [
    ("s3://bucket/models/llama", True), ("gs://bucket/llama", True),  # vLLM loads URLs itself
    ("~/no-such-model", False),  # vLLM expands no ~: as given, it does not exist
    ("org/a\nb", False),  # no model id; the refusal stays one line
])
def test_urls_are_vllms_and_a_refusal_is_one_line(model: str, served: bool, empty_cache: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = model_problem(model, BUILTIN)
    assert (line is None) == served, line
    assert line is None or "\n" not in line


def test_the_offline_setting_named_is_the_one_set_and_modelscope_is_read_as_vllm_does(
        empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    line = model_problem("org/x", BUILTIN)
    assert line is not None and "TRANSFORMERS_OFFLINE is set" in line
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "yes")  # vLLM reads only 1/true: the hub still serves it
    assert model_problem("org/x", BUILTIN) is not None
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "true")
    assert model_problem("org/x", BUILTIN) is None
