"""Manager behaviour beyond the invariants, what a step is served: merges, policies, resume, errors.

A miss returns just the step's rows; a hit merges the cached prefix, then the step's rows, for the
hidden states and every per-token mm key, also a same-step hit on rows the save itself writes and a
one-token hit when a block is one token (I5); leftover (non per-token) mm values keep their shapes
per request; a padded token-major mm value is sliced to the unpadded rows; after block reuse the
newest tenant's rows are served (I7); the hidden opt-out still serves mm; a resume after preemption
serves the full prefix; contract errors on bad input change nothing; an ended request's untaken
hit is never served (I12).

Also: a zero-row write next to other requests' rows leaves a request's hit for the first step
that schedules it (contract section 4.4).

Deferred writes, the GPU staging budget and the stats counters:
tests/manager/test_deferred_budget_and_stats.py; the builder and committer threads, waits and
shutdown: tests/manager/test_threads_and_shutdown.py.
"""

from __future__ import annotations

import pytest
import torch
from cache_helpers import BS, MODES, WIDTH, E, config, manager, save, settle, slots, started, truth

from omni_cache import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.errors import PHRASE_SLOT_MAPPING
from omni_cache.runtime.manager import OmniPrefixCacheManager


@pytest.mark.parametrize("eager", MODES)
def test_miss_returns_just_this_steps_rows(eager: bool) -> None:
    m = manager(eager)
    m.new_step_starts([started("a"), started("b")])
    step, rows = save(m, [("a", [0, 1], 0, 6), ("b", [2], 0, 3)], padded=12)
    out = m.materialize(step, ["b", "a"])
    assert torch.equal(out.hidden_states["a"], rows[:6]) and torch.equal(out.hidden_states["b"], rows[6:])
    assert out.mm_outputs == {} and out.mm_for("a") == {}
    assert m.stats()["misses"] == 2 and m.stats()["hits"] == 0
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_hit_merges_prefix_then_step_rows_for_hidden_and_mm(eager: bool) -> None:
    m = manager(eager)
    m.new_step_starts([started("a")])
    s1, rows_a = save(m, [("a", [4, 5, 6], 0, 12)], mm_key="audio.codes")
    m.materialize(s1, ["a"])
    # chunked prefill of "b": first chunk serves the 8-token hit, the second is plain
    m.new_step_starts([started("b", hit_end=8, blocks=[4, 5, 9, 10])])
    s2, rows_b1 = save(m, [("b", [4, 5, 9, 10], 8, 12)], mm_key="audio.codes")
    out = m.materialize(s2, ["b"])
    merged = torch.cat([rows_a[:8], rows_b1])
    assert torch.equal(out.hidden_states["b"], merged)
    assert torch.equal(out.mm_outputs["audio.codes"]["b"], -merged[:, :2])
    m.new_step_starts([PrefixCacheRequestEvent("b", E.EXTENDED)])
    s3, rows_b2 = save(m, [("b", [4, 5, 9, 10], 12, 16)], mm_key="audio.codes")
    assert torch.equal(m.materialize(s3, ["b"]).hidden_states["b"], rows_b2)
    assert m.stats()["hits"] == 1 and m.stats()["hit_tokens"] == 8
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_same_step_hit_on_rows_this_save_writes(eager: bool) -> None:
    m = manager(eager)
    # vLLM publishes block hashes at allocation: "b" hits the block "a" computes in this very step
    m.new_step_starts([started("a"), started("b", hit_end=4, blocks=[0, 2])])
    step, rows = save(m, [("a", [0, 1], 0, 6), ("b", [0, 2], 4, 7)], tag_of={"b": "a"})
    out = m.materialize(step, ["a", "b"])
    assert torch.equal(out.hidden_states["a"], rows[:6])
    assert torch.equal(out.hidden_states["b"], torch.cat([rows[:4], rows[6:]]))
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_leftover_shapes_are_preserved_per_request(eager: bool) -> None:
    m = manager(eager)
    m.new_step_starts([started("a"), started("b")])
    per_request = torch.arange(6.0).reshape(2, 3)  # dim 0 is not a token count
    scalar = torch.tensor(5.0)
    one_d = torch.arange(7.0)  # 1-D tensors are never per-token
    step, _ = save(m, [("a", [0], 0, 4), ("b", [1], 0, 3)],
                   mm={"codes.list": [[1, 2], [3]], "pooled": per_request, "scalar": scalar, "vec": one_d})
    out = m.materialize(step, ["a", "b"])
    for req in ("a", "b"):
        got = out.mm_for(req)
        assert got["codes.list"] == [[1, 2], [3]]
        assert got["pooled"].shape == (2, 3) and torch.equal(got["pooled"], per_request)
        assert got["scalar"].shape == () and got["vec"].shape == (7,)
        assert got["pooled"].data_ptr() != per_request.data_ptr()  # a host copy, not the live buffer
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_padded_token_major_mm_is_sliced_to_unpadded(eager: bool) -> None:
    m = manager(eager)
    m.new_step_starts([started("a")])
    padded_mm = torch.arange(16.0 * 3).reshape(16, 3)  # dim 0 == padded count
    step, rows = save(m, [("a", [0, 1, 2], 0, 10)], padded=16, mm={"audio.codes": padded_mm})
    out = m.materialize(step, ["a"])
    assert torch.equal(out.hidden_states["a"], rows)
    assert torch.equal(out.mm_outputs["audio.codes"]["a"], padded_mm[:10])
    m.shutdown()


def test_newest_tenant_wins_after_block_reuse() -> None:
    m = manager()
    m.new_step_starts([started("a")])
    m.discard_step(save(m, [("a", [7], 0, 4)])[0])
    m.new_step_starts([PrefixCacheRequestEvent("a", E.ABORTED), started("c")])
    rows_c = save(m, [("c", [7], 0, 4)])
    m.discard_step(rows_c[0])
    m.new_step_starts([PrefixCacheRequestEvent("c", E.FINISHED), started("d", hit_end=4, blocks=[7, 8])])
    step, rows_d = save(m, [("d", [7, 8], 4, 6)])
    assert torch.equal(m.materialize(step, ["d"]).hidden_states["d"], torch.cat([rows_c[1], rows_d]))


@pytest.mark.parametrize("eager", MODES)
def test_hidden_opt_out_still_serves_mm(eager: bool) -> None:
    m = manager(eager)
    m.register_policy(ModelCachePolicy(needs_full_hidden_states=False))
    m.new_step_starts([started("a")])
    codes = truth("a", range(8))[:, :3]
    layout = PrefixCacheWriteLayout.packed([("a", 0, 8)], slots([0, 1], 0, 8))
    s1 = m.save_outputs(None, {"audio.codes": codes}, num_tokens_unpadded=8, num_tokens_padded=8,
                        write_layout=layout)
    out = m.materialize(s1, ["a"])
    assert out.hidden_states is None and torch.equal(out.mm_outputs["audio.codes"]["a"], codes)
    m.new_step_starts([started("b", hit_end=8, blocks=[0, 1, 2])])
    more = truth("b", range(8, 10))[:, :3]
    layout = PrefixCacheWriteLayout.packed([("b", 8, 10)], slots([0, 1, 2], 8, 10))
    s2 = m.save_outputs(torch.zeros(2, WIDTH), {"audio.codes": more}, num_tokens_unpadded=2,
                        num_tokens_padded=2, write_layout=layout)
    out = m.materialize(s2, ["b"])
    assert out.hidden_states is None and torch.equal(out.mm_outputs["audio.codes"]["b"], torch.cat([codes, more]))
    assert not m.pool.has_key(HIDDEN_KEY)
    m.shutdown()


@pytest.mark.parametrize("eager", MODES)
def test_resume_after_preemption_serves_the_full_prefix(eager: bool) -> None:
    m = manager(eager)
    m.new_step_starts([started("a")])
    s1, prompt = save(m, [("a", [2, 3], 0, 8)])
    m.materialize(s1, ["a"])
    # "a" is preempted (blocks freed, no event), then resumed: the allocator re-finds 8 tokens
    m.new_step_starts(PrefixCacheStep([PrefixCacheRequestEvent("a", E.RESUMED, 0, 8, ((2, 3, 6),), 3)], {"a": 3}))
    s2, rest = save(m, [("a", [2, 3, 6], 8, 11)])
    assert torch.equal(m.materialize(s2, ["a"]).hidden_states["a"], torch.cat([prompt, rest]))
    # a resume with no hit recomputes from 0 and returns just those rows
    m.new_step_starts([PrefixCacheRequestEvent("a", E.RESUMED, 0, 0, (), 4)])
    s3, again = save(m, [("a", [9], 0, 4)])
    assert torch.equal(m.materialize(s3, ["a"]).hidden_states["a"], again)
    m.shutdown()


def test_contract_errors_on_bad_input_change_nothing() -> None:
    m = manager()
    m.new_step_starts([started("a")])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="still live"):
        m.new_step_starts([started("a")])
    layout = PrefixCacheWriteLayout.packed([("a", 0, 4)], torch.arange(3))
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_SLOT_MAPPING):
        m.save_outputs(truth("a", range(4)), {}, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)
    layout = PrefixCacheWriteLayout.packed([("a", 0, 4)], torch.arange(4))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="hidden_states has 2 rows"):
        m.save_outputs(truth("a", range(2)), {}, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="reserved key"):
        m.save_outputs(truth("a", range(4)), {HIDDEN_KEY: 1}, num_tokens_unpadded=4, num_tokens_padded=4,
                       write_layout=layout)
    m.new_step_starts(PrefixCacheStep([], {"a": 3}))
    for _ in range(2):  # the failed save kept the scheduled counts: a retry is checked again
        with pytest.raises(OmniPrefixCacheUnmatchError, match="scheduled 3 tokens"):
            save(m, [("a", [0], 0, 4)])
    first, _ = save(m, [("a", [0], 0, 3)])
    m.discard_step(first)
    m.new_step_starts([PrefixCacheRequestEvent("b", E.STARTED, 0, 4, ((1,),))])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="must continue the hit"):
        save(m, [("b", [1, 2], 0, 6)])
    assert m.staging.slot_states() == ["free"] * 3 and m.stats()["unconsumed_step_ids"] == {}
    step, _ = save(m, [("b", [1, 2], 4, 6)], tag_of={"b": "x"})  # the pending hit survived the failed save
    assert step == first + 1  # refused saves burned no step id
    with pytest.raises(OmniPrefixCacheUnmatchError, match="is not readable"):
        m.materialize(step, ["b"])  # block 1 was never written
    m.register_policy(ModelCachePolicy())
    with pytest.raises(OmniPrefixCacheUnmatchError, match="register it before the first save"):
        m.register_policy(ModelCachePolicy(needs_full_hidden_states=False))


# ---- a hit of one block when a block is one token ------------------------------------------
@pytest.mark.parametrize("eager", MODES)
def test_a_one_token_hit_with_block_size_one_is_served(eager: bool) -> None:
    """With ``block_size=1`` a one-token hit is aligned and real: it is served and counted, never dropped as
    a miss (I5).

    With ``block_size=1`` a hit of one token is aligned and real: b must be served a's
    row at KV slot 5 before its own, and counted as one hit of one token.

    Kills the mutant: ``if event.hit_end > 0`` -> ``> 1`` in ``_install_lookup`` (the hit dropped as a
    miss).

    With ``block_size=1`` a one-token hit is aligned and real: it is served and counted, never dropped as
    a miss (I5)."""
    m = OmniPrefixCacheManager(config(block_size=1), eager=eager)
    m.new_step_starts([started("a")])
    rows_a = torch.arange(16, dtype=torch.float32).reshape(2, 8) + 1
    layout = PrefixCacheWriteLayout.packed([("a", 0, 2)], torch.tensor([5, 6]))
    s1 = m.save_outputs(rows_a, {}, num_tokens_unpadded=2, num_tokens_padded=2, write_layout=layout)
    m.discard_step(s1)
    m.new_step_starts([PrefixCacheRequestEvent("a", PrefixCacheEventKind.FINISHED),
                       started("b", hit_end=1, blocks=[5, 9])])
    rows_b = torch.full((1, 8), -3.0)
    layout = PrefixCacheWriteLayout.packed([("b", 1, 2)], torch.tensor([9]))
    s2 = m.save_outputs(rows_b, {}, num_tokens_unpadded=1, num_tokens_padded=1, write_layout=layout)
    out = m.materialize(s2, ["b"])
    assert torch.equal(out.hidden_states["b"], torch.cat([rows_a[:1], rows_b])), out.hidden_states["b"]
    stats = m.stats()
    assert (stats["hits"], stats["hit_tokens"]) == (1, 1), stats
    m.shutdown()


# ---- I5/I12: an ended request's untaken hit is dropped ------------------------------------
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_an_ended_requests_untaken_hit_is_never_served(eager: bool) -> None:
    """A request that ends (FINISHED or ABORTED) before its hit is read drops that hit: it is never served to
    a later step (I12).

    Kills the mutant: ``manager:OmniPrefixCacheManager.new_step_starts:del_call:9103d72c`` (the ``end``
    op's ``self.hits.drop(req_id)`` deleted: the hit stays pending after FINISHED).

    A request that ends (FINISHED or ABORTED) before its hit is read drops that hit: it is never served to
    a later step (I12)."""
    m = manager(eager)
    try:
        m.new_step_starts([started("x")])
        step, _ = save(m, [("x", [0, 1], 0, 8)])
        m.discard_step(step)
        m.new_step_starts([started("a", 8, [0, 1], 4)])  # a hit of 8, never taken by a save
        m.new_step_starts([PrefixCacheRequestEvent("a", PrefixCacheEventKind.FINISHED)])
        # The id's next rows start afresh at 0: no hit of the ended request continues into them.
        step, rows = save(m, [("a", [2], 0, 4)])
        out = m.materialize(step, ["a"])
        assert torch.equal(out.hidden_states["a"], rows), "an ended request's pending hit was served"
    finally:
        m.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_a_zero_row_write_leaves_its_hit_for_the_first_step_that_schedules_it(eager: bool) -> None:
    """B starts with a 4-token hit on A's block, but its first step schedules nothing for it (a
    zero-row write next to C's rows): B gets ``(0, width)`` rows there, and the step that does
    schedule B serves ``[0, token_end)``, the hit then its rows (contract section 4.4). Found by an
    independent attack: the zero-row write took the hit, so B got the prefix in a step that
    scheduled none of its tokens and only its new rows in the next."""
    from omni_cache.runtime.events import PrefixCacheWrite

    m = manager(eager=eager)
    m.new_step_starts([started("A")])
    m.materialize(save(m, [("A", [0, 1], 0, BS)])[0], ["A"])
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED), started("B", BS, [0, 2]), started("C")])
    settle(m)
    rows_c = truth("C", range(3))
    layout = PrefixCacheWriteLayout([PrefixCacheWrite("C", 0, 3, 0, 3), PrefixCacheWrite("B", 3, 3, BS, BS)], 3,
                                    slots([3], 0, 3))
    step = m.save_outputs(rows_c, {}, num_tokens_unpadded=3, num_tokens_padded=3, write_layout=layout)
    out = m.materialize(step, ["C", "B"])
    assert torch.equal(out.hidden_states["C"], rows_c)
    assert out.hidden_states["B"].shape == (0, truth("B", range(1)).shape[1]), out.hidden_states["B"].shape
    step = save(m, [("B", [0, 2], BS, BS + 2)], tag_of={"B": "A"})[0]
    assert torch.equal(m.materialize(step, ["B"]).hidden_states["B"], truth("A", range(BS + 2)))
    m.shutdown()
