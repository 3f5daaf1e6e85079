"""Verification of omni-cache against its TLA+ models.

Owns: the public face of ``omni_cache.verify``: the TLC runner (``tlc``), the
spec/code conformance check (``conformance``) and trace validation
(``traces``). ``omni-cache verify`` and the tests use these.

Upholds (by checking): I1 ExactlyOnce, I2 BoundedStaging, I3 PageExclusive,
I6 NeverSilentMiss, I7 NoStaleTenant, I8 StickyFailure, I9 AbortsLand, and
that the runtime's machines only take the transitions the models checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_cache.runtime.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "check_conformance": "omni_cache.verify.conformance",
    "compare_graph": "omni_cache.verify.conformance",
    "ManifestEntry": "omni_cache.verify.tlc",
    "ManifestError": "omni_cache.verify.tlc",
    "RunResult": "omni_cache.verify.tlc",
    "TLCUnavailable": "omni_cache.verify.tools",
    "default_tla_dir": "omni_cache.verify.tlc",
    "find_java": "omni_cache.verify.tools",
    "find_tla2tools": "omni_cache.verify.tools",
    "load_manifest": "omni_cache.verify.tlc",
    "parse_tlc_output": "omni_cache.verify.tlc",
    "run_entry": "omni_cache.verify.tlc",
    "run_manifest": "omni_cache.verify.tlc",
    "tlc_available": "omni_cache.verify.tools",
    "TraceCheck": "omni_cache.verify.traces",
    "TraceReplayError": "omni_cache.verify.traces",
    "check_trace_tlc": "omni_cache.verify.traces",
    "replay": "omni_cache.verify.traces",
    "validate_trace": "omni_cache.verify.traces",
}

__all__ = [
    "ManifestEntry",
    "ManifestError",
    "RunResult",
    "TLCUnavailable",
    "TraceCheck",
    "TraceReplayError",
    "check_conformance",
    "check_trace_tlc",
    "compare_graph",
    "default_tla_dir",
    "find_java",
    "find_tla2tools",
    "load_manifest",
    "parse_tlc_output",
    "replay",
    "run_entry",
    "run_manifest",
    "tlc_available",
    "validate_trace",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from omni_cache.verify.conformance import check_conformance, compare_graph
    from omni_cache.verify.tlc import (
        ManifestEntry,
        ManifestError,
        RunResult,
        default_tla_dir,
        load_manifest,
        parse_tlc_output,
        run_entry,
        run_manifest,
    )
    from omni_cache.verify.tools import TLCUnavailable, find_java, find_tla2tools, tlc_available
    from omni_cache.verify.traces import TraceCheck, TraceReplayError, check_trace_tlc, replay, validate_trace
