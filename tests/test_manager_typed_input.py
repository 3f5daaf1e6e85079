"""What the manager's doors refuse, and that a refusal changes nothing: typed input and scheduled counts.

Each bad input below is refused with ``OmniPrefixCacheUnmatchError`` (or, for a value type, a
``TypeError`` at construction that names the argument), never a bare ``TypeError`` /
``AttributeError`` from deep inside; after the refusal ``stats()`` is unchanged and the next valid
call works (a refused call changes no state):

* scheduled counts (contract 4.3, "slot mapping covers"): each request's rows equal its scheduled
  count, zero included -- a count of 0 for a request with rows, rows for a request with no count, a
  count with no rows;
* an unhashable request id; ``materialize`` with an unhashable request id; a sparse ``slots_cpu``;
  a hit bound that is not an int; ``new_step_starts`` given something that is not an event.

Invariants touched: I4 (a refused materialize consumes nothing), I5 (hits are ints), I13's
"a refused call changes no state".
"""

from __future__ import annotations

import pytest
import torch
from cache_helpers import MODES, manager, save, slots, started, truth

from omni_cache import (
    OmniPrefixCacheUnmatchError,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
)
from omni_cache.errors import PHRASE_SLOT_MAPPING

# ---- scheduled counts: rows equal counts, zero included --------------------------------------


@pytest.mark.parametrize("eager", MODES)
@pytest.mark.parametrize(("counts", "named"), [
    ({"A": 4, "B": 0}, "request 'B' was scheduled 0 tokens but the slot mapping covers 4 rows"),
    ({"A": 4}, r"request 'B' was not scheduled \(no count: 0 tokens\) but the slot mapping covers 4 rows"),
    ({"A": 4, "B": 4, "C": 2}, "request 'C' was scheduled 2 tokens but the slot mapping covers 0 rows"),
])
def test_each_requests_rows_equal_its_scheduled_count_zero_included(eager: bool, counts: dict[str, int],
                                                                    named: str) -> None:
    m = manager(eager)
    try:
        m.new_step_starts(PrefixCacheStep((started("A"), started("B"), started("C")), counts))
        before = m.stats()
        with pytest.raises(OmniPrefixCacheUnmatchError, match=named):
            save(m, [("A", [0], 0, 4), ("B", [1], 0, 4)])
        assert PHRASE_SLOT_MAPPING in named
        assert m.stats() == before, "a refused save changed state"
        # The counts are kept for the retry: the layout the counts describe is accepted.
        spans = [(r, [i], 0, n) for i, (r, n) in enumerate(counts.items()) if n]
        step, rows = save(m, spans)
        out = m.materialize(step, [r for r, *_ in spans])
        assert torch.equal(torch.cat([out.hidden_states[r] for r, *_ in spans]), rows)
    finally:
        m.shutdown()


def test_a_zero_row_request_with_a_zero_count_is_accepted() -> None:
    m = manager()
    try:
        m.new_step_starts(PrefixCacheStep((started("A"), started("idle")), {"A": 2, "idle": 0}))
        layout = PrefixCacheWriteLayout((PrefixCacheWrite("A", 0, 2, 0, 2), PrefixCacheWrite("idle", 2, 2, 0, 0)),
                                        2, slots([0], 0, 2))
        step = m.save_outputs(truth("A", range(2)), {}, num_tokens_unpadded=2, num_tokens_padded=2,
                              write_layout=layout)
        assert m.materialize(step, ["idle"]).hidden_states["idle"].shape[0] == 0
    finally:
        m.shutdown()
