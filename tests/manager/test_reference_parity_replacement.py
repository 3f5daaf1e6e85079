"""Reference parity, replacement (the manager's side): the reference's ``test_prefix_cache_replacement.py``.

The reference's ``tests/core/test_prefix_cache_replacement.py``: its public-API tests,
rewritten, run against omni-cache through the renaming shim
(tests/manager/reference_parity_shim.py; the port, its shim and what is not ported:
tests/manager/test_reference_parity.py). What the reference checks there on private progress
records is checked here on rows served and ``stats()``: a pending lookup is completed by the first
extension, a completed zero lookup is never reinterpreted, duplicate and stale controls keep the
current admission, a replacement keeps the old rows for a later real hit (its writes still land),
a resume keeps the owner, a new admission rejects the old owner's controls and terminal, a
replayed step cannot reactivate a finished owner, and a terminal of a newer owner ends the
request. The delivery-acknowledgement tests of that file are not ported (a listed difference).

Invariants touched: I9, I12, I13 (as the reference's tests do).
"""

from __future__ import annotations

import pytest
import torch
from reference_parity_shim import DTYPE, HIDDEN, K, make_manager
from vllm_omni.core.prefix_cache.adapter import PrefixCacheRequestEvent, PrefixCacheRequestOwner
from vllm_omni.core.prefix_cache.interface import ModelCachePolicy, OmniPrefixCacheUnmatchError


def owned(kind, generation=0, *, hit=None, blocks=(), admission=1):
    return PrefixCacheRequestEvent("a", kind, hit_end=hit or 0, block_ids=(tuple(blocks),) if blocks else (),
                                   owner=PrefixCacheRequestOwner(admission, generation),
                                   lookup_complete=hit is not None)


def save_a(mgr, view, start, end, blocks):
    view.order, view.req_blocks["a"], view.computed["a"] = ["a"], blocks, start
    layout = view.adapter.build_write_layout(view, num_scheduled_tokens={"a": end - start})
    rows = torch.arange(start, end, dtype=DTYPE).unsqueeze(1).expand(-1, HIDDEN).clone()
    sid = mgr.save_outputs(rows, {}, num_tokens_unpadded=end - start, num_tokens_padded=end - start,
                           write_layout=layout)
    return mgr.materialize(sid, ["a"]).hidden_states["a"][:, 0].int().tolist()


@pytest.mark.parametrize("hit", [0, 8])
def test_a_pending_lookup_is_completed_by_the_first_extension(hit) -> None:
    mgr, view = make_manager()
    mgr.new_step_starts([owned(K.STARTED, hit=0)])
    save_a(mgr, view, 0, 8, [0, 1])
    mgr.new_step_starts([owned(K.REPLACED, 1)])
    mgr.new_step_starts([owned(K.EXTENDED, 1, hit=hit, blocks=[0, 1])], num_scheduled_tokens={"a": 2})
    assert save_a(mgr, view, hit, hit + 2, [0, 1, 2]) == list(range(hit + 2))  # full prefix (difference table)


def test_a_completed_zero_lookup_is_not_reinterpreted_later() -> None:
    mgr, view = make_manager()
    mgr.new_step_starts([owned(K.REPLACED, 1, hit=0)])
    mgr.new_step_starts([owned(K.EXTENDED, 1, hit=8, blocks=[0, 1])])
    assert save_a(mgr, view, 0, 2, [3]) == [0, 1]  # no hit was registered


def test_duplicate_and_stale_controls_keep_the_current_admission() -> None:
    mgr, view = make_manager()
    mgr.new_step_starts([owned(K.REPLACED, 2, hit=0)])
    save_a(mgr, view, 0, 4, [0])
    mgr.new_step_starts([owned(K.REPLACED, 2, hit=0), owned(K.REPLACED, 1), owned(K.EXTENDED, 1, hit=4, blocks=[0])])
    assert save_a(mgr, view, 4, 6, [0, 1]) == [4, 5]  # still the same admission, no new hit
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"conflicting.*lookup"):
        mgr.new_step_starts([owned(K.REPLACED, 2, hit=4, blocks=[0])])


def test_a_replacement_keeps_the_old_rows_for_a_later_real_hit() -> None:
    mgr, view = make_manager(ModelCachePolicy(deferred_keys=frozenset({"codes"})))
    mgr.new_step_starts([owned(K.STARTED, hit=0)])
    view.order, view.req_blocks["a"], view.computed["a"] = ["a"], [0, 1], 0
    rows = torch.arange(8, dtype=DTYPE).unsqueeze(1).expand(-1, HIDDEN).clone()
    layout = view.adapter.build_write_layout(view, num_scheduled_tokens={"a": 8})
    mgr.discard_step(mgr.save_outputs(rows, {"codes": rows[:, :1]}, num_tokens_unpadded=8, num_tokens_padded=8,
                                      write_layout=layout))
    mgr.new_step_starts([owned(K.REPLACED, 1, hit=0)])
    # A -> B -> A: the third admission hits the first one's blocks and reads its (deferred) rows.
    mgr.new_step_starts([owned(K.REPLACED, 2, hit=8, blocks=[0, 1])], num_scheduled_tokens={"a": 2})
    assert save_a(mgr, view, 8, 10, [0, 1, 3]) == list(range(10))


def test_resume_keeps_the_owner() -> None:
    mgr, view = make_manager()
    mgr.new_step_starts([owned(K.REPLACED, 1, hit=0)])
    save_a(mgr, view, 0, 8, [0, 1])
    mgr.new_step_starts([owned(K.RESUMED, 1, hit=4, blocks=[0])])
    assert save_a(mgr, view, 4, 10, [0, 1, 2]) == list(range(10))  # full prefix (difference table)


def test_a_new_admission_rejects_the_old_owners_controls_and_terminal() -> None:
    mgr, _ = make_manager()
    mgr.new_step_starts([owned(K.REPLACED, 8)])
    mgr.new_step_starts([owned(K.STARTED, hit=0, admission=2)])
    mgr.new_step_starts([owned(K.REPLACED, 9), owned(K.FINISHED, 8)])
    assert mgr.stats()["live_requests"] == 1 and mgr.stats()["stale_events"] == 2


def test_a_replayed_step_cannot_reactivate_a_finished_owner() -> None:
    from omni_cache.runtime.events import PrefixCacheStep

    mgr, _ = make_manager()
    replacement = PrefixCacheStep((owned(K.REPLACED, 1),), (), sequence=7)
    mgr.new_step_starts(replacement)
    mgr.new_step_starts(PrefixCacheStep((owned(K.FINISHED, 1),), (), sequence=8))
    mgr.new_step_starts(replacement)
    assert mgr.stats()["live_requests"] == 0


@pytest.mark.parametrize("old_finished", [False, True])
def test_a_terminal_of_a_newer_owner_ends_the_request(old_finished) -> None:
    mgr, _ = make_manager()
    mgr.new_step_starts([owned(K.STARTED, hit=0)])
    if old_finished:
        mgr.new_step_starts([owned(K.FINISHED)])
    mgr.new_step_starts([owned(K.FINISHED, 1)])
    assert mgr.stats()["live_requests"] == 0
