"""A real served engine for tests: ``omni-cache serve`` as a server process on 127.0.0.1.

``ServedEngine`` starts ``python -m omni_cache.cli serve tiny-llama --port P --delivery-dir D``
(vLLM's default multiprocess engine: API server, engine core and worker processes) as the
harness's ``ServerProcess``: its own process group, a wait for ``/health``, a stop by SIGTERM
(then SIGKILL), the log kept. ``complete`` is a real HTTP client (stdlib ``urllib``): it POSTs to ``/v1/completions``.
Files are read with vLLM's own ``load_hidden_states``. ``worker_stats`` reads every worker's
``omni_cache_stats`` through vLLM's dev-mode ``/collective_rpc`` (the server needs
``VLLM_SERVER_DEV_MODE=1``); ``expected_series`` maps one worker's numbers to the ``/metrics``
samples they must equal -- written out here, independently of the package's own mapping -- and
``metrics_matching_worker`` waits (bounded) until a scrape equals them.
"""

from __future__ import annotations

import json
import sys
import time
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


def post_json(url: str, body: dict[str, Any], timeout_s: float = 60.0) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        raw = response.read()
    return json.loads(raw) if raw else None


def worker_stats(url: str) -> list[dict[str, Any]]:
    """Every worker's ``omni_cache_stats`` (rank order), through the served engine's ``/collective_rpc``."""
    return post_json(url + "/collective_rpc", {"method": "omni_cache_stats"})["results"]


def expected_series(worker: dict[str, Any]) -> dict[str, float]:
    """The ``/metrics`` samples one worker's numbers (``omni_cache_stats``) make, as docs/metrics.md says
    (``delivery_failures``: the worker's part; ``metrics_matching_worker`` adds the scheduler's)."""
    from omni_cache.runtime.errors import ERROR_KINDS

    stats, tier, delivery = worker["manager"], worker["tier"], worker["delivery"]
    assert stats is not None, "the worker's cache starts at the first engine step: send a request first"
    staging = stats["staging"]
    p = "vllm:omni_cache_"
    return {
        p + "saved_tokens_total": stats["saved_rows"], p + "hit_tokens_total": stats["hit_tokens"],
        p + "hit_requests_total": stats["hits"], p + "failed_writes_total": stats["writes_failed"],
        p + "tier_stores_total": tier["tier_stored_blocks"],
        p + "tier_loads_total": tier["tier_restored_blocks"] + tier["tier_load_failures"],
        p + "tier_restores_total": stats["tier_restores"], p + "tier_evictions_total": tier["tier_evictions"],
        p + "tier_load_failures_total": tier["tier_load_failures"],
        p + "delivered_files_total": delivery["files"], p + "delivered_bytes_total": delivery["bytes"],
        p + "delivery_failures_total": delivery["failures"],
        p + "staging_slots_in_use": staging["depth"] - staging["slots"]["free"], p + "staging_depth": staging["depth"],
        p + "pool_bytes": sum(stats["pool_bytes"].values()), p + "staging_bytes": sum(staging["page_bytes"].values()),
        p + "writes_in_flight": stats["writes_in_flight"], p + "tier_bytes": tier["tier_bytes"],
        p + "staging_wait_seconds_count": staging["claims"], p + "delivery_latency_seconds_count": delivery["files"],
        **{p + f'errors_total{{kind="{kind}"}}': worker["errors"][kind] for kind in ERROR_KINDS},
    }


def metrics_matching_worker(url: str, rank: int = 0, timeout_s: float = 30.0, *,
                            scheduler_failures: int = 0) -> tuple[Any, list[dict[str, Any]]]:
    """The scrape of ``/metrics`` and the workers' numbers once every sample ``expected_series``
    names equals worker ``rank``'s (the engine's last steps reach the API server a moment after
    their outputs); an ``AssertionError`` listing the differences if they never do.
    ``scheduler_failures``: the delivery failures the scheduler answered on this server so far (a
    request that ended before its file), which /metrics adds to the worker's own."""
    from omni_cache.harness.served.scrape import scrape_metrics

    deadline = time.monotonic() + timeout_s
    while True:
        scrape = scrape_metrics(url)
        workers = worker_stats(url)
        assert scrape.available, scrape.note
        want = expected_series(workers[rank])
        want["vllm:omni_cache_delivery_failures_total"] += scheduler_failures
        diff = {k: (scrape.samples.get(k), v) for k, v in want.items() if scrape.samples.get(k) != v}
        if not diff:
            return scrape, workers
        if time.monotonic() > deadline:
            raise AssertionError(f"/metrics (got, worker's) differ after {timeout_s:.0f} s: {diff}")
        time.sleep(0.5)
