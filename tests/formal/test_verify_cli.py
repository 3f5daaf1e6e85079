"""``omni-cache verify``: table/JSON output, --only, ad-hoc --cfg, exit codes, and the CI rule.

Exit 0 when every run is as the manifest says, 1 on any surprise, 2 when TLC
cannot run. Where java is missing the TLC tests skip -- except under CI=true,
where ``require_tlc`` fails them (checked here without java).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_cache.cli import SUBCOMMANDS, main
from omni_cache.verify.testing import require_tlc
from omni_cache.verify.tlc import default_tla_dir

TLA = default_tla_dir()


def test_verify_is_a_subcommand() -> None:
    assert "verify" in SUBCOMMANDS


@pytest.mark.tlc
def test_verify_only_json(capsys: pytest.CaptureFixture[str]) -> None:
    require_tlc()
    assert main(["verify", "--only", "ServeZeros", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True
    [run] = doc["runs"]
    assert run["cfg"] == "MCTenancyServeZeros.cfg" and run["result"] == "invariant:NeverSilentMiss"
    assert run["exit"] == 12 and run["distinct_states"] > 0 and run["seconds"] > 0
    # the table's summary claims the runs --only selected, never the whole manifest
    assert main(["verify", "--only", "ServeZeros"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "1 run, 0 surprise(s)" in out and "every run --only 'ServeZeros' selects behaves as the manifest says" in out
    assert "every model and broken variant" not in out


@pytest.mark.tlc
def test_verify_table_and_surprise_exit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An ad-hoc cfg with larger constants passes; a broken variant claimed to be ok is a surprise."""
    require_tlc()
    big = tmp_path / "Bigger.cfg"
    big.write_text((TLA / "tenancy" / "MCTenancy.cfg").read_text().replace("NumReaders = 2", "NumReaders = 3"))
    assert main(["verify", "--cfg", str(big), "--spec", str(TLA / "tenancy" / "MCTenancy.tla")]) == 0
    out = capsys.readouterr().out
    assert "Bigger.cfg" in out and "as expected" in out and "distinct states" in out
    assert "1 ad-hoc run, 0 surprise(s)" in out and "TLC's result is the one --expect names" in out
    assert "manifest" not in out.split("distinct states", 1)[1]  # an ad-hoc run is judged by its --expect
    cfg = TLA / "staging" / "MCStagingReleaseHeld.cfg"
    assert main(["verify", "--cfg", str(cfg), "--expect", "ok"]) == 1
    captured = capsys.readouterr()
    assert "SURPRISE" in captured.out
    assert "result invariant:PageExclusive, --expect wants ok" in captured.err


def test_verify_no_match_and_bad_expect(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["verify", "--only", "no-such-model"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: omni-cache verify") and "no manifest entry matches" in err
    cfg = TLA / "staging" / "MCStaging.cfg"
    with pytest.raises(SystemExit) as exited:  # refused at parse time, with verify's usage
        main(["verify", "--cfg", str(cfg), "--expect", "fine"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "usage: omni-cache verify" in err and "argument --expect: wants one of ok, deadlock" in err


def test_verify_without_java_exits_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OMNI_CACHE_JAVA", "/nonexistent/java")
    assert main(["verify", "--only", "tenancy"]) == 2
    assert "not an executable java" in capsys.readouterr().err


@pytest.mark.parametrize(("java", "says"), [
    ("#!/bin/sh\nexit 1\n", "-version exited 1 without naming a Java version"),
    ('#!/bin/sh\necho \'openjdk version "1.8.0_392"\' >&2\n', "is Java 8: TLC needs Java 11 or newer"),
])
def test_verify_with_a_java_that_cannot_run_tlc_exits_2(java: str, says: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A java that does not run, or is older than 11, is "TLC cannot run" (exit 2, one line), not a
    surprise on every run with drifted state counts (exit 1)."""
    fake = tmp_path / "java"
    fake.write_text(java)
    fake.chmod(0o755)
    monkeypatch.setenv("OMNI_CACHE_JAVA", str(fake))
    assert main(["verify", "--only", "MCStagingConformance"]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_require_tlc_skips_locally_and_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_CACHE_JAVA", "/nonexistent/java")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="TLC cannot run here"):
        require_tlc()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true but TLC cannot run"):
        require_tlc()


@pytest.mark.parametrize(("strip", "expect", "says"), [
    (("INVARIANT", "PROPERT"), "ok", "names no INVARIANT and no PROPERTY, so TLC would check nothing"),
    ((), "invariant:NoSuchInvariant", "names an invariant the cfg does not check (it checks TypeOK"),
    (("PROPERT",), "property:SaveCompletes", "names a property the cfg does not check (it checks no property)"),
])
def test_verify_cfg_that_checks_nothing_or_not_the_expected_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], strip: tuple[str, ...], expect: str, says: str,
) -> None:
    """An ad-hoc cfg without invariants and properties would report "ok" for a search that checked
    nothing but deadlocks; an expected violation the cfg does not check could never be seen. Both are
    refused before TLC starts (no java needed), naming the cfg."""
    cfg = tmp_path / "MCStaging.cfg"
    kept, dropping = [], False
    for line in (TLA / "staging" / "MCStaging.cfg").read_text().splitlines():
        if line.strip() and not line[0].isspace():
            dropping = line.lstrip().startswith(strip) if strip else False
        if not dropping:
            kept.append(line)
    cfg.write_text("\n".join(kept) + "\n")
    with pytest.raises(SystemExit) as exited:
        main(["verify", "--cfg", str(cfg), "--spec", str(TLA / "staging" / "MCStaging.tla"), "--expect", expect])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: omni-cache verify") and f"--cfg {cfg}: " in err and says in err


@pytest.mark.parametrize(("text", "phrase"), [("{not json", "is not JSON"),
                                              ("[1, 2]", "must hold a JSON object with a 'runs' list, got list")])
def test_a_malformed_manifest_is_named_in_one_line(text: str, phrase: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A manifest that is there but is not a manifest: exit 2 naming the file (no traceback, no usage: the
    command line was right)."""
    (tmp_path / "manifest.json").write_text(text)
    assert main(["verify", "--tla-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("omni-cache verify: error: ") and phrase in err[0]
    assert str(tmp_path / "manifest.json") in err[0]


@pytest.mark.tlc
def test_verify_cfg_runs_with_the_spec_the_manifest_names_and_refuses_a_directory(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A manifest cfg whose spec is neither MC<cfg>.tla nor MC<folder>.tla (a broken variant's
    module) runs with the manifest's spec without --spec; a directory is named as one."""
    require_tlc()
    # MCWritesBugs.tla and MCStagingEngineBugs.tla, from the manifest (MCWrites.tla and MCStaging.tla
    # do not define the substituted actions: a parse error before)
    assert main(["verify", "--cfg", str(TLA / "writes" / "MCWritesErrorUncounted.cfg"),
                 "--expect", "invariant:FailureSticks"]) == 0
    assert main(["verify", "--cfg", str(TLA / "staging" / "MCStagingAbortKeepsPage.cfg"),
                 "--expect", "invariant:OnePagePerSave"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["verify", "--cfg", str(TLA / "writes")])
    assert exited.value.code == 2
    assert "is a directory, not a .cfg file" in capsys.readouterr().err


@pytest.mark.tlc
def test_a_run_stopped_by_the_timeout_says_so_not_that_its_counts_drifted(capsys: pytest.CaptureFixture[str]) -> None:
    require_tlc()
    assert main(["verify", "--timeout", "0.5", "--only", "MCTenancyTier.cfg"]) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    assert "TLC timed out before it finished (raise --timeout)" in text and "timed out after 0.5s" in text
    assert "drifted" not in text
