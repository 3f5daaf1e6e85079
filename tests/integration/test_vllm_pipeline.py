"""The two-stage pipeline on real vLLM CPU engines (marker ``vllm``; one set of engines per module).

A thinker with prefix caching and the omni cache hands each finished request's
full-prompt rows to a talker (seeded random checkpoint, ``prompt_embeds``); the
talker's tokens and logprobs must equal the same workload's with prefix caching
off on the thinker, and both negative controls must be caught. A cache that
serves one wrong prefix row must make the run fail, by check (a) and by the
talker's output alike.
"""

from __future__ import annotations

import contextlib
import tempfile

import pytest
from vllm_support import require_vllm, shutdown_llm

from omni_cache.harness.pipeline.report import exit_code, summarize
from omni_cache.harness.pipeline.run import Pipeline, PipelineConfig
from omni_cache.integration.runner_hooks import PrefixCacheRunnerHooks

pytestmark = pytest.mark.vllm

CONFIG = PipelineConfig(preset="mix", requests=6, repeats=1, talker_tokens=6)


@pytest.fixture(scope="module")
def engines():
    require_vllm()
    from omni_cache.harness.pipeline.stages import build_llm, thinker_kwargs
    from omni_cache.harness.pipeline.talker import talker_checkpoint, talker_kwargs
    from omni_cache.harness.vllm_engine.engine import prepare_vllm_env, stdout_to_stderr, tiny_llama_dir

    prepare_vllm_env()
    opts = Pipeline(CONFIG).opts
    with contextlib.ExitStack() as stack, stdout_to_stderr():
        ckpt = stack.enter_context(talker_checkpoint(CONFIG.seed))
        thinker_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="omni-cache-thinker-"))
        tiny_llama_dir(thinker_dir)
        built = {name: build_llm(talker_kwargs(ckpt, opts)) for name in ("talker", "talker_truth", "talker_alone")}
        built.update({"thinker_apc": build_llm(thinker_kwargs(thinker_dir, opts, prefix_caching=True)),
                      "thinker_truth": build_llm(thinker_kwargs(thinker_dir, opts, prefix_caching=False)),
                      "thinker_alone": build_llm(thinker_kwargs(thinker_dir, opts, prefix_caching=True, cache=False))})
    yield built
    for llm in built.values():
        shutdown_llm(llm)


@pytest.fixture(scope="module")
def result(engines):
    return Pipeline(CONFIG).run(engines)


def test_talker_output_with_prefix_caching_equals_prefix_caching_off(result) -> None:
    assert not result.mismatches, [str(m) for m in result.mismatches]
    assert result.requests == 6 and result.with_apc.finished == result.without_apc.finished == 6
    assert result.with_apc.talker_finished == result.without_apc.talker_finished == 6
    assert result.with_apc.hit_tokens > 0 and result.with_apc.hit_requests >= 3
    assert result.served_from_cache == result.with_apc.hit_tokens  # every hit row went through the cache
    assert result.identity.compared == 6 and result.talker_identical
    assert result.thinker_answers_equal == 6 and result.row_max_rel_diff == 0.0
    assert result.with_apc.prefill_tokens + result.with_apc.hit_tokens == result.without_apc.prefill_tokens
    assert result.with_apc.overlap_steps > 0  # the talker stepped while the thinker still had work
    s = summarize(result)
    assert s["ok"] and exit_code(result) == 0 and s["vllm_version"]
    assert s["prefill_tokens_with_apc"] < s["prefill_tokens_without_apc"]
    assert s["cache_cost"]["steps"] > 0 and s["cache_cost"]["forward_ms_per_step"] > 0
    assert s["cache_cost"]["begin_step_ms_per_step"] > 0 and s["targets"]["judged"] is False  # llama: reported only


def test_the_third_thinker_is_prefix_caching_without_the_cache(result) -> None:
    """The upper bound ran in lockstep with the others: the same hits and prefill as the cache's thinker
    (the same scheduler), no cache on its engine, every talker request of it finished, never compared."""
    alone = result.apc_alone
    assert alone is not None and alone.finished == alone.talker_finished == 6
    assert alone.hit_tokens == result.with_apc.hit_tokens and alone.prefill_tokens == result.with_apc.prefill_tokens
    assert alone.thinker_s > 0 and alone.end_to_end_s >= alone.thinker_s
    assert len(result.repeats_apc_alone) == CONFIG.repeats and result.speedup(alone) is not None
    assert result.identity.compared == 6  # its talker outputs (wrong rows) are not among the comparisons


def test_control_only_computed_rows_is_caught(result) -> None:
    v = result.control_computed
    assert v.compared == result.with_apc.hit_requests > 0
    assert v.all_differ, [c.name for c in v.comparisons if c.identical]


def test_control_one_perturbed_prefix_row_is_caught(result) -> None:
    v = result.control_perturbed
    assert v.compared == 1 and v.all_differ and "position" in result.perturbed
    assert v.min_logprob_diff > 10 * CONFIG.tolerance  # well clear of the identity's tolerance
    assert result.controls_caught == 2


def test_a_wrong_cached_row_fails_the_run(engines, monkeypatch) -> None:
    """The cache serves row 10 scaled in every first output but the run's very first (that one computed
    all its rows; later ones sit behind a shared system prompt): check (a) names a wrong hit row and the
    talker's output differs."""
    real = PrefixCacheRunnerHooks.materialize
    seen: list[str] = []

    def corrupt(self, step_id):
        out = real(self, step_id)
        for rid, rows in (out.hidden_states or {}).items():
            if rows.shape[0] > 40:  # a first output (system prompts are 64 or 96 tokens)
                if seen:
                    rows[10] = rows[10] * 1.5
                seen.append(rid)
        return out

    monkeypatch.setattr(PrefixCacheRunnerHooks, "materialize", corrupt)
    res = Pipeline(CONFIG).run(engines)
    assert len(seen) >= 2
    assert any("differs from the forward" in str(m) and "[hit]" in str(m) for m in res.mismatches)
    assert res.identity.differing >= 1 and not res.talker_identical
    assert exit_code(res) == 1 and not summarize(res)["ok"]
