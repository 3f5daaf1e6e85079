"""What the cache adds to a real engine step, measured on the real vLLM CPU engine (marker ``vllm``).

Protects the measurement's honesty, never a time: every configuration is measured on steps of
exactly its shape, every part is timed, the parts fit inside the totals they are part of, every
saved step id is materialized (none left at the end), and the probe leaves the engine's bridge as
it found it (the engine keeps serving, checked rows and all, after the probe is gone).
"""

from __future__ import annotations

import pytest
from vllm_support import shutdown_llm, small_llm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm():
    engine = small_llm(kv_blocks=64)
    yield engine
    shutdown_llm(engine)


def test_a_step_is_measured_part_by_part_and_the_bridge_is_left_as_found(llm) -> None:
    from omni_cache.harness.vllm_engine.step_cost import PARTS, STAGES, run_step_cost
    from omni_cache.integration.vllm_bridge import bridge_of, runner_of

    bridge, runner = bridge_of(llm), runner_of(llm)
    result = run_step_cost(llm, model="llama", repeats=1, decode_steps=4, decode_batches=(1, 3),
                           prefill_tokens=(64,))
    assert result.unconsumed == 0 and bridge.step_ids.qsize() == 0
    assert [(c.stage, c.kind, c.requests, c.rows) for c in result.configs] == [
        (s, k, r, n) for s in STAGES for k, r, n in (("decode", 1, 1), ("decode", 3, 3), ("prefill", 1, 64))]
    for c in result.configs:
        assert c.steps >= 3 if c.kind == "decode" else c.steps == 4
        p = c.parts_us
        assert set(p) == set(PARTS) and c.cache_us > 0 and c.forward_us > 0 and c.step_us > c.forward_us
        assert p["translate"] + p["new_step_starts"] <= p["begin_step"]  # parts inside their totals
        assert p["view"] + p["layout"] + p["save"] + p["model_outputs"] <= p["after_forward"]
        assert (p["model_outputs"] > 0) is (c.stage == "hidden+mm")  # the stand-in only where it runs
    assert result.one_token("hidden").requests == 1 and set(result.fit("hidden")) == {
        "intercept_us", "per_request_us", "per_row_us"}
    wrapped = {"begin_step", "after_forward_v1", "view_v1", "_model_forward", "materialize", "translate_step",
               "build_write_layout", "new_step_starts", "save_outputs"}
    for obj in (bridge, runner, bridge.hooks, bridge.hooks.adapter, bridge.hooks.manager):
        assert not wrapped & set(vars(obj)), (type(obj).__name__, wrapped & set(vars(obj)))  # the class's own again
    assert bridge.mm_outputs_fn is None  # as the engine was built (the probe set and reset it)
    from omni_cache.harness.vllm_engine.engine import VllmSimConfig, VllmSimulation
    from omni_cache.harness.vllm_engine.workload import PlannedRequest

    sim = VllmSimulation(VllmSimConfig(kv_blocks=64), [PlannedRequest("after", tuple(range(3, 70)), 3, 0)])
    res = sim.run(llm)  # the engine still serves, every row checked
    assert res.ok and res.rows_verified > 0, [str(m) for m in res.mismatches]
