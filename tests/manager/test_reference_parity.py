"""Reference parity: the vLLM-Omni prefix cache's public-API tests, rewritten, run against omni-cache.

The reference (vllm-project/vllm-omni, ``vllm_omni/core/prefix_cache/``, commit
9b356ef) tests its cache in ``tests/core/test_prefix_cache*.py``. The port holds
those that use only the public API, re-expressed in our words; they import
the reference's module names, which a pure renaming shim (``_install_shim``, in
tests/manager/reference_parity_shim.py with the helpers the port's files share)
maps to omni-cache's modules -- nothing else is adapted. Where omni-cache
deliberately differs (``spec/contract.md`` section 13, "differences from the
reference"), the reference's expectation is kept as a strict xfail: it must keep
failing, so the table stays true.

The port follows the reference's files. This one: the manager's tests
(``test_prefix_cache.py``: a miss, a hit's merge, partial matches, same-step hits, absent
rows, unaligned or blockless hits, mm and deferred keys, padded steps, tenant succession,
the model policy, step ids consumed once, full staging, the save snapshot, staging
capacity) and the config gate's refusal of decode context parallel.
tests/manager/test_reference_parity_adapter.py: the scheduler adapter's
(``test_prefix_cache_adapter.py``); tests/manager/test_reference_parity_replacement.py:
replacement, the manager side (``test_prefix_cache_replacement.py``).

Not ported: tests that read private attributes (``_step_ctxs``, ``_controller``,
``_request_progress``, ``_observed_owners``, ...), the delivery-acknowledgement
tests (``test_prefix_cache_delivery.py``, ``test_prefix_cache_replacement.py``'s
``delivery_view``/``ack_delivery``/``commit_output``: a listed difference), tests
that need a vLLM runtime (``test_prefix_cache_resume.py``,
``test_prefix_cache_runner_mixin.py``), and the reference's group-view and
``stage_prefix_cache_config(**fields)`` tests (a different integration seam,
listed too). Their public behaviour is covered by ``tests/request_identity/test_identity_and_replay.py``
and the integration tests.

Invariants touched: I1, I2, I4, I5, I6, I10 (as the reference's tests do; the port's other
files: I9, I12, I13).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from reference_parity_shim import DTYPE, HIDDEN, K, make_manager, new_req
from vllm_omni.core.prefix_cache.adapter import PrefixCacheRequestEvent
from vllm_omni.core.prefix_cache.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
)


def rows_of(slots: torch.Tensor) -> torch.Tensor:
    """Every row's value is its KV slot id, as in the reference's tests."""
    return slots.to(DTYPE).unsqueeze(1).expand(slots.numel(), HIDDEN).clone()


def run_step(mgr, view, reqs, new_hits=None, finished=(), mm=None, num_tokens_padded=None) -> int:
    """One step: ``reqs`` maps req -> (blocks, first scheduled position, scheduled tokens)."""
    view.order = list(reqs)
    scheduled, new, slot_parts = {}, [], []
    for req_id, (blocks, start, n) in reqs.items():
        view.req_blocks[req_id] = blocks
        view.computed[req_id] = start
        scheduled[req_id] = n
        slot_parts.append(view.slots_for(req_id, start, start + n))
        new.append(new_req(req_id, (new_hits or {}).get(req_id, 0), [list(blocks)]))
    out = SimpleNamespace(scheduled_new_reqs=new, finished_req_ids=set(finished), num_scheduled_tokens=scheduled)
    events = view.adapter.translate_scheduler_output(out)
    layout = view.adapter.build_write_layout(view, num_scheduled_tokens=scheduled)
    mgr.new_step_starts(events)
    slots = torch.cat(slot_parts)
    n = int(slots.numel())
    return mgr.save_outputs(rows_of(slots), mm or {}, num_tokens_unpadded=n,
                            num_tokens_padded=n if num_tokens_padded is None else num_tokens_padded,
                            write_layout=layout)


def test_a_miss_passes_this_steps_rows_through() -> None:
    mgr, view = make_manager()
    sid = run_step(mgr, view, {"a": ([0, 1], 0, 8)})
    assert torch.equal(mgr.materialize(sid, ["a"]).hidden_states["a"], rows_of(view.slots_for("a", 0, 8)))


def test_a_hit_merges_the_cached_prefix() -> None:
    mgr, view = make_manager()
    mgr.materialize(run_step(mgr, view, {"a": ([0, 1], 0, 8)}), ["a"])
    sid = run_step(mgr, view, {"b": ([0, 1, 2], 8, 4)}, new_hits={"b": 8}, finished=["a"])
    merged = mgr.materialize(sid, ["b"]).hidden_states["b"]
    assert merged.shape == (12, HIDDEN) and torch.equal(merged, rows_of(view.slots_for("b", 0, 12)))


@pytest.mark.parametrize("a_finished_first", [False, True])
def test_a_partial_match_hits_the_shared_prefix_only(a_finished_first) -> None:
    mgr, view = make_manager()
    mgr.materialize(run_step(mgr, view, {"a": ([0, 1, 2], 0, 12)}), ["a"])
    sid = run_step(mgr, view, {"b": ([0, 1, 3], 8, 4)}, new_hits={"b": 8},
                   finished=["a"] if a_finished_first else ())
    assert torch.equal(mgr.materialize(sid, ["b"]).hidden_states["b"], rows_of(view.slots_for("b", 0, 12)))
    # a later request hitting b's divergent third block reads b's rows there
    sid = run_step(mgr, view, {"c": ([0, 1, 3, 4], 12, 1)}, new_hits={"c": 12}, finished=["b"])
    assert torch.equal(mgr.materialize(sid, ["c"]).hidden_states["c"], rows_of(view.slots_for("c", 0, 13)))


def test_a_live_request_back_among_new_ones_is_not_a_hit_until_it_finishes() -> None:
    mgr, view = make_manager()
    mgr.materialize(run_step(mgr, view, {"a": ([0, 1], 0, 8)}), ["a"])
    sid = run_step(mgr, view, {"a": ([0, 1, 2], 8, 4)}, new_hits={"a": 8})  # a chunk continuation
    assert torch.equal(mgr.materialize(sid, ["a"]).hidden_states["a"], rows_of(view.slots_for("a", 8, 12)))
    mgr.materialize(run_step(mgr, view, {"b": ([3], 0, 2)}, finished=["a"]), ["b"])
    sid = run_step(mgr, view, {"a": ([0, 1, 4], 8, 4)}, new_hits={"a": 8}, finished=["b"])
    out = mgr.materialize(sid, ["a"]).hidden_states["a"]
    assert out.shape == (12, HIDDEN) and torch.equal(out[:8], rows_of(view.slots_for("a", 0, 8)))


def test_a_same_step_hit_reads_rows_written_in_that_step() -> None:
    mgr, view = make_manager()
    view.req_blocks["a"] = [0, 1]
    sid = run_step(mgr, view, {"a": ([0, 1], 0, 8), "b": ([0, 1, 2], 8, 4)}, new_hits={"b": 8})
    out = mgr.materialize(sid, ["a", "b"])
    assert torch.equal(out.hidden_states["b"][:8], rows_of(view.slots_for("b", 0, 8)))


def test_a_hit_on_absent_rows_raises() -> None:
    mgr, view = make_manager()
    view.req_blocks["c"] = [5, 6]
    sid = run_step(mgr, view, {"c": ([5, 6, 7], 8, 4)}, new_hits={"c": 8})
    with pytest.raises(OmniPrefixCacheUnmatchError):
        mgr.materialize(sid, ["c"])
    mgr.materialize(run_step(mgr, view, {"d": ([8], 0, 2)}), ["d"])  # the cache stays usable


def test_a_hit_without_blocks_or_unaligned_raises_at_register() -> None:
    mgr, view = make_manager()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="carries no block_ids"):
        mgr.new_step_starts((PrefixCacheRequestEvent("empty", K.STARTED, hit_end=4, block_ids=((),)),))
    mgr.materialize(run_step(mgr, view, {"a": ([0, 1], 0, 8)}), ["a"])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="prefix hit not block aligned"):
        run_step(mgr, view, {"b": ([0, 1, 2], 8, 4)}, new_hits={"b": 6})


def test_mm_keys_merge_key_major() -> None:
    mgr, view = make_manager()
    first = {"talker.h": torch.arange(24, dtype=DTYPE).reshape(8, 3)}
    mgr.materialize(run_step(mgr, view, {"a": ([0, 1], 0, 8)}, mm=first), ["a"])
    second = {"talker.h": torch.full((4, 3), 7.0)}
    sid = run_step(mgr, view, {"b": ([0, 1, 2], 8, 4)}, new_hits={"b": 8}, finished=["a"], mm=second)
    merged = mgr.materialize(sid, ["b"]).mm_outputs["talker.h"]["b"]
    assert torch.equal(merged, torch.cat([first["talker.h"], second["talker.h"]]))


@pytest.mark.parametrize("padded", [None, 16])
def test_codes_audio_is_an_ordinary_per_token_key_even_on_a_padded_step(padded) -> None:
    mgr, view = make_manager()
    audio = torch.arange(16, dtype=DTYPE).reshape(8, 2)
    sid = run_step(mgr, view, {"a": ([0, 1], 0, 8)}, mm={"codes.audio": audio}, num_tokens_padded=padded)
    assert torch.equal(mgr.materialize(sid, ["a"]).mm_outputs["codes.audio"]["a"], audio)
    more = torch.full((4, 2), 3.0)
    sid = run_step(mgr, view, {"b": ([0, 1, 2], 8, 4)}, new_hits={"b": 8}, finished=["a"],
                   mm={"codes.audio": more}, num_tokens_padded=padded)
    assert torch.equal(mgr.materialize(sid, ["b"]).mm_outputs["codes.audio"]["b"], torch.cat([audio, more]))


def test_deferred_key_hit_and_padded_step() -> None:
    mgr, view = make_manager(ModelCachePolicy(deferred_keys=frozenset({"k"})))
    mgr.materialize(run_step(mgr, view, {"a": ([0], 0, 4)}, mm={"k": torch.full((4, 2), 1.0)}), ["a"])
    sid = run_step(mgr, view, {"b": ([0, 1], 4, 2)}, new_hits={"b": 4}, mm={"k": torch.full((2, 2), 9.0)})
    rows = mgr.materialize(sid, ["b"]).mm_outputs["k"]["b"]
    assert torch.equal(rows, torch.cat([torch.full((4, 2), 1.0), torch.full((2, 2), 9.0)]))
    mgr, view = make_manager(ModelCachePolicy(needs_full_hidden_states=False, deferred_keys=frozenset({"codes.audio"})))
    audio = torch.arange(16, dtype=DTYPE).reshape(8, 2)
    sid = run_step(mgr, view, {"a": ([0, 1], 0, 8)}, mm={"codes.audio": audio}, num_tokens_padded=16)
    assert torch.equal(mgr.materialize(sid, ["a"]).mm_outputs["codes.audio"]["a"], audio)


def test_tenant_succession_a_hit_reads_the_newest_tenant() -> None:
    mgr, view = make_manager()
    mgr.materialize(run_step(mgr, view, {"a": ([2], 0, 4)}, mm={"k": torch.full((4, 2), 1.0)}), ["a"])
    mgr.materialize(run_step(mgr, view, {"b": ([2], 0, 4)}, finished=["a"], mm={"k": torch.full((4, 2), 2.0)}), ["b"])
    sid = run_step(mgr, view, {"c": ([2, 3], 4, 2)}, new_hits={"c": 4}, finished=["b"],
                   mm={"k": torch.full((2, 2), 3.0)})
    out = mgr.materialize(sid, ["c"])
    assert torch.equal(out.mm_outputs["k"]["c"], torch.cat([torch.full((4, 2), 2.0), torch.full((2, 2), 3.0)]))
    assert torch.equal(out.hidden_states["c"][:4], rows_of(view.slots_for("c", 0, 4)))


def test_policy_from_model_shim() -> None:
    class Model:
        requires_full_prefix_cached_hidden_states = False
        deferred_prefix_cache_mm_keys = frozenset({"codes.audio"})
        mm_outputs_written_in_sample = True

    policy = ModelCachePolicy.from_model(Model())
    assert (policy.needs_full_hidden_states, policy.hidden_key, policy.deferred_keys) == (
        False, None, frozenset({"codes.audio"}))
    assert policy.mm_outputs_written_in_sample and policy.skip_immediate_mm("codes.audio")
    assert policy.get_hit_keys([HIDDEN_KEY, "codes.audio"]) == ["codes.audio"]
    default = ModelCachePolicy.from_model(object())
    assert default.hidden_key == HIDDEN_KEY and not default.deferred_keys
    assert default.get_hit_keys(["talker.h", HIDDEN_KEY]) == [HIDDEN_KEY, "talker.h"]
    with pytest.raises(OmniPrefixCacheUnmatchError, match="mm_outputs_written_in_sample"):
        ModelCachePolicy(mm_outputs_written_in_sample=True)


def test_step_ids_are_consumed_by_id_exactly_once() -> None:
    mgr, view = make_manager()
    s1 = run_step(mgr, view, {"a": ([0], 0, 4)})
    s2 = run_step(mgr, view, {"b": ([1], 0, 4)})
    mgr.discard_step(s2)
    assert torch.equal(mgr.materialize(s1, ["a"]).hidden_states["a"], rows_of(view.slots_for("a", 0, 4)))
    for consume in (lambda: mgr.materialize(s1, ["a"]), lambda: mgr.discard_step(s1),
                    lambda: mgr.materialize(s1 + 999, ["ghost"])):
        with pytest.raises(OmniPrefixCacheUnmatchError):
            consume()


def test_full_staging_times_out_naming_unconsumed_steps() -> None:
    mgr, view = make_manager(staging_depth=2, staging_claim_timeout_s=0.05)
    with pytest.raises(OmniPrefixCacheStagingTimeoutError, match="unconsumed step contexts"):
        for pos in range(8):
            run_step(mgr, view, {"a": ([0, 1, 2, 3], pos, 1)})


@pytest.mark.xfail(strict=True, raises=ValueError,
                   reason="difference (contract section 13): staging_claim_timeout_s must be positive")
def test_reference_accepts_a_zero_claim_timeout() -> None:
    make_manager(staging_claim_timeout_s=0.0)


def test_a_layout_that_does_not_cover_the_step_raises() -> None:
    mgr, view = make_manager()
    view.order, view.req_blocks["a"], view.computed["a"] = ["a"], [0], 0
    events = view.adapter.translate_scheduler_output(
        SimpleNamespace(scheduled_new_reqs=[new_req("a")], finished_req_ids=set(), num_scheduled_tokens={"a": 2}))
    mgr.new_step_starts(events)
    layout = view.adapter.build_write_layout(view, num_scheduled_tokens={"a": 2})
    with pytest.raises(OmniPrefixCacheUnmatchError):
        mgr.save_outputs(torch.zeros(4, HIDDEN), {}, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)


def test_materialize_refuses_ids_outside_the_snapshot_and_oversized_steps_raise() -> None:
    mgr, view = make_manager()
    mgr.materialize(run_step(mgr, view, {"a": ([0, 1], 0, 8)}), ["a"])
    sid = run_step(mgr, view, {"b": ([0, 1, 2], 8, 4)}, new_hits={"b": 8}, finished=["a"])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="outside the save snapshot"):
        mgr.materialize(sid, ["b", "late_joiner"])
    small, view = make_manager(staging_capacity_tokens=4)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="staging capacity is 4"):
        run_step(small, view, {"a": ([0, 1], 0, 8)})


@pytest.mark.xfail(strict=True, raises=OmniPrefixCacheUnmatchError,
                   reason="difference (contract section 13): a never-written mm row raises, never reads as zeros")
def test_reference_serves_zeros_for_a_never_written_mm_row() -> None:
    mgr, view = make_manager(ModelCachePolicy(deferred_keys=frozenset({"k"})))
    mgr.materialize(run_step(mgr, view, {"a": ([0], 0, 4)}, mm={"k": torch.full((4, 2), 5.0)}), ["a"])
    mgr.materialize(run_step(mgr, view, {"c": ([1], 0, 4)}), ["c"])  # block 1 never gets "k"
    sid = run_step(mgr, view, {"b": ([0, 1, 2], 8, 2)}, new_hits={"b": 8}, mm={"k": torch.full((2, 2), 9.0)})
    rows = mgr.materialize(sid, ["b"]).mm_outputs["k"]["b"]
    assert torch.equal(rows[4:8], torch.zeros(4, 2))


# --------------------------------------------------------------------------- the gate


def test_the_gate_refuses_decode_context_parallel_as_the_reference_does() -> None:
    from fakes_vllm import VllmConfig, kv_cache_config

    from omni_cache.integration import stage_prefix_cache_config

    kv = kv_cache_config(8, 16)
    config = VllmConfig()
    assert stage_prefix_cache_config(config, kv) is not None
    config.parallel_config = SimpleNamespace(decode_context_parallel_size=1)  # type: ignore[attr-defined]
    assert stage_prefix_cache_config(config, kv) is not None
    config.parallel_config = SimpleNamespace(decode_context_parallel_size=2)  # type: ignore[attr-defined]
    with pytest.raises(OmniPrefixCacheUnmatchError, match="decode context parallel"):
        stage_prefix_cache_config(config, kv)
