"""The cache in a served engine: a real ``omni-cache serve`` process on 127.0.0.1, real HTTP clients.

Protects, on vLLM's default multiprocess engine (API server, engine core and worker in their own
processes): every request's full-prompt hidden states leave the engine as a file in vLLM's
hidden-states format, read with vLLM's own ``load_hidden_states``, equal to the same prompt
recomputed with a fresh ``cache_salt`` (``check-server`` and an independent client), also for a
chat completion (the rows of its rendered prompt); file names
stay safe whatever ``X-Request-Id`` a client sends; a client-given path is ignored unless allowed;
a second server on the same delivery directory is refused at start; a full disk, a slow disk and a
missing directory fail only the requests they hit, with a clear
error in the response, and the server keeps answering; the cache's series on ``/metrics``
(scraped over HTTP, vLLM's default registry) equal the worker's own numbers read through
``/collective_rpc`` and what a prefix-sharing workload implies, and ``check-server`` reports them;
SIGTERM under load leaves no partial file and no unconsumed step id. One server serves the module
(its faults are keyed by request id).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from served_support import ServedEngine, load, metrics_matching_worker, params

from omni_cache.harness.served.launch import serve_command
from omni_cache.harness.served.process import ServerProcess, free_port
from omni_cache.integration.metrics import SERIES

pytestmark = pytest.mark.vllm

SLOW_S = 6.0
TIMEOUT_S = 2.0
PREFIX = ("The omni thinker hands its hidden states to the talker, and the talker speaks them. " * 3)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServedEngine:
    tmp = tmp_path_factory.mktemp("served")
    # --shutdown-timeout: SIGTERM drains the engine (vLLM's default, 0, may kill the engine process
    # before its worker shuts down, and the shutdown's log line with it)
    engine = ServedEngine(tmp, "--delivery-timeout", str(TIMEOUT_S), "--shutdown-timeout", "60",
                          env={"OMNI_CACHE_DELIVERY_FAULT": f"enospc@disk-full,slow:{SLOW_S:g}@slow-disk",
                               "VLLM_SERVER_DEV_MODE": "1"})  # /collective_rpc reads the worker's numbers
    yield engine
    engine.stop()


def test_check_server_passes_against_a_served_engine(server: ServedEngine) -> None:
    """The README's pair: ``check-server`` drives the server over HTTP (concurrent requests, prefix
    hits within a round and across rounds) and every file equals the cache_salt recomputation."""
    out = subprocess.run([sys.executable, "-m", "omni_cache.cli", "check-server", server.url, "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["ok"] and report["files_checked"] == report["requests"] == 18
    assert report["hit_requests"] > 0 and report["cached_tokens"] > 0
    assert report["cached_rows_matched_origin"] == report["cached_tokens"]
    assert report["control_caught"] and report["include_output_files"] > 0
    assert report["reader"] == "vllm load_hidden_states"
    metrics = report["metrics"]  # the cache's series, scraped before and after the run
    assert metrics["available"], metrics
    change = metrics["change"]
    assert change["vllm:omni_cache_delivered_files_total"] == 2 * report["requests"]  # each request and its truth
    assert change["vllm:omni_cache_hit_requests_total"] >= report["hit_requests"]
    assert change["vllm:omni_cache_hit_tokens_total"] >= report["cached_tokens"]
    assert change["vllm:omni_cache_hit_tokens_total"] >= change["vllm:prefix_cache_hits_total"] > 0
    assert change["vllm:omni_cache_delivery_failures_total"] == 0
    text = subprocess.run([sys.executable, "-m", "omni_cache.cli", "check-server", server.url, "--families", "1",
                           "--per-family", "2"], capture_output=True, text=True, timeout=600)
    assert text.returncode == 0, text.stdout + text.stderr[-3000:]
    assert "cache metrics on " + server.url + "/metrics" in text.stdout
    assert re.search(r"vllm:omni_cache_delivered_files_total +\+8 \(", text.stdout), text.stdout  # 4 + 4 truths


def test_an_independent_client_reads_rows_equal_to_the_recomputation(server: ServedEngine) -> None:
    """HTTP and vLLM's reader only: a prefix hit's file has one row per prompt token, equal bit for
    bit to the same prompt recomputed with a fresh cache_salt; cleanup_hidden_states removes it."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
    )

    first = server.complete(PREFIX + "first question")
    second = server.complete(PREFIX + "second question")
    truth = server.complete(PREFIX + "second question", cache_salt="independent-client-truth")
    p1, p2, pt = params(first), params(second), params(truth)
    assert p2["hidden_states_cached_tokens"] > 0, p2
    assert pt["hidden_states_cached_tokens"] == 0, pt
    got, want = load(p2["hidden_states_path"]), load(pt["hidden_states_path"])
    assert got["token_ids"].shape[0] == got["hidden_states"].shape[0] == second["usage"]["prompt_tokens"]
    assert torch.equal(got["token_ids"], want["token_ids"])
    assert torch.equal(got["hidden_states"], want["hidden_states"])
    assert not torch.equal(got["hidden_states"], torch.zeros_like(got["hidden_states"]))
    for path in (p1["hidden_states_path"], p2["hidden_states_path"], pt["hidden_states_path"]):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, "the rows encode the prompt: the server's user only"
        cleanup_hidden_states(path)
        assert not os.path.exists(path) and not os.path.exists(path + ".lock")
    assert stat.S_IMODE(os.stat(server.delivery_dir).st_mode) == 0o700


def test_a_chat_completion_delivers_the_rows_of_its_rendered_prompt(server: ServedEngine) -> None:
    """``/v1/chat/completions`` (the tiny model's chat template renders plain text): the file holds one
    row per token of the rendered prompt, equal bit for bit to the same text sent as a completion
    under a fresh ``cache_salt``."""
    from jinja2 import Template
    from tokenizers import Tokenizer

    from omni_cache.harness.served.launch import CHAT_TEMPLATE, tiny_llama_dir

    messages = [{"role": "system", "content": "You speak for the thinker."},
                {"role": "user", "content": "Chat with the talker: " + PREFIX}]
    body = json.dumps({"model": "tiny-llama", "messages": messages, "max_tokens": 3, "temperature": 0.0}).encode()
    request = urllib.request.Request(server.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=180) as response:
        chat = json.loads(response.read())
    rendered = Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    data = load(params(chat)["hidden_states_path"])
    tokenizer = Tokenizer.from_file(os.path.join(tiny_llama_dir(), "tokenizer.json"))
    assert data["token_ids"].tolist() == tokenizer.encode(rendered).ids  # the rendering, one token per byte
    assert data["hidden_states"].shape[0] == chat["usage"]["prompt_tokens"]
    plain = server.complete(rendered, cache_salt="chat-truth")
    assert torch.equal(load(params(plain)["hidden_states_path"])["hidden_states"], data["hidden_states"])


def test_a_second_server_on_the_same_delivery_directory_is_refused_at_start(server: ServedEngine,
                                                                             tmp_path: Path) -> None:
    """Two servers on one directory would count and remove each other's files. Started as vLLM's
    own server (no launcher to check first), the second one's output worker finds the directory
    held and the server exits during start, naming the setting; the first keeps serving files."""
    port = free_port()
    argv, env = serve_command("tiny-llama", ["--port", str(port)], delivery={"delivery_dir": str(server.delivery_dir)})
    with pytest.raises(RuntimeError, match="exited with"):
        ServerProcess(argv, port=port, log_path=tmp_path / "rival.log", env={**env, "VLLM_LOGGING_LEVEL": "INFO"},
                      start_timeout_s=420.0).stop()
    log = (tmp_path / "rival.log").read_text(errors="replace")
    refusal = f"omni_cache.delivery_dir: {server.delivery_dir} is the delivery directory of another running server"
    assert f"OmniKVConnector: {refusal}" in log, log[-3000:]
    again = server.complete("after the rival " + PREFIX)
    assert load(params(again)["hidden_states_path"])["hidden_states"].shape[0] == again["usage"]["prompt_tokens"]


@pytest.mark.parametrize("request_id", ["../../../../tmp/omni-escape", "/etc/omni-abs", "a/b/../../c",
                                        "x" * 3000, "..", "%00nul", "é\u202eunicode"])
def test_client_chosen_request_ids_never_leave_the_delivery_directory(server: ServedEngine, request_id: str) -> None:
    """vLLM takes ``X-Request-Id`` as the request id; the file's name is made safe from it: inside the
    delivery directory, one path component of bounded length, distinct for two requests with one id."""
    headers = {"X-Request-Id": request_id.encode("utf-8").decode("latin-1")}
    with cf.ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(lambda _: server.complete("hostile id " + PREFIX, headers=headers), range(2)))
    paths = [params(r)["hidden_states_path"] for r in responses]
    assert len(set(paths)) == 2, paths
    root = os.path.realpath(server.delivery_dir)
    for path in paths:
        assert os.path.dirname(os.path.realpath(path)) == root, path
        name = os.path.basename(path)
        assert len(name) < 128 and "/" not in name and not name.startswith("."), name
        assert load(path)["hidden_states"].shape[0] == responses[0]["usage"]["prompt_tokens"]
    assert not Path("/tmp/omni-escape.safetensors").exists() and not Path("/etc/omni-abs").exists()


def test_a_client_path_is_ignored_unless_the_operator_allows_it(server: ServedEngine, tmp_path: Path) -> None:
    """As vLLM's connector: without allow_custom_save_path a requested path is not honoured."""
    wanted = tmp_path / "client-chosen.safetensors"
    response = server.complete("custom path " + PREFIX, kv_transfer_params={"hidden_states_path": str(wanted)})
    path = params(response)["hidden_states_path"]
    assert not wanted.exists() and os.path.dirname(path) == os.path.realpath(server.delivery_dir)
    assert load(path)["hidden_states"].shape[0] == response["usage"]["prompt_tokens"]


@pytest.mark.parametrize("value", ["yes", 1])
def test_a_bad_delivery_option_is_a_400_before_the_request_runs(server: ServedEngine, value: object) -> None:
    """The API server's check (the launcher's ``--middleware``): a ``kv_transfer_params.include_output_tokens``
    that is not true, false or null is answered 400 naming it, in the OpenAI error format, on both
    endpoints; the request never runs (no file appears) and the server keeps serving."""
    import urllib.error

    before = sorted(os.listdir(server.delivery_dir))
    for endpoint, body in (("/v1/completions", {"prompt": "a bad option " + PREFIX}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a bad option"}]})):
        payload = {"model": "tiny-llama", "max_tokens": 2, **body, "kv_transfer_params": {"include_output_tokens": value}}
        request = urllib.request.Request(server.url + endpoint, data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=60)
        assert info.value.code == 400, endpoint
        error = json.loads(info.value.read())["error"]
        assert error == {"message": f"kv_transfer_params.include_output_tokens must be true or false, got {value!r}",
                         "type": "BadRequestError", "param": "kv_transfer_params", "code": 400}, error
    assert sorted(os.listdir(server.delivery_dir)) == before, "a refused request wrote something"
    after = server.complete("after a bad option " + PREFIX, kv_transfer_params={"include_output_tokens": None})
    assert load(params(after)["hidden_states_path"])["hidden_states"].shape[0] == after["usage"]["prompt_tokens"]


def test_a_full_disk_fails_that_request_and_the_server_keeps_serving(server: ServedEngine) -> None:
    response = server.complete("disk full " + PREFIX, headers={"X-Request-Id": "disk-full-1"})
    error = params(response).get("hidden_states_error", "")
    assert "No space left on device" in error and "disk-full-1" in error, params(response)
    assert "hidden_states_path" not in params(response)
    assert response["choices"][0]["text"] is not None  # the request itself completed
    after = server.complete("after the full disk " + PREFIX)
    assert load(params(after)["hidden_states_path"])["hidden_states"].shape[0] == after["usage"]["prompt_tokens"]
    assert server.healthy()


def test_a_slow_disk_is_a_bounded_wait_and_a_clear_error_never_an_engine_death(server: ServedEngine) -> None:
    """A file not written within delivery_timeout_s fails its request (the step waited that long,
    not the disk's time), is never published later, and the engine keeps serving."""
    t0 = time.monotonic()
    response = server.complete("slow disk " + PREFIX, headers={"X-Request-Id": "slow-disk-1"})
    waited = time.monotonic() - t0
    error = params(response).get("hidden_states_error", "")
    assert "delivery_timeout_s" in error and "slow-disk-1" in error, params(response)
    assert waited < SLOW_S + 30, waited
    after = server.complete("after the slow disk " + PREFIX)
    assert load(params(after)["hidden_states_path"])["hidden_states"].shape[0] == after["usage"]["prompt_tokens"]
    time.sleep(max(0.0, SLOW_S - (time.monotonic() - t0)) + 1.0)  # the slow write has finished by now
    published = [p for p in os.listdir(server.delivery_dir) if "slow-disk" in p and p.endswith(".safetensors")]
    assert published == [], "a file whose request was failed must never appear later"
    assert server.healthy()


def test_a_missing_delivery_directory_fails_requests_not_the_server(server: ServedEngine) -> None:
    shutil.rmtree(server.delivery_dir)
    response = server.complete("no directory " + PREFIX)
    assert "hidden_states_error" in params(response), params(response)
    assert server.healthy()
    os.makedirs(server.delivery_dir, mode=0o700)
    again = server.complete("directory back " + PREFIX)
    assert load(params(again)["hidden_states_path"])["hidden_states"].shape[0] == again["usage"]["prompt_tokens"]


def test_metrics_equal_the_workers_numbers_and_what_a_prefix_sharing_workload_implies(server: ServedEngine) -> None:
    """After a family of prompts sharing a long prefix (one first, three at once after it, one of
    them with output-token rows) and one request whose file fails (a full disk): every cache
    series on /metrics equals the worker's own numbers (``omni_cache_stats`` through
    ``/collective_rpc``), and their change covers the workload: the hit tokens at least the
    shared block-aligned prefix of each later request and at least vLLM's own prefix-cache hits,
    the rows saved exactly the tokens the engine computed, one file per request but the failed one."""
    before, _ = metrics_matching_worker(server.url)  # earlier tests' last steps have reached /metrics
    prefix = "metrics family: " + PREFIX  # the byte-level tokenizer: one token per byte, plus <s>
    shared = (1 + len(prefix)) // 32 * 32  # block-aligned tokens each later request shares
    first = server.complete(prefix + "first question?")
    with cf.ThreadPoolExecutor(3) as pool:
        later = list(pool.map(lambda i: server.complete(
            prefix + f"question {i}?", **({"kv_transfer_params": {"include_output_tokens": True}} if i == 1 else {})),
            range(3)))
    failed = server.complete("metrics disk full " + PREFIX, headers={"X-Request-Id": "disk-full-metrics"})
    assert "hidden_states_error" in params(failed)
    responses = [first, *later, failed]
    for response in (first, *later):
        load(params(response)["hidden_states_path"])  # every file is in place (output-token ones too)
    after, workers = metrics_matching_worker(server.url)
    (worker,) = workers
    assert worker["output_rank"] and worker["reports_metrics"]
    families = {k.split("{")[0].removesuffix("_total").removesuffix("_count").removesuffix("_sum") for k in after.samples}
    assert {s.name for s in SERIES} <= families
    change = after.delta(before)
    assert change["vllm:omni_cache_hit_requests_total"] >= 3
    assert change["vllm:omni_cache_hit_tokens_total"] >= 3 * shared
    assert change["vllm:omni_cache_hit_tokens_total"] >= change["vllm:prefix_cache_hits_total"] >= 3 * shared
    computed = sum(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] - 1 for r in responses)
    assert change["vllm:omni_cache_saved_tokens_total"] == computed - change["vllm:omni_cache_hit_tokens_total"]
    assert change["vllm:omni_cache_delivered_files_total"] == 4 and change["vllm:omni_cache_delivery_failures_total"] == 1
    assert change["vllm:omni_cache_delivery_latency_seconds_count"] == 4
    assert change["vllm:omni_cache_delivered_bytes_total"] == sum(
        os.path.getsize(params(r)["hidden_states_path"]) for r in (first, *later))
    assert after.samples["vllm:omni_cache_staging_slots_in_use"] == 0  # idle: every step id consumed
    assert after.samples["vllm:omni_cache_staging_wait_seconds_sum"] == 0  # the worker consumes at once
    assert sum(v for k, v in after.samples.items() if k.startswith("vllm:omni_cache_errors_total")) == 0


def test_an_abandoned_include_output_tokens_request_is_a_delivery_failure_on_metrics(server: ServedEngine) -> None:
    """A streaming client that leaves makes vLLM abort its request; with include_output_tokens its file
    was still due, so the scheduler side answers ``hidden_states_error`` (the worker is only told to
    drop the request's rows) and /metrics counts the failure beside the worker's own."""
    from served_support import worker_stats

    from omni_cache.harness.served.scrape import scrape_metrics

    key = "vllm:omni_cache_delivery_failures_total"
    before, (worker,) = metrics_matching_worker(server.url)
    body = {"model": "tiny-llama", "prompt": "abandoned " + PREFIX, "max_tokens": 1500, "stream": True,
            "ignore_eos": True, "kv_transfer_params": {"include_output_tokens": True}}
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.readline()  # the first chunk: the request runs; then the client leaves
    deadline = time.monotonic() + 60
    while scrape_metrics(server.url).samples[key] < before.samples[key] + 1:
        assert time.monotonic() < deadline, "the abandoned request's delivery failure never reached /metrics"
        time.sleep(0.5)
    assert scrape_metrics(server.url).samples[key] == before.samples[key] + 1
    assert worker_stats(server.url)[0]["delivery"]["failures"] == worker["delivery"]["failures"]  # not the worker's
    metrics_matching_worker(server.url, scheduler_failures=1)  # every other series still the worker's
    assert server.healthy()


def test_sigterm_under_load_leaves_no_partial_file_and_no_unconsumed_step(server: ServedEngine) -> None:
    """Runs last: SIGTERM while requests are in flight; every file that exists is whole, no
    temporary file is left, and the worker's cache reports 0 unconsumed step ids at shutdown."""
    prompts = [f"load {i} " + PREFIX * 2 for i in range(10)]
    # NOTE: the server drains its engine first (--shutdown-timeout 60), then waits for open HTTP
    # connections to close; a request cut off by the stop never answers, so the clients give up
    # after 30 s and the server's exit is awaited well past that.
    with cf.ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(server.complete, p, max_tokens=32, timeout_s=30.0) for p in prompts]
        cf.wait(futures, timeout=120, return_when=cf.FIRST_COMPLETED)
        server.terminate()
        server.wait(300.0)
    names = os.listdir(server.delivery_dir)
    assert not [n for n in names if ".omni-tmp-" in n], names
    whole = 0
    for name in names:
        if name.endswith(".safetensors"):
            data = load(os.path.join(server.delivery_dir, name))
            assert data["hidden_states"].shape[0] == data["token_ids"].shape[0] > 0, name
            whole += 1
    assert whole > 0
    log = server.log()
    assert "0 unconsumed step ids" in log, log[-3000:]
    assert "unconsumed step ids:" not in log
