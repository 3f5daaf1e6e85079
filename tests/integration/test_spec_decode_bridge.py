"""I14 on the producer side: the runner bridge hands a verify step on only with its verdict.

Protects ``VllmRunnerBridge`` with speculative decoding (``omni_cache.integration.spec_decode``):
a step whose requests carry draft tokens is held from its save (``after_forward_v1``) to the
end of sampling (``after_sample``), where the verdict -- the sampled tokens the rejection
sampler kept, and vLLM's own stop rule -- cuts the rows that are not the requests' through
``trim_step``; only then is the step id published, with the kept rows' spans. A step that gets
no verdict never leaves: it is discarded, and the cache fails (``queue``: the error raises).
The runner is a V1-shaped fake (tests/fakes_vllm.py's ``InputBatch``) around a real manager;
tests/integration/test_vllm_speculative.py runs the same on vLLM's real CPU engine.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fakes_vllm import CachedRequestData, InputBatch, NewRequestData, SchedulerOutput
from vllm_support import require_vllm

from omni_cache.integration.spec_decode import VerifyStep, verdict_of
from omni_cache.integration.vllm_bridge import VllmRunnerBridge
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.interface import PrefixCacheConfig

BS = 32


class _Runner:
    """The V1 runner's parts the bridge reads: ``input_batch`` (block tables with a slot mapping),
    ``requests`` (per request: sampling params, prompt length, output tokens), ``max_model_len``."""

    def __init__(self, bridge: VllmRunnerBridge) -> None:
        self.bridge = bridge
        self.input_batch = InputBatch(max_num_reqs=4, max_num_blocks_per_req=4, block_size=BS)
        for table in self.input_batch.block_table.block_tables:
            table.slot_mapping = SimpleNamespace(gpu=torch.zeros(256, dtype=torch.int64))
        self.requests: dict[str, Any] = {}
        self.max_model_len = 512

    def prefill(self, rid: str, prompt_len: int, blocks: list[int]) -> int | None:
        so = SchedulerOutput([NewRequestData(rid, list(range(prompt_len)), (blocks,), 0)], CachedRequestData.make_empty(),
                             {rid: prompt_len}, prompt_len)
        self.bridge.begin_step(so)
        self.input_batch.add_request(rid, 0, blocks)
        self.requests[rid] = SimpleNamespace(sampling_params=None, num_prompt_tokens=prompt_len, output_token_ids=[])
        return self._forward(so, {rid: 0})

    def verify(self, drafts: dict[str, int], computed: dict[str, int]) -> int | None:
        """One decode step: each request's sampled token plus ``drafts[r]`` draft tokens."""
        scheduled = {r: 1 + drafts.get(r, 0) for r in computed}
        so = SchedulerOutput([], CachedRequestData(list(computed), set(), [[] for _ in computed], {},
                                                   [None] * len(computed), list(computed.values()),
                                                   [0] * len(computed)),
                             scheduled, sum(scheduled.values()),
                             scheduled_spec_decode_tokens={r: [9] * k for r, k in drafts.items() if k})
        self.bridge.begin_step(so)
        for rid, c in computed.items():
            self.input_batch.num_computed_tokens_cpu[self.input_batch.req_id_to_index[rid]] = c
        return self._forward(so, computed)

    def _forward(self, so: Any, computed: dict[str, int]) -> int | None:
        ids = self.input_batch.req_ids[: self.input_batch.num_reqs]
        rows = torch.tensor([[float(ord(r[0])), float(p)] for r in ids
                             for p in range(computed.get(r, 0), computed.get(r, 0) + so.num_scheduled_tokens.get(r, 0))])
        n = rows.shape[0]
        return self.bridge.after_forward_v1(self, rows, torch.zeros(n, dtype=torch.int64),
                                            torch.zeros(n, dtype=torch.int64))

    def sample(self, tokens: dict[str, list[int]]) -> None:
        for rid, new in tokens.items():
            self.requests[rid].output_token_ids.extend(new)
        self.bridge.after_sample(SimpleNamespace(req_ids=list(tokens), sampled_token_ids=list(tokens.values())), self)


def _bridge(consumer: str = "queue") -> tuple[VllmRunnerBridge, _Runner]:
    bridge = VllmRunnerBridge({"consumer": consumer})
    bridge.hooks.configure(PrefixCacheConfig(num_blocks=16, block_size=BS, staging_capacity_tokens=256))
    bridge.on_model_loaded(SimpleNamespace())
    bridge.speculative = True  # what on_kv_cache_initialized sets for a speculative_config
    return bridge, _Runner(bridge)


def _rows_of(bridge: VllmRunnerBridge, rid: str) -> list[int]:
    """The positions of ``rid``'s rows in the next published step (column 1 holds the position)."""
    ps = bridge.step_ids.get_nowait()
    out = bridge.hooks.materialize(ps.step_id)
    return [int(p) for p in out.hidden_states[rid][:, 1].tolist()]


def test_I14_a_verify_step_is_handed_on_only_with_its_verdict() -> None:
    bridge, runner = _bridge()
    runner.prefill("A", 40, [1, 2])
    runner.prefill("B", 10, [3])
    assert _rows_of(bridge, "A") == list(range(40)) and _rows_of(bridge, "B") == list(range(10))
    runner.verify({"A": 3}, {"A": 40, "B": 10})  # A: its token at 40 and drafts at 41..43; B: no draft
    assert bridge.step_ids.empty(), "a verify step was handed on before its verdict"
    runner.sample({"A": [7, 8], "B": [5]})  # A's first draft accepted, the second rejected
    ps = bridge.step_ids.get_nowait()
    assert dict((r, (s, e)) for r, s, e in ps.spans) == {"A": (40, 42), "B": (10, 11)}
    out = bridge.hooks.materialize(ps.step_id)
    assert out.hidden_states["A"][:, 1].tolist() == [40.0, 41.0]
    assert out.hidden_states["B"][:, 1].tolist() == [10.0]
    assert bridge.verify_steps.counters == {"verify_steps": 1, "draft_tokens_accepted": 1,
                                            "draft_tokens_rejected": 2, "rows_trimmed": 2}
    assert bridge.hooks.manager.stats()["trimmed_rows"] == 2
    assert bridge.shutdown() == {}


def test_a_step_without_drafts_is_handed_on_at_once() -> None:
    bridge, runner = _bridge()
    runner.prefill("A", 40, [1, 2])
    assert not bridge.step_ids.empty()
    assert bridge.verify_steps.pending is None


@pytest.mark.parametrize("consumer", ["discard", "queue"])
def test_I14_a_verify_step_without_a_verdict_never_leaves(consumer: str) -> None:
    bridge, runner = _bridge(consumer)
    runner.prefill("A", 40, [1, 2])
    if consumer == "queue":
        bridge.hooks.materialize(bridge.step_ids.get_nowait().step_id)
    step_id = runner.verify({"A": 2}, {"A": 40})  # no sample_tokens follows (its execute_model failed)
    assert step_id is not None and bridge.hooks.save_time_req_ids(step_id) == ("A",)
    so = SchedulerOutput.make_empty()
    if consumer == "queue":
        with pytest.raises(OmniPrefixCacheUnmatchError, match="sample_tokens did not run"):
            bridge.begin_step(so)
    else:
        bridge.begin_step(so)
        assert bridge.failed is not None and "sample_tokens did not run" in bridge.failed
        assert sum(bridge.errors.counts().values()) == 1  # the contained error is counted
    assert bridge.step_ids.empty()
    assert bridge.hooks.manager.stats()["unconsumed_step_ids"] == {}  # discarded, never handed on
    assert bridge.hooks.save_time_req_ids(step_id) is None  # and the hooks forgot it


def test_an_output_without_sampled_token_lists_fails_the_verdict_and_hands_nothing_on() -> None:
    bridge, runner = _bridge("discard")
    runner.prefill("A", 40, [1, 2])
    runner.verify({"A": 2}, {"A": 40})
    bridge.after_sample(SimpleNamespace(req_ids=["A"], sampled_token_ids=torch.tensor([[7, -1, -1]])), runner)
    assert bridge.failed is not None and "carries no sampled token lists" in bridge.failed
    assert bridge.hooks.manager.stats()["unconsumed_step_ids"] == {}


def test_speculative_decoding_on_model_runner_v2_is_refused() -> None:
    bridge, _ = _bridge()
    bridge.hooks.begin_step(SchedulerOutput.make_empty())  # builds the manager: the cache is active
    with pytest.raises(OmniPrefixCacheUnmatchError, match="speculative decoding with Model Runner V2"):
        bridge.install_v2_block_mirror(SimpleNamespace())


@pytest.mark.vllm
@pytest.mark.parametrize(("max_tokens", "eos", "sampled", "kept"), [
    (100, None, [11, 12, 13, 14], 4),  # all 3 drafts accepted: the token and the drafts
    (100, None, [11, 99], 2),  # one accepted, the second rejected
    (100, None, [99], 1),  # the first rejected
    (6, None, [11, 12, 13, 14], 2),  # 4 outputs before: max_tokens stops after 2 of the 4 new tokens
    (100, 12, [11, 12, 13, 14], 2),  # the second new token is the end-of-sequence token
    (100, None, [], 1),  # no sampled token (an output vLLM drops): none of the drafts is kept
])
def test_the_verdict_keeps_one_row_per_token_of_the_final_output_but_the_last(
        max_tokens: int, eos: int | None, sampled: list[int], kept: int) -> None:
    """A request at position 20 with 4 outputs so far runs a verify step of its token and 3
    drafts (4 rows): the rows kept are its token's and the accepted drafts', cut where vLLM's
    own ``check_stop`` ends the request (``max_tokens``, end of sequence)."""
    require_vllm()
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    params.update_from_generation_config({}, eos_token_id=eos)
    state = SimpleNamespace(sampling_params=params, num_prompt_tokens=16, output_token_ids=[1, 2, 3, 4, *sampled])
    step = VerifyStep(1, 1, (("A", 20, 24), ("B", 5, 6)), {"A": 3})
    verdict = verdict_of(step, {"A": sampled, "B": [7]}, {"A": state}, 512)
    assert verdict.spans(step.spans) == (("A", 20, 20 + kept), ("B", 5, 6))
    assert verdict.accepted == max(len(sampled) - 1, 0)
    assert verdict.rejected == 3 - verdict.accepted


def test_the_sampled_tokens_are_read_from_vllms_bookkeeping_and_nothing_else() -> None:
    """``_bookkeeping_sync``'s 8 values give the tokens; another shape (another vLLM) is refused."""
    from omni_cache.integration.spec_decode import bookkeeping_tokens

    got = bookkeeping_tokens(({}, None, None, [[7, 8], [5]], {}, ["A", "B"], {"A": 0, "B": 1}, []))
    assert (got.req_ids, got.sampled_token_ids) == (["A", "B"], [[7, 8], [5]])
    for bad in ((1, 2, 3), ({}, None, None, None, {}, ["A"], {}, []), [[7]]):
        with pytest.raises(TypeError, match="_bookkeeping_sync returned"):
            bookkeeping_tokens(bad)
