"""Ground truth of the hidden-state tier in a real vLLM run, kept independently of the tier.

Owns: ``TierTruth``, the runner bridge's ``step_observer``: at the top of each
engine step it reads the ``OmniKVConnector`` plan in the step's connector
metadata and models the tier from the forward's own captures -- a store
remembers, under the block hash, the rows the forward last computed at the
block's KV slots; a load places those remembered rows into the new block's
slots (``ForwardCapture.place``). Check (a) then checks every hit row served
from the tier exactly as it checks local hits: bit for bit, and of the same
token prefix (so a row restored into the old slot, a stale version or another
block's rows is caught). Counts ``external_tokens`` (tokens the scheduler
allocated for connector-loaded blocks) and ``unstored_loads`` (loads of a hash
never stored: the cache must then refuse the hit, never serve it). Checks
contract section 4.10 from outside. Upholds nothing itself.
"""

from __future__ import annotations

from typing import Any

from omni_cache.harness.vllm_engine.truth import ForwardCapture
from omni_cache.integration.kv_nesting import omni_metadata

__all__ = ["TierTruth"]


class TierTruth:
    def __init__(self, capture: ForwardCapture, engine_step: Any) -> None:
        self.capture = capture
        self.engine_step = engine_step  # () -> the bridge's current engine step
        self.bs = capture.block_size
        # block hash -> the captures of its slots when it was stored (engine thread only).
        self.stored: dict[bytes, list[Any]] = {}
        self.external_tokens = 0
        self.store_instructions = 0
        self.unstored_loads = 0

    def on_step(self, scheduler_output: Any) -> None:
        # the plan wherever vLLM nests the wrapper's metadata (MultiConnector: MultiKVConnectorMetadata.metadata)
        plan = getattr(omni_metadata(getattr(scheduler_output, "kv_connector_metadata", None)), "omni_tier", None)
        if not plan:
            return
        step = int(self.engine_step())
        for store in plan.stores:
            caps = [self.capture.latest(store.block_id * self.bs + i) for i in range(self.bs)]
            self.store_instructions += 1
            if all(c is not None for c in caps):
                self.stored[store.block_hash] = caps
        for load in plan.loads:
            self.external_tokens += self.bs
            stored = self.stored.get(load.block_hash)
            if stored is None:
                self.unstored_loads += 1
                continue
            for i, cap in enumerate(stored):
                self.capture.place(load.block_id * self.bs + i, step, cap)
