"""Several TLC runs per JVM (omni_cache/verify/tlc_batch.py): same results as one JVM per run.

The CI tier's pinned state counts (tests/formal/test_tla_models.py) already run through the pool;
here: runs in one driver JVM do not leak settings into each other, a timeout kills only its
JVM (the next run gets a new one), and OMNI_CACHE_TLC_BATCH=0 turns the pool off.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_cache.verify.testing import require_tlc
from omni_cache.verify.tlc import (
    EXIT_DEADLOCK,
    EXIT_OK,
    default_tla_dir,
    open_pool,
    parse_tlc_output,
    run_tlc,
)
from omni_cache.verify.tools import find_java, find_tla2tools

TLA = default_tla_dir()
STAGING = TLA / "staging"

pytestmark = pytest.mark.tlc


def _pool_or_skip():  # type: ignore[no-untyped-def]
    require_tlc()
    ctx = open_pool(find_java(), find_tla2tools())
    pool = ctx.__enter__()
    if pool is None:
        ctx.__exit__(None, None, None)
        pytest.skip("no javac here: every TLC run starts its own JVM")
    return ctx, pool


def test_runs_in_one_jvm_match_runs_in_their_own(tmp_path: Path) -> None:
    """The lost-release variant without, then with, the deadlock check in the same JVM, then
    again alone: the second run must still find the deadlock (no setting carries over)."""
    ctx, pool = _pool_or_skip()
    spec, cfg = STAGING / "MCStagingLostRelease.tla", STAGING / "MCStagingLostRelease.cfg"
    try:
        first = run_tlc(spec, cfg, workdir=tmp_path / "a", check_deadlock=False, pool=pool)
        second = run_tlc(spec, cfg, workdir=tmp_path / "b", check_deadlock=True, pool=pool)
    finally:
        ctx.__exit__(None, None, None)
    alone = run_tlc(spec, cfg, workdir=tmp_path / "c", check_deadlock=True)
    assert first.exit_code == EXIT_OK, first.output[-2000:]
    assert second.exit_code == alone.exit_code == EXIT_DEADLOCK, second.output[-2000:]
    seen = [parse_tlc_output(r.output, r.exit_code) for r in (second, alone)]
    assert seen[0] == seen[1], seen
    assert (tmp_path / "b" / "tlc.out").is_file() and not (tmp_path / "c" / "tlc.out").exists()


def test_a_timeout_kills_only_its_jvm(tmp_path: Path) -> None:
    ctx, pool = _pool_or_skip()
    spec = STAGING / "MCStaging.tla"
    try:
        slow = run_tlc(spec, STAGING / "MCStagingNightly.cfg", workdir=tmp_path / "a", timeout_s=1, pool=pool)
        after = run_tlc(spec, STAGING / "MCStagingFailingCopies.cfg", workdir=tmp_path / "b", pool=pool)
    finally:
        ctx.__exit__(None, None, None)
    assert slow.exit_code == -1 and "timed out" in slow.output
    outcome = parse_tlc_output(after.output, after.exit_code)
    assert after.exit_code == EXIT_OK and outcome.result == "ok", after.output[-2000:]


def test_the_pool_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    require_tlc()
    monkeypatch.setenv("OMNI_CACHE_TLC_BATCH", "0")
    with open_pool(find_java(), find_tla2tools()) as pool:
        assert pool is None
