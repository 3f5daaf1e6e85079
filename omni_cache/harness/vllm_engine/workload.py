"""Workloads for ``omni-cache simulate --engine vllm``: what requests arrive when.

Owns: ``VllmPreset`` (engine sizing and workload shape), ``PRESETS`` and
``plan_requests`` -- a deterministic (from the seed) list of ``PlannedRequest``
(prompt token ids, output length, the engine step it arrives at and, for
aborts, the step it is aborted at).

The shapes are chosen so the real engine produces every path the cache has:
prompts behind shared system prompts arriving together (same-step hits) and
later (cross-step hits), an exact repeat of a prompt, a prompt longer than the
token budget (chunked prefill), more concurrent decodes than the small KV cache
holds (preemption and resume) and aborts mid-decode and while waiting.
Upholds nothing (input generation only).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["PRESETS", "PlannedRequest", "VllmPreset", "plan_requests"]

VOCAB = 512
FIRST_TOKEN = 3  # 0..2 are left to special tokens


@dataclass(frozen=True)
class VllmPreset:
    name: str
    description: str
    requests: int
    kv_blocks: int  # KV-cache blocks of the engine (block size 32); small -> preemption
    max_batched_tokens: int = 256
    max_model_len: int = 512
    system_prompt_blocks: tuple[int, ...] = (2, 3)
    suffix_tokens: tuple[int, int] = (8, 120)
    output_tokens: tuple[int, int] = (4, 40)
    wave: int = 6  # requests arriving together
    wave_gap_steps: int = 6
    long_prompt_tokens: int = 400  # > max_batched_tokens: a chunked prefill
    aborts: int = 2
    promises_preemptions: bool = False  # run as the preset, the engine must preempt (else exit 3)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, VllmPreset] = {
    "mixed": VllmPreset(
        "mixed",
        "waves of requests behind shared system prompts, a repeat, a chunked 400-token prompt, "
        "a 48-block KV cache (preemption) and two aborts",
        requests=24,
        kv_blocks=48,
        promises_preemptions=True,
    ),
    "pressure": VllmPreset(
        "pressure",
        "long decodes on a 24-block KV cache: many preemptions and resumes",
        requests=16,
        kv_blocks=24,
        output_tokens=(40, 80),
        wave=8,
        wave_gap_steps=3,
        long_prompt_tokens=300,
        aborts=1,
        promises_preemptions=True,
    ),
}


@dataclass(frozen=True)
class PlannedRequest:
    name: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrive_step: int
    abort_step: int | None = None


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(n)]


def plan_requests(preset: VllmPreset, *, seed: int, requests: int | None = None, block_size: int = 32) -> list[PlannedRequest]:
    """The run's requests, deterministic from ``seed``."""
    n = preset.requests if requests is None else requests
    if n < 1:
        raise ValueError(f"--requests must be at least 1, got {n}")
    rng = random.Random(seed)
    systems = [_tokens(rng, b * block_size) for b in preset.system_prompt_blocks]
    max_prompt = preset.max_model_len - preset.output_tokens[1] - 1
    plan: list[PlannedRequest] = []
    prompts: list[list[int]] = []
    for i in range(n):
        arrive = (i // preset.wave) * preset.wave_gap_steps
        if i == n // 2 and prompts:  # an exact repeat of an earlier prompt
            prompt = list(prompts[0])
        elif i == n // 3:  # longer than the token budget: chunked prefill
            prompt = systems[0] + _tokens(rng, preset.long_prompt_tokens - len(systems[0]))
        else:
            system = systems[(i // 2) % len(systems)]  # pairs share a system prompt: same-step hits
            prompt = system + _tokens(rng, rng.randint(*preset.suffix_tokens))
        prompt = prompt[:max_prompt]
        prompts.append(prompt)
        plan.append(PlannedRequest(f"req{i:03d}", tuple(prompt), rng.randint(*preset.output_tokens), arrive))
    # Aborts: the last-but-one request while it decodes, then (if asked) one during its prefill.
    for k in range(min(preset.aborts, n)):
        idx = n - 2 - k if n - 2 - k >= 0 else k
        req = plan[idx]
        delay = 3 if k == 0 else 1
        plan[idx] = PlannedRequest(req.name, req.prompt, max(req.max_tokens, 16), req.arrive_step,
                                   abort_step=req.arrive_step + delay)
    return plan
