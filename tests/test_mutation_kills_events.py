"""Tests that kill survivors of the first sample of ``omni_cache/events.py`` (the adapter's value
types and ``StepRows``), ``tools/ast_mutants.py --modules events --sample 40 --seed 11``: 37 of 40
were killed by the suite as it stood, these kill the other 3, each checked by applying its
mutant to a copy (``tools/ast_mutants.py --only ID --tests FILE``) and seeing it fail.

Invariants touched: I12 (a request's owner orders its admissions, so a malformed owner is
refused where it is built), I13 and the scheduled-count check (a step's counts are a private
snapshot of ints), and the reference's public defaults (DESIGN section 7).
"""

from __future__ import annotations

import numpy as np
import pytest

from omni_cache import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
)
from omni_cache.events import PrefixCacheRequestOwner


@pytest.mark.parametrize("field", ["admission_id", "generation"])
@pytest.mark.parametrize("bad", [-1, True, 1.0, "1", None])
def test_a_malformed_owner_is_refused_where_it_is_built(field: str, bad: object) -> None:
    """Mutant: ``events:PrefixCacheRequestOwner.__post_init__:del_raise:3a5afb80``. An owner's
    fields order admissions (I12): a negative, bool, float, string or missing one is refused at
    construction with its name, never compared later."""
    kwargs: dict[str, object] = {"admission_id": 3, "generation": 0, field: bad}
    with pytest.raises(ValueError, match=rf"PrefixCacheRequestOwner\.{field} must be an int >= 0, got {bad!r}"):
        PrefixCacheRequestOwner(**kwargs)  # type: ignore[arg-type]
    assert PrefixCacheRequestOwner(0, 0) < PrefixCacheRequestOwner(0, 1) < PrefixCacheRequestOwner(1, 0)


def test_an_events_defaults_are_the_references() -> None:
    """Mutant: ``events:PrefixCacheRequestEvent:int_off:ee162ae5#3`` (``num_output_tokens`` default
    0 -> 1). DESIGN section 7: ``PrefixCacheRequestEvent(req_id, kind, hit_start=0, hit_end=0,
    block_ids=(), scheduled_tokens=0, num_output_tokens=0)``."""
    event = PrefixCacheRequestEvent("r", PrefixCacheEventKind.STARTED)
    assert (event.hit_start, event.hit_end, event.block_ids, event.scheduled_tokens, event.num_output_tokens) == (
        0, 0, (), 0, 0)


def test_a_steps_scheduled_counts_are_a_private_snapshot_of_ints() -> None:
    """Mutant: ``events:PrefixCacheStep.__post_init__:del_call:13443f18`` (the copy of
    ``scheduled_tokens`` deleted). The step keeps its own ``{req_id: int}``: pairs are accepted,
    numpy counts become ints, and the caller's dict changing later changes nothing."""
    counts = {"a": np.int64(3)}
    step = PrefixCacheStep((), counts)
    counts["a"] = 5
    counts["b"] = 1
    assert step.scheduled_tokens == {"a": 3} and type(step.scheduled_tokens["a"]) is int
    assert PrefixCacheStep((), [("a", 2), ("b", np.int32(1))]).scheduled_tokens == {"a": 2, "b": 1}
