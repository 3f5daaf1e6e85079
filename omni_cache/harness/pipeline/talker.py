"""The talker of ``omni-cache pipeline``: its checkpoint, its engine's arguments and its stage.

Owns: ``talker_checkpoint`` (the thinker's talker, ``vllm_sim.models.talker_config``: a Llama of
the thinker's width with weights drawn from the seed, written with ``transformers``
``save_pretrained`` into a temporary directory removed on exit), ``talker_kwargs`` (no prefix
caching, no cache, ``prompt_embeds`` on), ``project`` (the identity between the stages: both
widths are the thinker's) and ``TalkerStage`` (requests given as ``prompt_embeds``; greedy, the
logprob of every sampled token kept). vLLM is imported only inside functions.

Upholds nothing itself (the checks are ``pipeline.checks``).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache.harness.pipeline.stages import StageOptions
from omni_cache.harness.vllm_engine.engine import engine_kwargs
from omni_cache.harness.vllm_engine.models import DEFAULT_MODEL, talker_config, talker_kv_bytes_per_block

__all__ = ["TALKER_INIT_STD", "TalkerOutput", "TalkerStage", "project", "talker_checkpoint", "talker_kwargs"]

TALKER_INIT_STD = 0.2  # the talker's weight init (std); larger than the usual 0.02, so small input changes show


def talker_kwargs(model_dir: str, opts: StageOptions) -> dict[str, Any]:
    """The talker: a real (seeded) checkpoint fed ``prompt_embeds``; no prefix caching, no cache."""
    kwargs = engine_kwargs(model_dir, kv_blocks=opts.kv_blocks, max_batched_tokens=opts.max_batched_tokens,
                           max_model_len=opts.max_model_len, load_format="auto", enable_prompt_embeds=True,
                           enable_prefix_caching=False, worker_cls="auto", additional_config={}, seed=opts.seed,
                           kv_cache_memory_bytes=opts.kv_blocks * talker_kv_bytes_per_block(opts.model))
    kwargs.update(dict(opts.extra))
    return kwargs


@contextlib.contextmanager
def talker_checkpoint(seed: int, model: str = DEFAULT_MODEL) -> Iterator[str]:
    """The talker of ``model``'s thinker (``vllm_sim.models.talker_config``: a Llama of the thinker's
    width) with weights drawn from ``seed``, saved with ``save_pretrained``; the directory is removed
    on exit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tempfile.mkdtemp(prefix="omni-cache-talker-")
    try:
        talker = talker_config(model)
        config = LlamaConfig(**{k: v for k, v in talker.items() if k not in ("architectures", "model_type")},
                             initializer_range=TALKER_INIT_STD)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            weights = LlamaForCausalLM(config)
        weights.save_pretrained(path)
        del weights
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def project(rows: torch.Tensor, talker_width: int) -> torch.Tensor:
    """The thinker-to-talker projection: the identity, float32 ``[prompt_len, hidden]``."""
    if rows.shape[-1] != talker_width:
        raise ValueError(f"thinker rows are {rows.shape[-1]} wide, the talker takes {talker_width}: "
                         "only the identity projection (equal widths) is defined")
    return rows.to(torch.float32).contiguous()



@dataclass
class TalkerOutput:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]  # of each sampled token


@dataclass
class TalkerStage:
    """The talker engine: requests are ``prompt_embeds``; greedy, ``logprobs`` of the sampled tokens."""

    llm: Any
    max_tokens: int
    width: int = talker_config()["hidden_size"]
    step_s: float = 0.0
    outputs: dict[str, TalkerOutput] = field(default_factory=dict)

    def add(self, name: str, rows: torch.Tensor) -> None:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, detokenize=False, ignore_eos=True,
                            logprobs=0)
        self.llm.llm_engine.add_request(name, {"prompt_embeds": project(rows, self.width)}, sp)

    def busy(self) -> bool:
        return bool(self.llm.llm_engine.has_unfinished_requests())

    def step(self) -> list[str]:
        t = time.perf_counter()
        outs = self.llm.llm_engine.step()
        self.step_s += time.perf_counter() - t
        done = []
        for out in outs:
            if out.finished:
                co = out.outputs[0]
                lps = tuple(float(lp[tok].logprob) for tok, lp in zip(co.token_ids, co.logprobs or (), strict=True))
                self.outputs[out.request_id] = TalkerOutput(tuple(co.token_ids), lps)
                done.append(out.request_id)
        return done

    def run_all(self, requests: dict[str, torch.Tensor]) -> dict[str, TalkerOutput]:
        """Run ``requests`` to completion (the controls); their outputs."""
        for name, rows in requests.items():
            self.add(name, rows)
        while self.busy():
            self.step()
        return {name: self.outputs[name] for name in requests}

