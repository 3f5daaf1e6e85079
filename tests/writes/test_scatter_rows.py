"""``block_pool.scatter_rows``: rows land at their KV slots bit for bit, whichever path copies them.

Protected: every landing (the committer's ``SlotTenancy.land_all``, the pool's ``write``) goes
through ``scatter_rows``, which takes ``index_copy_`` for small writes and a numpy assignment over
same-width integer views for large ones. Both must give exactly ``index_copy_``'s bits (NaNs,
signed zeros, every dtype the pool holds), touch no other slot, refuse rows of another shape or
dtype instead of broadcasting them, and fall back to ``index_copy_`` where numpy cannot view the
tensors. A manager landing a prefill-sized step through the numpy path serves the same rows.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_cache import OmniPrefixCacheUnmatchError
from omni_cache.runtime.block_pool import (
    SAME_SIZE_INT,
    SCATTER_NUMPY_MIN_BYTES,
    PrefixBlockPool,
    scatter_rows,
)

NUM_SLOTS = 4096
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
# Dtypes torch's CPU index_copy_ does not implement: they land through same-width integer views.
NO_INDEX_COPY = [getattr(torch, name) for name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
                 if hasattr(torch, name)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits (complex as its real pairs), so NaN == NaN and -0.0 != 0.0."""
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    return t.contiguous().view(SAME_SIZE_INT[t.element_size()])


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bits of ``dtype`` (any pattern: NaNs, infinities, signed zeros, subnormals)."""
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        real = torch.float32 if dtype is torch.complex64 else torch.float64
        return torch.view_as_complex(_random((*shape, 2), real, gen))
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _check_against_index_copy(dst: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    expected = dst.clone()
    if rows.dtype in NO_INDEX_COPY:  # the same scatter, of the bits
        bits = SAME_SIZE_INT[rows.element_size()]
        expected.view(bits).index_copy_(0, slots, rows.view(bits))
    else:
        expected.index_copy_(0, slots, rows)
    scatter_rows(dst, slots, rows)
    assert torch.equal(_bits(dst), _bits(expected))


@pytest.mark.parametrize("dtype", DTYPES + NO_INDEX_COPY, ids=str)
@pytest.mark.parametrize("num_rows", [1, 8, 512])
def test_every_dtype_lands_bit_for_bit_as_index_copy(dtype: torch.dtype, num_rows: int) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    width = 128
    dst = _random((NUM_SLOTS, width), dtype, gen)  # slots not written keep their (random) bits
    rows = _random((num_rows, width), dtype, gen)
    # every dtype's 512 rows are large enough for the numpy path, its 1 and 8 rows are not
    assert (rows.nbytes >= SCATTER_NUMPY_MIN_BYTES) == (num_rows == 512)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:num_rows]
    _check_against_index_copy(dst, slots, rows)


@pytest.mark.parametrize("num_rows", [8, 512])
def test_bool_rows_land_as_index_copy_stores_them_whatever_their_bytes(num_rows: int) -> None:
    """A bool tensor viewed from bytes may hold 2 or 255; ``index_copy_`` stores them as 1, so the
    numpy path's raw byte copy must not take bools (small and large writes agree)."""
    rows = torch.full((num_rows, 256), 2, dtype=torch.uint8).view(torch.bool)
    dst = torch.zeros(NUM_SLOTS, 256, dtype=torch.bool)
    slots = torch.arange(num_rows) * 3
    _check_against_index_copy(dst, slots, rows)
    assert int(dst.view(torch.uint8)[slots].max()) == 1


@settings(max_examples=60, deadline=None)
@given(num_rows=st.integers(1, 200), width=st.integers(1, 300),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.int64, torch.uint8]),
       seed=st.integers(0, 2**31 - 1), strided=st.booleans(), inner=st.booleans())
def test_any_shape_and_layout_lands_as_index_copy(num_rows: int, width: int, dtype: torch.dtype, seed: int,
                                                  strided: bool, inner: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    shape = (3, width) if inner else (width,)  # rows of more than one dimension too
    dst = _random((NUM_SLOTS, *shape), dtype, gen)
    rows = _random((num_rows, *shape), dtype, gen)
    if strided:  # every other row of a larger tensor: not contiguous
        rows = _random((2 * num_rows, *shape), dtype, gen)[::2]
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:num_rows]
    _check_against_index_copy(dst, slots, rows)


def test_the_numpy_path_takes_the_callers_numpy_slots() -> None:
    dst = torch.zeros(NUM_SLOTS, 1024)
    rows = torch.randn(64, 1024)
    slots = torch.randperm(NUM_SLOTS)[:64]
    scatter_rows(dst, slots, rows, slots.numpy())
    assert torch.equal(dst[slots], rows)
    assert int((dst.abs().sum(1) > 0).sum()) == 64  # no other slot touched


@pytest.mark.parametrize("bad", ["width", "dtype", "count", "one_row"])
def test_rows_of_another_shape_or_dtype_are_refused_never_broadcast(bad: str) -> None:
    """Where numpy would raise, cast (float64 bits into int32 columns) or broadcast (one row over
    every slot), the scatter refuses and changes nothing."""
    width = SCATTER_NUMPY_MIN_BYTES // 4  # even one float32 row takes the numpy path
    dst = torch.zeros(256, width)
    slots = torch.arange(64) * 4
    rows = {"width": torch.ones(64, width // 2), "dtype": torch.ones(64, width, dtype=torch.float64),
            "count": torch.ones(65, width), "one_row": torch.ones(1, width)}[bad]
    assert rows.nbytes >= SCATTER_NUMPY_MIN_BYTES  # the numpy path's own check
    with pytest.raises(OmniPrefixCacheUnmatchError, match="block pool scatter"):
        scatter_rows(dst, slots, rows)
    assert not dst.any()


@pytest.mark.parametrize("bad", ["negative", "int32", "two_dims", "numpy_count"])
def test_slots_numpy_would_read_otherwise_are_refused(bad: str) -> None:
    """``index_copy_`` refuses a negative slot, int32 or 2-D slots; numpy would wrap the negative one
    to the last row and take the others: the numpy path refuses them all, and a numpy view of
    another length, before anything is written."""
    dst = torch.zeros(256, 1024)
    rows = torch.ones(64, 1024)
    slots = torch.arange(64)
    slots_np = None
    if bad == "negative":
        slots = torch.cat([torch.tensor([-1]), torch.arange(1, 64)])
    elif bad == "int32":
        slots = slots.to(torch.int32)
    elif bad == "two_dims":
        slots = slots.view(64, 1)
    else:
        slots_np = slots.numpy()[:63]
    assert rows.nbytes >= SCATTER_NUMPY_MIN_BYTES
    with pytest.raises(OmniPrefixCacheUnmatchError, match="block pool scatter"):
        scatter_rows(dst, slots, rows, slots_np)
    assert not dst.any()


def test_the_first_and_the_last_slot_land_on_the_numpy_path() -> None:
    dst = torch.zeros(256, 1024)
    rows = torch.randn(64, 1024)
    slots = torch.cat([torch.tensor([0, 255]), torch.arange(2, 64)])
    assert rows.nbytes >= SCATTER_NUMPY_MIN_BYTES
    scatter_rows(dst, slots, rows, slots.numpy())
    assert torch.equal(dst[slots], rows)


def test_small_rows_of_another_shape_are_refused_by_index_copy() -> None:
    dst = torch.zeros(NUM_SLOTS, 8)
    with pytest.raises((IndexError, RuntimeError)):
        scatter_rows(dst, torch.arange(2), torch.ones(1, 8))
    assert not dst.any()


@pytest.mark.parametrize("dtype", NO_INDEX_COPY, ids=str)
def test_small_rows_of_a_dtype_without_index_copy_are_checked_before_their_bits_land(dtype: torch.dtype) -> None:
    """Their integer views would land them in a pool of another dtype of the same width (uint16 bits
    into a float16 pool) or of another row shape: refused first, nothing written."""
    same_width = {1: torch.int8, 2: torch.float16, 4: torch.float32, 8: torch.float64}
    rows = torch.zeros(2, 4, dtype=dtype)
    other_pool = torch.ones(NUM_SLOTS, 4, dtype=same_width[rows.element_size()])
    own_pool = torch.zeros(NUM_SLOTS, 4, dtype=dtype)
    for dst, bad in ((other_pool, rows), (own_pool, torch.zeros(2, 5, dtype=dtype)),
                     (own_pool, torch.zeros(3, 4, dtype=dtype))):
        before = _bits(dst).clone()
        with pytest.raises(OmniPrefixCacheUnmatchError, match="block pool scatter"):
            scatter_rows(dst, torch.arange(2), bad)
        assert torch.equal(_bits(dst), before)


def test_tensors_numpy_cannot_view_take_index_copy() -> None:
    dst = torch.zeros(NUM_SLOTS, 1024, requires_grad=False)
    rows = torch.randn(64, 1024, requires_grad=True)
    slots = torch.randperm(NUM_SLOTS)[:64]
    with torch.no_grad():
        scatter_rows(dst, slots, rows)
    assert torch.equal(dst[slots], rows.detach())


def test_the_pools_write_lands_a_large_write_through_it() -> None:
    pool = PrefixBlockPool(NUM_SLOTS)
    rows = torch.randn(128, 512, dtype=torch.float32).to(torch.bfloat16)
    slots = torch.randperm(NUM_SLOTS)[:128]
    pool.write("hidden", slots, rows)
    assert torch.equal(_bits(pool.rows("hidden", slots)), _bits(rows))
    # the pool's own checks come first, naming the key and the slot range
    with pytest.raises(OmniPrefixCacheUnmatchError, match="block pool write of 'hidden': 128 rows for 4 slots"):
        pool.write("hidden", slots[:4], rows)
    for bad in (NUM_SLOTS, -1):
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"KV slots out of range \[0, 4096\)"):
            pool.write("hidden", torch.cat([slots[:-1], torch.tensor([bad])]), rows)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_a_manager_serves_keys_of_dtypes_without_index_copy_through_a_hit(eager: bool) -> None:
    """uint16 codes and float8 rows (no CPU ``index_copy_`` in torch) land and are served bit for bit,
    also as a later request's cached prefix, where ``index_copy_`` itself would raise at their landing and
    fail the cache for good (I8)."""
    from cache_helpers import finished, manager, save, settle, slots, started

    from omni_cache import PrefixCacheStep

    gen = torch.Generator().manual_seed(7)
    keys = {name: _random((8, 3), getattr(torch, name), gen) for name in ("uint16", "uint32", "float8_e4m3fn")
            if hasattr(torch, name)}
    m = manager(eager=eager)
    try:
        m.new_step_starts(PrefixCacheStep((started("a", scheduled=8),), {"a": 8}))
        step, _ = save(m, [("a", [0, 1], 0, 8)], mm=dict(keys))
        out = m.materialize(step, ["a"])
        for key, rows in keys.items():
            assert torch.equal(_bits(out.mm_outputs[key]["a"]), _bits(rows))
        settle(m)
        m.new_step_starts(PrefixCacheStep((finished("a"), started("b", 4, [0], scheduled=4)), {"b": 4}))
        tail = {key: _random((4, 3), rows.dtype, gen) for key, rows in keys.items()}
        step, _ = save(m, [("b", [0, 2], 4, 8)], mm=dict(tail))
        out = m.materialize(step, ["b"])
        for key, rows in keys.items():  # a's first block (the hit), then b's own rows
            assert torch.equal(_bits(out.mm_outputs[key]["b"]), _bits(torch.cat([rows[:4], tail[key]])))
        assert slots([0, 2], 4, 8).tolist() == [8, 9, 10, 11]  # b's rows went to its own block
    finally:
        m.shutdown()
