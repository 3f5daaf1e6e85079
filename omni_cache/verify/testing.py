"""Helpers for test suites that check the runtime against the TLA+ models.

Owns: ``require_tlc`` (skip where java/TLC is missing, but FAIL under CI=true,
where a skipped model check would hide a broken proof) and
``assert_trace_valid`` (replay a ``TraceRecorder``'s events against the state
tables, and optionally with TLC against tla/staging/StagingSlot.tla).

Upholds (by checking): see ``omni_cache.verify.traces`` (I1, I2 along traces).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from omni_cache.runtime.trace import TraceEvent, TraceRecorder
from omni_cache.verify.tools import tlc_available
from omni_cache.verify.traces import validate_trace


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def require_tlc() -> None:
    """Skip the calling test if TLC cannot run here; under CI=true, fail instead."""
    import pytest

    reason = tlc_available()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"CI=true but TLC cannot run, so the TLA+ checks would be skipped: {reason}")
    pytest.skip(f"TLC cannot run here: {reason}")


def assert_trace_valid(
    trace: TraceRecorder | Iterable[TraceEvent], *, tlc: bool = False, tla_dir: Path | None = None
) -> dict[tuple[str, str], str]:
    """Replay ``trace`` (fast, pure Python); with ``tlc=True`` also check it with TLC.

    With ``tlc=True`` where TLC cannot run, the TLC half is skipped (failed
    under CI=true) via ``require_tlc``. Returns every object's final state.
    """
    if tlc:
        require_tlc()
    return validate_trace(trace, tlc=tlc, tla_dir=tla_dir)
