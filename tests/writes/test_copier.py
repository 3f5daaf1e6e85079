"""The copy engine: large copies go in slices of at most the chunk size, every row copied once.

Upholds the data half of I4 (a snapshot is a copy of exactly the saved rows).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
import torch
from cache_helpers import MODES, finished, manager, save, started

from omni_cache import (
    ModelCachePolicy,
)
from omni_cache.runtime.copier import CopyEngine


# ---- the chunked synchronous copy ---------------------------------------------------------
class _CopyLog(torch.Tensor):
    """A tensor that records the row count of every ``copy_`` into it (or a slice of it)."""

    copies: ClassVar[list[int]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.copy_:
            cls.copies.append(args[0].shape[0] if args[0].dim() else 1)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize(
    ("shape", "dtype", "chunk_bytes", "slices"),
    [
        ((10, 6), torch.float32, 3 * 24 + 12, [3, 3, 3, 1]),  # 3 rows per slice, a short last one
        ((9, 6), torch.float32, 3 * 24, [3, 3, 3]),  # exact multiple
        ((7, 6), torch.float32, 24, [1] * 7),  # one row per slice
        ((3, 6), torch.float32, 10, [1, 1, 1]),  # a row larger than a chunk: still one row per slice
        ((2, 1), torch.float32, 4, [1, 1]),  # two rows are split; shape[1] == 1 is not "one row"
        ((10, 1), torch.float32, 12, [3, 3, 3, 1]),
        ((10,), torch.float32, 12, [3, 3, 3, 1]),  # 1-D: rows are elements
        ((5, 6), torch.float32, 5 * 24, [5]),  # fits: one copy
        ((1, 6), torch.float32, 4, [1]),  # one row: one copy, whatever its size
        ((), torch.float64, 4, [1]),  # 0-D: one copy, never indexed by rows
    ],
    ids=str,
)
def test_chunked_copy_copies_every_row_in_slices_of_at_most_chunk_bytes(
    shape: tuple[int, ...], dtype: torch.dtype, chunk_bytes: int, slices: list[int]
) -> None:
    """A chunked copy copies every row once, in slices of at most the chunk size.

    Kills the mutants: the chunk loop's start, step and slice bounds; the one-copy shortcut's conditions.

    A chunked copy copies every row once, in slices of at most the chunk size."""
    src = torch.arange(1, 1 + max(1, int(np.prod(shape))), dtype=dtype).reshape(shape)
    engine = CopyEngine(use_cuda=False, chunk_bytes=chunk_bytes)
    _CopyLog.copies = []
    dst = torch.zeros(shape, dtype=dtype).as_subclass(_CopyLog)
    engine._chunked(dst, src)
    assert torch.equal(dst.as_subclass(torch.Tensor), src)
    assert _CopyLog.copies == slices


@pytest.mark.parametrize("eager", MODES)
def test_round_trip_with_a_tiny_copy_chunk(eager: bool) -> None:
    """Every copy path (staging page, deferred host copy) chunked by a 40-byte ``copy_chunk_bytes``."""
    m = manager(eager, copy_chunk_bytes=40)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"})))
    m.new_step_starts([started("a")])
    audio = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    s1, rows = save(m, [("a", [0, 1], 0, 8)], mm={"audio": audio})
    out = m.materialize(s1, ["a"])
    assert torch.equal(out.hidden_states["a"], rows) and torch.equal(out.mm_outputs["audio"]["a"], audio)
    m.new_step_starts([finished("a"), started("b", hit_end=8, blocks=[0, 1, 2])])
    s2, rows_b = save(m, [("b", [0, 1, 2], 8, 12)], mm={"audio": torch.ones(4, 3)})
    out = m.materialize(s2, ["b"])
    assert torch.equal(out.hidden_states["b"], torch.cat([rows, rows_b]))
    assert torch.equal(out.mm_outputs["audio"]["b"], torch.cat([audio, torch.ones(4, 3)]))
    m.shutdown()
