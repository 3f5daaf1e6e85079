"""The API server's check of a request's delivery options (``request_check``), as ASGI middleware.

Protected: a POST whose JSON ``kv_transfer_params`` has a bad ``include_output_tokens`` is answered
400 in the OpenAI error format and never reaches the app; every other request reaches the app with
its body exactly as it came (a body in several chunks included), and GETs are never read. The
scheduler side gives a request that arrives without the check the same reason
(tests/integration/test_delivery_scheduler.py); the real server: tests/served/test_served_engine.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from omni_cache.integration.request_check import CHECKED_PATHS, KvTransferParamsCheck, request_params_problem


class _App:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        self.bodies.append(b"".join(chunks))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _call(body: bytes, *, method: str = "POST", chunk: int = 0,
          path: str = "/v1/completions") -> tuple[_App, list[dict[str, Any]]]:
    app, sent = _App(), []
    parts = [body[i:i + chunk] for i in range(0, len(body), chunk)] if chunk else [body]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(KvTransferParamsCheck(app)({"type": "http", "method": method, "path": path}, receive, send))
    return app, sent


@pytest.mark.parametrize("path", sorted(CHECKED_PATHS))
@pytest.mark.parametrize("value", ["yes", 1, 0, [], {}])
def test_a_bad_include_output_tokens_is_a_400_that_never_reaches_the_app(value: object, path: str) -> None:
    body = json.dumps({"prompt": "x", "kv_transfer_params": {"include_output_tokens": value}}).encode()
    app, sent = _call(body, chunk=7, path=path)
    assert app.bodies == [] and sent[0]["status"] == 400
    message = f"kv_transfer_params.include_output_tokens must be true or false, got {value!r}"
    assert json.loads(sent[1]["body"]) == ({"type": "error", "error": {"type": "invalid_request_error", "message": message}}
                                           if path == "/v1/messages" else {"error": {
        "message": message, "type": "BadRequestError", "param": "kv_transfer_params", "code": 400}})


@pytest.mark.parametrize("encode", [
    lambda d: json.dumps(d).replace("kv_transfer_params", "kv\\u005ftransfer_params").encode(),  # an escaped key
    lambda d: json.dumps(d).encode("utf-16"),
    lambda d: json.dumps(d).encode("utf-32-le"),
], ids=["escaped key", "utf-16", "utf-32-le"])
def test_the_key_spelled_or_encoded_another_way_is_checked_too(encode: Any) -> None:
    """JSON may escape any character of the key, and a body may be UTF-16 or -32: checked all the same."""
    body = encode({"prompt": "x", "kv_transfer_params": {"include_output_tokens": "yes"}})
    assert b"kv_transfer_params" not in body and json.loads(body)["kv_transfer_params"]
    app, sent = _call(body)
    assert app.bodies == [] and sent[0]["status"] == 400


@pytest.mark.parametrize("body", [
    {"prompt": "x"},
    {"prompt": "x", "kv_transfer_params": {"include_output_tokens": True}},
    {"prompt": "x", "kv_transfer_params": {"include_output_tokens": None, "hidden_states_path": "a.safetensors"}},
    {"prompt": "x", "kv_transfer_params": "not an object: vLLM answers it"},
    ["not", "an", "object"],
], ids=repr)
@pytest.mark.parametrize("chunk", [0, 5])
def test_any_other_request_reaches_the_app_with_its_body_as_it_came(body: Any, chunk: int) -> None:
    raw = json.dumps(body).encode()
    app, sent = _call(raw, chunk=chunk)
    assert app.bodies == [raw] and sent[0]["status"] == 200


def test_a_body_that_is_not_json_a_get_and_other_endpoints_reach_the_app() -> None:
    app, _ = _call(b'{"kv_transfer_params": {"include_output_tokens": "yes"')  # cut short: vLLM answers it
    assert len(app.bodies) == 1
    deep = b'{"kv_transfer_params": ' + b"[" * 200_000  # no parser takes it (RecursionError): vLLM answers it
    app, sent = _call(deep)
    assert app.bodies == [deep] and sent[0]["status"] == 200
    app, _ = _call(b"", method="GET")
    assert app.bodies == [b""]
    bad = json.dumps({"kv_transfer_params": {"include_output_tokens": "yes"}}).encode()
    app, _ = _call(bad, path="/tokenize")  # an endpoint that hands no kv_transfer_params to the engine
    assert app.bodies == [bad]


def test_a_large_body_is_checked_too() -> None:
    """Over a MiB (multimodal data), the body is parsed on a worker thread, with the same verdict."""
    body = json.dumps({"prompt": "x" * (2 << 20), "kv_transfer_params": {"include_output_tokens": "yes"}}).encode()
    app, sent = _call(body, chunk=1 << 16)
    assert app.bodies == [] and sent[0]["status"] == 400
    fine = body.replace(b'"yes"', b"true")
    app, sent = _call(fine, chunk=1 << 16)
    assert app.bodies == [fine] and sent[0]["status"] == 200


def test_the_problem_names_the_value() -> None:
    assert request_params_problem({"include_output_tokens": "no"}) == "include_output_tokens must be true or false, got 'no'"
    assert request_params_problem({"include_output_tokens": False}) is None
    assert request_params_problem(None) is None and request_params_problem({}) is None


def test_a_body_without_the_key_is_not_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Escapes elsewhere (a prompt's non-ASCII text, as ``json.dumps`` writes it) do not make the
    check parse a body that names no ``kv_transfer_params``: it goes to the app as it came."""
    from omni_cache.integration import request_check

    parsed: list[bytes] = []
    monkeypatch.setattr(request_check, "_problem", lambda body: parsed.append(body))
    raw = json.dumps({"prompt": "été, naïve \u2603", "kv_transfer": 1}).encode()
    assert b"\\u00e9" in raw
    app, sent = _call(raw)
    assert app.bodies == [raw] and sent[0]["status"] == 200 and parsed == []
