"""Generated spec mutants (omni_cache/verify/mutants.py): the operators, and TLC killing one.

The full kill table is ``omni-cache verify --mutants`` (minutes); here: the
generator's operators make the edits they claim, the fixed-seed sample is
stable, every equivalence listed in tla/mutants_equivalent.json names a
generated mutant, and one mutant (consume without its guard) is killed by an
invariant, not a crash (item 4 of the spec's guard-robustness).
"""

from __future__ import annotations

import pytest

from omni_cache.verify.mutants import MODELS, all_mutants, generate, load_equivalent, run_mutants
from omni_cache.verify.testing import require_tlc
from omni_cache.verify.tlc import default_tla_dir

TLA = default_tla_dir()


def _mutants(folder: str):  # type: ignore[no-untyped-def]
    model = next(m for m in MODELS if m.folder == folder)
    return generate(model, (TLA / folder / model.spec).read_text())


def test_operators_make_their_edits() -> None:
    staging = _mutants("staging")
    by_op = {m.operator for m in staging}
    assert by_op == {"drop-guard", "negate-guard", "skip-update", "flip-comparison", "swap-state"}
    drop = next(m for m in staging if m.action == "consume" and m.operator == "drop-guard")
    assert drop.old.strip() == "/\\ i \\in unconsumed" and drop.new is None
    skip = next(m for m in staging if m.action == "save" and m.operator == "skip-update" and "nextId'" in m.old)
    assert skip.new is not None and skip.new.strip() == "/\\ UNCHANGED nextId"
    text = (TLA / "staging" / "Staging.tla").read_text()
    assert "/\\ i \\in unconsumed" not in drop.apply(text).split("consume(i) ==")[1].split("\n\n")[0]


def test_sample_is_fixed_and_large_enough() -> None:
    first, second = all_mutants(TLA), all_mutants(TLA)
    assert [m.ident for m in first] == [m.ident for m in second]
    assert len(first) >= 20 and {m.model.folder for m in first} == {"staging", "tenancy", "writes"}


def test_every_listed_equivalent_is_a_generated_mutant() -> None:
    idents = {m.ident for m in all_mutants(TLA, per_model=None)}
    for ident in load_equivalent(TLA):
        assert ident in idents, f"tla/mutants_equivalent.json lists {ident}, which the generator does not make"


@pytest.mark.tlc
def test_consume_without_its_guard_is_killed_by_an_invariant() -> None:
    require_tlc()
    drop = next(m for m in _mutants("staging") if m.action == "consume" and m.operator == "drop-guard")
    [result] = run_mutants(TLA, only=drop.ident, per_model=None, jobs=1)
    assert result.verdict == "killed", result.runs
    assert result.runs[0][1] == 12 and result.runs[0][2] == "invariant:ExactlyOnce", result.runs


@pytest.mark.tlc
def test_cli_prints_the_kill_table(capsys: pytest.CaptureFixture[str]) -> None:
    """`omni-cache verify --mutants` prints each mutant with its verdict and a summary line."""
    require_tlc()
    from omni_cache.cli import main

    drop = next(m for m in _mutants("writes") if m.action == "fail" and m.operator == "skip-update"
                and "failure'" in m.old)
    code = main(["verify", "--mutants", "--all-mutants", "--only", drop.ident, "--jobs", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert drop.ident in out and "killed" in out and "invariant:FailureSticks" in out
    assert ("1 mutants: 1 killed (an invariant or property violated, exit 12/13, or a reachability run passed), 0 equivalent, "
            "0 stillborn (do not parse), 0 survived") in out


@pytest.mark.tlc
def test_the_kill_table_shows_each_edit_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    """TLA+ text that reads as rich markup (``![i]``) is shown as written, never dropped."""
    require_tlc()
    from omni_cache.cli import main

    mutant = next(m for m in _mutants("staging") if m.action == "consume" and m.operator == "skip-update"
                  and "EXCEPT ![i]" in m.old)
    assert main(["verify", "--mutants", "--all-mutants", "--only", mutant.ident, "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "[delivered EXCEPT ![i] = @ + 1]" in out, out


def _one(folder: str, action: str, operator: str, old: str):  # type: ignore[no-untyped-def]
    return next(m for m in _mutants(folder) if m.action == action and m.operator == operator and old in m.old)


@pytest.mark.tlc
@pytest.mark.parametrize(("action", "operator", "old", "cfg", "code", "result"), [
    # used to crash TLC (exit 75: CHOOSE on no edge); WAfter is total, so TypeOK catches it
    ("fail", "drop-guard", "LiveStates", "MCWrites.cfg", 12, "invariant:TypeOK"),
    # used to crash TLC (Head(<<>>)); First is total, so the committer never copies: AbortsLand
    ("start_copy", "negate-guard", "queue # <<>>", "MCWrites.cfg", 13, "property:?"),
    # removed behaviour (no write ever registered): the fair engine of MCWritesLive.cfg catches it
    ("register", "negate-guard", "~Registered(i)", "MCWritesLive.cfg", 13, "property:?"),
    # shutdown never takes effect, so ShutdownDrains holds vacuously on every CI cfg: the reachability
    # run (NeverStopped, which the correct spec violates) passes, and that is the kill
    ("shutdown", "negate-guard", "~shut", "MCWritesReachStop.cfg", 0, "ok"),
    ("stop", "skip-update", "stopped' = TRUE", "MCWritesReachStop.cfg", 0, "ok"),
])
def test_writes_mutants_that_crashed_or_hid_are_killed(action: str, operator: str, old: str, cfg: str,
                                                       code: int, result: str) -> None:
    require_tlc()
    mutant = _one("writes", action, operator, old)
    [res] = run_mutants(TLA, only=mutant.ident, per_model=None, jobs=1)
    assert res.verdict == "killed", res.runs
    assert (cfg, code, result) in res.runs, res.runs


@pytest.mark.tlc
def test_a_mutant_that_does_not_parse_is_stillborn_not_killed() -> None:
    """`\\E withWrite \\notin BOOLEAN` is no TLA+: SANY rejects it (exit 150) on every cfg."""
    require_tlc()
    mutant = _one("staging", "save", "flip-comparison", "withWrite")
    [res] = run_mutants(TLA, only=mutant.ident, per_model=None, jobs=1)
    assert res.verdict == "stillborn", res.runs
    assert all(c == 150 and r == "parse-error" for _, c, r in res.runs), res.runs
