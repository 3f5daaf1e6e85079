"""``omni-cache check-server``: a running server, checked over HTTP against its own ground truth.

Owns: ``ServerCheck`` (the workload, the checks and the report) and its pieces: the prompts
(families that share long prefixes: within a batch, sent concurrently, and across time, a
second round after the first), the HTTP client (stdlib ``urllib``, one thread per request in
flight), the ground truth (every prompt again with a fresh ``cache_salt``, so the server
recomputes it whole: no prefix cache, no omni cache rows), the file checks (each delivered file
read with vLLM's own ``load_hidden_states``, else safetensors: ``token_ids`` equal to the
truth's, one row per token, every prompt row equal to the truth's bit for bit, and every
output-token row within ``output_tolerance``: decode steps batch a request with whatever else
runs, and vLLM's CPU kernels are not batch-invariant there, so the last bits of a decode row may
differ from the recomputation's; a prompt row computed in a prefill chunk is exact), the origin
check (every cached prefix row is bit for bit the row that another request of its family
computed at that position: a hit serves copies, never recomputations, never another tenant's
rows) and the negative control (one prefix row of a checked file perturbed: the same checks
must catch it, or the checker proves nothing). The server's ``/metrics`` is read before and
after the run, and the report carries the cache's series (their totals and their change during
the run) beside what it checked, or says why there are none. Works against any server the omni cache serves, the
built-in ``tiny-llama`` or a real model (text prompts, the model name read from ``/v1/models``).

Upholds: nothing itself; it is the outside view of I4/I6/I7 for a served engine: what a client
reads is the full prompt's rows, never a stale tenant's, never zeros.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import random
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

from omni_cache.harness.served.scrape import metrics_section, scrape_settled

__all__ = ["CheckConfig", "CheckReport", "ServerCheck"]

_WORDS = ("omni", "thinker", "talker", "audio", "vision", "prefix", "cache", "block", "token", "hidden", "state",
          "stage", "engine", "serve", "batch", "slot", "row", "tenant", "write", "read", "merge", "step", "model")


@dataclass(frozen=True)
class CheckConfig:
    url: str
    families: int = 3  # prompts that share a prefix form a family
    per_family: int = 3  # requests per family and round
    prefix_words: int = 40
    max_tokens: int = 4
    concurrency: int = 6
    include_output_every: int = 4  # every n-th request asks include_output_tokens
    seed: int = 0
    tolerance: float = 0.0  # prompt rows: largest |diff| / max |row| still equal; 0: bit for bit
    output_tolerance: float = 1e-5  # output-token rows (decode steps are not batch-invariant on CPU)
    timeout_s: float = 120.0
    keep_files: bool = False


@dataclass
class FileCheck:
    name: str
    path: str | None
    tokens: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    max_rel_diff: float = 0.0
    problem: str | None = None


@dataclass
class CheckReport:
    url: str
    model: str = ""
    requests: int = 0
    files_checked: int = 0
    rows_checked: int = 0
    hit_requests: int = 0
    cached_tokens: int = 0
    include_output_files: int = 0
    max_rel_diff: float = 0.0
    max_output_rel_diff: float = 0.0
    tolerance: float = 0.0
    output_tolerance: float = 0.0
    cached_rows_matched_origin: int = 0
    control_caught: bool = False
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    reader: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)  # the cache's /metrics: scrape.metrics_section

    @property
    def ok(self) -> bool:
        return not self.problems and self.control_caught and self.files_checked == self.requests

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


class HttpError(RuntimeError):
    pass


def _post(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return _json_of("POST", request, timeout_s)


def _get(url: str, timeout_s: float) -> dict[str, Any]:
    return _json_of("GET", urllib.request.Request(url), timeout_s)


def _json_of(method: str, request: urllib.request.Request, timeout_s: float) -> dict[str, Any]:
    """The JSON object a request answers; every other answer is one ``HttpError`` naming it."""
    what = f"{method} {request.full_url}"
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        raise HttpError(f"{what}: HTTP {exc.code}: {exc.read()[:300]!r}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise HttpError(f"{what}: {exc}") from None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise HttpError(f"{what}: the answer is not a JSON object ({raw[:120]!r}): is this vLLM's OpenAI server?")
    return doc


def _reader() -> tuple[str, Any, Any]:
    """vLLM's own reader and cleanup when vLLM is installed, else safetensors' (same files)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        return "vllm load_hidden_states", load_hidden_states, cleanup_hidden_states
    except ImportError:
        import os

        from safetensors.torch import load_file

        def cleanup(path: str) -> None:
            for p in (path, path + ".lock"):
                if os.path.exists(p):
                    os.remove(p)

        return "safetensors load_file", lambda p: load_file(p, device="cpu"), cleanup


def compare_rows(rows: Any, truth: Any, tolerance: float) -> tuple[float, int | None]:
    """(largest per-row |diff| / max |truth row|, the first row over ``tolerance`` or ``None``)."""
    import torch

    if rows.shape != truth.shape:
        return math.inf, 0
    if tolerance == 0.0:
        equal = (rows == truth).all(dim=-1) if rows.dim() > 1 else rows == truth
        bad = (~equal).nonzero().flatten()
        diff = (rows.float() - truth.float()).abs().max().item() if rows.numel() else 0.0
        scale = truth.float().abs().max().item() or 1.0
        return diff / scale, (int(bad[0]) if len(bad) else None)
    diff = (rows.float() - truth.float()).abs().reshape(rows.shape[0], -1).max(dim=1).values
    scale = truth.float().abs().reshape(truth.shape[0], -1).max(dim=1).values.clamp_min(torch.finfo(torch.float32).tiny)
    rel = diff / scale
    bad = (rel > tolerance).nonzero().flatten()
    return float(rel.max().item()) if len(rel) else 0.0, (int(bad[0]) if len(bad) else None)


class ServerCheck:
    """Drive ``config.url`` and check what it delivers (see the module docstring)."""

    def __init__(self, config: CheckConfig) -> None:
        self.config = config
        self.base = config.url.rstrip("/")
        self.rng = random.Random(config.seed)
        self.run_tag = f"{config.seed}-{int(time.time() * 1000)}"
        self._output_diff = 0.0

    # ----------------------------------------------------------------- workload
    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(n))

    def prompts(self) -> list[list[tuple[str, str, bool]]]:
        """Two rounds of (name, prompt, include_output_tokens): families share a long prefix."""
        c = self.config
        prefixes = [f"[{self.run_tag} family {f}] " + self._words(c.prefix_words) for f in range(c.families)]
        rounds: list[list[tuple[str, str, bool]]] = []
        n = 0
        for r in range(2):
            batch = []
            for f, prefix in enumerate(prefixes):
                for k in range(c.per_family):
                    n += 1
                    include = c.include_output_every > 0 and n % c.include_output_every == 0
                    batch.append((f"r{r}f{f}k{k}", f"{prefix} | question {r}.{k}: {self._words(6)}", include))
            rounds.append(batch)
        return rounds

    def _complete(self, model: str, prompt: str, include: bool, salt: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": self.config.max_tokens,
                                "temperature": 0.0, "seed": self.config.seed}
        # NOTE: said either way: a server started with --include-output-tokens defaults to true
        body["kv_transfer_params"] = {"include_output_tokens": include}
        if salt is not None:
            body["cache_salt"] = salt
        return _post(self.base + "/v1/completions", body, self.config.timeout_s)

    # -------------------------------------------------------------------- run
    def run(self) -> CheckReport:
        c = self.config
        t0 = time.perf_counter()
        report = CheckReport(c.url, tolerance=c.tolerance, output_tolerance=c.output_tolerance)
        models = _get(self.base + "/v1/models", c.timeout_s)
        before = scrape_settled(self.base, c.timeout_s)
        listed = models.get("data")
        if not (isinstance(listed, list) and listed and isinstance(listed[0], dict) and listed[0].get("id")):
            raise HttpError(f"GET {self.base}/v1/models lists no model ({str(models)[:120]}): is this vLLM's "
                            "OpenAI server, with its model loaded?")
        report.model = model = listed[0]["id"]
        reader_name, load, cleanup = _reader()
        report.reader = reader_name
        served: list[tuple[str, str, bool, dict[str, Any]]] = []
        pool = cf.ThreadPoolExecutor(max_workers=c.concurrency)
        try:
            for batch in self.prompts():  # round 2 starts after round 1: hits across time
                futures = {pool.submit(self._complete, model, p, inc, None): (name, p, inc) for name, p, inc in batch}
                for future in cf.as_completed(futures):
                    name, prompt, include = futures[future]
                    served.append((name, prompt, include, future.result()))
        finally:  # NOTE: an interrupt (Ctrl-C, SIGTERM) or a failed request waits for no queued request
            pool.shutdown(wait=False, cancel_futures=True)
        served.sort(key=lambda s: s[0])
        report.requests = len(served)
        truths = []
        for name, prompt, include, _ in served:  # the ground truth: recomputed whole, one at a time
            truths.append(self._complete(model, prompt, include, salt=f"truth-{self.run_tag}-{name}"))
        checks: list[FileCheck] = []
        loaded: dict[str, tuple[Any, Any]] = {}
        to_clean: list[str] = []
        for (name, _, include, response), truth in zip(served, truths, strict=True):
            check = self._check_file(name, include, response, truth, load, loaded, to_clean)
            checks.append(check)
            if check.problem is not None:
                report.problems.append(f"{name}: {check.problem}")
                continue
            report.files_checked += 1
            report.rows_checked += check.tokens
            report.max_rel_diff = max(report.max_rel_diff, check.max_rel_diff)
            report.include_output_files += int(include)
            if check.cached_tokens > 0:
                report.hit_requests += 1
                report.cached_tokens += check.cached_tokens
        for check in checks:
            if check.problem is None and check.cached_tokens > 0:
                cached = loaded[check.name][0]["hidden_states"][: check.cached_tokens]
                problem = self._origin(check.name, cached, checks, loaded)
                if problem is None:
                    report.cached_rows_matched_origin += check.cached_tokens
                else:
                    report.problems.append(f"{check.name}: {problem}")
        report.max_output_rel_diff = self._output_diff
        report.control_caught = self._control(checks, loaded, report)
        report.metrics = metrics_section(before, scrape_settled(self.base, c.timeout_s))
        if not c.keep_files:
            for path in to_clean:
                cleanup(path)
        report.seconds = time.perf_counter() - t0
        return report

    def _check_file(self, name: str, include: bool, response: dict[str, Any], truth: dict[str, Any], load: Any,
                    loaded: dict[str, tuple[Any, Any]], to_clean: list[str]) -> FileCheck:
        params = response.get("kv_transfer_params") or {}
        truth_params = truth.get("kv_transfer_params") or {}
        path, truth_path = params.get("hidden_states_path"), truth_params.get("hidden_states_path")
        check = FileCheck(name, path, cached_tokens=int(params.get("hidden_states_cached_tokens") or 0))
        for p in (path, truth_path):
            if p:
                to_clean.append(p)
        if not path:
            check.problem = f"no hidden_states_path in kv_transfer_params: {params}"
            return check
        if not truth_path:
            check.problem = f"the ground-truth request got no file: {truth_params}"
            return check
        if response["choices"][0]["text"] != truth["choices"][0]["text"]:
            check.problem = "the generated text differs from the ground truth's (not a deterministic server?)"
            return check
        try:
            got, want = load(path), load(truth_path)
        except Exception as exc:  # a file that cannot be read is a finding
            check.problem = f"reading the file failed: {type(exc).__name__}: {exc}"
            return check
        prompt_tokens = int(response["usage"]["prompt_tokens"])
        expected = prompt_tokens + (int(response["usage"]["completion_tokens"]) - 1 if include else 0)
        ids, rows = got.get("token_ids"), got.get("hidden_states")
        if ids is None or rows is None:
            check.problem = f"the file lacks token_ids or hidden_states: {sorted(got)}"
            return check
        check.tokens = int(ids.shape[0])
        check.prompt_tokens = prompt_tokens
        if check.tokens != expected or int(rows.shape[0]) != check.tokens:
            check.problem = (f"{int(rows.shape[0])} rows and {check.tokens} token ids, expected {expected} "
                             f"({prompt_tokens} prompt tokens{', outputs but the last' if include else ''})")
            return check
        same_ids = ids.shape == want["token_ids"].shape and bool((ids == want["token_ids"]).all())
        if not same_ids:
            check.problem = "token_ids differ from the ground truth's"
            return check
        for key in sorted(set(got) - {"token_ids"}):
            if key not in want:
                check.problem = f"the ground truth has no {key!r}"
                return check
            n = prompt_tokens
            rel, bad = compare_rows(got[key][:n], want[key][:n], self.config.tolerance)
            check.max_rel_diff = max(check.max_rel_diff, rel)
            if bad is not None:
                where = "a cached prefix row" if bad < check.cached_tokens else "a computed prompt row"
                check.problem = (f"{key} row {bad} ({where}) differs from the ground truth "
                                 f"(max |diff| / max |row| = {rel:.3g}, tolerance {self.config.tolerance:g})")
                return check
            if check.tokens > n:
                rel, bad = compare_rows(got[key][n:], want[key][n:], self.config.output_tolerance)
                self._output_diff = max(self._output_diff, rel)
                if bad is not None:
                    check.problem = (f"{key} row {n + bad} (an output-token row) differs from the ground truth "
                                     f"(max |diff| / max |row| = {rel:.3g}, tolerance {self.config.output_tolerance:g})")
                    return check
        loaded[name] = (got, want)
        return check

    @staticmethod
    def _family(name: str) -> str:
        return name.split("f", 1)[1].split("k", 1)[0]

    def _origin(self, name: str, rows: Any, checks: list[FileCheck], loaded: dict[str, tuple[Any, Any]]) -> str | None:
        """``None`` when ``rows`` (request ``name``'s cached prefix rows) are bit for bit another
        same-family request's rows at those positions (the request that computed them, or another
        copy of them)."""
        import torch

        c = int(rows.shape[0])
        for other in checks:
            if other.name == name or other.name not in loaded or self._family(other.name) != self._family(name):
                continue
            theirs = loaded[other.name][0]["hidden_states"]
            if theirs.shape[0] >= c and torch.equal(theirs[:c], rows):
                return None
        return (f"its {c} cached prefix rows are not bit for bit the rows of any other request of its family "
                "(a hit must serve the rows the engine computed there)")

    def _control(self, checks: list[FileCheck], loaded: dict[str, tuple[Any, Any]], report: CheckReport) -> bool:
        """Perturb one prefix row of a checked file (one with a hit, if any): the check must catch it."""
        candidates = [c for c in checks if c.problem is None and c.name in loaded]
        if not candidates:
            report.problems.append("negative control: no checked file to perturb")
            return False
        target = max(candidates, key=lambda c: c.cached_tokens)
        got, want = loaded[target.name]
        rows = got["hidden_states"].clone()
        # NOTE: 10x the tolerance (at least 1e-3 of the row): a change any tolerance must catch
        rows[0] = rows[0] + (rows[0].abs().max() + 1.0) * max(1e-3, 10 * self.config.tolerance)
        _, bad = compare_rows(rows[: target.prompt_tokens], want["hidden_states"][: target.prompt_tokens],
                              self.config.tolerance)
        if bad != 0:
            report.problems.append(f"negative control: a perturbed prefix row of {target.name} was not caught")
            return False
        if target.cached_tokens > 0:
            caught = self._origin(target.name, rows[: target.cached_tokens], checks, loaded) is not None
            if not caught:
                report.problems.append(f"negative control: the origin check missed a perturbed cached row of "
                                       f"{target.name}")
                return False
        return True
