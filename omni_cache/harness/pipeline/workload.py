"""Workloads of ``omni-cache pipeline``: which thinker requests arrive when.

Owns: ``PipelinePreset`` (engine sizing and workload shape), ``PRESETS``,
``PlannedTurn`` and ``plan_turns`` -- a deterministic (from the seed) list of
turns. A turn with a ``parent`` is the next turn of a conversation: its prompt
is the parent's prompt, the parent's answer (the thinker's output tokens, known
only at run time) and its own new user tokens, and it arrives
``turn_gap_steps`` pipeline steps after its parent finished (``arrive_step`` is
then the earliest step). ``resolve_prompt`` builds a prompt from the answers.

Shapes: ``system`` (requests behind two shared system prompts, arriving in
waves whose pairs share a prompt: hits within a step and across steps),
``multiturn`` (conversations: each turn's prompt extends the previous turn's
prompt and answer, hits across steps) and ``mix`` (both, arrivals over time).
Pure Python; no torch or vLLM. Upholds nothing (input generation only).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["MAX_REQUESTS", "PRESETS", "PipelinePreset", "PlannedTurn", "max_prompt_len", "plan_turns",
           "resolve_prompt"]

VOCAB = 512
FIRST_TOKEN = 3  # 0..2 are left to special tokens
MAX_REQUESTS = 64  # keeps a run within minutes on a 2-core CPU


@dataclass(frozen=True)
class PipelinePreset:
    name: str
    description: str
    requests: int  # default number of thinker requests (turns)
    conversation_share: float  # fraction of requests that are conversation turns
    turns: int = 4  # turns per conversation
    system_prompt_blocks: tuple[int, ...] = (2, 3)  # block size 32
    suffix_tokens: tuple[int, int] = (8, 48)  # a system request's own tokens
    first_turn_tokens: tuple[int, int] = (24, 64)  # a conversation's first user text (after its system prompt)
    user_tokens: tuple[int, int] = (8, 24)  # each later turn's new user text
    answer_tokens: tuple[int, int] = (4, 12)  # thinker output tokens
    wave: int = 4  # system requests arriving together
    wave_gap_steps: int = 5
    turn_gap_steps: int = 2
    conversation_system: bool = True  # conversations open behind a shared system prompt
    talker_tokens: int = 8
    kv_blocks: int = 96
    max_batched_tokens: int = 256
    max_model_len: int = 512

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, PipelinePreset] = {
    "system": PipelinePreset(
        "system", "requests behind two shared system prompts, in waves whose pairs share a prompt "
        "(hits within a step and across steps)", requests=12, conversation_share=0.0),
    "multiturn": PipelinePreset(
        "multiturn", "conversations of 4 turns: turn n's prompt is turn n-1's prompt, its answer and new "
        "user text (hits across steps)", requests=12, conversation_share=1.0, conversation_system=False),
    "mix": PipelinePreset(
        "mix", "system-prompt waves and 3-turn conversations arriving over time", requests=12,
        conversation_share=0.5, turns=3),
}


@dataclass(frozen=True)
class PlannedTurn:
    name: str
    tokens: tuple[int, ...]  # the turn's own tokens (the whole prompt when parent is None)
    max_tokens: int  # thinker output tokens (the answer)
    arrive_step: int  # earliest pipeline step; a child also waits turn_gap_steps after its parent finished
    parent: str | None = None


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(n)]


def max_prompt_len(preset: PipelinePreset) -> int:
    """The longest prompt the preset can produce (system prompt, first turn and every later turn at their maximum)."""
    system = max(preset.system_prompt_blocks) * 32
    single = system + preset.suffix_tokens[1]
    turn0 = (system if preset.conversation_system else 0) + preset.first_turn_tokens[1]
    turns = turn0 + (preset.turns - 1) * (preset.answer_tokens[1] + preset.user_tokens[1])
    return max(single, turns)


def plan_turns(preset: PipelinePreset, *, seed: int, requests: int | None = None) -> list[PlannedTurn]:
    """The run's thinker requests, deterministic from ``seed``, parents before their children."""
    n = preset.requests if requests is None else requests
    if not 1 <= n <= MAX_REQUESTS:
        raise ValueError(f"--requests must be from 1 to {MAX_REQUESTS}, got {n}")
    longest = max_prompt_len(preset) + preset.answer_tokens[1]
    if longest > preset.max_model_len:
        raise ValueError(f"preset {preset.name!r}: a prompt and its answer can reach {longest} tokens, "
                         f"over max_model_len {preset.max_model_len}")
    rng = random.Random(seed)
    systems = [_tokens(rng, b * 32) for b in preset.system_prompt_blocks]
    n_conv_turns = round(n * preset.conversation_share)
    n_single = n - n_conv_turns
    conversations = math.ceil(n_conv_turns / preset.turns) if n_conv_turns else 0
    plan: list[PlannedTurn] = []
    for i in range(n_single):
        system = systems[(i // 2) % len(systems)]  # pairs share a system prompt: hits within a step
        arrive = (i // preset.wave) * preset.wave_gap_steps
        plan.append(PlannedTurn(f"sys{i:02d}", tuple(system + _tokens(rng, rng.randint(*preset.suffix_tokens))),
                                rng.randint(*preset.answer_tokens), arrive))
    left = n_conv_turns
    for c in range(conversations):
        turns = min(preset.turns, left)
        left -= turns
        system = systems[c % len(systems)] if preset.conversation_system else []
        arrive = 1 + c * preset.wave_gap_steps  # between the system waves: arrivals over time
        parent: str | None = None
        for t in range(turns):
            name = f"conv{c}.t{t}"
            if t == 0:
                tokens = tuple(system + _tokens(rng, rng.randint(*preset.first_turn_tokens)))
            else:
                tokens = tuple(_tokens(rng, rng.randint(*preset.user_tokens)))
            plan.append(PlannedTurn(name, tokens, rng.randint(*preset.answer_tokens), arrive if t == 0 else 0, parent))
            parent = name
    return plan


def resolve_prompt(turn: PlannedTurn, prompts: dict[str, tuple[int, ...]], answers: dict[str, tuple[int, ...]]
                   ) -> tuple[int, ...]:
    """``turn``'s prompt: its tokens, behind its parent's prompt and answer when it has a parent."""
    if turn.parent is None:
        return turn.tokens
    if turn.parent not in answers:
        raise ValueError(f"turn {turn.name!r}: its previous turn {turn.parent!r} has not finished")
    return prompts[turn.parent] + answers[turn.parent] + turn.tokens
