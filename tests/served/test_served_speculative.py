"""I14 in a served engine: speculative decoding under ``omni-cache serve``, checked over HTTP.

Protects, on a real ``omni-cache serve tiny-llama`` process (vLLM's default multiprocess
engine) started with vLLM's own ``--speculative-config`` (n-gram drafts, passed through):
``check-server`` still exits 0 with output-token files (``include_output_tokens``: rows of
tokens computed in verify steps); and a client whose prompts hold traps (repeated n-grams
built from the thinker's own token chains, read over HTTP first) makes the proposer draft
tokens the model rejects -- vLLM's ``/metrics`` must count rejected drafts -- while every
delivered file holds exactly one row per token but the last (prompt and output tokens,
``token_ids`` equal to the request's), each equal to the same tokens recomputed as one prompt
with a fresh ``cache_salt`` (a prefill: no draft token in its forward): prompt rows bit for bit,
output-token rows within the served check's output tolerance (decode and verify steps are not
batch-invariant on CPU). A rejected draft's row in a file would differ from that recomputation.
And the cache's ``/metrics`` series equal the worker's own numbers after those steps (vLLM takes a
speculative step's connector stats before the step's files are done).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import urllib.request

import pytest
from served_support import ServedEngine, complete, load, metrics_matching_worker, params

from omni_cache.harness.vllm_engine.speculative import probe_chains, trapped

pytestmark = pytest.mark.vllm

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
BYTE_TOKENS = (3, 259)  # the tiny-llama tokenizer's byte symbols
OUTPUT_TOLERANCE = 1e-5  # check-server's default for output-token rows


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServedEngine:
    engine = ServedEngine(tmp_path_factory.mktemp("served-spec"), "--speculative-config", json.dumps(SPEC),
                          name="spec-server", env={"VLLM_SERVER_DEV_MODE": "1"})  # /collective_rpc: the worker's numbers
    yield engine
    engine.stop()


def _drafts(server: ServedEngine) -> tuple[float, float]:
    """vLLM's own counters on /metrics: draft tokens scheduled, accepted."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"):
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values.get("vllm:spec_decode_num_draft_tokens_total", 0.0), \
        values.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)


def test_check_server_passes_with_speculative_decoding(server: ServedEngine) -> None:
    out = subprocess.run([sys.executable, "-m", "omni_cache.cli", "check-server", server.url, "--max-tokens", "16",
                          "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["ok"] and report["files_checked"] == report["requests"]
    assert report["hit_requests"] > 0 and report["include_output_files"] > 0
    assert report["cached_rows_matched_origin"] == report["cached_tokens"] > 0
    drafts, _ = _drafts(server)
    assert drafts > 0, "vLLM scheduled no draft token: the run did not decode speculatively"


def test_I14_files_hold_the_requests_rows_only_while_drafts_are_rejected(server: ServedEngine) -> None:
    import torch

    rng = random.Random(7)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [complete(server.url, p, max_tokens=max_tokens, return_token_ids=True)["choices"][0]["token_ids"]
                for p in prompts]  # type: ignore[arg-type]

    chains = probe_chains(generate, rng.sample(range(*BYTE_TOKENS), 6))
    drafts0, accepted0 = _drafts(server)
    shared = [rng.randrange(*BYTE_TOKENS) for _ in range(64)]  # two full blocks: later requests hit them
    checked = 0
    for i, chain in enumerate(list(chains.values()) * 2):  # the second round hits the first's blocks too
        prompt = trapped(shared + [rng.randrange(*BYTE_TOKENS) for _ in range(40)], chain, keep=64,
                         vocab=BYTE_TOKENS[1], first_token=BYTE_TOKENS[0])
        got = complete(server.url, prompt, max_tokens=24, return_token_ids=True,  # type: ignore[arg-type]
                       kv_transfer_params={"include_output_tokens": True})
        tokens = [*prompt, *got["choices"][0]["token_ids"]]
        file = load(params(got)["hidden_states_path"])
        assert file["token_ids"].tolist() == tokens[:-1], f"request {i}: one row per token but the last"
        assert file["hidden_states"].shape[0] == len(tokens) - 1
        truth = complete(server.url, tokens[:-1], max_tokens=1, cache_salt=f"spec-truth-{i}")  # type: ignore[arg-type]
        assert params(truth).get("hidden_states_cached_tokens") == 0, params(truth)
        want = load(params(truth)["hidden_states_path"])["hidden_states"][: len(tokens) - 1]
        rows = file["hidden_states"]
        assert torch.equal(rows[: len(prompt)], want[: len(prompt)]), f"request {i}: prompt rows differ"
        for p in range(len(prompt), len(tokens) - 1):
            rel = ((rows[p] - want[p]).abs().max() / want[p].abs().max()).item()
            assert rel <= OUTPUT_TOLERANCE, f"request {i}: output-token row {p} differs by {rel:.3g} of its scale"
            checked += 1
    drafts, accepted = _drafts(server)
    assert drafts - accepted > drafts0 - accepted0, "no draft token was rejected: the traps did not work"
    assert checked > 0
    # vLLM takes a speculative step's connector stats before the step's files are done: the cache's
    # series must still reach /metrics with the step (the last step's file included), equal to the worker's.
    _, workers = metrics_matching_worker(server.url)
    assert workers[0]["delivery"]["files"] >= 2 * 2 * len(chains)  # each trap request and its recomputation
