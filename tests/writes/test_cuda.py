"""CUDA path: device tensors, side-stream copies ordered by events, committer thread, pinned pages.

Skipped cleanly without a CUDA device (CI has none); run on a GPU machine with
``pytest -m cuda``.
"""

from __future__ import annotations

import pytest
import torch
from cache_helpers import E, config, slots, started, truth

from omni_cache import (
    ModelCachePolicy,
    PrefixCacheRequestEvent,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.copier import CopyEngine
from omni_cache.runtime.manager import OmniPrefixCacheManager

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)"),
]


def _save(m: OmniPrefixCacheManager, req: str, blocks: list[int], start: int, end: int) -> tuple[int, torch.Tensor]:
    rows = truth(req, range(start, end))
    dev = rows.cuda()
    layout = PrefixCacheWriteLayout.packed([(req, start, end)], slots(blocks, start, end))
    step = m.save_outputs(dev, {"audio.codes": -dev[:, :2].contiguous(), "audio.embeds": dev[:, :3] * 2},
                          num_tokens_unpadded=end - start, num_tokens_padded=end - start, write_layout=layout)
    dev.fill_(-1)  # the next forward overwrites the live buffer right away (I4)
    return step, rows


def test_cuda_async_hits_merge_and_pages_are_pinned() -> None:
    m = OmniPrefixCacheManager(config(staging_depth=2), eager=False)
    assert m.use_cuda and not m.eager
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio.embeds"})))
    m.new_step_starts([started("a")])
    s1, rows_a = _save(m, "a", [1, 2], 0, 8)
    out = m.materialize(s1, ["a"])
    assert torch.equal(out.hidden_states["a"], rows_a)
    assert torch.equal(out.mm_outputs["audio.embeds"]["a"], rows_a[:, :3] * 2)
    m.new_step_starts([PrefixCacheRequestEvent("a", E.FINISHED), started("b", hit_end=8, blocks=[1, 2, 3])])
    s2, rows_b = _save(m, "b", [1, 2, 3], 8, 12)
    out = m.materialize(s2, ["b"])
    merged = torch.cat([rows_a, rows_b])
    assert torch.equal(out.hidden_states["b"], merged)
    assert torch.equal(out.mm_outputs["audio.codes"]["b"], -merged[:, :2])
    assert torch.equal(out.mm_outputs["audio.embeds"]["b"], merged[:, :3] * 2)
    assert m.pool.pin_memory and m.staging.pin_memory
    assert m.shutdown() == {}


def test_cuda_many_steps_with_a_late_builder() -> None:
    m = OmniPrefixCacheManager(config(staging_depth=3, num_blocks=128), eager=False)
    m.new_step_starts([started("p")])
    s0, prompt = _save(m, "p", [0, 1], 0, 8)
    m.materialize(s0, ["p"])
    pending: list[tuple[int, str, torch.Tensor]] = []
    for i in range(60):
        req = f"r{i}"
        m.new_step_starts([started(req, hit_end=8, blocks=[0, 1, 2 + i])])
        step, rows = _save(m, req, [0, 1, 2 + i], 8, 10)
        pending.append((step, req, torch.cat([prompt, rows])))
        if len(pending) == 2:  # the builder lags one step behind the engine
            step, r, want = pending.pop(0)
            assert torch.equal(m.materialize(step, [r]).hidden_states[r], want)
    for step, r, want in pending:
        assert torch.equal(m.materialize(step, [r]).hidden_states[r], want)
    assert m.shutdown() == {}


# ---- CUDA: the compute event is recorded on the compute stream --------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_the_compute_event_covers_work_queued_before_it() -> None:
    """The compute event is recorded, so the copy stream waits for the forward queued before it (CUDA path).

    An event never recorded reports complete at once; one recorded behind a long kernel
    does not, so the copy stream waiting on it would not wait for the forward.

    Kills the mutant: ``copier:CopyEngine.record_compute_event:del_call:42299636`` (``event.record``
    deleted).

    The compute event is recorded, so the copy stream waits for the forward queued before it (CUDA path)."""
    engine = CopyEngine(use_cuda=True, chunk_bytes=1 << 20)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning on the compute stream
    event = engine.record_compute_event()
    assert not event.query(), "the compute event completed before the work queued ahead of it"
    event.synchronize()
    assert event.query()
