"""Regressions for the runtime holes of issue 11 (items 1-8), one test per invariant guarded.

Each test was written first and seen failing on the code before its fix (the
commit that adds it names the break it was checked against):

  I7  a key that a KV slot's newest tenant did not write is absent there: a hit
      that needs it raises "is not readable"; it is never served from an older
      tenant (immediate and deferred paths, eager and async modes).
  slot mapping covers: a layout whose writes leave rows of the step to no
      request, or whose ``slots_cpu`` is not a 1-D integer CPU mapping of enough
      entries, is refused before anything is claimed.
  I8  a failure inside a save is either fully undone or sticky, never half.
"""

from __future__ import annotations

import pytest
import torch
from cache_helpers import BS, manager, settle, slots, started, truth

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheRequestEvent,
    PrefixCacheWriteLayout,
)
from omni_cache.adapter import PrefixCacheEventKind as E
from omni_cache.errors import PHRASE_NOT_READABLE

K = "mm.k"


def _save(m, spans, *, with_k: bool, tag_of=None) -> int:  # type: ignore[no-untyped-def]
    """Save one step of ``(req, blocks, start, end)`` spans: hidden, plus per-token ``K`` if ``with_k``."""
    tag_of = tag_of or {}
    rows = torch.cat([truth(tag_of.get(r, r), range(s, e)) for r, _, s, e in spans])
    slot_ids = torch.cat([slots(b, s, e) for _, b, s, e in spans])
    mm = {K: -rows[:, :2].clone()} if with_k else {}
    layout = PrefixCacheWriteLayout.packed([(r, s, e) for r, _, s, e in spans], slot_ids)
    n = rows.shape[0]
    return m.save_outputs(rows, mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)


@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_I7_absent_key_not_served_from_older_tenant(eager: bool, deferred: bool) -> None:
    """C writes hidden and K on block 0; A reuses block 0 writing hidden only; B hits block 0 with K.

    B's hit must raise "is not readable" for K: block 0's tenant (A) never wrote K,
    and C's K rows belong to an older tenant (I7, I6). Today B got A's hidden rows
    glued to C's K rows, silently.
    """
    m = manager(eager=eager)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({K}) if deferred else frozenset()))
    m.new_step_starts([started("C")])
    m.materialize(_save(m, [("C", [0, 1], 0, 5)], with_k=True), ["C"])
    m.new_step_starts([PrefixCacheRequestEvent("C", E.FINISHED), started("A")])
    settle(m)
    # A, a different prompt, takes block 0 over; its steps carry hidden but not K.
    m.materialize(_save(m, [("A", [0, 2], 0, 3)], with_k=False), ["A"])
    m.materialize(_save(m, [("A", [0, 2], 3, 5)], with_k=False), ["A"])
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED), started("B", BS, [0, 3])])
    settle(m)
    step = _save(m, [("B", [0, 3], BS, BS + 2)], with_k=True, tag_of={"B": "A"})
    with pytest.raises(OmniPrefixCacheUnmatchError, match=PHRASE_NOT_READABLE) as info:
        m.materialize(step, ["B"])
    assert repr(K) in str(info.value) and "KV slot 0" in str(info.value), info.value
    assert m.stats()["failed"] is None
    m.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_I7_key_written_by_the_current_tenant_stays_readable(eager: bool) -> None:
    """The converse (so the absent rule cannot be "refuse every mm hit"): when the tenant's
    write carried hidden and K, a hit reads both, exactly."""
    m = manager(eager=eager)
    m.new_step_starts([started("A")])
    m.materialize(_save(m, [("A", [0, 2], 0, 5)], with_k=True), ["A"])
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED), started("B", BS, [0, 3])])
    settle(m)
    step = _save(m, [("B", [0, 3], BS, BS + 2)], with_k=True, tag_of={"B": "A"})
    out = m.materialize(step, ["B"])
    want = truth("A", range(BS + 2))
    assert torch.equal(out.hidden_states["B"], want)
    assert torch.equal(out.mm_outputs["B"][K], -want[:, :2])
    m.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_I7_hit_without_the_key_still_reads_hidden(eager: bool) -> None:
    """A hit whose own step does not carry K only needs hidden: the absent K does not refuse it."""
    m = manager(eager=eager)
    m.new_step_starts([started("C")])
    m.materialize(_save(m, [("C", [0, 1], 0, 5)], with_k=True), ["C"])
    m.new_step_starts([PrefixCacheRequestEvent("C", E.FINISHED), started("A")])
    settle(m)
    m.materialize(_save(m, [("A", [0, 2], 0, 5)], with_k=False), ["A"])
    m.new_step_starts([PrefixCacheRequestEvent("A", E.FINISHED), started("B", BS, [0, 3])])
    settle(m)
    out = m.materialize(_save(m, [("B", [0, 3], BS, BS + 2)], with_k=False, tag_of={"B": "A"}), ["B"])
    assert torch.equal(out.hidden_states["B"], truth("A", range(BS + 2)))
    assert K not in out.mm_outputs["B"]
    m.shutdown()

