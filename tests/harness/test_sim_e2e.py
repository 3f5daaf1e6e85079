"""End-to-end runs of ``omni-cache simulate`` against the real manager, and its failure path.

A run exits 0 only if every output handed to the talker matched the ground
truth. These tests also prove the check can fail: a manager whose output is
corrupted, whose block pool is scribbled over, or whose pool write fails makes
the run report the request, step, key and position (or the contract error),
and the command exit 1.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from omni_cache.cli import main
from omni_cache.harness.sim_engine import SimConfig, Simulation
from omni_cache.harness.sim_engine import engine as sim_engine
from omni_cache.harness.sim_engine.report import summarize
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.interface import HIDDEN_KEY, PrefixCacheConfig
from omni_cache.runtime.manager import OmniPrefixCacheManager

SMALL = {"requests": 20}


@pytest.mark.parametrize(
    ("preset", "eager"), [("chat", True), ("multiturn", False), ("audio", True), ("audio", False)]
)
def test_preset_runs_clean(preset: str, eager: bool) -> None:
    res = Simulation(SimConfig.from_preset(preset, seed=1, eager=eager, **SMALL)).run()
    assert res.ok, [str(m) for m in res.mismatches[:3]]
    assert res.rows_from_cache > 0 and res.allocator.hits == res.rows_from_cache
    assert res.talker_completed == res.scheduler.finished > 0
    assert res.unconsumed == {}
    assert res.manager_stats["saved"] == res.manager_stats["materialized"] == res.saves
    if preset == "audio":
        assert res.manager_stats["budget_flushes"] > 0  # small gpu_staging_bytes forces flushes


def test_chat_exercises_preemption_same_step_hits_and_padding() -> None:
    res = Simulation(SimConfig.from_preset("chat", seed=0, requests=40, num_blocks=64)).run()
    assert res.ok, [str(m) for m in res.mismatches[:3]]
    assert res.scheduler.preemptions > 0 and res.scheduler.resumes > 0
    assert res.scheduler.same_step_hits > 0
    assert res.padded_steps > 0 and res.allocator.evictions > 0


def _fingerprint(res: Any) -> tuple[Any, ...]:
    return (res.steps, res.computed_tokens, res.allocator.hits, res.allocator.evictions,
            res.scheduler.preemptions, res.scheduler.finished, res.rows_checked)


def test_runs_are_deterministic_from_the_seed_in_both_modes() -> None:
    a = Simulation(SimConfig.from_preset("chat", seed=5, eager=True, **SMALL)).run()
    b = Simulation(SimConfig.from_preset("chat", seed=5, eager=False, **SMALL)).run()
    c = Simulation(SimConfig.from_preset("chat", seed=6, eager=True, **SMALL)).run()
    assert a.ok and b.ok and c.ok
    assert _fingerprint(a) == _fingerprint(b)
    assert _fingerprint(a) != _fingerprint(c)


class CorruptingManager:
    """The real manager, but one materialized hidden row is wrong."""

    def __init__(self, inner: OmniPrefixCacheManager, at_call: int = 8) -> None:
        self.inner = inner
        self.calls = 0
        self.at_call = at_call
        self.corrupted: tuple[int, str] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def materialize(self, step_id: int, req_ids: Any) -> Any:
        out = self.inner.materialize(step_id, req_ids)
        self.calls += 1
        if self.corrupted is None and self.calls >= self.at_call:
            req = next(iter(out.hidden_states))
            out.hidden_states[req][0] += 0.125
            self.corrupted = (step_id, req)
        return out


def test_a_corrupted_output_is_reported_naming_request_step_key_position() -> None:
    made: list[CorruptingManager] = []

    def factory(config: PrefixCacheConfig, eager: bool) -> CorruptingManager:
        made.append(CorruptingManager(OmniPrefixCacheManager(config, eager=eager)))
        return made[0]

    res = Simulation(SimConfig.from_preset("chat", seed=2, **SMALL), manager_factory=factory).run()
    assert not res.ok
    step_id, req = made[0].corrupted or (None, None)
    first = res.mismatches[0]
    assert (first.step_id, first.req_id, first.key) == (step_id, req, HIDDEN_KEY)
    assert first.position is not None and "differs from the ground truth" in first.detail
    assert summarize(res)["mismatches"][0]["request"] == req


def test_a_scribbled_block_pool_is_caught_on_a_later_hit() -> None:
    class Scribbler(OmniPrefixCacheManager):
        saves = 0

        def save_outputs(self, *args: Any, **kwargs: Any) -> int:
            sid = super().save_outputs(*args, **kwargs)
            Scribbler.saves += 1
            if Scribbler.saves == 6:  # the cache diverges behind the manager's back
                junk = torch.full((self.config.num_slots, 64), 3.0)
                self.pool.write(HIDDEN_KEY, torch.arange(self.config.num_slots), junk)
            return sid

    res = Simulation(
        SimConfig.from_preset("chat", seed=0, **SMALL),
        manager_factory=lambda config, eager: Scribbler(config, eager=eager),
    ).run()
    assert not res.ok
    cached = [m for m in res.mismatches if m.key == HIDDEN_KEY and "cached prefix" in m.detail]
    assert cached and cached[0].position is not None and cached[0].req_id is not None


def test_a_failed_pool_write_stops_the_run_with_a_contract_error() -> None:
    class FailFifth(FaultHooks):
        n = 0

        def before_pool_write(self, write: Any, key: str) -> None:
            FailFifth.n += 1
            if FailFifth.n == 5:
                raise OSError("injected pool write failure")

    res = Simulation(
        SimConfig.from_preset("chat", seed=0, **SMALL),
        manager_factory=lambda config, eager: OmniPrefixCacheManager(config, eager=eager, faults=FailFifth()),
    ).run()
    assert not res.ok
    assert any("injected pool write failure" in m.detail or "write failed" in m.detail for m in res.mismatches)
    assert res.steps < 20  # stopped at the failure, no hang


def _cli(argv: list[str]) -> int:
    """``omni-cache simulate ARGV``'s exit code (a usage error's SystemExit included)."""
    try:
        return main(["simulate", *argv])
    except SystemExit as exc:
        return int(exc.code or 0)


def test_cli_json_summary_and_steps_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["--preset", "multiturn", "--requests", "12", "--json", "--async", "--dtype", "bfloat16"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["mode"] == "async" and summary["preset"] == "multiturn"
    for key in ("requests", "steps", "tokens", "prefix_cache", "served_from_cache_tokens", "staging",
                "bytes_cached", "tokens_per_s"):
        assert key in summary
    assert summary["staging"]["claim_wait_ms_p99"] >= summary["staging"]["claim_wait_ms_p50"] >= 0
    assert set(summary["bytes_cached"]["written"]) == {"hidden", "audio.codes", "audio.embeds"}
    assert _cli(["--steps-limit", "5", "--json"]) == 3  # cut short: not OK
    limited = json.loads(capsys.readouterr().out)
    assert limited["steps"]["run"] == 5 and limited["steps"]["stopped_by_steps_limit"]
    assert not limited["complete"] and limited["ok"]
    assert _cli(["--steps-limit", "5", "--json", "--allow-incomplete"]) == 0
    assert _cli(["--block-size", "0"]) == 2


def test_a_run_that_verified_no_request_whole_is_incomplete(capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose every request the workload aborted (here one conversation's first turn, its later
    turns skipped) verified no request whole: exit 3 naming why, never OK (0 only when allowed)."""
    assert _cli(["--preset", "multiturn", "--requests", "4", "--seed", "0", "--json"]) == 3
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["ok"] and not summary["complete"] and summary["requests"]["verified_by_talker"] == 0
    assert "no request was finished and verified whole: the workload aborted the 1 that ran" in err
    assert _cli(["--preset", "multiturn", "--requests", "4", "--seed", "0", "--allow-incomplete"]) == 0
    assert "result: INCOMPLETE: 4 requests asked, 1 run, 0 finished and verified whole" in capsys.readouterr().out


def test_cli_exits_1_with_a_report_on_mismatch(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(
        sim_engine, "default_manager",
        lambda config, eager: CorruptingManager(OmniPrefixCacheManager(config, eager=eager), at_call=3),
    )
    assert _cli(["--requests", "8"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "request req-" in out and "key 'hidden'" in out and "position" in out


def test_cuda_device_is_refused_cleanly_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="no CUDA device"):
        SimConfig.from_preset("chat", device="cuda")
    assert _cli(["--device", "cuda"]) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
@pytest.mark.parametrize("preset", ["chat", "audio"])
def test_cuda_stream_path_serves_the_ground_truth(preset: str) -> None:
    res = Simulation(SimConfig.from_preset(preset, seed=3, eager=False, device="cuda", **SMALL)).run()
    assert res.ok, [str(m) for m in res.mismatches[:3]]
    assert res.rows_from_cache > 0 and res.talker_completed > 0


def test_a_contract_error_in_materialize_is_reported_and_the_run_stops() -> None:
    class Raising(CorruptingManager):
        def materialize(self, step_id: int, req_ids: Any) -> Any:
            self.calls += 1
            if self.calls == 4:
                self.corrupted = (step_id, "")
                raise RuntimeError("boom: is not readable")
            return self.inner.materialize(step_id, req_ids)

    made: list[Raising] = []

    def factory(config: PrefixCacheConfig, eager: bool) -> Raising:
        made.append(Raising(OmniPrefixCacheManager(config, eager=eager)))
        return made[0]

    res = Simulation(SimConfig.from_preset("chat", seed=0, **SMALL), manager_factory=factory).run()
    assert not res.ok
    first = res.mismatches[0]
    assert made[0].corrupted is not None and first.step_id == made[0].corrupted[0]
    assert "materialize raised RuntimeError: boom" in first.detail
    assert res.steps < 40  # the engine stopped soon after the builder failed


def test_the_builder_delay_help_names_the_simulators_claim_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    """The help's bound on --builder-delay-ms says the simulator's own staging claim timeout."""
    from omni_cache.harness.sim_engine.config import SimConfig

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"a save waits for a staging slot at most {SimConfig.claim_timeout_s:g} s" in help_text
    assert SimConfig.claim_timeout_s * 1000 > 10_000  # the largest delay the flag takes stays under it
