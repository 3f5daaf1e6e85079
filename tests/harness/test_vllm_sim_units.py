"""Pieces of ``simulate --engine vllm`` that need no vLLM: check (b)'s tolerance,
the workload plan, the CLI's argument checks and the bridge's settings."""

from __future__ import annotations

import pytest
import torch

from omni_cache.cli import main
from omni_cache.harness.vllm_engine.engine import (
    DEFAULT_TOLERANCE,
    VllmSimConfig,
    VllmSimResult,
    VllmSimulation,
)
from omni_cache.harness.vllm_engine.workload import PRESETS, plan_requests
from omni_cache.integration.vllm_bridge import VllmRunnerBridge


def _compare(rel_noise: float):
    sim = VllmSimulation(VllmSimConfig())
    truth = torch.full((4,), 2e-4)
    served = truth.clone()
    served[1] += rel_noise * 2e-4
    sim.capture.prompt_rows["s"] = {0: truth.clone(), 1: served}
    sim.capture.forward_rows["t"] = {0: truth.clone(), 1: truth.clone()}
    res = VllmSimResult(sim.config)
    req = type("R", (), {"prompt": (5, 6)})()
    sim._compare_prompt("s", "t", req, res, DEFAULT_TOLERANCE)
    return res


def test_check_b_is_relative_to_the_row_scale() -> None:
    assert _compare(0.2 * DEFAULT_TOLERANCE).ok
    res = _compare(3 * DEFAULT_TOLERANCE)
    assert not res.ok
    m = res.mismatches[0]
    assert (m.req_id, m.key, m.position) == ("s", "hidden", 1) and "tolerance" in m.detail
    assert res.recompute_max_rel_diff == pytest.approx(3 * DEFAULT_TOLERANCE, rel=1e-3)


def test_a_prompt_row_the_next_stage_never_got_is_a_mismatch() -> None:
    sim = VllmSimulation(VllmSimConfig())
    sim.capture.prompt_rows["s"] = {0: torch.ones(2)}
    sim.capture.forward_rows["t"] = {0: torch.ones(2), 1: torch.ones(2)}
    res = VllmSimResult(sim.config)
    sim._compare_prompt("s", "t", type("R", (), {"prompt": (5, 6)})(), res, DEFAULT_TOLERANCE)
    assert [m.position for m in res.mismatches] == [1] and "never received" in res.mismatches[0].detail


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_plans_are_deterministic_and_exercise_every_path(name) -> None:
    preset = PRESETS[name]
    plan = plan_requests(preset, seed=0)
    assert plan == plan_requests(preset, seed=0) and plan != plan_requests(preset, seed=1)
    assert any(len(r.prompt) > preset.max_batched_tokens for r in plan)  # chunked prefill
    assert sum(r.abort_step is not None for r in plan) == preset.aborts
    assert len({r.prompt for r in plan}) < len(plan)  # an exact repeat
    assert all(len(r.prompt) + r.max_tokens <= preset.max_model_len for r in plan)


def test_bad_vllm_arguments_exit_2(capsys) -> None:
    for argv, said in ((["simulate", "--engine", "vllm", "--dtype", "float32"], "only applies to --engine sim"),
                       (["simulate", "--preset", "pressure"], "needs --engine vllm")):  # a vLLM preset on sim
        with pytest.raises(SystemExit) as exc:  # the subcommand's usage and one error line
            main(argv)
        assert exc.value.code == 2
        assert said in capsys.readouterr().err
    with pytest.raises(ValueError, match="num-blocks"):
        VllmSimConfig(kv_blocks=4)
    with pytest.raises(ValueError, match="unknown additional_config"):
        VllmRunnerBridge({"eagre": True})


@pytest.mark.parametrize(("settings", "named"), [
    ({"eager": "no"}, r"\['eager'\] must be true or false, got 'no'"),
    ({"needs_full_hidden_states": "false"}, r"\['needs_full_hidden_states'\] must be true or false"),
    ({"all_tp_ranks": 1}, r"\['all_tp_ranks'\] must be true or false, got 1"),
    ({"deferred_keys": "audio.codes"}, r"\['deferred_keys'\] must be a list of mm key names, got 'audio.codes'"),
    ({"deferred_keys": ["audio.codes", 3]}, r"\['deferred_keys'\] must be a list of mm key names"),
    (["eager"], r"\['omni_cache'\] must be a mapping of settings"),
])
def test_bridge_settings_of_the_wrong_type_are_refused_by_key(settings: object, named: str) -> None:
    """A setting is never read by truthiness or iterated as a string ("no" is not false, a key name
    is not a set of characters): the wrong type is refused at start, naming the key."""
    with pytest.raises(ValueError, match=named):
        VllmRunnerBridge(settings)  # type: ignore[arg-type]


def test_bridge_settings_of_the_right_type_are_taken() -> None:
    bridge = VllmRunnerBridge({"eager": True, "deferred_keys": ["audio.codes"], "needs_full_hidden_states": True,
                               "all_tp_ranks": False})
    assert not bridge.hooks.all_tp_ranks
