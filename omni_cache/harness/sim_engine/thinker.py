"""The simulated thinker stage: one forward pass per scheduler step.

Owns: the thinker's persistent output buffers (reused every step, like a model
runner's static CUDA-graph outputs) and the step's write layout. ``forward``
packs the scheduled chunks in batch order, fills

- ``hidden``: ``[num_tokens_padded, hidden_width]`` rows (``truth.TruthSpec``),
- ``audio.codes``: per-token int64 codes (immediate, JOIN_NEXT_STEP),
- ``audio.embeds``: per-token float rows (deferred via the policy),
- leftovers in some steps: a fresh per-step list and a 1-D int64 tensor view,

with junk after the unpadded rows of a padded step (on ``device``: CPU, or
CUDA to drive the manager's stream path), and builds the
``PrefixCacheWriteLayout`` (rows in batch order; ``slots_cpu`` from each
request's block table, ``-1`` for padded rows as vLLM's slot mapping pads).

Because the buffers are overwritten by the next forward, any cache result that
still aliases them is caught by the checker (I4 snapshot).

Upholds nothing itself: its reused buffers let the checker catch an I4 violation.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omni_cache.harness.sim_engine.scheduler import ScheduledChunk
from omni_cache.harness.sim_engine.truth import (
    CODES_KEY,
    EMBEDS_KEY,
    LEFTOVER_LIST_KEY,
    LEFTOVER_TENSOR_KEY,
    TruthSpec,
)
from omni_cache.runtime.events import PrefixCacheWriteLayout
from omni_cache.runtime.interface import HIDDEN_KEY, ModelCachePolicy, TensorName

JUNK_FLOAT = 1000.0
"""Value of padded (junk) float rows: outside the truth range [-16, 16)."""
JUNK_CODE = -7


@dataclass
class ForwardOutput:
    """What the thinker hands to ``save_outputs`` for one step."""

    hidden: torch.Tensor
    mm: dict[TensorName, Any]
    num_tokens_unpadded: int
    num_tokens_padded: int
    layout: PrefixCacheWriteLayout
    leftovers: dict[TensorName, Any]
    """Private copies of the leftover values (what every request must get back)."""


def policy_for(spec: TruthSpec) -> ModelCachePolicy:
    """The thinker's cache policy: hidden cached, ``audio.embeds`` deferred."""
    del spec
    return ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({EMBEDS_KEY}))


class Thinker:
    """Deterministic forward over persistent buffers of ``capacity`` rows."""

    def __init__(
        self,
        spec: TruthSpec,
        capacity_tokens: int,
        *,
        pad_multiple: int = 8,
        pad_probability: float = 0.5,
        leftover_every: int = 3,
        seed: int = 0,
        device: str | torch.device = "cpu",
    ) -> None:
        self.spec = spec
        self.capacity_tokens = capacity_tokens
        self.pad_multiple = max(1, pad_multiple)
        self.pad_probability = pad_probability
        self.leftover_every = leftover_every
        self._rng = random.Random(seed ^ 0x7417)
        # Persistent outputs: overwritten by every forward (I4 is tested against this).
        self.device = torch.device(device)
        self._buffers: dict[TensorName, torch.Tensor] = {
            key: torch.empty((capacity_tokens, *spec.row_shape(key)), dtype=spec.key_dtype(key), device=self.device)
            for key in spec.per_token_keys
        }
        self._lens = torch.empty(capacity_tokens, dtype=torch.int64, device=self.device)

    def padded_size(self, num_tokens: int) -> int:
        """Padding as a CUDA-graph runner does it: up to a multiple, sometimes."""
        if self._rng.random() >= self.pad_probability:
            return num_tokens
        return min(self.capacity_tokens, -(-num_tokens // self.pad_multiple) * self.pad_multiple)

    def forward(self, step: int, chunks: Sequence[ScheduledChunk]) -> ForwardOutput:
        unpadded = sum(c.num_tokens for c in chunks)
        if unpadded > self.capacity_tokens:
            raise ValueError(f"step {step}: {unpadded} tokens exceed the thinker capacity {self.capacity_tokens}")
        padded = self.padded_size(unpadded)
        slots = torch.full((padded,), -1, dtype=torch.int64)
        spans: list[tuple[str, int, int]] = []
        row = 0
        for chunk in chunks:
            req, s, e = chunk.req, chunk.token_start, chunk.token_end
            hashes = req.truth_hashes[s:e]
            for key, buf in self._buffers.items():
                buf[row:row + e - s] = self.spec.rows(key, hashes)
            slots[row:row + e - s] = torch.tensor([req.slot_of(p) for p in range(s, e)], dtype=torch.int64)
            spans.append((req.req_id, s, e))
            row += e - s
        for key, buf in self._buffers.items():
            buf[unpadded:padded] = JUNK_CODE if key == CODES_KEY else JUNK_FLOAT
        layout = PrefixCacheWriteLayout.packed(spans, slots)
        mm: dict[TensorName, Any] = {k: self._buffers[k][:padded] for k in (CODES_KEY, EMBEDS_KEY)}
        leftovers: dict[TensorName, Any] = {}
        if self.leftover_every and step % self.leftover_every == 0:
            meta = [step, len(chunks), unpadded]
            mm[LEFTOVER_LIST_KEY] = meta
            leftovers[LEFTOVER_LIST_KEY] = list(meta)
        if self.leftover_every and step % (self.leftover_every + 2) == 1:
            lens = self._lens[: len(chunks)]
            lens.copy_(torch.tensor([c.num_tokens for c in chunks], dtype=torch.int64))
            mm[LEFTOVER_TENSOR_KEY] = lens
            leftovers[LEFTOVER_TENSOR_KEY] = lens.detach().to("cpu", copy=True)
        return ForwardOutput(
            hidden=self._buffers[HIDDEN_KEY][:padded],
            mm=mm,
            num_tokens_unpadded=unpadded,
            num_tokens_padded=padded,
            layout=layout,
            leftovers=leftovers,
        )
