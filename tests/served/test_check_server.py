"""``omni-cache check-server``'s own checks: they pass what is right and catch what is wrong.

Protected first: the checker cannot pass a server that delivers wrong rows. ``compare_rows``
flags the first row that differs (bit for bit, or beyond a relative tolerance; a shape mismatch
is row 0); run against a server over real HTTP, a correct server passes (exit 0: every file
checked, prefix hits, every cached row traced to the row its family computed, the negative
control caught), and each way of being wrong fails (exit 1): a perturbed cached row, a hit whose
claimed cached rows match no other request of its family (the origin check), a response without a
file; a server without prefix hits is clean but incomplete (exit 3), an unreachable one is one
error line (exit 1). The server here is a small stand-in that speaks the completions API and
writes files the way the omni cache does (rows a function of the tokens up to each position,
hits at block granularity, one ``.lock`` per file), so that each fault can be injected on
purpose; the real server is checked by ``check-server`` in the served tests.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from omni_cache.cli import main
from omni_cache.harness.served.check import compare_rows

BS = 16
WIDTH = 8
_MOD = (1 << 31) - 1


# ---------------------------------------------------------------------------------- compare_rows
def test_equal_rows_pass_bit_for_bit() -> None:
    rows = torch.randn(6, WIDTH)
    assert compare_rows(rows, rows.clone(), 0.0) == (0.0, None)


def test_the_first_differing_row_is_named() -> None:
    truth = torch.randn(6, WIDTH)
    rows = truth.clone()
    rows[4, 3] = torch.nextafter(rows[4, 3], torch.tensor(float("inf")))  # one ulp
    rows[5] += 1.0
    rel, bad = compare_rows(rows, truth, 0.0)
    assert bad == 4 and rel > 0


def test_a_tolerance_passes_small_relative_differences_and_flags_larger_ones() -> None:
    truth = torch.full((3, WIDTH), 100.0)
    rows = truth.clone()
    rows[1, 0] += 1e-4  # 1e-6 of the row's scale
    assert compare_rows(rows, truth, 1e-5)[1] is None
    rows[2, 0] += 2e-3  # 2e-5: just past the tolerance
    rel, bad = compare_rows(rows, truth, 1e-5)
    assert bad == 2 and rel == pytest.approx(2e-5, rel=1e-3)


def test_a_row_of_zeros_in_the_truth_is_never_matched_by_a_different_row() -> None:
    truth = torch.zeros(2, WIDTH)
    rows = truth.clone()
    rows[1, 0] = 1e-30
    assert compare_rows(rows, truth, 0.5)[1] == 1


def test_a_shape_mismatch_is_a_difference_at_row_0() -> None:
    assert compare_rows(torch.zeros(5, WIDTH), torch.zeros(6, WIDTH), 0.0)[1] == 0
    assert compare_rows(torch.zeros(5, WIDTH), torch.zeros(5, WIDTH + 1), 1e-3)[1] == 0


# ------------------------------------------------------------------------ a server to check
def _rows(ids: list[int]) -> torch.Tensor:
    """Row ``p`` is a function of tokens ``[0, p]`` (as a model's hidden state is)."""
    h, out = 0, []
    for p, t in enumerate(ids):
        h = (h * 1000003 + t + 1) % _MOD
        out.append([float(h % 4093), float(p), float((h // 4093) % 4091), float(t)] + [float((h >> k) % 97)
                                                                                       for k in range(WIDTH - 4)])
    return torch.tensor(out, dtype=torch.float32)


class FakeServer:
    """The completions API with hidden-state files, and one ``fault``:
    ``None`` (correct), ``"perturb_hit"`` (a hit's cached row 1 is off), ``"overclaim"`` (a hit
    claims more cached rows than its family shares), ``"no_hits"``, ``"no_file"`` (a hit's
    response names no file), ``"never_file"`` (no response names a file), ``"short_hit"`` (a hit's file lacks its cached rows and their ids, the
    shape of vLLM issue 44485), ``"bad_ids"`` (a hit's file has a wrong token id), ``"not_vllm"``
    (HTML, not JSON), ``"no_models"`` (an empty model list), ``"include_default"`` (not a fault:
    output-token rows unless a request says otherwise, as ``--include-output-tokens``)."""

    def __init__(self, directory: Path, fault: str | None = None) -> None:
        self.directory, self.fault = directory, fault
        self.seen: set[tuple[Any, ...]] = set()
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if server.fault == "not_vllm":  # another web server on the port
                    self.send_response(200)
                    self.send_header("Content-Length", "13")
                    self.end_headers()
                    self.wfile.write(b"<html></html>")
                    return
                self._reply({"object": "list", "data": [] if server.fault == "no_models" else [{"id": "fake-model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._reply(server.complete(body))

            def _reply(self, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                return None

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = [b + 3 for b in body["prompt"].encode()]
        n, max_tokens, salt = len(ids), int(body["max_tokens"]), body.get("cache_salt")
        include = (body.get("kv_transfer_params") or {}).get("include_output_tokens")
        if include is None:  # the server's default: "include_default" is a server started with --include-output-tokens
            include = self.fault == "include_default"
        outputs = [3 + (sum(ids) * 31 + k * 7) % 26 + 94 for k in range(max_tokens)]
        with self.lock:  # prefix caching: full blocks seen before, never the last token
            cached = 0
            for end in range(BS, n, BS):
                if (salt, *ids[:end]) in self.seen:
                    cached = end
            self.seen.update((salt, *ids[:end]) for end in range(BS, n + 1, BS))
        if self.fault == "no_hits":
            cached = 0
        all_ids = ids + (outputs[:-1] if include else [])
        rows = _rows(all_ids)
        params: dict[str, Any] = {"hidden_states_cached_tokens": cached, "hidden_states_num_tokens": len(all_ids)}
        if cached and self.fault == "perturb_hit":
            rows[1] += 0.5
        if cached and self.fault == "overclaim":
            params["hidden_states_cached_tokens"] = (n - 1) // BS * BS
        token_ids = torch.tensor(all_ids, dtype=torch.long)
        if cached and self.fault == "short_hit":
            rows, token_ids = rows[cached:], token_ids[cached:]
        if cached and self.fault == "bad_ids":
            token_ids[-1] += 1
        if not (cached and self.fault == "no_file") and self.fault != "never_file":
            path = str(self.directory / f"{uuid.uuid4().hex}.safetensors")
            save_file({"hidden_states": rows, "token_ids": token_ids}, path)
            Path(path + ".lock").touch()
            params["hidden_states_path"] = path
        return {"id": "cmpl-x", "model": "fake-model", "kv_transfer_params": params,
                "choices": [{"index": 0, "text": bytes(o - 3 for o in outputs).decode(), "finish_reason": "length"}],
                "usage": {"prompt_tokens": n, "completion_tokens": max_tokens, "total_tokens": n + max_tokens}}


@pytest.fixture
def serve(tmp_path: Path):
    servers: list[FakeServer] = []

    def start(fault: str | None = None) -> FakeServer:
        servers.append(FakeServer(tmp_path, fault))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _check(url: str, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any]]:
    code = main(["check-server", url, "--json", "--families", "2", "--per-family", "3", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_a_correct_server_passes_every_check(serve, capsys, tmp_path: Path) -> None:
    server = serve()
    code, report = _check(server.url, capsys)
    assert code == 0 and report["ok"] and report["problems"] == []
    assert report["requests"] == report["files_checked"] == 12 and report["include_output_files"] == 3
    assert report["hit_requests"] >= 6 and report["cached_tokens"] == report["cached_rows_matched_origin"] > 0
    assert report["control_caught"] and report["model"] == "fake-model" and report["max_rel_diff"] == 0.0
    assert [n for n in os.listdir(tmp_path) if n.endswith(".safetensors")] == []  # read, then cleaned up


def test_kept_files_stay(serve, capsys, tmp_path: Path) -> None:
    code, _ = _check(serve().url, capsys, "--keep-files")
    assert code == 0 and len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) == 24  # + the truths


def test_a_perturbed_cached_row_is_caught(serve, capsys) -> None:
    code, report = _check(serve("perturb_hit").url, capsys)
    assert code == 1 and not report["ok"] and report["problems"]
    assert all("hidden_states row 1 (a cached prefix row) differs from the ground truth" in p
               for p in report["problems"])


def test_a_hit_whose_rows_match_no_family_member_is_caught(serve, capsys) -> None:
    code, report = _check(serve("overclaim").url, capsys)
    assert code == 1 and report["problems"] and report["cached_rows_matched_origin"] < report["cached_tokens"]
    assert any("are not bit for bit the rows of any other request of its family" in p for p in report["problems"])


def test_a_file_without_its_cached_rows_is_caught(serve, capsys) -> None:
    code, report = _check(serve("short_hit").url, capsys)
    assert code == 1 and report["problems"]
    assert all("rows and" in p and "token ids, expected" in p for p in report["problems"])


def test_a_file_with_a_wrong_token_id_is_caught(serve, capsys) -> None:
    code, report = _check(serve("bad_ids").url, capsys)
    assert code == 1 and report["problems"] and all("token_ids differ" in p for p in report["problems"])


def test_a_checker_that_cannot_see_a_difference_fails_its_negative_control(serve, capsys, monkeypatch) -> None:
    from omni_cache.harness.served import check

    monkeypatch.setattr(check, "compare_rows", lambda rows, truth, tolerance: (0.0, None))  # a blind comparison
    code, report = _check(serve().url, capsys)
    assert code == 1 and not report["control_caught"]
    assert any("negative control: a perturbed prefix row" in p and "was not caught" in p for p in report["problems"])


def test_a_response_without_a_file_is_caught(serve, capsys) -> None:
    code, report = _check(serve("no_file").url, capsys)
    assert code == 1 and report["files_checked"] < report["requests"]
    assert any("no hidden_states_path in kv_transfer_params" in p for p in report["problems"])


def test_a_server_that_names_no_file_claims_no_equality(serve, capsys) -> None:
    """Nothing compared is said as such, never as rows "equal bit for bit"; the run fails."""
    code = main(["check-server", serve("never_file").url, "--families", "1", "--per-family", "2"])
    out = capsys.readouterr().out
    assert code == 1 and "files checked against the cache_salt recomputation: 0 " in out
    assert "prompt rows equal to the recomputation: none compared (no file was checked)" in out
    assert "bit for bit (largest" not in out and out.rstrip().splitlines()[-1].startswith("FAILED")


def test_a_server_without_prefix_hits_is_clean_but_incomplete(serve, capsys) -> None:
    code = main(["check-server", serve("no_hits").url, "--families", "1", "--per-family", "2"])
    out = capsys.readouterr().out
    assert code == 3 and "NO HITS" in out and "negative control (a perturbed prefix row): caught" in out


def test_an_unreachable_server_is_one_error_line(capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    code = main(["check-server", f"http://127.0.0.1:{port}", "--timeout", "5"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and err.startswith("omni-cache check-server: error: GET ")


def test_a_loose_tolerance_still_catches_its_negative_control(serve, capsys) -> None:
    """The control's perturbation grows with ``--tolerance``: every offered tolerance can pass a
    correct server (before: any tolerance over 1e-3 failed its control)."""
    for tolerance in ("0.01", "1"):
        code, report = _check(serve().url, capsys, "--tolerance", tolerance)
        assert code == 0 and report["control_caught"] and report["tolerance"] == float(tolerance)


@pytest.mark.parametrize(("fault", "says"), [("not_vllm", "the answer is not a JSON object"),
                                             ("no_models", "lists no model")])
def test_a_server_that_is_not_vllm_is_one_error_line(serve, capsys, fault: str, says: str) -> None:
    code = main(["check-server", serve(fault).url, "--timeout", "5"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and says in err and "is this vLLM's OpenAI server" in err


def test_a_server_that_includes_output_tokens_by_default_passes(serve, capsys) -> None:
    """A server started with ``--include-output-tokens``: the checker says which requests are
    prompt-only instead of taking the server's default (before: every prompt-only file was "too long")."""
    code, report = _check(serve("include_default").url, capsys)
    assert code == 0 and report["ok"] and report["hit_requests"] >= 6, report["problems"]
    assert report["include_output_files"] == 3
