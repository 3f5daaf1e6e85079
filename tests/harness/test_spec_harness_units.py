"""The speculative-decoding harness without an engine: its ground truth can fail, its inputs hold.

Protects the outside check of I14 that ``simulate``/``pipeline --speculative`` rely on
(``harness.vllm_engine.truth_spec.SpecCapture``): fed the forwards of a verify step by hand, it
accepts the rows of the request's tokens and fails a served rejected draft's row, a row past
the request's last token and a position never served -- a check that cannot fail proves
nothing. Also the traps (``speculative.trapped``: deterministic, the prompt's head kept, the
n-grams in place), the probe, the engine options and the refusals of ``--speculative`` (one
line, exit 2). tests/integration/test_vllm_speculative.py runs all of it on vLLM's real engine.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omni_cache.cli import main
from omni_cache.harness.vllm_engine.speculative import (
    METHODS,
    check_speculative,
    draft_kv_layers,
    probe_chains,
    speculative_config,
    trapped,
)
from omni_cache.harness.vllm_engine.truth import LEFTOVER_KEY, PER_TOKEN_KEYS, derive_mm
from omni_cache.harness.vllm_engine.truth_spec import SpecCapture
from omni_cache.integration.vllm_bridge import ForwardRecord
from omni_cache.runtime.interface import StageCacheOutputs

BS = 32
PROMPT = [10, 11, 12, 13]
FINAL = [*PROMPT, 20, 21, 22, 23, 24]  # rows at positions 0..7


def _row(p: int, tok: int) -> torch.Tensor:
    return torch.tensor([float(p), float(tok), 1.0, 2.0] * 4)


class _Run:
    """Forwards of request ``A`` as vLLM runs them, then what a consumer was served."""

    def __init__(self) -> None:
        self.cap = SpecCapture(BS)
        self.cap.register_prompt("A", PROMPT)
        self.records: dict[int, ForwardRecord] = {}

    def forward(self, step: int, start: int, tokens: list[int], *, new: bool = False) -> None:
        hidden = torch.stack([_row(start + i, t) for i, t in enumerate(tokens)])
        n = len(tokens)
        so = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="A", num_computed_tokens=0)] if new else [],
                             scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[],
                                                                   resumed_req_ids=set()))
        rec = ForwardRecord(step, step, ("A",), (("A", start, start + n),), hidden,
                            torch.tensor(tokens), torch.arange(start, start + n), torch.arange(start, start + n),
                            derive_mm(hidden), {"A": (0,)}, so)
        self.records[step] = rec
        self.cap.observe(rec)

    def serve(self, step: int, start: int, end: int) -> None:
        rec = self.records[step]
        first = rec.spans[0][1]
        rows = rec.hidden_states[start - first : end - first]
        mm = {k: {"A": rec.mm_outputs[k][start - first : end - first]} for k in PER_TOKEN_KEYS}
        mm[LEFTOVER_KEY] = {"A": rec.mm_outputs[LEFTOVER_KEY]}
        self.cap.check_step(step, step, (("A", start, end),), StageCacheOutputs({"A": rows}, mm))

    def details(self) -> str:
        self.cap.check_tokens({"A": FINAL}, {"A"})
        return " | ".join(m.detail for m in self.cap.mismatches)


def _verify_run() -> _Run:
    """A's prompt, a verify step (its token 20, draft 21 accepted, drafts 98 and 99 rejected),
    then the step that computes positions 6, 7 again with its accepted tokens 22, 23."""
    run = _Run()
    run.forward(1, 0, PROMPT, new=True)
    run.forward(2, 4, [20, 21, 98, 99])
    run.forward(3, 6, [22, 23])
    return run


def test_the_rows_of_the_requests_tokens_pass() -> None:
    run = _verify_run()
    run.serve(1, 0, 4)
    run.serve(2, 4, 6)  # trimmed: the rejected drafts' rows are cut
    run.serve(3, 6, 8)
    assert run.details() == ""
    assert run.cap.rows_of_tokens_checked == 8 and sorted(run.cap.served_rows["A"]) == list(range(8))


def test_a_served_rejected_drafts_row_fails() -> None:
    run = _verify_run()
    run.serve(1, 0, 4)
    run.serve(2, 4, 8)  # untrimmed: positions 6, 7 hold rejected drafts' rows
    run.serve(3, 6, 8)
    assert "served the row of token 98 at position 6, where the request's token is 22" in run.details()


def test_a_row_past_the_last_token_and_a_position_never_served_fail() -> None:
    run = _verify_run()
    run.forward(4, 8, [24, 30])  # one more step: position 9 is past the request's end (its 9 tokens)
    run.serve(1, 0, 4)
    run.serve(2, 4, 5)  # one accepted row too few: position 5 is never served again
    run.serve(4, 8, 10)
    details = run.details()
    assert "past the request's last input token" in details and "never got the rows of positions [5, 6, 7]" in details


def test_the_traps_are_deterministic_keep_the_head_and_hold_the_ngrams() -> None:
    prompt = list(range(100, 200))
    chain = [7, 8, 9, 10, 11, 10, 11]  # x a b c ... then the cycle 10 11
    got = trapped(prompt, chain, keep=64, vocab=512, first_token=3)
    assert got == trapped(prompt, chain, keep=64, vocab=512, first_token=3)
    assert len(got) == len(prompt) and got[:64] == prompt[:64] and got[-1] == 7
    tail = got[-13:]
    assert tail[1:4] == [7, 8, 9] and tail[4] != 10  # "x a b z1": z1 is not the chain's next token
    assert tail[6:9] == [10, 11, 10] and tail[9] != 11  # "p q p y1": y1 breaks the cycle
    short = trapped([5, 6], chain, keep=0, vocab=512, first_token=3)
    assert len(short) == 13 and short[-1] == 7


def test_the_probe_reads_each_chain_and_the_methods_have_their_options(tmp_path: Any) -> None:
    chains = probe_chains(lambda prompts, n: [[p[0] + 1] * n for p in prompts], [5, 9])
    assert chains == {5: [5, *[6] * 6], 9: [9, *[10] * 6]}
    assert speculative_config("ngram")["method"] == "ngram"
    for method, name in (("draft", "draft_model"), ("eagle", "eagle")):
        config = speculative_config(method, str(tmp_path / method))
        assert config["method"] == name and (tmp_path / method / "config.json").exists()
        assert draft_kv_layers(method) == 1
    assert draft_kv_layers("ngram") == draft_kv_layers(None) == 0 and set(METHODS) == {"ngram", "draft", "eagle"}
    with pytest.raises(ValueError, match="unknown speculative method"):
        speculative_config("medusa")


@pytest.mark.parametrize(("cfg", "message"), [
    (dict(speculative="medusa"), "--speculative must be one of ngram, draft, eagle"),
    (dict(speculative="ngram", model="hybrid"), "runs the llama thinker: not --model hybrid"),
    (dict(speculative="ngram", tp=2), "not with --tp/--pp"),
    (dict(speculative="ngram", kv_connector="example"), "does not combine with --kv-connector"),
])
def test_speculative_runs_the_jobs_do_not_make_are_refused(cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_speculative(SimpleNamespace(**{"model": "llama", "tp": 1, "pp": 1, "kv_connector": None, **cfg}))
    check_speculative(SimpleNamespace(speculative=None))


@pytest.mark.parametrize(("argv", "message"), [
    (["simulate", "--speculative", "ngram"], "--speculative only applies to --engine vllm"),
    (["simulate", "--engine", "vllm", "--speculative", "ngram", "--model", "hybrid"], "not --model hybrid"),
    (["pipeline", "--speculative", "draft", "--tp", "2"], "not with --tp/--pp"),
])
def test_a_refused_speculative_command_is_one_line_exit_2(argv: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if "error: " in line and message in line], err
