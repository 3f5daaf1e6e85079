"""The output checker and the talker must fail on wrong outputs (a check that cannot fail proves nothing)."""

from __future__ import annotations

import torch

from omni_cache.harness.sim_engine.checker import OutputChecker, ReqExpectation, StepExpectation, Talker
from omni_cache.harness.sim_engine.truth import (
    CODES_KEY,
    EMBEDS_KEY,
    LEFTOVER_LIST_KEY,
    TruthSpec,
    prefix_hashes,
)
from omni_cache.runtime.interface import HIDDEN_KEY, StageCacheOutputs

SPEC = TruthSpec(hidden_width=8, embeds_width=4)
HASHES = prefix_hashes([11, 12, 13, 14, 15, 16])
OTHER = prefix_hashes([11, 12, 99, 14, 15, 16])


def _exp(out_start: int = 0, token_start: int = 4, token_end: int = 6) -> StepExpectation:
    req = ReqExpectation("r1", HASHES, token_start, token_end, out_start)
    return StepExpectation(7, 3, [req], leftovers={LEFTOVER_LIST_KEY: [7, 1, 2]})


def _good(exp: StepExpectation) -> StageCacheOutputs:
    req = exp.reqs[0]
    rows = {k: SPEC.rows(k, HASHES[req.out_start:req.token_end]) for k in SPEC.per_token_keys}
    mm = {k: v for k, v in rows.items() if k != HIDDEN_KEY}
    mm[LEFTOVER_LIST_KEY] = [7, 1, 2]
    return StageCacheOutputs({"r1": rows[HIDDEN_KEY]}, {k: {"r1": v} for k, v in mm.items()})  # key-major


def test_correct_outputs_pass_and_count_cached_rows() -> None:
    checker = OutputChecker(SPEC)
    exp = _exp()
    assert checker.check_step(exp, _good(exp)) == []
    assert checker.rows_checked == 6 and checker.rows_from_cache == 4


def test_wrong_tenant_row_is_reported_with_request_step_key_position() -> None:
    checker = OutputChecker(SPEC)
    exp = _exp()
    out = _good(exp)
    out.hidden_states["r1"][2] = SPEC.rows(HIDDEN_KEY, OTHER)[2]  # a stale tenant's row at position 2
    [m] = checker.check_step(exp, out)
    assert (m.step, m.step_id, m.req_id, m.key, m.position) == (7, 3, "r1", HIDDEN_KEY, 2)
    assert "another prefix" in m.detail and "cached prefix" in m.detail
    assert "step 7 (step id 3), request r1, key 'hidden', position 2" in str(m)
    assert checker.mismatches == [m]


def test_zeros_wrong_shape_and_dtype_are_reported() -> None:
    checker = OutputChecker(SPEC)
    exp = _exp()
    out = _good(exp)
    out.mm_outputs[EMBEDS_KEY]["r1"][5] = 0  # a silent miss in this step's deferred row
    out.mm_outputs[CODES_KEY]["r1"] = out.mm_outputs[CODES_KEY]["r1"][4:]  # only this step's rows after a hit
    out.hidden_states["r1"] = out.hidden_states["r1"].to(torch.bfloat16)
    found = {m.key: m for m in checker.check_step(exp, out)}
    assert found[EMBEDS_KEY].position == 5 and "zeros" in found[EMBEDS_KEY].detail
    assert "this step" in found[EMBEDS_KEY].detail
    assert "expected shape (6, 4)" in found[CODES_KEY].detail
    assert "dtype" in found[HIDDEN_KEY].detail


def test_leftovers_missing_keys_and_extra_keys_are_reported() -> None:
    checker = OutputChecker(SPEC)
    exp = _exp(out_start=4)
    out = _good(exp)
    out.mm_outputs[LEFTOVER_LIST_KEY]["r1"] = [8, 1, 2]  # a later step's value (not snapshotted)
    out.mm_outputs["step.stale"] = {"r1": [1]}
    found = checker.check_step(exp, out)
    assert {m.key for m in found} == {LEFTOVER_LIST_KEY, "step.stale"}
    missing = checker.check_step(exp, StageCacheOutputs(None, {}))
    assert [m.key for m in missing] == [HIDDEN_KEY, None]


def test_talker_requires_every_position_exactly_once() -> None:
    talker = Talker(SPEC)
    rows = SPEC.rows(HIDDEN_KEY, HASHES)
    first = ReqExpectation("r", HASHES, 0, 4, 0)
    assert talker.receive(1, first, rows[:4]) is None
    # A gap (positions 4..5 skipped) is reported.
    gap = talker.receive(2, ReqExpectation("r", HASHES, 5, 6, 5), rows[5:6])
    assert gap is not None and gap.position == 4
    # A restart (first step after RESUMED: rows from 0) replaces what was seen.
    assert talker.receive(3, ReqExpectation("r", HASHES, 4, 5, 0), rows[:5]) is None
    assert talker.receive(4, ReqExpectation("r", HASHES, 5, 6, 5), rows[5:6]) is None
    assert talker.finish(5, "r", HASHES, 6) is None
    assert talker.completed == 1
    # Too few positions at finish, or a wrong accumulated row, fail.
    talker.receive(6, ReqExpectation("s", HASHES, 0, 3, 0), rows[:3])
    assert talker.finish(7, "s", HASHES, 6) is not None
    bad = rows[:3].clone()
    bad[1] += 1
    talker.receive(8, ReqExpectation("t", HASHES, 0, 3, 0), bad)
    m = talker.finish(9, "t", HASHES, 3)
    assert m is not None and m.position == 1 and m.req_id == "t"
