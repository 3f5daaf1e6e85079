"""Verification of omni-cache against its TLA+ models.

Owns: the public face of ``omni_cache.verify``: the TLC runner (``tlc``), the
spec/code conformance check (``conformance``) and trace validation
(``traces``). ``omni-cache verify`` and the tests use these.

Upholds (by checking): I1 ExactlyOnce, I2 BoundedStaging, I3 PageExclusive,
I6 NeverSilentMiss, I7 NoStaleTenant, I8 StickyFailure, I9 AbortsLand, and
that the runtime's machines only take the transitions the models checked.
"""

from omni_cache.verify.conformance import check_conformance, compare_graph
from omni_cache.verify.tlc import (
    ManifestEntry,
    ManifestError,
    RunResult,
    TLCUnavailable,
    default_tla_dir,
    find_java,
    find_tla2tools,
    load_manifest,
    parse_tlc_output,
    run_entry,
    run_manifest,
    tlc_available,
)
from omni_cache.verify.traces import (
    TraceCheck,
    TraceReplayError,
    check_trace_tlc,
    replay,
    validate_trace,
)

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
