"""A served request's own delivery options, checked before vLLM takes the request.

Owns: ``request_params_problem`` (what is wrong with a request's ``kv_transfer_params`` for
delivery, or ``None``) and ``KvTransferParamsCheck``, an ASGI middleware that answers such a
request at once with HTTP 400 in the OpenAI error format, naming the key and the value, so the
request never runs. ``omni-cache serve`` installs it (vLLM's ``--middleware``); the scheduler side
(``delivery_sched``) applies the same check to a request that reaches the engine without it (a
server started without the middleware): that request runs and its response carries the reason as
``hidden_states_error``.

No torch, no vLLM: the API server process imports this by name. Upholds: a request whose body
names no ``kv_transfer_params`` (however the JSON spells or encodes the key), or to an endpoint
outside ``CHECKED_PATHS`` (those that run no engine request), is passed on untouched (its body is
read once and replayed as it came); only a JSON body whose ``kv_transfer_params`` object has a
bad delivery option is answered here (``/v1/messages`` in Anthropic's error format). NOTE: vLLM adds
``--middleware`` classes after its own, so this check runs before its API-key check: a request
with a bad option is answered 400 before it is authenticated (nothing runs for it either way).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["CHECKED_PATHS", "MIDDLEWARE", "KvTransferParamsCheck", "request_params_problem"]

MIDDLEWARE = "omni_cache.integration.request_check.KvTransferParamsCheck"
"""The import path vLLM's ``--middleware`` takes."""

# The key as JSON may spell it in UTF-8: each character itself or a ``\uXXXX`` escape of it.
_KEY = re.compile(b"".join(rb"(?:%s|\\u00%02x)" % (re.escape(bytes([c])), c) for c in b"kv_transfer_params"),
                  re.IGNORECASE)
_MARK = b"kv_transfer_params"  # the key as it is usually spelled
_WIDE = b"\x00"  # UTF-16 or UTF-32: a NUL byte in ASCII text
CHECKED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                           "/invocations", "/inference/v1/generate"})
"""The endpoints whose requests carry ``kv_transfer_params`` to the engine (SageMaker's
``/invocations`` forwards to the completions or chat route)."""
_INLINE_BYTES = 1 << 20  # bodies above this are parsed on a worker thread

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def request_params_problem(params: Any) -> str | None:
    """What is wrong with a request's ``kv_transfer_params`` for delivery (one sentence), or ``None``.

    ``include_output_tokens`` is true, false, or null (null or absent: the server's setting)."""
    if not isinstance(params, dict) or "include_output_tokens" not in params:
        return None
    include = params["include_output_tokens"]
    if include is None or isinstance(include, bool):
        return None
    return f"include_output_tokens must be true or false, got {include!r}"


class KvTransferParamsCheck:
    """ASGI middleware: a POST whose JSON body has a ``kv_transfer_params`` object with a bad
    delivery option is answered 400 (see the module docstring); anything else goes to ``app``."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in CHECKED_PATHS:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        while True:  # the whole body (vLLM reads it whole too), kept to replay as it came
            message = await receive()
            messages.append(message)
            if message.get("type") != "http.request" or not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in messages if m.get("type") == "http.request")
        # NOTE: a large body (multimodal data) is searched and parsed off the event loop
        problem = await asyncio.to_thread(_check, body) if len(body) > _INLINE_BYTES else _check(body)
        del body  # NOTE: the replayed messages are the only copy held while the request runs
        if problem is not None:
            await _bad_request(send, problem, anthropic=scope.get("path") == "/v1/messages")
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def _check(body: bytes) -> str | None:
    """``_problem`` of a body that may name the key (memchr-fast tests first; the per-character
    pattern only where the body has a ``\\u`` escape at all), else None."""
    if _MARK in body or _WIDE in body or (b"\\u" in body and _KEY.search(body) is not None):
        return _problem(body)
    return None


def _problem(body: bytes) -> str | None:
    try:
        request = json.loads(body)
    except Exception:  # not JSON, or JSON no parser takes (nested too deep): vLLM answers it
        return None
    params = request.get("kv_transfer_params") if isinstance(request, dict) else None
    problem = request_params_problem(params)
    return None if problem is None else f"kv_transfer_params.{problem}"


async def _bad_request(send: Send, message: str, *, anthropic: bool) -> None:
    error = ({"type": "error", "error": {"type": "invalid_request_error", "message": message}} if anthropic else
             {"error": {"message": message, "type": "BadRequestError", "param": "kv_transfer_params", "code": 400}})
    payload = json.dumps(error).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
