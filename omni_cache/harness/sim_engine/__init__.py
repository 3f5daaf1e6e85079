"""``omni-cache simulate``: a simulated two-stage omni engine around the cache.

Owns nothing itself; the modules each own one part:

- ``truth``: the ground truth (rows as a function of a token prefix);
- ``request``: a request's tokens, progress, block table and hashes;
- ``allocator``: the paged KV block allocator with prefix caching;
- ``scheduler``: token budget, chunked prefill, preemption/resume, finish/abort;
- ``workload``: the presets (chat, multiturn, audio) and their request streams;
- ``thinker``: the forward pass (per-token rows, mm keys, padding, layout);
- ``checker``: verification of every output and the talker stage;
- ``builder``: the builder thread (materialize, then verify);
- ``engine``: the per-step protocol loop;
- ``config`` and ``report``: the run's knobs and its summary.

Everything the cache returns is checked against the ground truth, so a run
that exits 0 has exercised I1, I2, I4-I7 and I9 on a realistic workload.

Upholds nothing itself: it checks the runtime from outside.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_cache.runtime.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "SimConfig": "omni_cache.harness.sim_engine.config",
    "SimResult": "omni_cache.harness.sim_engine.engine",
    "Simulation": "omni_cache.harness.sim_engine.engine",
    "PRESETS": "omni_cache.harness.sim_engine.workload",
}

__all__ = ["PRESETS", "SimConfig", "SimResult", "Simulation"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from omni_cache.harness.sim_engine.config import SimConfig
    from omni_cache.harness.sim_engine.engine import SimResult, Simulation
    from omni_cache.harness.sim_engine.workload import PRESETS
