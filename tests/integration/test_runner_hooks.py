"""PrefixCacheRunnerHooks: lifecycle, pipeline-parallel rank, dummy runs, output path.

The manager is built lazily at the first real step and only on the last PP
rank; warmup/dummy runs never reach it; materialize uses the save-time request
ids (I4) and a step is consumed exactly once (I1) -- by materialize, by discard
when the payload comes from live outputs, or by discard when materialize fails
(so a failed read never pins a staging slot: I2).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from fakes_vllm import (
    CacheConfig,
    NewRequestData,
    OmniSchedulerOutput,
    SchedulerOutput,
    VllmConfig,
    kv_cache_config,
    truth_rows,
)
from fakes_vllm_engine import FakeModelRunner

from omni_cache import ModelCachePolicy, OmniPrefixCacheUnmatchError, PrefixCacheConfig
from omni_cache.integration import BlockTableView, PrefixCacheRunnerHooks
from omni_cache.runtime.manager import OmniPrefixCacheManager

BS = 4
PROMPT = list(range(30, 40))


class Model:
    requires_full_prefix_cached_hidden_states = True


class SpyFactory:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.managers: list[OmniPrefixCacheManager] = []

    def __call__(self, config: PrefixCacheConfig, **kwargs: Any) -> OmniPrefixCacheManager:
        spy = self

        class Spy(OmniPrefixCacheManager):
            def register_policy(self, policy: ModelCachePolicy) -> None:
                spy.calls.append("register_policy")
                super().register_policy(policy)

            def new_step_starts(self, events: Any, **kw: Any) -> None:
                spy.calls.append("new_step_starts")
                super().new_step_starts(events, **kw)

            def save_outputs(self, *args: Any, **kw: Any) -> int:
                spy.calls.append("save_outputs")
                return super().save_outputs(*args, **kw)

        manager = Spy(config, **kwargs)
        self.managers.append(manager)
        return manager


def _so(*new: NewRequestData, finished=()) -> SchedulerOutput:
    scheduled = {n.req_id: len(n.prompt_token_ids or ()) - n.num_computed_tokens for n in new}
    so = OmniSchedulerOutput.make_empty()
    so.scheduled_new_reqs = list(new)
    so.num_scheduled_tokens = scheduled
    so.total_num_scheduled_tokens = sum(scheduled.values())
    so.finished_req_ids = set(finished)
    return so


def _hooks(factory: Any = None, **kw: Any) -> PrefixCacheRunnerHooks:
    hooks = PrefixCacheRunnerHooks(manager_factory=factory, eager=True, **kw)
    hooks.on_model_loaded(Model())
    hooks.on_kv_cache_initialized(VllmConfig(), kv_cache_config(16, BS))
    return hooks


def _run(hooks: PrefixCacheRunnerHooks, so: SchedulerOutput) -> int | None:
    return FakeModelRunner(hooks, block_size=BS).execute_model(so)


def test_manager_is_built_lazily_at_the_first_real_step() -> None:
    spy = SpyFactory()
    hooks = _hooks(spy, is_last_pp_rank=True)
    assert hooks.manager is None and spy.managers == []
    step_id = _run(hooks, _so(NewRequestData("r", PROMPT, ([1, 2, 3],), 0)))
    assert len(spy.managers) == 1 and hooks.manager is spy.managers[0]
    assert spy.calls == ["register_policy", "new_step_starts", "save_outputs"]
    assert hooks.manager.policy == ModelCachePolicy.from_model(Model())
    assert step_id is not None
    out = hooks.materialize(step_id)
    torch.testing.assert_close(out.hidden_states["r"], truth_rows(PROMPT, 0, 10))
    _run(hooks, _so())
    assert len(spy.managers) == 1


@pytest.mark.parametrize("rank", [False, lambda: False])
def test_not_the_last_pp_rank_never_builds_a_manager(rank: Any) -> None:
    spy = SpyFactory()
    hooks = _hooks(spy, is_last_pp_rank=rank)
    assert _run(hooks, _so(NewRequestData("r", PROMPT, ([1, 2, 3],), 0))) is None
    assert spy.managers == [] and hooks.manager is None and spy.calls == []


def test_the_pp_rank_is_asked_from_vllm_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []

    def get_pp_group() -> Any:
        asked.append(True)
        return types.SimpleNamespace(is_last_rank=False, rank_in_group=0, world_size=2)

    fake = types.ModuleType("vllm.distributed.parallel_state")
    fake.get_pp_group = get_pp_group  # type: ignore[attr-defined]
    fake.get_tp_group = lambda: types.SimpleNamespace(rank_in_group=0, world_size=1)  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.distributed"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", fake)
    spy = SpyFactory()
    hooks = _hooks(spy)  # is_last_pp_rank=None, rank=None: ask vLLM
    assert asked == []
    for _ in range(2):
        assert hooks.begin_step(_so(NewRequestData("r", PROMPT, ([1, 2, 3],), 0))) is None
    assert asked == [True] and spy.managers == []


def test_dummy_runs_are_never_fed() -> None:
    spy = SpyFactory()
    hooks = _hooks(spy, is_last_pp_rank=True)
    so = _so(NewRequestData("warm", PROMPT, ([1, 2, 3],), 0))
    assert hooks.begin_step(so, is_dummy=True) is None
    assert hooks.after_forward(torch.zeros(10, 4), {}, num_tokens_unpadded=10, num_tokens_padded=16,
                               is_dummy=True) is None
    assert spy.managers == [] and hooks.adapter.live_req_ids == frozenset()
    _run(hooks, _so(NewRequestData("r", PROMPT, ([1, 2, 3],), 0)))  # first real step
    assert hooks.after_forward(torch.zeros(10, 4), {}, num_tokens_unpadded=10, num_tokens_padded=16,
                               is_dummy=True) is None
    assert spy.calls.count("save_outputs") == 1


def test_after_forward_without_begin_step_raises() -> None:
    hooks = _hooks(is_last_pp_rank=True)
    step_id = _run(hooks, _so(NewRequestData("r", PROMPT, ([1, 2, 3],), 0)))
    assert step_id is not None
    view = BlockTableView(["r"], [0], torch.tensor([[1, 2, 3]]), block_size=BS)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="no begin_step for this step"):
        hooks.after_forward(torch.zeros(10, 4), {}, view=view, num_tokens_unpadded=10, num_tokens_padded=10)


def test_set_up_order_is_enforced() -> None:
    no_kv = PrefixCacheRunnerHooks(is_last_pp_rank=True, eager=True)
    no_kv.on_model_loaded(Model())
    with pytest.raises(OmniPrefixCacheUnmatchError, match="before the KV cache was initialized"):
        no_kv.begin_step(_so())
    no_model = PrefixCacheRunnerHooks(is_last_pp_rank=True, eager=True)
    no_model.on_kv_cache_initialized(VllmConfig(), kv_cache_config(16, BS))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="before the model was loaded"):
        no_model.begin_step(_so())


def test_policy_is_frozen_at_model_load() -> None:
    hooks = _hooks(is_last_pp_rank=True)
    assert hooks.on_model_loaded(Model()) == hooks.policy  # same policy again: fine

    class Other:
        requires_full_prefix_cached_hidden_states = True
        deferred_prefix_cache_mm_keys = ("audio.codes",)

    with pytest.raises(OmniPrefixCacheUnmatchError, match="frozen at model load"):
        hooks.on_model_loaded(Other())


def test_prefix_caching_off_makes_every_hook_a_no_op() -> None:
    spy = SpyFactory()
    hooks = PrefixCacheRunnerHooks(manager_factory=spy, is_last_pp_rank=True)
    hooks.on_model_loaded(Model())
    off = VllmConfig(cache_config=CacheConfig(enable_prefix_caching=False))
    assert hooks.on_kv_cache_initialized(off, kv_cache_config(16, BS)) is None
    assert _run(hooks, _so(NewRequestData("r", PROMPT, ([1, 2, 3],), 0))) is None
    assert spy.managers == [] and hooks.shutdown() == {}
    assert hooks.build_payload(None, lambda out: out) is None


def test_configure_after_the_manager_runs_raises() -> None:
    hooks = _hooks(is_last_pp_rank=True)
    hooks.begin_step(_so())
    with pytest.raises(OmniPrefixCacheUnmatchError, match="already running"):
        hooks.configure(PrefixCacheConfig(num_blocks=8, block_size=BS))


def test_build_payload_from_live_outputs_discards_the_step() -> None:
    hooks = _hooks(is_last_pp_rank=True)
    step_id = _run(hooks, _so(NewRequestData("r", PROMPT, ([1, 2, 3],), 0)))
    seen: list[Any] = []
    assert hooks.build_payload(step_id, lambda out: seen.append(out) or "live", from_live_outputs=True) == "live"
    assert seen == [None]
    stats = hooks.manager.stats()
    assert (stats["discarded"], stats["materialized"], stats["unconsumed_step_ids"]) == (1, 0, {})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed or never saved"):
        hooks.materialize(step_id)


def test_build_payload_materializes_once() -> None:
    hooks = _hooks(is_last_pp_rank=True)
    step_id = _run(hooks, _so(NewRequestData("r", PROMPT, ([1, 2, 3],), 0)))
    rows = hooks.build_payload(step_id, lambda out: out.hidden_states["r"])
    torch.testing.assert_close(rows, truth_rows(PROMPT, 0, 10))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed or never saved"):
        hooks.build_payload(step_id, lambda out: out)


def test_a_materialize_that_fails_before_consuming_discards_the_step() -> None:
    class Failing(OmniPrefixCacheManager):
        def materialize(self, step_id: int, req_ids: Any) -> Any:
            raise RuntimeError("builder crashed before reading")

    hooks = _hooks(lambda config, **kw: Failing(config, **kw), is_last_pp_rank=True)
    step_id = _run(hooks, _so(NewRequestData("r", PROMPT, ([1, 2, 3],), 0)))
    with pytest.raises(RuntimeError, match="builder crashed"):
        hooks.materialize(step_id)
    stats = hooks.manager.stats()
    assert stats["unconsumed_step_ids"] == {} and stats["discarded"] == 1  # the staging slot is not pinned


def test_an_unreadable_hit_raises_and_leaves_nothing_unconsumed() -> None:
    hooks = _hooks(is_last_pp_rank=True)
    # a 4-token hit on block 5, which this cache never saw written: "is not readable" (I6)
    step_id = _run(hooks, _so(NewRequestData("r", PROMPT, ([5, 6, 7],), 4)))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="is not readable"):
        hooks.materialize(step_id)
    assert hooks.manager.stats()["unconsumed_step_ids"] == {}
    assert hooks.save_time_req_ids(step_id) is None
    with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed or never saved"):
        hooks.discard(step_id)


def test_shutdown_reports_unconsumed_steps() -> None:
    hooks = _hooks(is_last_pp_rank=True)
    step_id = _run(hooks, _so(NewRequestData("r", PROMPT, ([1, 2, 3],), 0)))
    unconsumed = hooks.shutdown()
    assert list(unconsumed) == [step_id] and "fakes_vllm_engine.py" in unconsumed[step_id]


def test_explicit_write_layout_and_counts() -> None:
    hooks = _hooks(is_last_pp_rank=True)
    hooks.begin_step(_so(NewRequestData("r", PROMPT, ([1, 2, 3],), 0)))
    view = BlockTableView(["r"], [0], torch.tensor([[1, 2, 3]]), block_size=BS)
    layout = hooks.adapter.build_write_layout(view, num_scheduled_tokens={"r": 10})
    step_id = hooks.after_forward(truth_rows(PROMPT, 0, 10), None, write_layout=layout,
                                  num_tokens_unpadded=10, num_tokens_padded=10)
    assert step_id is not None and hooks.save_time_req_ids(step_id) == ("r",)
    hooks.begin_step(_so())
    with pytest.raises(ValueError, match="pass view= or write_layout="):
        hooks.after_forward(torch.zeros(1, 4), {}, num_tokens_unpadded=1, num_tokens_padded=1)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="no manager"):
        PrefixCacheRunnerHooks(is_last_pp_rank=True).discard(1)


def test_a_request_withheld_after_a_failed_kv_load_is_resumed_on_its_prefix() -> None:
    """``withhold`` leaves a request out of its step's materialize (its KV load failed: vLLM fails it
    or recomputes it from the first failed block); its next EXTENDED (the cut ``num_computed_tokens``)
    becomes RESUMED on the prefix's blocks, so the cut hit is served again -- never the vacated block."""
    from fakes_vllm import CachedRequestData

    from omni_cache.runtime.events import PrefixCacheEventKind as K

    hooks = _hooks(is_last_pp_rank=True)
    step_id = _run(hooks, _so(NewRequestData("r", PROMPT, ([1, 2, 3],), 0), NewRequestData("s", PROMPT[:8], ([4, 5],), 0)))
    assert step_id is not None
    hooks.withhold(step_id, {"r": (1, 2, 3)})
    out = hooks.materialize(step_id)
    assert set(out.hidden_states) == {"s"}
    so = OmniSchedulerOutput.make_empty()
    so.scheduled_cached_reqs = CachedRequestData(["r"], set(), [[]], {}, [None], [BS], [0])
    so.num_scheduled_tokens = {"r": len(PROMPT) - BS}
    so.total_num_scheduled_tokens = len(PROMPT) - BS
    step = hooks.begin_step(so)
    assert step is not None
    (event,) = [e for e in step.events if e.req_id == "r"]
    assert event.kind is K.RESUMED and event.hit_end == BS and event.block_ids == ((1,),)
    assert hooks.reloaded_req_ids == {"r"}
    hooks.manager.shutdown()
