"""Ground truth of the simulated thinker: rows as a pure function of a token prefix.

Owns: the rolling prefix hash (``prefix_hash``/``extend_prefix_hashes``), the
sampler (``next_token``) and the reference rows of every simulated key
(``TruthSpec.rows``). The thinker computes its outputs with these functions and
the checker recomputes them independently from the request's token ids, so the
value of every row is known without trusting the cache.

A row at position ``p`` depends on the token ids ``[0, p]`` only through the
rolling hash of that prefix: two requests that share a prefix share its rows
(which is exactly what a prefix hit may serve), and a row of any other prefix
differs in (almost) every element, so a wrong tenant's row is detected
(I6 never a silent miss, I7 no stale tenant, seen from the outside).

Values are small multiples of 1/8 in [-16, 16): exact in float32 and bfloat16,
so the check is an exact equality.

Upholds nothing (ground truth).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from omni_cache.runtime.interface import HIDDEN_KEY, TensorName

MASK64 = (1 << 64) - 1
ROOT_HASH = 0x243F6A8885A308D3
"""The hash of the empty prefix (the same for every request)."""

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB

CODES_KEY: TensorName = "audio.codes"
"""Per-token, immediate (JOIN_NEXT_STEP) mm key: integer codes."""
EMBEDS_KEY: TensorName = "audio.embeds"
"""Per-token, deferred (JOIN_ON_FINISH) mm key: float embeddings."""
LEFTOVER_LIST_KEY: TensorName = "step.meta"
"""Leftover mm key: a per-step Python list (returned as-is to every request)."""
LEFTOVER_TENSOR_KEY: TensorName = "step.lens"
"""Leftover mm key: a 1-D int64 tensor (not token-major, so leftover)."""

CODES_VOCAB = 1024


def _mix(x: int) -> int:
    """splitmix64 finalizer on a Python int."""
    x &= MASK64
    x ^= x >> 30
    x = (x * _M1) & MASK64
    x ^= x >> 27
    x = (x * _M2) & MASK64
    x ^= x >> 31
    return x


def prefix_hash(prev: int, token: int) -> int:
    """The rolling hash of ``prefix + [token]`` given the hash of ``prefix``."""
    return _mix(prev + _GOLDEN + (token + 1) * _M2)


def extend_prefix_hashes(hashes: list[int], tokens: Sequence[int]) -> None:
    """Append the prefix hashes of ``tokens[len(hashes):]`` to ``hashes`` in place."""
    prev = hashes[-1] if hashes else ROOT_HASH
    for token in tokens[len(hashes):]:
        prev = prefix_hash(prev, int(token))
        hashes.append(prev)


def prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """The prefix hash of every position of ``tokens``."""
    out: list[int] = []
    extend_prefix_hashes(out, tokens)
    return out


def next_token(last_prefix_hash: int, vocab_size: int) -> int:
    """The greedy sample after a prefix: a function of that prefix only."""
    return _mix(last_prefix_hash ^ 0x5DEECE66D) % vocab_size


def _bits(hashes: Iterable[int], salt: int, width: int) -> np.ndarray:
    """``[n, width]`` uint64 pseudo-random bits from each hash and column."""
    h = np.fromiter((int(x) for x in hashes), dtype=np.uint64)
    cols = np.arange(width, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(salt & MASK64)
    x = h[:, None] ^ cols[None, :]
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(_M1)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(_M2)
    x = x ^ (x >> np.uint64(31))
    return x


_SALTS: dict[str, int] = {HIDDEN_KEY: 0x1234_5678_9ABC_DEF1, CODES_KEY: 0x0F1E_2D3C_4B5A_6978, EMBEDS_KEY: 0x7A5A_A5A5_3C3C_C3C3}


def _dtype(name: str) -> torch.dtype:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {name!r}")
    return dtypes[name]


@dataclass(frozen=True)
class TruthSpec:
    """Shapes and dtypes of the simulated thinker's per-token keys."""

    hidden_width: int = 64
    dtype: str = "float32"
    codes_width: int = 4
    embeds_width: int = 32
    vocab_size: int = 32000

    def __post_init__(self) -> None:
        for name in ("hidden_width", "codes_width", "embeds_width", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TruthSpec.{name} must be positive")
        _dtype(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _dtype(self.dtype)

    @property
    def per_token_keys(self) -> tuple[TensorName, ...]:
        """Every per-token key, hidden first."""
        return (HIDDEN_KEY, CODES_KEY, EMBEDS_KEY)

    def row_shape(self, key: TensorName) -> tuple[int, ...]:
        return {HIDDEN_KEY: (self.hidden_width,), CODES_KEY: (self.codes_width,), EMBEDS_KEY: (self.embeds_width,)}[key]

    def key_dtype(self, key: TensorName) -> torch.dtype:
        return torch.int64 if key == CODES_KEY else self.torch_dtype

    def row_bytes(self, key: TensorName) -> int:
        size = torch.empty((), dtype=self.key_dtype(key)).element_size()
        return int(np.prod(self.row_shape(key))) * size

    def rows(self, key: TensorName, hashes: Sequence[int]) -> torch.Tensor:
        """Reference rows of ``key`` for positions whose prefix hashes are ``hashes``."""
        width = self.row_shape(key)[0]
        if len(hashes) == 0:
            return torch.empty((0, width), dtype=self.key_dtype(key))
        bits = _bits(hashes, _SALTS[key], width)
        if key == CODES_KEY:
            return torch.from_numpy((bits >> np.uint64(54)).astype(np.int64))
        # 8 bits -> [-128, 127] / 8: exact in bf16 (8-bit significand) and fp32.
        vals = ((bits >> np.uint64(56)).astype(np.int16) - 128).astype(np.float32) / np.float32(8.0)
        return torch.from_numpy(vals).to(self.torch_dtype)
