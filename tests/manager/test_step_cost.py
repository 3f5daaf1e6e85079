"""A step's bookkeeping runs no Python per request, and the fast checks that make it so
refuse exactly what the per-write walks refuse.

Deterministic, never timed: ``sys.settrace`` counts the Python lines the package runs for one
decode step (new_step_starts + save_outputs + materialize) at 2 and at 64 requests, with and
without a new request's hit among them; a loop, comprehension or generator over the step's
requests shows up as lines that grow with the batch. The rest checks the fast paths that
replaced those loops against the same refusals: the layout's ``StepRows`` (derived when the
layout is built, trusted only for the very writes they were derived from), the scheduled-count
check's three paths, the pool's one-reduction slot check, and the reader's per-hit merge among
many decoding requests.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any, NamedTuple

import pytest
import torch
from cache_helpers import MODES, assert_waits_for_lock, config, finished, save, slots, started, truth

import omni_cache
from omni_cache.runtime.block_pool import PrefixBlockPool
from omni_cache.runtime.errors import PHRASE_SLOT_MAPPING, OmniPrefixCacheUnmatchError
from omni_cache.runtime.events import (
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
    StepRows,
    layout_rows,
)
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.runtime.validation import check_scheduled

PACKAGE = os.path.dirname(omni_cache.__file__)


# ---- no Python per request in a decode step ---------------------------------------------
def _decoding(n: int, eager: bool = True, mm_key: str | None = None) -> tuple[OmniPrefixCacheManager, list[str]]:
    """A manager with ``n`` requests of 4 prompt tokens (request i on blocks i and n + 1 + i), one
    decode step done (position 4), so the next decode step is at position 5. ``mm_key``: a
    per-token mm key saved with every step (``cache_helpers.save``)."""
    m = OmniPrefixCacheManager(config(num_blocks=2 * n + 4, staging_capacity_tokens=8 * n + 8), eager=eager)
    reqs = [f"r{i}" for i in range(n)]
    m.new_step_starts([started(r, scheduled=4) for r in reqs])
    step, _ = save(m, [(r, [i, n + 1 + i], 0, 4) for i, r in enumerate(reqs)], mm_key=mm_key)
    m.materialize(step, reqs)
    m.new_step_starts(PrefixCacheStep((), dict.fromkeys(reqs, 1)))
    step, _ = save(m, [(r, [i, n + 1 + i], 4, 5) for i, r in enumerate(reqs)], mm_key=mm_key)
    m.materialize(step, reqs)
    return m, reqs


class _Step(NamedTuple):
    events: PrefixCacheStep
    hidden: torch.Tensor
    layout: PrefixCacheWriteLayout
    req_ids: list[str]


def _decode_step(n: int, reqs: list[str], *, new_hit: bool) -> _Step:
    """Decode position 5 of every request; with ``new_hit``, request "h" starts with a 4-token hit
    on r0's first block (block 0) and computes its position 4 on block n (its own)."""
    spans = [(r, [i, n + 1 + i], 5, 6) for i, r in enumerate(reqs)]
    events: tuple[Any, ...] = ()
    if new_hit:
        events = (started("h", hit_end=4, blocks=(0, n), scheduled=1),)
        spans.append(("h", [0, n], 4, 5))
    rows = torch.cat([truth("r0" if r == "h" else r, range(s, e)) for r, _, s, e in spans])
    layout = PrefixCacheWriteLayout.packed([(r, s, e) for r, _, s, e in spans],
                                           torch.cat([slots(b, s, e) for _, b, s, e in spans]))
    scheduled = {r: e - s for r, _, s, e in spans}
    return _Step(PrefixCacheStep(events, scheduled), rows, layout, [r for r, *_ in spans])


def _lines_of_one_step(n: int, *, new_hit: bool) -> Counter[tuple[str, str]]:
    """Python lines of the package run by one decode step of ``n`` requests, by (file, function)."""
    m, reqs = _decoding(n)
    step = _decode_step(n, reqs, new_hit=new_hit)  # built outside the trace: the engine builds it
    lines: Counter[tuple[str, str]] = Counter()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        code = frame.f_code
        if event == "line" and code.co_filename.startswith(PACKAGE):
            lines[(os.path.relpath(code.co_filename, PACKAGE), code.co_name)] += 1
        return tracer

    previous = sys.gettrace()  # a coverage tracer, if any: restored after
    sys.settrace(tracer)
    try:
        m.new_step_starts(step.events)
        step_id = m.save_outputs(step.hidden, {}, num_tokens_unpadded=len(step.hidden),
                                 num_tokens_padded=len(step.hidden), write_layout=step.layout)
        out = m.materialize(step_id, step.req_ids)
    finally:
        sys.settrace(previous)
    # The traced step did its work: every request's row, the new request's hit rows first.
    assert set(out.hidden_states) == set(step.req_ids)
    assert torch.equal(out.hidden_states["r1"], truth("r1", [5]))
    if new_hit:
        assert torch.equal(out.hidden_states["h"], truth("r0", range(5)))
    m.shutdown()
    return lines


@pytest.mark.parametrize("new_hit", [False, True], ids=["decode", "decode+new hit"])
def test_a_decode_step_runs_the_same_python_lines_at_2_and_64_requests(new_hit: bool) -> None:
    """Per-step bookkeeping does not grow with the requests. A Python loop over
    the step's requests anywhere in the package (validation, the scheduled counts, hits, the step
    context, the outputs) makes the 64-request step run more lines than the 2-request one."""
    small, large = _lines_of_one_step(2, new_hit=new_hit), _lines_of_one_step(64, new_hit=new_hit)
    grew = {k: (small[k], large[k]) for k in set(small) | set(large) if small[k] != large[k]}
    assert not grew, f"Python lines that depend on the number of requests, (file, function): (2, 64): {grew}"
    functions = {name for _, name in small}
    assert {"validate_save", "check_scheduled", "build_outputs", "_per_request"} <= functions
    if new_hit:
        assert {"take", "_merge_hit"} <= functions
    assert sum(small.values()) > 300  # the trace saw the whole step


# ---- the layout's facts: derived once, trusted only for the writes they describe ---------
def _write(req: str, start: int, end: int, token_start: int = 0) -> PrefixCacheWrite:
    return PrefixCacheWrite(req, start, end, token_start, token_start + end - start)


def _layout(writes: list[PrefixCacheWrite], total: int) -> PrefixCacheWriteLayout:
    return PrefixCacheWriteLayout(tuple(writes), total, torch.arange(max(total, 1), dtype=torch.int64))


def _save_layout(m: OmniPrefixCacheManager, layout: PrefixCacheWriteLayout, n: int) -> int:
    return m.save_outputs(torch.ones(n, 4), {}, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)


# writes, total rows, the phrase of the refusal (None: accepted)
LAYOUTS: dict[str, tuple[list[PrefixCacheWrite], int, str | None]] = {
    "tiles": ([_write("a", 0, 2), _write("z", 2, 2), _write("b", 2, 3)], 3, None),
    "first write not at row 0": ([_write("a", 1, 3)], 3, "belong to no request"),
    "a gap": ([_write("a", 0, 1), _write("b", 2, 3)], 3, "belong to no request"),
    "short of the rows": ([_write("a", 0, 1), _write("b", 1, 2)], 3, "belong to no request"),
    "an overlap": ([_write("a", 0, 2), _write("b", 1, 3)], 3, "overlaps another"),
    "past the rows": ([_write("a", 0, 2), _write("b", 2, 4)], 3, "exceeds"),
    "a request twice": ([_write("a", 0, 1), _write("a", 1, 3)], 3, "repeats a request"),
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_layout_facts_tile_exactly_when_the_walk_accepts(case: str) -> None:
    """``StepRows.tiles`` holds for writes that tile the rows in order and for nothing the walk
    refuses; the save then accepts, or refuses with the walk's own message, changing nothing."""
    writes, total, phrase = LAYOUTS[case]
    layout = _layout(writes, total)
    rows = layout_rows(layout)
    assert rows is not None and rows.writes is layout.writes
    assert rows.tiles is (phrase is None)
    m = OmniPrefixCacheManager(config())
    if phrase is None:
        step = _save_layout(m, layout, total)
        out = m.materialize(step, ["a", "z", "b"])
        assert [len(out.hidden_states[r]) for r in ("a", "z", "b")] == [2, 0, 1]
    else:
        with pytest.raises(OmniPrefixCacheUnmatchError, match=phrase):
            _save_layout(m, layout, total)
        assert m.stats()["saved"] == 0 and m.stats()["staging"]["claims"] == 0
    m.shutdown()


def test_writes_out_of_row_order_are_walked_and_served_in_row_order() -> None:
    layout = _layout([_write("b", 2, 3, 7), _write("a", 0, 2, 5)], 3)
    assert layout_rows(layout).tiles is False  # type: ignore[union-attr]
    m = OmniPrefixCacheManager(config())
    hidden = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    step = m.save_outputs(hidden, {}, num_tokens_unpadded=3, num_tokens_padded=3, write_layout=layout)
    out = m.materialize(step, ["b", "a"])
    assert torch.equal(out.hidden_states["a"], hidden[:2]) and torch.equal(out.hidden_states["b"], hidden[2:])
    m.shutdown()


def test_facts_of_other_writes_are_never_trusted() -> None:
    """The save trusts ``StepRows`` only for the very tuple of writes they were derived from:
    writes swapped into the frozen layout afterwards, or facts of another layout planted in it,
    are walked (and refused) as if no facts existed."""
    good = _layout([_write("a", 0, 1), _write("b", 1, 3)], 3)
    bad_writes = (_write("a", 0, 2), _write("b", 1, 3))  # overlapping
    swapped = _layout(list(good.writes), 3)
    object.__setattr__(swapped, "writes", bad_writes)  # the facts still say "tiles"
    planted = _layout(list(bad_writes), 3)
    object.__setattr__(planted, "_rows", layout_rows(good))  # tiling facts of other writes
    for layout in (swapped, planted):
        assert layout_rows(layout) is None
        m = OmniPrefixCacheManager(config())
        with pytest.raises(OmniPrefixCacheUnmatchError, match="overlaps another"):
            _save_layout(m, layout, 3)
        m.shutdown()


def test_writes_that_are_not_prefix_cache_writes_get_no_facts() -> None:
    """Only frozen ``PrefixCacheWrite`` keep facts true; anything else is walked at every save."""

    class Loose(NamedTuple):
        req_id: str
        row_start: int
        row_end: int
        token_start: int
        token_end: int

    assert StepRows.of((Loose("a", 0, 1, 0, 1),), 1) is None
    assert StepRows.of((_write("a", 0, 1),), 1) is not None
    with pytest.raises(TypeError, match="req_id must be hashable"):  # refused where it is built
        PrefixCacheWrite(["unhashable"], 0, 1, 0, 1)  # type: ignore[arg-type]


# ---- scheduled counts: three paths, one answer ---------------------------------------------
def _rows(*spans: tuple[str, int]) -> StepRows:
    writes, row = [], 0
    for req, size in spans:
        writes.append(_write(req, row, row + size))
        row += size
    rows = StepRows.of(tuple(writes), row)
    assert rows is not None and rows.tiles
    return rows


@pytest.mark.parametrize("scheduled", [
    {"a": 2, "b": 1},  # the layout's requests in row order (the list path)
    {"b": 1, "a": 2},  # another order (the dict path)
    {"a": 2, "b": 1, "gone": 0},  # a zero count for a request not in the layout
    {"a": 2.0, "b": True},  # integer-likes compare by value, as the walk does
    {},
])
def test_scheduled_counts_that_match_pass(scheduled: dict[str, Any]) -> None:
    check_scheduled(scheduled, _rows(("a", 2), ("b", 1)))


@pytest.mark.parametrize("scheduled", [{"a": 2, "idle": 0}, {"idle": 0, "a": 2}, {"a": 2}])
def test_a_zero_row_write_matches_a_zero_count_or_none(scheduled: dict[str, Any]) -> None:
    """A request in the batch with nothing scheduled: its zero rows equal its count, 0 given or not."""
    check_scheduled(scheduled, _rows(("a", 2), ("idle", 0)))


@pytest.mark.parametrize(("scheduled", "named"), [
    ({"a": 2, "b": 2}, "request 'b' was scheduled 2 tokens but the slot mapping covers 1 rows"),
    ({"b": 2, "a": 1}, "request 'b' was scheduled 2 tokens but the slot mapping covers 1 rows"),
    ({"a": 1, "b": 3}, "request 'a' was scheduled 1 tokens but the slot mapping covers 2 rows"),
    ({"a": 2, "b": 1, "c": 1}, "request 'c' was scheduled 1 tokens but the slot mapping covers 0 rows"),
    ({"a": 2, "b": 0}, "request 'b' was scheduled 0 tokens but the slot mapping covers 1 rows"),  # zero included
    ({"b": 1, "a": 0}, "request 'a' was scheduled 0 tokens but the slot mapping covers 2 rows"),
    ({"a": 2}, r"request 'b' was not scheduled \(no count: 0 tokens\) but the slot mapping covers 1 rows"),
])
def test_scheduled_counts_that_differ_name_the_first_request(scheduled: dict[str, Any], named: str) -> None:
    assert PHRASE_SLOT_MAPPING in named
    with pytest.raises(OmniPrefixCacheUnmatchError, match=named):
        check_scheduled(scheduled, _rows(("a", 2), ("b", 1)))


@pytest.mark.parametrize("eager", MODES)
def test_a_save_whose_rows_differ_from_the_scheduled_counts_changes_nothing(eager: bool) -> None:
    m = OmniPrefixCacheManager(config(), eager=eager)
    m.new_step_starts(PrefixCacheStep((started("a"), started("b")), {"b": 1, "a": 3}))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="request 'a' was scheduled 3 tokens"):
        save(m, [("a", [0], 0, 2), ("b", [1], 0, 1)])
    assert m.stats()["saved"] == 0 and m.stats()["staging"]["claims"] == 0
    step, rows = save(m, [("b", [1], 0, 1), ("a", [0], 0, 3)])  # the same counts, rows in another order
    assert torch.equal(m.materialize(step, ["a", "b"]).hidden_states["a"], rows[1:])
    m.new_step_starts([finished("a"), finished("b")])
    m.shutdown()


# ---- the pool's slot range check, short (max of a list) and long (one reduction) ----------
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("num_rows", [32, 512])
def test_slot_lists_are_range_checked_at_both_ends(dtype: torch.dtype, num_rows: int) -> None:
    """int64 slots are read as unsigned (a negative slot is then above any num_slots): steps of up
    to 256 rows take Python's max of that list, longer ones one reduction; other dtypes take min
    and max. 0 and num_slots - 1 pass, -1 and num_slots are refused wherever they are."""
    pool = PrefixBlockPool(2 * num_rows)
    ok = torch.arange(0, 2 * num_rows, 2, dtype=dtype)
    ok[5] = 2 * num_rows - 1
    pool.check_slots(ok)
    for bad, where in ((-1, 0), (-1, num_rows - 1), (2 * num_rows, 0), (2 * num_rows, 17), (-(2**31), 3)):
        slots_ = ok.clone()
        slots_[where] = bad
        with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"KV slots out of range \[0, {2 * num_rows}\)"):
            pool.check_slots(slots_)


# ---- the reader merges hits per hit, among many decoding requests ------------------------
@pytest.mark.parametrize("eager", MODES)
def test_a_new_hit_among_decoding_requests_is_served_with_every_subset(eager: bool) -> None:
    n = 6
    m, reqs = _decoding(n, eager, mm_key="mm")
    step = _decode_step(n, reqs, new_hit=True)
    m.new_step_starts(step.events)
    want = {r: truth(r, [5]) for r in reqs} | {"h": truth("r0", range(5))}
    first = m.save_outputs(step.hidden, {"mm": -step.hidden[:, :2].clone()}, num_tokens_unpadded=n + 1,
                           num_tokens_padded=n + 1, write_layout=step.layout)
    out = m.materialize(first, ["r4", "h", "r1", "h"])  # a subset, out of order, "h" named twice
    assert set(out.hidden_states) == {"r4", "h", "r1"}
    for r, rows in out.hidden_states.items():
        assert torch.equal(rows, want[r]), r
        assert torch.equal(out.mm_outputs["mm"][r], -want[r][:, :2]), r
    m.shutdown()


@pytest.mark.parametrize("subset", [None, ["h", "r2"], ["r0", "r1", "r2", "r3", "r4", "r5", "h"]])
def test_a_new_hit_merges_only_its_own_rows(subset: list[str] | None) -> None:
    n = 6
    m, reqs = _decoding(n)
    step = _decode_step(n, reqs, new_hit=True)
    m.new_step_starts(step.events)
    sid = m.save_outputs(step.hidden, {}, num_tokens_unpadded=n + 1, num_tokens_padded=n + 1,
                         write_layout=step.layout)
    names = step.req_ids if subset is None else subset
    out = m.materialize(sid, names).hidden_states
    for r in names:
        assert torch.equal(out[r], truth("r0", range(5)) if r == "h" else truth(r, [5])), r
    m.shutdown()



# ---- where a step was saved: the first frame outside the runtime ---------------------------
def _compiled_in(path: str, source: str, **names: Any) -> dict[str, Any]:
    namespace: dict[str, Any] = dict(names)
    exec(compile(source, path, "exec"), namespace)  # a function whose frames claim to be in ``path``
    return namespace


def test_saved_at_is_the_first_frame_outside_the_runtime_or_in_a_driver() -> None:
    """``caller_location`` skips the runtime's frames (an engine hook in ``integration`` included)
    and stops at the caller: a frame outside the package, or one of the package's drivers (the
    bench, the CLI, the simulators), which save steps as an engine does."""
    from omni_cache.runtime.locks import caller_location

    runtime = _compiled_in(os.path.join(PACKAGE, "integration", "fake_hook.py"),
                           "def hook():\n    return caller_location()\n", caller_location=caller_location)
    driver = _compiled_in(os.path.join(PACKAGE, "harness", "bench", "fake_driver.py"),
                          "def drive():\n    return hook()\n", hook=runtime["hook"])
    here = f"{__file__}:{sys._getframe().f_lineno + 1}"
    assert runtime["hook"]() == here  # through the runtime's frame to this test's line
    assert driver["drive"]() == os.path.join(PACKAGE, "harness", "bench", "fake_driver.py") + ":2"
    m = OmniPrefixCacheManager(config())
    step, _ = save(m, [("a", [0], 0, 2)])
    saved_at = m.shutdown()[step]  # unconsumed: shutdown reports where it was saved
    assert saved_at.startswith(os.path.join(os.path.dirname(os.path.dirname(__file__)), "cache_helpers.py") + ":")


def test_the_compiled_stand_in_files_are_not_reported_by_coverage() -> None:
    """The two functions above claim files that do not exist; coverage must skip them (else the
    test run warns "Couldn't parse ... fake_hook.py / fake_driver.py")."""
    import fnmatch
    import pathlib

    tomllib = pytest.importorskip("tomllib")
    pyproject = pathlib.Path(PACKAGE).parent / "pyproject.toml"
    omit = tomllib.loads(pyproject.read_text())["tool"]["coverage"]["run"]["omit"]
    for name in (os.path.join(PACKAGE, "integration", "fake_hook.py"), os.path.join(PACKAGE, "harness", "bench", "fake_driver.py")):
        assert any(fnmatch.fnmatch(name, pattern) for pattern in omit), name


# ---- the staging calls whose trace notes are now built only for a recorder keep their lock ----
@pytest.mark.parametrize("what", ["hold", "unhold", "done_reading"])
def test_staging_hold_unhold_and_done_reading_wait_for_the_pool_lock(what: str) -> None:
    """A staging page's write holds and its reader flag change only under the staging lock (I3, I11).

    Kills the mutants: ``drop_with`` on ``StagingPool.hold`` / ``unhold`` / ``done_reading`` (a write's
    hold count or the reader flag changed while another thread holds the pool lock).

    A staging page's write holds and its reader flag change only under the staging lock (I3, I11)."""

    from omni_cache.runtime.staging import StagingPool

    pool = StagingPool(3, 4, 0.05)
    slot = pool.claim(2)
    pool.claimed_pages(slot, {"k": torch.ones(2, 3)})
    pool.save(slot, 1, "engine.py:1")
    if what == "unhold":
        pool.hold(slot)
    if what == "done_reading":
        pool.consume(1, caller="test")
    call = {"hold": pool.hold, "unhold": pool.unhold, "done_reading": pool.done_reading}[what]
    assert_waits_for_lock(pool._lock, lambda: call(slot), f"StagingPool.{what}")
