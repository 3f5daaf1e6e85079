"""A client-given file path on a served engine whose operator allows it (``--allow-custom-save-path``).

Protects: a request's ``kv_transfer_params.hidden_states_path`` is honoured only inside the
delivery directory: a path outside it, one that climbs out with ``..``, one through a symlink
that leads out, an existing file (never overwritten) and a name that is not ``.safetensors``
each fail that request's delivery with a clear error, write nothing outside, and the server
keeps serving; a streaming client (whose chunks carry no path) finds its rows at the path it chose;
each sample of an ``n`` = 2 request gets a file (sample 0 the path, sample 1 its ``.1`` sibling). Real server process on 127.0.0.1, real HTTP client, vLLM's reader.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest
from served_support import ServedEngine, load, params

pytestmark = pytest.mark.vllm

PROMPT = "A client may choose where its hidden states go, but only inside the delivery directory. " * 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServedEngine:
    engine = ServedEngine(tmp_path_factory.mktemp("served-custom"), "--allow-custom-save-path", name="custom")
    yield engine
    engine.stop()


def test_a_path_inside_the_delivery_directory_is_honoured(server: ServedEngine) -> None:
    (server.delivery_dir / "team-a").mkdir(mode=0o700)
    wanted = server.delivery_dir / "team-a" / "request-7.safetensors"
    response = server.complete(PROMPT, kv_transfer_params={"hidden_states_path": str(wanted)})
    assert params(response)["hidden_states_path"] == str(wanted)
    assert load(str(wanted))["hidden_states"].shape[0] == response["usage"]["prompt_tokens"]
    relative = server.complete(PROMPT + "again", kv_transfer_params={"hidden_states_path": "team-a/r8.safetensors"})
    assert params(relative)["hidden_states_path"] == str(server.delivery_dir / "team-a" / "r8.safetensors")


def _escape_cases(server: ServedEngine, tmp_path: Path) -> dict[str, tuple[str, Path]]:
    outside = tmp_path / "outside"
    outside.mkdir()
    link = server.delivery_dir / "link-out"
    if not link.exists():
        os.symlink(outside, link)
    existing = server.delivery_dir / "taken.safetensors"
    existing.write_bytes(b"not yours")
    return {
        "absolute outside": (str(outside / "a.safetensors"), outside / "a.safetensors"),
        "climbs out": ("../escape.safetensors", server.delivery_dir.parent / "escape.safetensors"),
        "symlink out": (str(link / "b.safetensors"), outside / "b.safetensors"),
        "existing file": (str(existing), existing),
        "not safetensors": (str(server.delivery_dir / "c.txt"), server.delivery_dir / "c.txt"),
    }


def test_a_streaming_client_gets_its_rows_at_the_path_it_chose(server: ServedEngine) -> None:
    """vLLM's streamed chunks carry no ``kv_transfer_params``: a streaming client's own path is how it
    finds its file, written whole once the stream has ended (vLLM's reader waits on the lock)."""
    wanted = server.delivery_dir / "streamed.safetensors"
    body = {"model": "tiny-llama", "prompt": PROMPT + "streamed", "max_tokens": 4, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
            "kv_transfer_params": {"hidden_states_path": str(wanted)}}
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=180) as response:
        chunks = [json.loads(line[len(b"data: "):]) for line in response.read().splitlines()
                  if line.startswith(b"data: {")]
    prompt_tokens = next(c["usage"]["prompt_tokens"] for c in chunks if c.get("usage"))
    assert load(str(wanted))["hidden_states"].shape[0] == prompt_tokens > 0


def test_each_sample_of_an_n_request_gets_a_file_and_the_response_names_one(server: ServedEngine) -> None:
    """With ``n`` = 2 vLLM runs two requests carrying the same params: sample 0 writes the path asked
    for, sample 1 its ``.1`` sibling; whichever the response names holds the prompt's rows."""
    wanted = server.delivery_dir / "two-samples.safetensors"
    response = server.complete(PROMPT + "n two", n=2, temperature=1.0, seed=5,
                               kv_transfer_params={"hidden_states_path": str(wanted)})
    got = params(response)
    files = [wanted, server.delivery_dir / "two-samples.1.safetensors"]
    assert "hidden_states_error" not in got and got["hidden_states_path"] in [str(f) for f in files], got
    prompt_tokens = response["usage"]["prompt_tokens"]
    first, second = (load(str(f)) for f in files)
    assert first["hidden_states"].shape[0] == second["hidden_states"].shape[0] == prompt_tokens
    assert first["token_ids"].tolist() == second["token_ids"].tolist()


@pytest.mark.parametrize("case", ["absolute outside", "climbs out", "symlink out", "existing file", "not safetensors"])
def test_a_path_that_leaves_the_directory_or_overwrites_is_refused(server: ServedEngine, tmp_path: Path,
                                                                   case: str) -> None:
    requested, target = _escape_cases(server, tmp_path)[case]
    before = target.read_bytes() if target.exists() else None
    response = server.complete(PROMPT + case, kv_transfer_params={"hidden_states_path": requested})
    got = params(response)
    assert "hidden_states_path" not in got and "hidden_states_path" in got.get("hidden_states_error", ""), got
    assert (target.read_bytes() if target.exists() else None) == before, "nothing may be written there"
    assert server.healthy()
