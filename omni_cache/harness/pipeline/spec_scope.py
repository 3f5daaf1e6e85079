"""``omni-cache pipeline --speculative METHOD``: the thinker with prefix caching decodes speculatively.

Owns: ``trap_turns`` (the planned turns with traps in their own tokens, built from the
thinker's chains, which a probe on the ground-truth thinker -- no cache, no speculation --
reads; ``vllm_engine.speculative``) and ``spec_findings`` (the draft counts of the runs with
prefix caching, the bridges' against vLLM's own counters, a disagreement added to the run's
mismatches).

The ground truth stays the thinker with prefix caching off and no speculative decoding: the
talker's tokens and logprobs with the cache must equal the talker's fed from that thinker,
and every row served under speculation is checked against the requests' final tokens
(``SpecCapture``).

Upholds (by checking): I14 from outside (the talker's identity and the draft counts).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from omni_cache.harness.pipeline.workload import FIRST_TOKEN, VOCAB, PlannedTurn
from omni_cache.harness.sim_engine.checker import Mismatch
from omni_cache.harness.vllm_engine.spec_run import KEEP, PROBES, vllm_draft_counts
from omni_cache.harness.vllm_engine.speculative import probe_chains, trapped

__all__ = ["spec_findings", "trap_turns"]


def trap_turns(plan: list[PlannedTurn], truth_llm: Any, seed: int) -> list[PlannedTurn]:
    """``plan`` with each turn's own tokens ending in traps (a conversation's first turn and the
    system requests keep their first ``KEEP`` tokens: the shared system prompt)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
        outs = truth_llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    chains = probe_chains(generate, random.Random(seed).sample(range(FIRST_TOKEN, VOCAB), PROBES))
    starts = sorted(chains)
    return [dataclasses.replace(turn, tokens=tuple(trapped(
        turn.tokens, chains[starts[hash(turn.tokens) % len(starts)]], keep=KEEP if turn.parent is None else 0,
        vocab=VOCAB, first_token=FIRST_TOKEN))) for turn in plan]


def spec_findings(stages: list[Any], apc_llm: Any, method: str, mismatches: list[Mismatch]) -> dict[str, Any]:
    """The draft counts of the runs with prefix caching (every repeat's bridge), vLLM's own for the
    same engine; a disagreement is a mismatch."""
    total = {"verify_steps": 0, "draft_tokens_accepted": 0, "draft_tokens_rejected": 0, "rows_trimmed": 0}
    for stage in stages:
        for key, value in stage.spec_counts.items():
            total[key] += value
    engine = vllm_draft_counts(apc_llm)
    accepted, rejected = total["draft_tokens_accepted"], total["draft_tokens_rejected"]
    if engine and (engine["draft_tokens"], engine["accepted_tokens"]) != (accepted + rejected, accepted):
        mismatches.append(Mismatch(None, None, None, None, None, (
            f"the bridges counted {accepted} accepted and {rejected} rejected draft tokens, vLLM "
            f"{engine['accepted_tokens']} accepted of {engine['draft_tokens']}")))
    return {"method": method, **total, "vllm_draft_tokens": engine.get("draft_tokens"),
            "vllm_accepted_tokens": engine.get("accepted_tokens")}
