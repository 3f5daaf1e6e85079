"""Ground truth of the simulated thinker: rows are a deterministic function of the prefix."""

from __future__ import annotations

import pytest
import torch

from omni_cache.harness.sim_engine.request import SimRequest
from omni_cache.harness.sim_engine.scheduler import ScheduledChunk
from omni_cache.harness.sim_engine.thinker import JUNK_FLOAT, Thinker, policy_for
from omni_cache.harness.sim_engine.truth import (
    CODES_KEY,
    EMBEDS_KEY,
    LEFTOVER_LIST_KEY,
    TruthSpec,
    extend_prefix_hashes,
    next_token,
    prefix_hashes,
)
from omni_cache.runtime.interface import HIDDEN_KEY


def test_prefix_hashes_are_incremental_and_prefix_determined() -> None:
    tokens = [5, 9, 9, 1, 7, 3]
    full = prefix_hashes(tokens)
    grown: list[int] = []
    for n in range(1, len(tokens) + 1):
        extend_prefix_hashes(grown, tokens[:n])
    assert grown == full
    assert len(set(full)) == len(full)
    # Same prefix, same hashes; a changed token changes every hash from there on.
    other = prefix_hashes([5, 9, 9, 2, 7, 3])
    assert other[:3] == full[:3]
    assert all(a != b for a, b in zip(other[3:], full[3:], strict=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_are_deterministic_exact_and_tenant_specific(dtype: str) -> None:
    spec = TruthSpec(hidden_width=64, dtype=dtype, embeds_width=16)
    a = prefix_hashes([1, 2, 3, 4])
    b = prefix_hashes([1, 2, 3, 5])
    for key in spec.per_token_keys:
        rows_a = spec.rows(key, a)
        assert rows_a.shape == (4, *spec.row_shape(key))
        assert rows_a.dtype == spec.key_dtype(key)
        assert torch.equal(rows_a, spec.rows(key, a))  # deterministic
        assert torch.equal(rows_a[:3], spec.rows(key, b)[:3])  # shared prefix, shared rows
        assert (rows_a[3] != spec.rows(key, b)[3]).sum() > spec.row_shape(key)[0] // 2  # another tenant differs
    hidden = spec.rows(HIDDEN_KEY, a)
    # Multiples of 1/8 in [-16, 16): exact in bf16 (no rounding between thinker and checker).
    assert torch.equal(hidden.float().to(torch.bfloat16).float(), hidden.float())
    assert float(hidden.abs().max()) <= 16.0
    assert bool(hidden.any(dim=1).all())  # no all-zero truth row (a zero row always means a miss)
    assert spec.rows(EMBEDS_KEY, []).shape == (0, 16)


def test_next_token_is_a_function_of_the_prefix() -> None:
    h = prefix_hashes([7, 7, 7])[-1]
    assert next_token(h, 1000) == next_token(h, 1000)
    assert 0 <= next_token(h, 1000) < 1000
    assert len({next_token(x, 32000) for x in prefix_hashes(list(range(50)))}) > 40


def _req(req_id: str, prompt: list[int], blocks: list[int]) -> SimRequest:
    req = SimRequest(req_id, prompt, max_tokens=4, block_size=4)
    req.block_ids = blocks
    return req


def test_thinker_forward_packs_rows_slots_padding_and_reuses_buffers() -> None:
    spec = TruthSpec(hidden_width=8, embeds_width=4)
    assert policy_for(spec).deferred_keys == frozenset({EMBEDS_KEY})
    thinker = Thinker(spec, 16, pad_multiple=8, pad_probability=1.0, leftover_every=1)
    a, b = _req("a", [1, 2, 3, 4, 5], [3, 1]), _req("b", [9, 8], [6])
    out = thinker.forward(0, [ScheduledChunk(a, 2, 5, None), ScheduledChunk(b, 0, 2, 0)])
    assert (out.num_tokens_unpadded, out.num_tokens_padded) == (5, 8)
    assert out.hidden.shape == (8, 8) and out.mm[CODES_KEY].shape == (8, 4)
    assert [(w.req_id, w.row_start, w.row_end, w.token_start, w.token_end) for w in out.layout.writes] == [
        ("a", 0, 3, 2, 5), ("b", 3, 5, 0, 2)]
    # slot = block * block_size + pos % block_size; padded rows map to -1.
    assert out.layout.slots_cpu.tolist() == [3 * 4 + 2, 3 * 4 + 3, 1 * 4 + 0, 6 * 4 + 0, 6 * 4 + 1, -1, -1, -1]
    assert torch.equal(out.hidden[:3], spec.rows(HIDDEN_KEY, a.truth_hashes[2:5]))
    assert torch.equal(out.mm[EMBEDS_KEY][3:5], spec.rows(EMBEDS_KEY, b.truth_hashes[0:2]))
    assert bool((out.hidden[5:] == JUNK_FLOAT).all())
    assert out.leftovers[LEFTOVER_LIST_KEY] == [0, 2, 5]
    first = out.hidden
    snapshot = first.clone()
    thinker.forward(1, [ScheduledChunk(b, 0, 2, 0)])
    assert not torch.equal(first, snapshot)  # the live buffer moved on: outputs must be snapshotted
