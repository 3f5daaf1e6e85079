"""A real served engine for tests: ``omni-cache serve`` as a server process on 127.0.0.1.

``ServedEngine`` starts ``python -m omni_cache.cli serve tiny-llama --port P --delivery-dir D``
(vLLM's default multiprocess engine: API server, engine core and worker processes) as the
harness's ``ServerProcess``: its own process group, a wait for ``/health``, a stop by SIGTERM
(then SIGKILL), the log kept. ``complete`` is a real HTTP client (stdlib ``urllib``): it POSTs to ``/v1/completions``.
Files are read with vLLM's own ``load_hidden_states``.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from vllm_support import require_vllm

from omni_cache.harness.served.process import ServerProcess, free_port

START_TIMEOUT_S = 420.0


class ServedEngine(ServerProcess):
    """``omni-cache serve tiny-llama`` (plus ``args``) on a free port, files in ``tmp/<name>-files``."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None, name: str = "server") -> None:
        require_vllm()
        port = free_port()
        self.delivery_dir = tmp / f"{name}-files"
        argv = [sys.executable, "-m", "omni_cache.cli", "serve", "tiny-llama", "--port", str(port),
                "--delivery-dir", str(self.delivery_dir), *args]
        # vLLM's default, the multiprocess engine: no in-process switch inherited from other tests
        full_env: dict[str, str | None] = {"VLLM_LOGGING_LEVEL": "INFO", "VLLM_ENABLE_V1_MULTIPROCESSING": None,
                                           **(env or {})}
        try:
            super().__init__(argv, port=port, log_path=tmp / f"{name}.log", env=full_env,
                             start_timeout_s=START_TIMEOUT_S)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None

    def wait(self, timeout_s: float = 120.0) -> int:
        try:
            return super().wait(timeout_s)
        except TimeoutError as exc:
            raise AssertionError(str(exc)) from None

    def complete(self, prompt: str, *, max_tokens: int = 4, headers: dict[str, str] | None = None,
                 timeout_s: float = 180.0, **body: Any) -> dict[str, Any]:
        return complete(self.url, prompt, max_tokens=max_tokens, headers=headers, timeout_s=timeout_s, **body)


def complete(url: str, prompt: str, *, max_tokens: int = 4, headers: dict[str, str] | None = None,
             timeout_s: float = 180.0, **body: Any) -> dict[str, Any]:
    payload = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **body}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"HTTP {exc.code}: {exc.read()[:500]!r}") from None


def params(response: dict[str, Any]) -> dict[str, Any]:
    return response.get("kv_transfer_params") or {}


def load(path: str) -> dict[str, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    return load_hidden_states(path)
