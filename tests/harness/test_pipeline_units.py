"""``omni-cache pipeline`` without vLLM: the workload generator, the checks and the argument errors.

The checks are exercised on a stand-in talker (a fixed random torch function of
the rows it is given, greedy): fed the right rows it agrees with itself, fed
only the computed rows or one perturbed row it must be flagged -- so a
comparison that cannot fail would fail here. The real engines are in
``tests/integration/test_vllm_pipeline.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from omni_cache.cli import main
from omni_cache.cli.args import EXIT_FAILED, EXIT_INCOMPLETE, EXIT_OK
from omni_cache.harness.pipeline.checks import (
    DEFAULT_LOGPROB_TOLERANCE,
    PERTURBATION,
    Verdict,
    compare,
    compare_all,
    perturb_row,
    row_diff,
)
from omni_cache.harness.pipeline.workload import (
    MAX_REQUESTS,
    PRESETS,
    max_prompt_len,
    plan_turns,
    resolve_prompt,
)


@dataclasses.dataclass(frozen=True)
class Out:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


# ---------------------------------------------------------------------- workload
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_plan_is_deterministic_sized_and_parents_come_first(preset: str) -> None:
    p = PRESETS[preset]
    plan = plan_turns(p, seed=3)
    assert plan == plan_turns(p, seed=3) and plan != plan_turns(p, seed=4)
    assert len(plan) == p.requests and len({t.name for t in plan}) == len(plan)
    seen: set[str] = set()
    for turn in plan:
        assert turn.parent is None or turn.parent in seen, turn
        seen.add(turn.name)
    for n in (1, 5, MAX_REQUESTS):
        assert len(plan_turns(p, seed=0, requests=n)) == n


def test_system_requests_share_prompts_in_pairs_and_arrive_in_waves() -> None:
    p = PRESETS["system"]
    plan = plan_turns(p, seed=0)
    sys_len = p.system_prompt_blocks[0] * 32
    assert plan[0].tokens[:sys_len] == plan[1].tokens[:sys_len]  # a pair: hits within a step
    assert plan[0].arrive_step == plan[1].arrive_step == 0
    assert plan[0].tokens[:sys_len] == plan[4].tokens[:sys_len]  # the next wave: hits across steps
    assert plan[4].arrive_step == p.wave_gap_steps
    assert plan[0].tokens[:sys_len] != plan[2].tokens[:sys_len]


def test_multiturn_prompt_is_previous_prompt_answer_and_new_text() -> None:
    plan = plan_turns(PRESETS["multiturn"], seed=0)
    first, second = plan[0], plan[1]
    assert first.parent is None and second.parent == first.name
    prompts = {first.name: resolve_prompt(first, {}, {})}
    with pytest.raises(ValueError, match="has not finished"):
        resolve_prompt(second, prompts, {})
    answers = {first.name: (7, 8, 9)}
    assert resolve_prompt(second, prompts, answers) == (*first.tokens, 7, 8, 9, *second.tokens)


def test_mix_has_both_shapes_and_arrivals_over_time() -> None:
    plan = plan_turns(PRESETS["mix"], seed=0)
    assert any(t.parent for t in plan) and any(t.name.startswith("sys") for t in plan)
    assert len({t.arrive_step for t in plan if t.parent is None}) >= 3


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_prompt_fits_the_engines(preset: str) -> None:
    p = PRESETS[preset]
    bound = max_prompt_len(p)
    plan = plan_turns(p, seed=1, requests=MAX_REQUESTS)
    prompts: dict[str, tuple[int, ...]] = {}
    answers: dict[str, tuple[int, ...]] = {}
    for turn in plan:
        prompts[turn.name] = resolve_prompt(turn, prompts, answers)
        answers[turn.name] = (5,) * p.answer_tokens[1]
        assert len(prompts[turn.name]) <= bound
    assert bound + p.answer_tokens[1] <= p.max_model_len


def test_plan_refuses_bad_sizes() -> None:
    for n in (0, MAX_REQUESTS + 1):
        with pytest.raises(ValueError, match="--requests must be from 1"):
            plan_turns(PRESETS["mix"], seed=0, requests=n)
    too_long = dataclasses.replace(PRESETS["multiturn"], turns=40)
    with pytest.raises(ValueError, match="over max_model_len"):
        plan_turns(too_long, seed=0)


# ---------------------------------------------------------------------- checks
def test_compare_flags_tokens_logprobs_lengths_and_nan() -> None:
    truth = Out((1, 2, 3), (-1.0, -2.0, -3.0))
    tol = DEFAULT_LOGPROB_TOLERANCE
    assert compare("a", truth, Out((1, 2, 3), (-1.0, -2.0 + tol / 2, -3.0)), tol).identical
    assert not compare("a", truth, Out((1, 2, 4), (-1.0, -2.0, -3.0)), tol).identical
    c = compare("a", truth, Out((1, 2, 3), (-1.0, -2.0 + 3 * tol, -3.0)), tol)
    assert c.tokens_equal and not c.identical and "logprob differs" in c.detail
    assert not compare("a", truth, Out((1, 2), (-1.0, -2.0)), tol).identical
    assert not compare("a", truth, Out((1, 2, 3), (-1.0, math.nan, -3.0)), tol).identical
    assert compare("a", truth, truth, 0.0).identical


def test_verdict_counts_and_a_missing_truth_is_a_difference() -> None:
    truth = {"a": Out((1,), (-1.0,)), "b": Out((2,), (-2.0,))}
    v = compare_all(truth, {"a": Out((1,), (-1.0,)), "b": Out((3,), (-2.0,)), "c": Out((1,), (-1.0,))}, 1e-4)
    assert (v.compared, v.identical, v.differing, v.tokens_differ) == (3, 1, 2, 2)
    assert not v.all_identical and not v.all_differ
    assert not Verdict().all_identical and not Verdict().all_differ  # nothing compared proves nothing
    renamed = compare_all(truth, {"x": Out((2,), (-2.0,))}, 1e-4, {"x": "b"})
    assert renamed.all_identical


def test_perturb_row_changes_exactly_one_row_and_row_diff_sees_it() -> None:
    rows = torch.randn(10, 16, generator=torch.Generator().manual_seed(0))
    bad = perturb_row(rows, 4)
    changed = [i for i in range(10) if not torch.equal(bad[i], rows[i])]
    assert changed == [4]
    assert torch.allclose(bad[4] - rows[4], torch.full((16,), PERTURBATION * float(rows[4].abs().max())))
    assert row_diff(rows, rows.clone()) == 0.0
    assert row_diff(bad, rows) > 0 and row_diff(rows[:9], rows) == math.inf
    with pytest.raises(ValueError, match="outside"):
        perturb_row(rows, 10)
    with pytest.raises(ValueError, match="unchanged"):
        perturb_row(torch.zeros(3, 4), 1)


class StandInTalker:
    """A fixed random function of the prompt rows (attention-free: mean of tanh projections, then a
    greedy walk), standing in for the talker engine."""

    def __init__(self, width: int = 16, vocab: int = 32) -> None:
        g = torch.Generator().manual_seed(11)
        self.w = torch.randn(width, width, generator=g) / width**0.5
        self.out = torch.randn(width, vocab, generator=g)
        self.emb = torch.randn(vocab, width, generator=g)

    def __call__(self, rows: torch.Tensor, steps: int = 4) -> Out:
        state = torch.tanh(rows @ self.w).mean(0)
        tokens, lps = [], []
        for _ in range(steps):
            logp = torch.log_softmax(state @ self.out, -1)
            tok = int(logp.argmax())
            tokens.append(tok)
            lps.append(float(logp[tok]))
            state = torch.tanh(state + self.emb[tok])
        return Out(tuple(tokens), tuple(lps))


def test_the_checks_fail_when_the_talker_gets_wrong_rows() -> None:
    talker = StandInTalker()
    g = torch.Generator().manual_seed(5)
    prompts = {f"r{i}": torch.randn(40 + i, 16, generator=g) for i in range(4)}
    hit = 32  # each request's first 32 rows came from the cache
    truth = {k: talker(v) for k, v in prompts.items()}
    tol = DEFAULT_LOGPROB_TOLERANCE
    assert compare_all(truth, {k: talker(v.clone()) for k, v in prompts.items()}, tol).all_identical
    computed_only = compare_all(truth, {k: talker(v[hit:]) for k, v in prompts.items()}, tol)
    assert computed_only.all_differ, [c.detail for c in computed_only.comparisons]
    perturbed = compare_all(truth, {k: talker(perturb_row(v, hit // 2)) for k, v in prompts.items()}, tol)
    assert perturbed.all_differ, [c.max_logprob_diff for c in perturbed.comparisons]


# ---------------------------------------------------------------------- result and exit codes
def _result(**changes: Any) -> Any:
    from omni_cache.harness.pipeline.checks import Comparison
    from omni_cache.harness.pipeline.run import PipelineConfig, PipelineResult, RunStats

    same = [Comparison(f"r{i}", True, 0.0, 1e-4) for i in range(2)]
    differ = [Comparison("r0", False, 1.0, 1e-4, "tokens differ")]
    res = PipelineResult(PipelineConfig(preset="mix", requests=2, repeats=1), requests=2,
                         with_apc=RunStats(hit_tokens=64, prefill_tokens=10, thinker_s=1.0, end_to_end_s=2.0),
                         without_apc=RunStats(prefill_tokens=74, thinker_s=2.0, end_to_end_s=3.0),
                         identity=Verdict(list(same)), thinker_answers_equal=2,
                         control_computed=Verdict(list(differ)), control_perturbed=Verdict(list(differ)))
    for k, v in changes.items():
        setattr(res, k, v)
    return res


def test_exit_codes_and_summary_fields() -> None:
    from omni_cache.harness.pipeline.checks import Comparison
    from omni_cache.harness.pipeline.report import exit_code, summarize

    ok = _result()
    s = summarize(ok)
    assert exit_code(ok) == EXIT_OK and s["ok"] and s["controls_caught"] == 2
    for key in ("ok", "requests", "hit_tokens", "talker_identical", "controls_caught", "prefill_tokens_with_apc",
                "prefill_tokens_without_apc", "thinker_speedup", "end_to_end_speedup", "vllm_version"):
        assert key in s, key
    assert s["thinker_speedup"] == 2.0 and s["end_to_end_speedup"] == 1.5 and s["prefill_saving"] == round(1 - 10 / 74, 4)
    missed = _result(control_perturbed=Verdict([Comparison("r0", True, 0.0, 1e-4)]))
    assert exit_code(missed) == EXIT_FAILED and summarize(missed)["controls_caught"] == 1
    wrong = _result(identity=Verdict([Comparison("r0", True, 0.0, 1e-4), Comparison("r1", False, 2.0, 1e-4)]))
    assert exit_code(wrong) == EXIT_FAILED and not summarize(wrong)["talker_identical"]
    short = _result(identity=Verdict([Comparison("r0", True, 0.0, 1e-4)]))  # a request never compared
    assert exit_code(short) == EXIT_FAILED
    from omni_cache.harness.pipeline.run import RunStats

    no_hits = _result(with_apc=RunStats(hit_tokens=0, thinker_s=1.0, end_to_end_s=1.0),
                      control_computed=Verdict(), control_perturbed=Verdict())  # nothing for a control to change
    assert exit_code(no_hits) == EXIT_INCOMPLETE and not summarize(no_hits)["ok"]
    assert summarize(no_hits)["controls_caught"] == 0
    no_hits_wrong = _result(with_apc=RunStats(hit_tokens=0), control_computed=Verdict(), control_perturbed=Verdict(),
                            identity=Verdict([Comparison("r0", False, 1.0, 1e-4), Comparison("r1", True, 0.0, 1e-4)]))
    assert exit_code(no_hits_wrong) == EXIT_FAILED  # a wrong output is a failure, hits or not


# ---------------------------------------------------------------------- argument errors
@pytest.mark.parametrize(("argv", "says"), [
    (["--requests", "0"], "argument --requests: wants an integer from 1 to 64, got 0"),
    (["--requests", "65"], "argument --requests: wants an integer from 1 to 64, got 65"),
    (["--preset", "chat"], "argument --preset: invalid choice: 'chat'"),
    (["--talker-tokens", "0"], "argument --talker-tokens: wants an integer from 1 to 64"),
    (["--tolerance", "-1"], "argument --tolerance: wants a number from 0 to 1"),
    (["--repeats", "9"], "argument --repeats: wants an integer from 1 to 5"),
    (["--seed", "x"], "argument --seed: wants an integer from 0 to 4,294,967,295"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--pp", "3"], "argument --pp: wants an integer from 1 to 2, got 3"),
    (["--tp", "0"], "argument --tp: wants an integer from 1 to 8, got 0"),
    (["--model", "gpt"], "argument --model: invalid choice: 'gpt'"),
])
def test_argument_errors_are_one_line_and_exit_2(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
                                                 ) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["pipeline", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: omni-cache pipeline" in err and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("omni-cache pipeline: error: ") and says in last, last


@pytest.mark.parametrize(("argv", "says"), [
    (["--model", "hybrid", "--tp", "2"], "--model hybrid runs on one worker: --tp and --pp take the llama model only"),
    (["--model", "hybrid", "--pp", "2"], "--model hybrid runs on one worker"),
    (["--tp", "3"], "--tp 3 does not divide the model's 2 attention heads"),
    (["--tp", "8", "--pp", "2"], "--tp 8 x --pp 2 = 16 workers; at most 8"),
    (["--kv-connector", "example", "--repeats", "1"], "--kv-connector needs --repeats 2 or more"),
    (["--kv-connector", "example", "--tp", "2"], "--kv-connector runs the thinker in this process: not with --tp 2"),
    (["--kv-connector", "example", "--model", "hybrid"], "--kv-connector runs the llama thinker (one KV-cache group)"),
])
def test_a_thinker_grid_the_model_cannot_run_is_one_line_and_exit_2(argv: list[str], says: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pipeline", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("omni-cache pipeline: error: ") and says in err[0], err


def test_the_thinker_engine_arguments_follow_model_and_grid() -> None:
    """Each worker of a ``tp x pp`` thinker gets the KV bytes of its own layers; the hybrid model its
    hybrid KV manager and a pool of ``pool_blocks`` (the preset's blocks plus the windows'); the truth
    thinker (prefix caching off) vLLM's own worker and no cache, in every case."""
    from omni_cache.harness.pipeline.stages import StageOptions, thinker_kwargs
    from omni_cache.harness.pipeline.talker import talker_kwargs
    from omni_cache.harness.vllm_engine.models import MODELS

    base = dict(kv_blocks=40, max_batched_tokens=256, max_model_len=1024)
    one = thinker_kwargs("/m", StageOptions(**base), prefix_caching=True)
    assert "tensor_parallel_size" not in one and one["kv_cache_memory_bytes"] == 40 * MODELS["llama"].kv_bytes_per_block
    tp = thinker_kwargs("/m", StageOptions(**base, tp=2), prefix_caching=True)
    assert (tp["tensor_parallel_size"], tp["pipeline_parallel_size"], tp["distributed_executor_backend"]) == (2, 1, "mp")
    assert tp["kv_cache_memory_bytes"] == one["kv_cache_memory_bytes"]  # the one KV head is replicated over TP
    pp = thinker_kwargs("/m", StageOptions(**base, pp=2), prefix_caching=True)
    assert pp["kv_cache_memory_bytes"] == one["kv_cache_memory_bytes"] // 2  # one of the two layers per stage
    assert pp["worker_cls"].endswith("OmniCPUWorker") and pp["enable_prefix_caching"]
    truth = thinker_kwargs("/m", StageOptions(**base, pp=2), prefix_caching=False)
    assert truth["worker_cls"] == "auto" and not truth["enable_prefix_caching"] and truth["additional_config"] == {}
    assert truth["pipeline_parallel_size"] == 2
    hybrid = thinker_kwargs("/m", StageOptions(**base, model="hybrid"), prefix_caching=True)
    assert hybrid["disable_hybrid_kv_cache_manager"] is False
    assert hybrid["kv_cache_memory_bytes"] == MODELS["hybrid"].kv_cache_memory_bytes(40) != one["kv_cache_memory_bytes"]
    talker = talker_kwargs("/t", StageOptions(**base, model="hybrid", tp=2))
    assert "tensor_parallel_size" not in talker and talker["enable_prompt_embeds"]
    kv = {"kv_connector": "OmniKVConnector"}
    assert thinker_kwargs("/m", StageOptions(**base, kv_transfer_config=kv), prefix_caching=True)["kv_transfer_config"] == kv
    assert "kv_transfer_config" not in thinker_kwargs("/m", StageOptions(**base, kv_transfer_config=kv),
                                                      prefix_caching=False)  # the ground truth has no connector
    assert "kv_transfer_config" not in talker_kwargs("/t", StageOptions(**base, kv_transfer_config=kv))


def test_missing_vllm_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                              ) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert main(["pipeline", "--requests", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vLLM is not installed" in err[0]


def test_the_command_prints_what_it_verified_and_exits_with_its_code(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The subcommand's own path, on made-up results (the real engines run in tests/integration/test_vllm_pipeline.py)."""
    import json

    import omni_cache.harness.pipeline.run as run_mod
    from omni_cache.harness.pipeline.checks import Comparison
    from omni_cache.harness.pipeline.run import RunStats

    results = iter([_result(), _result(), _result(identity=Verdict([Comparison("r0", False, 2.0, 1e-4, "tokens differ "
                                                                                  "from output position 0")])),
                    _result(with_apc=RunStats(hit_tokens=0, thinker_s=1.0, end_to_end_s=1.0),
                            control_computed=Verdict(), control_perturbed=Verdict())])
    seen: list[Any] = []

    def fake_run(config: Any, engines: Any = None) -> Any:
        seen.append(config)
        return next(results)

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(run_mod, "run_pipeline", fake_run)
    assert main(["pipeline", "--json", "--requests", "2", "--repeats", "1"]) == EXIT_OK
    s = json.loads(capsys.readouterr().out)
    assert s["ok"] and s["talker_identical"] and s["controls_caught"] == 2 and s["hit_tokens"] == 64
    assert seen[0].requests == 2 and seen[0].repeats == 1 and seen[0].tolerance == DEFAULT_LOGPROB_TOLERANCE
    assert main(["pipeline", "--tolerance", "0.001"]) == EXIT_OK and seen[1].tolerance == 0.001
    out = capsys.readouterr().out
    assert "talker output vs APC off" in out and "caught" in out and "OK" in out
    assert main(["pipeline"]) == EXIT_FAILED
    out = capsys.readouterr().out
    assert "FAILED" in out and "r0: tokens differ from output position 0" in out
    assert main(["pipeline"]) == EXIT_INCOMPLETE
    out = capsys.readouterr().out
    assert "INCOMPLETE: no request hit" in out and out.count("not run: no request hit") == 2
