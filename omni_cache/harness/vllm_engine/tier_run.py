"""``omni-cache simulate --engine vllm --kv-connector example``: prefixes that come back through a KV connector.

Owns: ``tier_plan`` (the two phases of requests), ``TierSimulation`` (a
``VllmSimulation`` whose engine runs vLLM's ``ExampleConnector`` under
``OmniKVConnector``, its disk store in a temporary directory removed at exit)
and ``tier_summary`` (what the report adds: ``tier_hit_tokens``, ``tier_bytes``,
load failures).

The run: phase 1 serves prompts behind two shared system prompts (the
connector stores their KV on disk, the tier their hidden and mm rows at
finish); then ``reset_prefix_cache()`` empties vLLM's local prefix cache; phase
2 serves prompts that repeat each phase-1 prompt's stored prefix with a new
tail, so their prefix KV comes back through ``ExampleConnector`` into new
blocks (the first of each system prompt wholly external, later ones a local hit
on the system prompt plus an external rest). Checks (a), (b), (c) of
``VllmSimulation`` run unchanged, check (a) with ``TierTruth`` modelling the
tier from the forward's own rows; the run also fails unless the scheduler
allocated external tokens, the tier restored every one of them, and no load
failed (unless ``expect_load_failures``). Check (b)'s recomputation skips
every prefix cache (``skip_reading_prefix_cache``).

Upholds nothing itself: it checks the tier's rows from outside.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from typing import Any

from omni_cache.harness.sim_engine.checker import Mismatch
from omni_cache.harness.vllm_engine.engine import (
    BLOCK_SIZE,
    VllmSimConfig,
    VllmSimResult,
    VllmSimulation,
    engine_kwargs,
)
from omni_cache.harness.vllm_engine.engine import tiny_llama_dir as _tiny_llama_dir
from omni_cache.harness.vllm_engine.grid import KV_CONNECTORS
from omni_cache.harness.vllm_engine.tier_truth import TierTruth
from omni_cache.harness.vllm_engine.workload import FIRST_TOKEN, VOCAB, PlannedRequest

__all__ = ["CONNECTORS", "TierSimulation", "add_tier_summary", "example_transfer_config", "render_tier",
           "tier_findings", "tier_plan"]

CONNECTORS = KV_CONNECTORS
TIER_KV_BLOCKS = 64


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(n)]


def _stored_len(n: int) -> int:
    """Tokens of an ``n``-token prompt that ExampleConnector stores (``align_to_block_size``)."""
    return (n - 1) // BLOCK_SIZE * BLOCK_SIZE


def tier_plan(seed: int, requests: int) -> tuple[list[PlannedRequest], list[PlannedRequest]]:
    """Phase 1 (``requests`` prompts) and phase 2 (one prompt per phase-1 prompt: its stored prefix,
    which ExampleConnector looks up as ``(len - 2) // 32 * 32`` tokens, plus a new 2..30-token tail)."""
    if requests < 1:
        raise ValueError(f"--requests must be at least 1, got {requests}")
    rng = random.Random(seed)
    systems = [_tokens(rng, 2 * BLOCK_SIZE), _tokens(rng, 3 * BLOCK_SIZE)]
    first: list[PlannedRequest] = []
    second: list[PlannedRequest] = []
    for i in range(requests):
        prompt = systems[i % 2] + _tokens(rng, rng.randint(40, 100))
        if len(prompt) % BLOCK_SIZE == 1:
            prompt.append(FIRST_TOKEN)
        first.append(PlannedRequest(f"p1-{i:03d}", tuple(prompt), rng.randint(2, 6), arrive_step=i // 3))
        kept = prompt[: _stored_len(len(prompt))]
        again = kept + _tokens(rng, rng.randint(2, 30))
        assert _stored_len(len(again) - 1) == len(kept), "phase-2 prompt must look up the stored prefix"
        # the first two (one per system prompt) arrive alone: wholly external; the rest two steps later
        second.append(PlannedRequest(f"p2-{i:03d}", tuple(again), rng.randint(2, 6), arrive_step=0 if i < 2 else 2))
    return first, second


def example_transfer_config(storage: str, tier_bytes: int = 64 << 20, tier_dir: str | None = None) -> dict[str, Any]:
    """``kv_transfer_config`` of vLLM's ``ExampleConnector`` (its disk store in ``storage``) under
    ``OmniKVConnector`` (the hidden-state tier: ``tier_bytes`` of host memory, ``tier_dir`` below it)."""
    settings: dict[str, Any] = {"tier_bytes": tier_bytes}
    if tier_dir is not None:
        settings["tier_dir"] = tier_dir
    return {
        "kv_connector": "OmniKVConnector", "kv_connector_module_path": "omni_cache.integration.kv_tier",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": {"shared_storage_path": storage}}],
            "omni_cache": settings,
        },
    }


def tier_findings(summary: dict[str, Any], *, expect_load_failures: bool = False) -> list[Mismatch]:
    """What a run whose prefixes came back through the connector failed to show: KV that came back
    at all (``external_tokens``), every loaded token's rows restored by the tier, no failed load."""
    if summary.get("external_tokens", 0) == 0:
        return [Mismatch(None, None, None, None, None,
                         "no KV came back through the connector (0 external tokens): the tier was not exercised")]
    if summary.get("tier_load_failures") and not expect_load_failures:
        return [Mismatch(None, None, None, None, None, f"{summary['tier_load_failures']} tier loads failed: "
                         f"{summary.get('tier_load_failure_blocks')}")]
    if summary.get("tier_hit_tokens", 0) != summary["external_tokens"] and not expect_load_failures:
        return [Mismatch(None, None, None, None, None, f"the tier restored {summary.get('tier_hit_tokens', 0)} "
                         f"tokens of the {summary['external_tokens']} the connector loaded")]
    return []


class TierSimulation(VllmSimulation):
    """See the module docstring. ``tier_bytes``/``tier_dir``: the tier's budget and second level."""

    def __init__(self, config: VllmSimConfig, *, tier_bytes: int = 64 << 20, tier_dir: str | None = None,
                 expect_load_failures: bool = False, load_failure_policy: str | None = None) -> None:
        if config.kv_connector not in CONNECTORS:
            raise ValueError(f"--kv-connector must be one of {list(CONNECTORS)}, got {config.kv_connector!r}")
        self.phase1, self.phase2 = tier_plan(config.seed, config.requests or 6)
        super().__init__(config, plan=list(self.phase1))
        self.tier_bytes, self.tier_dir = tier_bytes, tier_dir
        self.kv_blocks = config.kv_blocks or TIER_KV_BLOCKS
        self.max_batched_tokens = config.max_batched_tokens or 512
        self.expect_load_failures = expect_load_failures
        self.load_failure_policy = load_failure_policy  # vLLM's kv_load_failure_policy (None: its default)
        self.storage = tempfile.mkdtemp(prefix="omni-cache-example-connector-")
        self.tier_summary: dict[str, Any] = {}
        self._final_tier: dict[str, Any] | None = None  # the applier's summary once both phases ran
        self.truth: TierTruth | None = None

    def kv_transfer_config(self) -> dict[str, Any]:
        config = example_transfer_config(self.storage, self.tier_bytes, self.tier_dir)
        if self.load_failure_policy is not None:
            config["kv_load_failure_policy"] = self.load_failure_policy
        return config

    def build_llm(self) -> Any:
        from omni_cache.harness.vllm_engine.engine import prepare_vllm_env

        prepare_vllm_env()
        from vllm import LLM

        p = self.preset
        return LLM(**engine_kwargs(_tiny_llama_dir(), kv_blocks=self.kv_blocks, max_batched_tokens=self.max_batched_tokens,
                                   max_model_len=p.max_model_len, eager=self.config.eager,
                                   kv_transfer_config=self.kv_transfer_config()))

    def run(self, llm: Any = None) -> VllmSimResult:
        try:
            res = super().run(llm)
        finally:
            shutil.rmtree(self.storage, ignore_errors=True)
        self._check_tier(res)
        return res

    def _drive(self, llm: Any, res: VllmSimResult) -> None:
        bridge = self.bridge
        self.truth = TierTruth(self.capture, lambda: bridge.engine_step)
        bridge.step_observer = self.truth.on_step
        super()._drive(llm, res)
        if res.incomplete:  # --steps-limit cut the first phase: the second (the restart) is not run
            res.incomplete.append("the second phase (the tier's hits after a prefix-cache reset) was not run")
            self._keep_final_tier(bridge)
            return
        internal, finished = dict(self._internal), list(self._finished)
        if not llm.llm_engine.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache refused with the engine idle")
        self.plan = list(self.phase2)
        super()._drive(llm, res)
        self._internal = {**internal, **self._internal}
        self._finished = finished + self._finished
        res.finished = len({r.name for r in self._finished})
        self.plan = [*self.phase1, *self.phase2]
        self._keep_final_tier(bridge)

    def _keep_final_tier(self, bridge: Any) -> None:
        # NOTE: read while the engine runs: its shutdown closes the tier (entries and spill files gone).
        applier = getattr(bridge, "tier_applier", None)
        self._final_tier = dict(applier.summary()) if applier is not None else None

    def _check_tier(self, res: VllmSimResult) -> None:
        applier = getattr(getattr(self, "bridge", None), "tier_applier", None)
        truth = self.truth
        summary: dict[str, Any] = (  # the tier at the end of the run, else (a run that raised) as it is now
            self._final_tier if self._final_tier is not None
            else dict(applier.summary()) if applier is not None else {"tier_hit_tokens": 0})
        summary["external_tokens"] = truth.external_tokens if truth is not None else 0
        self.tier_summary = summary
        if res.mismatches or res.incomplete:
            return  # the first finding is reported (or the run was cut): the tier's own checks add nothing
        res.mismatches.extend(tier_findings(summary, expect_load_failures=self.expect_load_failures))


def add_tier_summary(summary: dict[str, Any], sim: VllmSimulation) -> None:
    """Add the tier's fields to a run's summary: ``tier`` (all counters) and, at top level,
    ``tier_hit_tokens``, ``tier_bytes`` and ``tier_load_failures``."""
    tier = dict(getattr(sim, "tier_summary", {}) or {})
    summary["kv_connector"] = sim.config.kv_connector
    if isinstance(sim, TierSimulation):  # the run's own sizes, not the preset's
        summary["config"].update(requests=len(sim.phase1) + len(sim.phase2), kv_blocks=sim.kv_blocks,
                                 max_batched_tokens=sim.max_batched_tokens, tier_bytes_budget=sim.tier_bytes)
        summary["kv_blocks"]["asked"] = sim.kv_blocks
    summary["tier"] = tier
    for key in ("tier_hit_tokens", "tier_bytes", "tier_load_failures"):
        summary[key] = tier.get(key, 0)


def render_tier(summary: dict[str, Any], console: Any) -> None:
    t = summary["tier"]
    console.print(
        f"hidden-state tier ({summary['kv_connector']} connector): {summary['tier_hit_tokens']} tier hit tokens "
        f"restored of {t.get('external_tokens', 0)} external tokens, {t.get('tier_stored_blocks', 0)} blocks "
        f"stored, {summary['tier_bytes']} bytes held ({t.get('tier_entries', 0)} entries, "
        f"{t.get('tier_evictions', 0)} evicted), {summary['tier_load_failures']} load failures",
        markup=False, highlight=False)
