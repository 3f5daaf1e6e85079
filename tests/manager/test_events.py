"""The adapter's value types a user builds: PrefixCacheRequestEvent, PrefixCacheStep,
PrefixCacheWriteLayout (spec/contract.md sections 2 and 10).

Their defaults are the reference's, malformed values are refused where the value is built,
and a built value is a private snapshot (I13: a step's events and counts cannot change after
it is handed over).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cache_helpers import E, finished, started

from omni_cache import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.events import PrefixCacheWrite


def test_an_events_defaults_are_the_references() -> None:
    """A request event's defaults are the reference's (spec/contract.md section 10).

    spec/contract.md section 10: ``PrefixCacheRequestEvent(req_id, kind, hit_start=0, hit_end=0,
    block_ids=(), scheduled_tokens=0, num_output_tokens=0)``.

    Kills the mutant: ``events:PrefixCacheRequestEvent:int_off:ee162ae5#3`` (``num_output_tokens`` default
    0 -> 1).

    A request event's defaults are the reference's (spec/contract.md section 10)."""
    event = PrefixCacheRequestEvent("r", PrefixCacheEventKind.STARTED)
    assert (event.hit_start, event.hit_end, event.block_ids, event.scheduled_tokens, event.num_output_tokens) == (
        0, 0, (), 0, 0)


def test_a_steps_scheduled_counts_are_a_private_snapshot_of_ints() -> None:
    """A step keeps a private snapshot of its scheduled counts, as ints (I13).

    The step keeps its own ``{req_id: int}``: pairs are accepted,
    numpy counts become ints, and the caller's dict changing later changes nothing.

    Kills the mutant: ``events:PrefixCacheStep.__post_init__:del_call:13443f18`` (the copy of
    ``scheduled_tokens`` deleted).

    A step keeps a private snapshot of its scheduled counts, as ints (I13)."""
    counts = {"a": np.int64(3)}
    step = PrefixCacheStep((), counts)
    counts["a"] = 5
    counts["b"] = 1
    assert step.scheduled_tokens == {"a": 3} and type(step.scheduled_tokens["a"]) is int
    assert PrefixCacheStep((), [("a", 2), ("b", np.int32(1))]).scheduled_tokens == {"a": 2, "b": 1}


# ---- a span with a negative row start is refused at construction ------------------------
def test_a_write_span_starting_before_row_zero_is_refused() -> None:
    """A write span that starts before row 0 of the step is refused where it is built.

    Kills the mutant: ``events:PrefixCacheWrite.__post_init__:int_off:39e2da9e`` (``0 <=`` -> ``-1 <=``).

    A write span that starts before row 0 of the step is refused where it is built."""
    with pytest.raises(ValueError, match="bad rows"):
        PrefixCacheWrite("a", -1, 3, 0, 4)
    PrefixCacheWrite("a", 0, 4, 0, 4)  # row 0 itself is fine


# ---- an empty list of slots becomes an int64 mapping -------------------------------------
def test_an_empty_slot_list_becomes_an_int64_mapping() -> None:
    """A zero-token step's empty slot list becomes an int64 mapping, so the save accepts it.

    ``torch.as_tensor([])`` is float32; without the cast a zero-token step's empty
    mapping would be kept as floats and refused as malformed by ``save_outputs``.

    Kills the mutant: ``events:PrefixCacheWriteLayout.__post_init__:int_off:ee162ae5`` (``numel() == 0``
    -> ``== 1``).

    A zero-token step's empty slot list becomes an int64 mapping, so the save accepts it."""
    layout = PrefixCacheWriteLayout((), 0, [])
    assert layout.slots_cpu is not None and layout.slots_cpu.dtype == torch.int64
    assert layout.slots_cpu.numel() == 0
    one = PrefixCacheWriteLayout((PrefixCacheWrite("a", 0, 1, 0, 1),), 1, [7])
    assert one.slots_cpu.dtype == torch.int64 and one.slots_cpu.tolist() == [7]


def test_an_integer_slot_mapping_of_any_width_becomes_int64() -> None:
    """A slot mapping of any integer width is cast once to int64, the width the pool indexes with.

    The pool indexes with int64 and its one-pass range check
    (a negative slot read as unsigned) is the int64 path: every integer mapping is cast once here.

    Kills the mutant: ``events:PrefixCacheWriteLayout.__post_init__:del_assign:cddcb075#1`` (an int32 or
    int16 mapping kept at its width).

    A slot mapping of any integer width is cast once to int64, the width the pool indexes with."""
    for dtype in (torch.int32, torch.int16, torch.uint8):
        layout = PrefixCacheWriteLayout.packed([("a", 0, 2)], torch.tensor([3, 4], dtype=dtype))
        assert layout.slots_cpu is not None and layout.slots_cpu.dtype == torch.int64, dtype
        assert layout.slots_cpu.tolist() == [3, 4]


def test_a_group_id_outside_the_events_groups_has_no_blocks() -> None:
    """A KV-cache group id outside an event's groups (negative included) has no blocks (I5).

    Kills the mutant: ``events:PrefixCacheRequestEvent.group_block_ids:int_off:39e2da9e`` (``0 <=`` ->
    ``-1 <=``): a negative group id is no group, never the last one counted from the end.

    A KV-cache group id outside an event's groups (negative included) has no blocks (I5)."""
    event = PrefixCacheRequestEvent("a", PrefixCacheEventKind.STARTED, 0, 8, ((0, 1), (2, 3)))
    assert event.group_block_ids(0) == (0, 1) and event.group_block_ids(1) == (2, 3)
    assert event.group_block_ids(-1) == () and event.group_block_ids(-2) == () and event.group_block_ids(2) == ()


# ---- value types: a step is a snapshot of its events -------------------------------------
def test_a_step_keeps_its_own_tuple_of_events() -> None:
    """A step keeps its own tuple of events: the caller's list changing later changes nothing.

    Kills the mutant: ``events:PrefixCacheStep.__post_init__:del_call:e57a566c`` (the events list kept as
    given).

    A step keeps its own tuple of events: the caller's list changing later changes nothing."""
    events = [started("A")]
    step = PrefixCacheStep(events)  # type: ignore[arg-type]
    events.append(finished("A"))  # the caller reuses its list for the next step
    assert isinstance(step.events, tuple), type(step.events)
    assert [e.req_id for e in step] == ["A"] and len(step) == 1, "the step changed after it was built"


def test_event_accepts_numpy_and_tensor_block_ids() -> None:
    e = PrefixCacheRequestEvent("A", E.STARTED, 0, 8, [np.int64(0), np.int64(1)])
    assert e.group0_block_ids == (0, 1)
    e = PrefixCacheRequestEvent("A", E.STARTED, 0, 8, (np.array([2, 3]), torch.tensor([4])))
    assert e.block_ids == ((2, 3), (4,))
