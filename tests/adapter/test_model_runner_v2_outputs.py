"""The adapter on vLLM's real scheduler data classes, shaped as Model Runner V2 emits them.

The adapter side: vLLM 0.32's V2 scheduler re-delivers a resumed
request among ``scheduled_new_reqs`` and names preempted ids in
``SchedulerOutput.preempted_req_ids``; the adapter must emit RESUMED with the hit
(so materialize returns the full prefix: 80 rows, not this step's 16), a step
that schedules zero tokens still passes its finished ids, and an abort arrives
as a finished id (0.32 has no ``aborted_req_ids``). I12 (one admission per id).
Needs vLLM (skipped without it outside CI); the objects are vLLM's own dataclasses.
"""

from __future__ import annotations

import pytest
import torch
from cache_helpers import manager, save
from vllm_support import require_vllm

from omni_cache import PrefixCacheEventKind, PrefixCacheSchedulerAdapter

pytestmark = pytest.mark.vllm
try:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched import output as output_mod
except ImportError:  # the autouse fixture skips outside CI and fails under CI=true
    SamplingParams = output_mod = None


@pytest.fixture(autouse=True)
def _needs_vllm() -> None:
    require_vllm()

K = PrefixCacheEventKind


def new_req(req_id: str, computed: int, blocks: list[int], prompt_len: int = 96):
    return output_mod.NewRequestData(
        req_id=req_id, prompt_token_ids=list(range(prompt_len)), mm_features=[],
        sampling_params=SamplingParams(max_tokens=4), pooling_params=None, block_ids=(list(blocks),),
        num_computed_tokens=computed, lora_request=None)


def scheduler_output(new=(), scheduled=None, finished=(), preempted=None):
    scheduled = dict(scheduled or {})
    return output_mod.SchedulerOutput(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=output_mod.CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(finished),
        free_encoder_mm_hashes=[], preempted_req_ids=preempted)


def test_v2_resume_among_new_requests_is_resumed_with_the_full_prefix() -> None:
    adapter, m = PrefixCacheSchedulerAdapter(), manager(staging_capacity_tokens=128, num_blocks=64)
    try:
        blocks = list(range(20, 40))
        m.new_step_starts(adapter.translate_step(scheduler_output([new_req("v", 0, blocks)], {"v": 64})))
        step, rows = save(m, [("v", blocks, 0, 64)])
        m.discard_step(step)
        # preempted in a step that schedules nothing (a zero-token step), resumed later as "new"
        step0 = adapter.translate_step(scheduler_output(preempted={"v"}))
        assert step0.events == () and adapter.preempted_req_ids == {"v"}
        m.new_step_starts(step0)
        resumed = adapter.translate_step(scheduler_output([new_req("v", 64, blocks)], {"v": 16}))
        (event,) = resumed.events
        assert (event.kind, event.hit_end) == (K.RESUMED, 64)
        m.new_step_starts(resumed)
        step, new = save(m, [("v", blocks, 64, 80)])
        out = m.materialize(step, ["v"])
        assert out.hidden_states["v"].shape[0] == 80
        assert torch.equal(out.hidden_states["v"], torch.cat([rows, new]))
    finally:
        m.shutdown()


def test_zero_token_step_passes_finished_and_aborted_ids() -> None:
    adapter = PrefixCacheSchedulerAdapter()
    adapter.translate_step(scheduler_output([new_req("a", 0, [1]), new_req("b", 0, [2])], {"a": 4, "b": 4}))
    step = adapter.translate_step(scheduler_output(finished={"a", "b"}))  # "b" was aborted: 0.32 says finished
    assert [(e.req_id, e.kind) for e in step] == [("a", K.FINISHED), ("b", K.FINISHED)]
    assert not adapter.live_req_ids
