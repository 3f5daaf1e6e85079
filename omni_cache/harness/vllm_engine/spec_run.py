"""``omni-cache simulate --engine vllm --speculative METHOD``: the thinker with speculative decoding.

Owns: ``SpecSimulation`` (a ``VllmSimulation`` whose engine runs vLLM's speculative decoding --
``ngram``, a tiny draft model or a tiny EAGLE head, ``speculative``), ``spec_kv_bytes`` (the
KV memory for the preset's blocks with the draft's layers), ``add_spec_summary`` and
``render_spec`` (what the report adds).

The run: first a probe -- one-token prompts, whose greedy continuations are the thinker's
token chains -- then the preset's workload with each prompt's tail rewritten to hold traps
built from those chains (``speculative.trapped``: the n-gram proposer then proposes tokens the
thinker rejects), then the checks:

- (a) as without speculation: every served row bit for bit the forward's own row
  (``SpecCapture``, a ``ForwardCapture`` whose tokens past a forward's start stay tentative),
  hit rows by their KV slot and token prefix;
- I14 from outside (``SpecCapture.check_tokens``): every served row is a row of a token the
  request has, by its final tokens (``RequestOutput``), and every finished request got one row
  per token but the last;
- (b) each finished request's prompt and output tokens but the last, recomputed alone after
  ``reset_prefix_cache`` (a prefill: no draft token in its forward) against every served row;
- (c) exactly once, as without speculation;
- the bridge's draft counts equal vLLM's own (``vllm:spec_decode_num_draft_tokens`` and
  ``..._num_accepted_tokens``), and the run promises rejected drafts and prefix hits (exit 3
  without them).

Upholds (by checking): I14, and I1 (exactly once) as without speculation.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from omni_cache.harness.sim_engine.checker import Mismatch
from omni_cache.harness.vllm_engine.engine import (
    BLOCK_SIZE,
    VllmSimConfig,
    VllmSimResult,
    VllmSimulation,
    engine_kwargs,
    prepare_vllm_env,
)
from omni_cache.harness.vllm_engine.models import MODELS, TINY_LLAMA, model_dir
from omni_cache.harness.vllm_engine.speculative import (
    draft_kv_layers,
    probe_chains,
    speculative_config,
    trapped,
)
from omni_cache.harness.vllm_engine.truth_spec import SpecCapture
from omni_cache.harness.vllm_engine.workload import FIRST_TOKEN, VOCAB, PlannedRequest

__all__ = ["PROBES", "SpecSimulation", "add_spec_summary", "render_spec", "spec_kv_bytes", "speculative_options",
           "vllm_draft_counts"]

PROBES = 16  # start tokens probed for their chains
KEEP = 96  # a prompt's first tokens are never rewritten (its system prompt: the hits)


def spec_kv_bytes(kv_blocks: int, method: str) -> int:
    """KV memory for ``kv_blocks`` blocks of the thinker's layers and the method's draft layers
    (one KV-cache group: every layer has the same per-layer shape)."""
    layers = TINY_LLAMA["num_hidden_layers"]
    per_layer = MODELS["llama"].kv_bytes_per_block // layers
    return kv_blocks * (layers + draft_kv_layers(method)) * per_layer


def speculative_options(method: str, kv_blocks: int) -> dict[str, Any]:
    """``LLM(...)`` options of a speculative thinker: vLLM's ``speculative_config`` (its draft built
    at run time), the KV memory for ``kv_blocks`` blocks with the draft's layers, and vLLM's own
    statistics on (its draft counters)."""
    return {"speculative_config": speculative_config(method), "kv_cache_memory_bytes": spec_kv_bytes(kv_blocks, method),
            "disable_log_stats": False}


def vllm_draft_counts(llm: Any) -> dict[str, int]:
    """vLLM's own counters: draft tokens scheduled and accepted (``vllm:spec_decode_num_*``)."""
    names = {"vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
    return {names[m.name]: int(m.value) for m in llm.get_metrics() if m.name in names}


class SpecSimulation(VllmSimulation):
    """See the module docstring."""

    capture: SpecCapture  # the base's ForwardCapture, with the tokens' tentative state

    def __init__(self, config: VllmSimConfig, plan: list[PlannedRequest] | None = None) -> None:
        if config.speculative is None:
            raise ValueError("SpecSimulation needs config.speculative")
        super().__init__(config, plan)
        # The prompts are the preset's with traps and decoding takes fewer steps: not the preset's run,
        # so not its promise (preemptions); this run promises rejected drafts and prefix hits instead.
        self.preset_plan = False
        self.capture = SpecCapture(BLOCK_SIZE)
        self.final: dict[str, list[int]] = {}  # engine request id -> its prompt and output tokens so far
        self._prompts: dict[str, tuple[int, ...]] = {}
        self.chains: dict[int, list[int]] = {}
        self._by_name: dict[str, tuple[int, ...]] = {}  # the workload's prompts (traps in), by request name
        self._llm: Any = None
        self._engine_counts: dict[str, int] = {}
        self.spec_summary: dict[str, Any] = {}
        self._recompute_stats = {"prompt_rows": 0, "prompt_exact": 0, "output_rows": 0, "output_exact": 0,
                                 "output_max_rel_diff": 0.0}

    def build_llm(self) -> Any:
        prepare_vllm_env()
        from vllm import LLM

        p, cfg = self.preset, self.config
        kv_blocks = cfg.kv_blocks or p.kv_blocks
        assert cfg.speculative is not None
        return LLM(**engine_kwargs(model_dir("llama"), kv_blocks=kv_blocks,
                                   max_batched_tokens=cfg.max_batched_tokens or p.max_batched_tokens,
                                   max_model_len=p.max_model_len, eager=cfg.eager,
                                   **speculative_options(cfg.speculative, kv_blocks)))

    def run(self, llm: Any = None) -> VllmSimResult:
        res = super().run(llm)
        self._summarize(res)
        return res

    # ------------------------------------------------------------------ workload
    def _on_output(self, out: Any) -> None:
        internal = self._internal.get(out.request_id, out.request_id)
        prompt = self._prompts.setdefault(internal, self._by_name.get(out.request_id, ()))
        self.final[internal] = [*prompt, *out.outputs[0].token_ids]

    def _add(self, le: Any, name: str, prompt: list[int], max_tokens: int) -> str:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
        internal = le.add_request(name, TokensPrompt(prompt_token_ids=prompt), sp)
        self._internal[name] = internal
        self._prompts[internal] = tuple(prompt)
        self.capture.register_prompt(internal, prompt)
        return str(internal)

    def _probe(self, llm: Any, res: VllmSimResult) -> dict[int, list[int]]:
        """The thinker's chains: the greedy continuation of each one-token probe prompt."""
        le = llm.llm_engine
        starts = random.Random(self.config.seed).sample(range(FIRST_TOKEN, VOCAB), PROBES)
        self._internal = {}

        def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
            names = [f"probe-{p[0]}" for p in prompts]
            for name, prompt in zip(names, prompts, strict=True):
                self._add(le, name, prompt, max_tokens)
            done: dict[str, list[int]] = {}
            while le.has_unfinished_requests():
                for out in le.step():
                    self._on_output(out)
                    if out.finished:
                        done[out.request_id] = list(out.outputs[0].token_ids)
                self._after_step(llm, res)
            return [done[n] for n in names]

        chains = probe_chains(generate, starts)
        self._probe_ids = {self._internal[f"probe-{x}"] for x in starts}
        return chains

    def _drive(self, llm: Any, res: VllmSimResult) -> None:
        self._llm = llm
        self.chains = self._probe(llm, res)
        starts = sorted(self.chains)
        self.plan = [dataclasses.replace(r, prompt=tuple(trapped(
            r.prompt, self.chains[starts[hash(r.prompt) % len(starts)]], keep=KEEP, vocab=VOCAB,
            first_token=FIRST_TOKEN))) for r in self.plan]
        self._by_name = {r.name: r.prompt for r in self.plan}
        probe_internal = dict(self._internal)
        super()._drive(llm, res)
        for r in self.plan:  # a request aborted before any output: its prompt is all it has
            internal = self._internal.get(r.name)
            if internal is not None:
                self._prompts.setdefault(internal, r.prompt)
                self.final.setdefault(internal, list(r.prompt))
        self._internal = {**probe_internal, **self._internal}

    # ------------------------------------------------------------------ check (b)
    def _recompute(self, llm: Any, res: VllmSimResult) -> None:
        """The I14 checks (every step consumed by now), then check (b): each finished request's tokens
        but the last, as one prompt, against every row served for it."""
        self.capture.check_tokens(self.final, {self._internal[r.name] for r in self._finished} | self._probe_ids)
        kept = self._finished
        self._finished = [dataclasses.replace(r, prompt=tuple(self.final[self._internal[r.name]][:-1])) for r in kept]
        try:
            super()._recompute(llm, res)
        finally:
            self._finished = kept

    def _compare_prompt(self, served_id: str, truth_id: str, r: PlannedRequest, res: VllmSimResult, tol: float) -> None:
        served = self.capture.served_rows.get(served_id, {})
        truth = self.capture.forward_rows.get(truth_id, {})
        prompt_len = len(self._prompts[served_id])
        stats = self._recompute_stats
        for p in range(len(r.prompt)):
            if p not in served:
                res.mismatches.append(Mismatch(None, None, served_id, "hidden", p,
                                               "the next stage never received this row"))
                return
            diff = (served[p] - truth[p]).abs().max().item()
            scale = truth[p].abs().max().item()
            rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
            kind = "prompt" if p < prompt_len else "output"
            stats[f"{kind}_rows"] += 1
            stats[f"{kind}_exact"] += int(diff == 0.0)
            res.recompute_rows += 1
            res.recompute_exact_rows += int(diff == 0.0)
            res.recompute_max_abs_diff = max(res.recompute_max_abs_diff, diff)
            res.recompute_max_rel_diff = max(res.recompute_max_rel_diff, rel)
            if kind == "output":
                stats["output_max_rel_diff"] = max(stats["output_max_rel_diff"], rel)
            if rel > tol:
                res.mismatches.append(Mismatch(None, None, served_id, "hidden", p,
                                               f"{kind} row differs from the recomputation by {diff:.3g} "
                                               f"({rel:.3g} of the row's max |value| {scale:.3g}; tolerance {tol:g})"))
                return

    # ------------------------------------------------------------------ summary
    def _summarize(self, res: VllmSimResult) -> None:
        bridge = getattr(self, "bridge", None)
        counters = dict(bridge.verify_steps.counters) if bridge is not None else {}
        engine = self._engine_counts
        self.spec_summary = {
            "method": self.config.speculative, **counters, "vllm_draft_tokens": engine.get("draft_tokens"),
            "vllm_accepted_tokens": engine.get("accepted_tokens"), "probes": len(self.chains),
            "rows_of_tokens_checked": self.capture.rows_of_tokens_checked, "recompute": dict(self._recompute_stats)}
        if res.mismatches:
            return
        accepted, rejected = counters.get("draft_tokens_accepted", 0), counters.get("draft_tokens_rejected", 0)
        if engine and (engine["draft_tokens"], engine["accepted_tokens"]) != (accepted + rejected, accepted):
            res.mismatches.append(Mismatch(None, None, None, None, None, (
                f"the bridge counted {accepted} accepted and {rejected} rejected draft tokens, vLLM "
                f"{engine['accepted_tokens']} accepted of {engine['draft_tokens']}")))
        if not res.incomplete and rejected == 0:
            res.incomplete.append("no draft token was rejected: the run did not show a verify step's trim")
        if not res.incomplete and res.hit_tokens == 0:
            res.incomplete.append("no request hit the prefix cache")

    def _check_exactly_once(self, bridge: Any, res: VllmSimResult) -> None:
        """vLLM's own draft counters, read here: the engine is still up."""
        if self._llm is not None:
            self._engine_counts = vllm_draft_counts(self._llm)
        super()._check_exactly_once(bridge, res)


def add_spec_summary(summary: dict[str, Any], sim: VllmSimulation) -> None:
    """Add the run's speculative decoding to its summary: ``speculative`` (the method, the bridge's
    and vLLM's counts, check (b)'s prompt and output rows) and, at top level,
    ``draft_tokens_accepted`` and ``draft_tokens_rejected``."""
    spec = dict(getattr(sim, "spec_summary", {}) or {})
    summary["speculative"] = spec
    summary["draft_tokens_accepted"] = spec.get("draft_tokens_accepted", 0)
    summary["draft_tokens_rejected"] = spec.get("draft_tokens_rejected", 0)


def render_spec(summary: dict[str, Any], console: Any) -> None:
    s = summary["speculative"]
    rc = s.get("recompute", {})
    console.print(
        f"speculative decoding ({s.get('method')}): {s.get('verify_steps', 0)} verify steps, "
        f"{summary['draft_tokens_accepted']} draft tokens accepted, {summary['draft_tokens_rejected']} rejected "
        f"(vLLM: {s.get('vllm_accepted_tokens')} of {s.get('vllm_draft_tokens')}), {s.get('rows_trimmed', 0)} rows "
        f"trimmed; {s.get('rows_of_tokens_checked', 0)} served rows checked against the final tokens; (b) "
        f"{rc.get('prompt_rows', 0)} prompt rows ({rc.get('prompt_exact', 0)} bit-identical), "
        f"{rc.get('output_rows', 0)} output rows ({rc.get('output_exact', 0)} bit-identical, max rel diff "
        f"{rc.get('output_max_rel_diff', 0.0):.3g})", markup=False, highlight=False)
