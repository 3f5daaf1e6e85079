"""The durable host store: one ``(num_blocks * block_size, width)`` tensor per key.

Owns: the pool tensors and the pool data lock. Rows are addressed by the engine's
KV slots (``slot = block_id * block_size + offset``); rows never written read as
zeros, which is why readers consult ``omni_cache.runtime.tenancy`` before trusting them
(I6). The committer's landing writes here (``SlotTenancy.land_all``, under the data
lock, into the tensors ``ensure_key`` publishes: allocated by ``prepare_keys`` before the save
that brings a new key claims anything, or by ``ensure_key`` itself); ``write`` is the pool's own
scatter of one key. Published keys are never dropped. It also owns each key's row signature
(dtype, row shape), fixed by the first write registered for the key (``fix_sigs``, the write
scheduler's call) before its rows land: ``check_sigs``, ``sigs`` and every landing compare with it.

``scatter_rows`` is the one way rows land at their slots (the pool's ``write``, the tenancy's
landing, and the bench's raw-copy floors).

Upholds I11: the data lock is a leaf lock; it covers one scatter or ``index_select``
and nothing is waited for or acquired while holding it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, KeysView

import numpy as np
import torch

from omni_cache.runtime.errors import PHRASE_SLOT_MAPPING, OmniPrefixCacheUnmatchError
from omni_cache.runtime.interface import TensorName
from omni_cache.runtime.validation import RowSig, allocate_rows, check_held_sigs, check_sig, row_sig

# Rows of at least this many bytes land through numpy (``scatter_rows``); smaller ones through
# ``index_copy_``. In a loop the numpy path already wins at 32 KiB (``tools/scatter_cost.py``), but
# between a step's other work its views cost more: in ``omni-cache bench --preset decode13`` the raw
# floor's 8-request decode save (32 KiB of hidden rows) took 26-28 µs through ``index_copy_``, 33-34 µs
# through numpy (4 runs each, 2026-12-07).
SCATTER_NUMPY_MIN_BYTES = 64 << 10
# An integer dtype of each element size: a same-width integer view copies any dtype's bits exactly.
SAME_SIZE_INT: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@functools.cache
def _has_index_copy(dtype: torch.dtype) -> bool:
    """Whether torch implements CPU ``index_copy_`` for ``dtype`` (not for float8 nor unsigned
    16/32/64-bit integers): probed once per dtype."""
    try:
        torch.zeros(1, dtype=dtype).index_copy_(0, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=dtype))
    except (NotImplementedError, RuntimeError):
        return False
    return True


def scatter_rows(dst: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                 slots_np: np.ndarray | None = None) -> None:
    """``dst[slots[i]] = rows[i]`` for every i, bit for bit as ``dst.index_copy_(0, slots, rows)``.

    ``slots``: int64 CPU, 1-D, in range and as many as ``rows`` (the callers check the range);
    ``slots_np``: its numpy view, when the caller has it. ``rows`` must have ``dst``'s row shape and
    dtype: a mismatch raises (a copy of the bits would broadcast or reinterpret them; this never
    does). Slots should be distinct: with a repeated slot which row lands there is unspecified, as
    for ``index_copy_``.

    NOTE: torch's CPU ``index_copy_`` scatters element by element; a numpy fancy assignment over
    same-width integer views of both tensors copies each row as one block, about 3x faster for a
    prefill's 512 rows of width 2048 bf16 (``tools/scatter_cost.py``). Writes under
    ``SCATTER_NUMPY_MIN_BYTES`` take ``index_copy_``, of the integer views where torch has none for
    the dtype (float8, uint16/32/64); bool (``index_copy_`` stores any nonzero byte as 1), complex
    dtypes, tensors with the negative bit, that require grad or are not on the CPU take
    ``index_copy_`` itself.
    """
    small = rows.nbytes < SCATTER_NUMPY_MIN_BYTES
    if small and _has_index_copy(rows.dtype):  # ``index_copy_`` checks the shapes itself
        dst.index_copy_(0, slots, rows)
        return
    bits = SAME_SIZE_INT.get(rows.element_size())
    if (bits is None or rows.dtype is torch.bool or rows.dtype.is_complex or rows.requires_grad or dst.requires_grad
            or rows.is_neg() or dst.is_neg() or not (rows.is_cpu and dst.is_cpu)):
        dst.index_copy_(0, slots, rows)
        return
    if (rows.dtype != dst.dtype or rows.shape[1:] != dst.shape[1:] or slots.dtype != torch.int64 or slots.dim() != 1
            or rows.shape[0] != slots.shape[0]):
        raise OmniPrefixCacheUnmatchError(
            f"block pool scatter: {tuple(rows.shape)} {rows.dtype} rows at {tuple(slots.shape)} {slots.dtype} "
            f"slots of a {tuple(dst.shape)} {dst.dtype} tensor: manager bug")
    if small:
        dst.view(bits).index_copy_(0, slots, rows.view(bits))
        return
    index = slots.numpy() if slots_np is None else slots_np
    if len(index) != rows.shape[0] or (len(index) and int(index.min()) < 0):  # numpy would wrap a negative slot
        raise OmniPrefixCacheUnmatchError(
            f"block pool scatter: {rows.shape[0]} rows at {len(index)} numpy slots (min "
            f"{int(index.min()) if len(index) else None}): manager bug")
    dst.view(bits).numpy()[index] = rows.view(bits).numpy()


def _describe_repeat(view: np.ndarray, describe_row: Callable[[int], str] | None) -> str:
    """The first KV slot two rows of ``view`` share, and those rows (an error's text)."""
    first: dict[int, int] = {}
    for row, slot in enumerate(view.tolist()):
        if slot in first:
            name = describe_row or (lambda r: f"row {r}")
            return f"{name(first[slot])} and {name(row)} both map to KV slot {slot}"
        first[slot] = row
    return "a KV slot is repeated"


class PrefixBlockPool:
    """Per tensor name, a zero-initialised host tensor of ``num_slots`` rows."""

    def __init__(self, num_slots: int, *, pin_memory: bool = False) -> None:
        self.num_slots = num_slots
        self.pin_memory = pin_memory
        # Leaf lock over the tensors below (and their dict).
        self.lock = threading.Lock()
        # key -> [num_slots, *row_shape]; allocated on first write, never dropped.
        self._tensors: dict[TensorName, torch.Tensor] = {}
        # key -> (dtype, row shape), fixed by the first write registered for the key (``fix_sigs``)
        # or its tensor's publication, whichever comes first: row checks compare tuples.
        self._sigs: dict[TensorName, RowSig] = {}
        # key -> (signature, zeros) ``prepare_keys`` allocated, published by the key's first landing.
        self._reserved: dict[TensorName, tuple[RowSig, torch.Tensor]] = {}

    def keys(self) -> list[TensorName]:
        with self.lock:
            return list(self._tensors)

    def has_key(self, key: TensorName) -> bool:
        with self.lock:
            return key in self._tensors

    def sigs(self) -> dict[TensorName, RowSig]:
        """Each key's fixed (dtype, row shape), its rows landed or not: a copy (keys are only ever added)."""
        with self.lock:
            return dict(self._sigs)

    def ensure_key(self, key: TensorName, rows: torch.Tensor) -> torch.Tensor:
        """The tensor of ``key``, allocated (zeros) on first use; shape/dtype checked.

        Call without holding ``lock``; it allocates outside the lock.
        """
        return self._tensor_for(key, rows)

    def tensor_locked(self, key: TensorName) -> torch.Tensor | None:
        """The tensor of ``key`` or None; the caller holds ``lock``."""
        return self._tensors.get(key)

    def check_sigs(self, sigs: dict[TensorName, RowSig]) -> None:
        """Raise unless each key's row signature in ``sigs`` matches the one fixed for it (a new key
        always matches)."""
        check_held_sigs("block pool key", self._sigs, sigs, sigs)  # no lock: keys are only ever added

    def fix_sigs(self, keys: KeysView[TensorName], sigs: dict[TensorName, RowSig]) -> None:
        """A write of ``keys`` (of signatures ``sigs``) is being registered: each key's row signature
        is fixed from now on, though its rows land later, so ``check_sigs`` and ``sigs`` refuse a
        later save or tier entry of another shape or dtype before anything is claimed. The caller
        checked ``sigs`` with ``check_sigs``; registrations run on the engine thread only."""
        if self._sigs.keys() >= keys:  # the usual save: every key fixed already (one C-level comparison)
            return
        with self.lock:
            for key in keys:
                self._sigs.setdefault(key, sigs[key])

    def prepare_keys(self, sigs: dict[TensorName, RowSig]) -> list[TensorName]:
        """Allocate the tensor of every key of ``sigs`` the pool does not hold yet, unpublished;
        return the keys reserved now.

        A save calls this before it claims anything, so an allocator's refusal is a refused save
        that changed nothing, never a failed landing (which would fail the cache for good, I8).
        The key's row shape is fixed by the first write registered for it (``fix_sigs``) and its
        tensor published by its first landing; a save refused before it registers gives its
        reservations back (``drop_reserved``), so it fixes no key's row shape and keeps no memory.
        A refusal of one key gives back the keys this call reserved before it.
        """
        if self._sigs.keys() >= sigs.keys():  # keys are only ever added (one C-level set comparison)
            return []
        reserved: list[TensorName] = []
        try:
            for key, sig in sigs.items():
                with self.lock:
                    needed = key not in self._sigs and self._reserved.get(key, (None,))[0] != sig
                if needed:
                    fresh = self._allocate(key, sig)
                    with self.lock:
                        if key not in self._sigs:  # else a landing published one meanwhile
                            self._reserved[key] = (sig, fresh)
                            reserved.append(key)
        except BaseException:
            self.drop_reserved(reserved)
            raise
        return reserved

    def drop_reserved(self, keys: list[TensorName]) -> None:
        """Give back the tensors ``prepare_keys`` reserved for ``keys`` that no landing published."""
        with self.lock:
            for key in keys:
                self._reserved.pop(key, None)

    def _tensor_for(self, key: TensorName, rows: torch.Tensor) -> torch.Tensor:
        sig = row_sig(rows)
        with self.lock:
            fixed = self._sigs.get(key)
        check_sig(f"block pool key {key!r}", fixed, sig)  # fixed at registration: nothing published for other rows
        with self.lock:
            tensor = self._tensors.get(key)
            if tensor is None:  # the first landing publishes the tensor ``prepare_keys`` allocated
                reserved = self._reserved.pop(key, None)
                if reserved is not None and reserved[0] == sig:
                    tensor = self._tensors[key] = reserved[1]
                    self._sigs.setdefault(key, sig)
        if tensor is None:
            fresh = self._allocate(key, sig)
            with self.lock:
                tensor = self._tensors.setdefault(key, fresh)
                if tensor is fresh:
                    self._sigs.setdefault(key, sig)
                    self._reserved.pop(key, None)
        check_sig(f"block pool key {key!r}", self._sigs[key], sig)
        return tensor

    def _allocate(self, key: TensorName, sig: RowSig) -> torch.Tensor:
        """Zeros of ``num_slots`` rows of ``sig`` (outside the lock); the allocator's refusal is a
        sizing problem and is named as one."""
        return allocate_rows((self.num_slots, *sig[1]), sig[0], pin_memory=self.pin_memory, zeroed=True,
                             what=f"cannot allocate the block pool of {key!r}: {self.num_slots:,} KV slots "
                                  f"(num_blocks x block_size) x rows of shape {tuple(sig[1])} {sig[0]}")

    def check_slots(self, slots: torch.Tensor, *, where: str = "block pool", distinct: bool = False,
                    describe_row: Callable[[int], str] | None = None) -> np.ndarray:
        """Raise unless every slot is in ``[0, num_slots)`` and, with ``distinct``, no slot appears twice
        (rows landing at one slot would overwrite each other); the message starts with ``where`` and
        names rows with ``describe_row``. Return the slots as a numpy view."""
        view = slots.numpy()
        if not len(view):
            return view
        repeated = False
        if view.dtype == np.int64:
            # Up to 256 slots (a decode step of up to 256 requests): Python's min and max of the list.
            # A step runs this between forward passes, with numpy's machinery cold: one ``tolist``
            # costs less than a reduction (measured in the narrow sweep: 7 µs less per step at 1
            # request) and than the unsigned view the reduction below needs.
            if len(view) <= 256:
                values = view.tolist()
                bad = min(values) < 0 or max(values) >= self.num_slots
                repeated = distinct and len(set(values)) != len(values)
            else:  # one pass: a negative slot read as unsigned is above any num_slots; the ufunc's
                # reduce directly (ndarray.max() adds a Python-level wrapper)
                bad = int(np.maximum.reduce(view.view(np.uint64))) >= self.num_slots
                if distinct:  # a prefill step, or a decode step of over 256 requests: one sort
                    ordered = np.sort(view)
                    repeated = bool((ordered[1:] == ordered[:-1]).any())
        else:
            bad = int(view.min()) < 0 or int(view.max()) >= self.num_slots
            repeated = distinct and len(np.unique(view)) != len(view)
        if bad:
            low, high = int(view.min()), int(view.max())
            raise OmniPrefixCacheUnmatchError(
                f"{where}: the {PHRASE_SLOT_MAPPING} KV slots out of range [0, {self.num_slots}) "
                f"(num_blocks x block_size): min {low}, max {high}"
            )
        if repeated:
            raise OmniPrefixCacheUnmatchError(f"{where}: the {PHRASE_SLOT_MAPPING} two rows at one KV slot: "
                                              + _describe_repeat(view, describe_row))
        return view

    def write(self, key: TensorName, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Scatter ``rows`` into ``key`` at ``slots`` (int64, CPU)."""
        if rows.shape[0] != slots.shape[0]:
            raise OmniPrefixCacheUnmatchError(
                f"block pool write of {key!r}: {rows.shape[0]} rows for {slots.shape[0]} slots"
            )
        self.check_slots(slots)
        tensor = self._tensor_for(key, rows)
        with self.lock:
            scatter_rows(tensor, slots, rows)

    def rows(self, key: TensorName, slots: torch.Tensor) -> torch.Tensor:
        """A copy of ``key``'s rows at ``slots``; unknown key raises."""
        self.check_slots(slots)
        with self.lock:
            tensor = self._tensors.get(key)
            if tensor is None:
                raise OmniPrefixCacheUnmatchError(
                    f"block pool has no key {key!r} (keys: {sorted(self._tensors)})"
                )
            return tensor.index_select(0, slots)

    def nbytes(self) -> dict[TensorName, int]:
        with self.lock:
            return {k: t.numel() * t.element_size() for k, t in self._tensors.items()}
