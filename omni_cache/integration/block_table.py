"""A CPU block-table view over a vLLM-style engine input batch.

Owns: ``BlockTableView`` -- a snapshot of the batch order of request ids, each
row's ``num_computed_tokens`` and the rows of the CPU block table of one KV
cache group (the output group, ``PrefixCacheConfig.output_group_id``) --,
``V2BlockTableMirror`` (the CPU copy of that group of Model Runner V2's
device-only block table, fed through its ``append_block_ids``) and
the step-slot computation ``slot = table[i, p // table_block_size] *
table_block_size + p % table_block_size``, with the table's own block size,
as vLLM's slot mapping computes it.

Everything is read from CPU tensors or numpy arrays (vLLM keeps CPU mirrors of
the block table and of ``num_computed_tokens``), so computing a step's slots
never synchronizes with the device.

Upholds the input side of I5 and of the "slot mapping covers" check. A table
may hold kernel blocks: when an attention backend needs blocks smaller than
the KV manager's, vLLM splits manager block ``b`` into kernel blocks ``b*k +
j`` (``k = block_size // kernel_block_size``), and then ``kernel_block *
kernel_block_size + offset`` equals the manager slot ``b * block_size +
offset``: one slot space either way. A view accepts a table block size that
divides the cache's block size, checks that every row holds such runs (a
packed stride would give other slots) and refuses any other size; a position
past the row's allocated blocks raises instead of reading block 0. The view copies what it reads, so later changes to the
engine's persistent batch cannot change a layout built from it (I4's input).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from omni_cache.runtime.interface import ReqId

__all__ = ["BlockTableView", "V2BlockTableMirror"]

_SMALL_STEP_TOKENS = 64
"""Steps of up to this many tokens get their slots in Python (see ``BlockTableView._slots``)."""


def _cpu_int64(values: Any, what: str, rows: int | None = None) -> np.ndarray:
    """A private int64 numpy copy of ``values`` (its first ``rows`` entries when given: the copy
    is taken of those only), read without a device synchronization."""
    array = _cpu_array(values, what)
    if rows is not None and array.ndim:
        array = array[:rows]
    # NOTE: one copy, of the rows the view keeps (never of the engine's whole persistent table):
    # the engine's buffers change after this step, the view must not.
    return array.astype(np.int64, copy=True)


def _cpu_ints(values: Any, what: str, rows: int | None = None) -> list[int]:
    """The first ``rows`` entries (all without ``rows``) of ``values``, flattened, as Python ints:
    a private copy. A scalar is one entry.

    NOTE: a step reads these between forward passes, with numpy's machinery cold: an integer
    array costs one slice and one ``tolist`` here, where a numpy int64 copy and the vectorized
    arithmetic on it cost several times that (``omni-cache bench --engine-step``)."""
    array = _cpu_array(values, what)
    if array.ndim != 1:
        array = array.reshape(-1)
    if array.dtype.kind not in "iu":  # bool, float, object: as numpy's int64 cast reads them
        array = array.astype(np.int64)
    return (array if rows is None else array[:rows]).tolist()


def _cpu_array(values: Any, what: str) -> np.ndarray:
    """``values`` as a numpy array sharing its memory; a device tensor is refused (reading it would
    synchronize with the device)."""
    if isinstance(values, torch.Tensor):
        if not values.is_cpu:  # one attribute: ``device.type`` builds a device object
            raise ValueError(
                f"BlockTableView: {what} must be a CPU tensor, the engine's CPU mirror (got a "
                f"{values.device} tensor: reading it would synchronize with the device)"
            )
        return values.detach().numpy() if values.requires_grad else values.numpy()
    return values if isinstance(values, np.ndarray) else np.asarray(values)


class BlockTableView:
    """Batch order, computed tokens and block-table rows of one KV group.

    ``req_ids[i]`` is row ``i`` of ``block_table_cpu`` and of
    ``num_computed_tokens``. ``block_size`` is the table's block size (the
    kernel block size where vLLM splits blocks); ``expected_block_size`` is the
    cache's (the KV manager's) block size, which it must divide, else
    construction raises. ``num_blocks_per_row`` (optional) bounds each row's
    valid blocks (in the table's blocks).
    """

    def __init__(
        self,
        req_ids: Sequence[ReqId],
        num_computed_tokens: Any,
        block_table_cpu: Any,
        *,
        block_size: int,
        expected_block_size: int | None = None,
        num_blocks_per_row: Any = None,
    ) -> None:
        if int(block_size) <= 0:
            raise ValueError(f"BlockTableView: block_size must be positive, got {block_size!r}")
        manager_block_size = int(block_size if expected_block_size is None else expected_block_size)
        if manager_block_size % int(block_size):
            raise ValueError(
                f"BlockTableView: block size mismatch: the prefix cache addresses KV slots with "
                f"{manager_block_size}-token blocks but this block table uses {block_size}-token "
                "blocks, which do not divide them; slots computed from it would address the wrong "
                f"rows. Use a table whose block size is {manager_block_size} or one of its divisors "
                "(vLLM's kernel block size)."
            )
        # Kernel blocks per KV-manager block (1: the table holds manager blocks).
        self.kernel_blocks_per_block = manager_block_size // int(block_size)
        self.block_size = int(block_size)
        self.req_ids: tuple[ReqId, ...] = tuple(req_ids)
        n = len(self.req_ids)
        self._row_of = {rid: i for i, rid in enumerate(self.req_ids)}
        if len(self._row_of) != n:
            raise ValueError(f"BlockTableView: duplicate request ids in the batch {list(self.req_ids)}")
        computed = _cpu_ints(num_computed_tokens, "num_computed_tokens", n)
        if len(computed) < n:
            raise ValueError(
                f"BlockTableView: {len(computed)} num_computed_tokens for a batch of {n} requests"
            )
        self.num_computed_tokens: tuple[int, ...] = tuple(computed)
        table = block_table_cpu
        table_np = _cpu_int64(table, "block_table_cpu", n)
        if table_np.ndim != 2 or table_np.shape[0] < n:
            raise ValueError(
                f"BlockTableView: block table of shape {tuple(np.shape(table))} cannot hold {n} rows"
            )
        self._table = table_np
        # Each row's valid blocks (in the table's blocks), as Python ints.
        self._limits: list[int] = (
            _cpu_ints(num_blocks_per_row, "num_blocks_per_row", n) if num_blocks_per_row is not None
            else [table_np.shape[1]] * n
        )
        if self.kernel_blocks_per_block > 1:
            self._check_kernel_runs()

    def _check_kernel_runs(self) -> None:
        """A kernel-block table must hold each manager block ``b`` as the run ``b*k .. b*k+k-1``:
        then ``kernel_block * kernel_size + offset`` is the manager slot ``b * block_size +
        offset`` the hits are addressed by. A packed layout (another stride) is refused."""
        k = self.kernel_blocks_per_block
        limits = np.array(self._limits, dtype=np.int64)
        cols = np.arange(self._table.shape[1], dtype=np.int64)
        valid = cols[None, :] < limits[:, None]
        partial = (limits % k) != 0
        first = self._table[:, (cols // k) * k]
        bad = valid & ((self._table != first + cols % k) | (first % k != 0))
        if bool(bad.any()) or bool(partial.any()):
            row = int(np.flatnonzero(bad.any(axis=1) | partial)[0])
            count = self._limits[row]
            raise ValueError(
                f"BlockTableView: the kernel block table row of request {self.req_ids[row]!r} "
                f"({self._table[row, :count].tolist()[:16]}, {count} kernel blocks) does not hold each "
                f"{k * self.block_size}-token block b as kernel blocks b*{k} .. b*{k}+{k - 1}; its slots "
                "would not be the KV manager's slots the cache's hits are addressed by"
            )

    @classmethod
    def from_input_batch(
        cls,
        input_batch: Any,
        *,
        block_size: int,
        kv_cache_group_id: int = 0,
    ) -> BlockTableView:
        """Read vLLM's ``InputBatch``: ``req_ids``, ``num_reqs``,
        ``num_computed_tokens_cpu`` and ``block_table[group]`` (a ``BlockTable``
        with ``block_size``, ``get_cpu_tensor()`` and ``num_blocks_per_row``).
        ``block_size`` is the prefix cache's (the KV cache group's) block size.
        """
        all_ids = list(input_batch.req_ids)
        num_reqs = int(getattr(input_batch, "num_reqs", len(all_ids)))
        req_ids = all_ids[:num_reqs]
        if any(rid is None for rid in req_ids):
            raise ValueError(
                "BlockTableView.from_input_batch: the input batch has empty rows among its first "
                f"{num_reqs}; build the view after the batch is condensed"
            )
        block_table = input_batch.block_table[kv_cache_group_id]
        if hasattr(block_table, "get_cpu_tensor"):
            table = block_table.get_cpu_tensor()
        else:
            table = block_table.block_table.cpu
        return cls(
            req_ids,
            input_batch.num_computed_tokens_cpu,
            table,
            block_size=int(block_table.block_size),
            expected_block_size=block_size,
            num_blocks_per_row=getattr(block_table, "num_blocks_per_row", None),
        )

    @classmethod
    def from_v2_input_batch(
        cls,
        input_batch: Any,
        table_cpu: Any,
        num_blocks_per_state: Any,
        *,
        table_block_size: int,
        block_size: int,
    ) -> BlockTableView:
        """Read Model Runner V2's per-step ``InputBatch`` (``req_ids``,
        ``num_reqs``, ``idx_mapping_np``: batch row -> request-state row,
        ``num_computed_tokens_np``) against CPU block-table rows indexed by
        request-state row (``table_cpu``, one KV group) and their block counts
        (``num_blocks_per_state``, e.g. ``BlockTables.num_blocks.np[0]``). V2
        keeps its block table on the device only, so ``table_cpu`` is a CPU
        mirror fed by the same ``append_block_ids`` calls (see
        ``V2BlockTableMirror`` below).
        """
        num_reqs = int(input_batch.num_reqs)
        req_ids = list(input_batch.req_ids)[:num_reqs]
        states = np.asarray(input_batch.idx_mapping_np)[:num_reqs].astype(np.int64)
        table = np.asarray(table_cpu)
        if states.size and int(states.max()) >= table.shape[0]:
            raise ValueError(
                f"BlockTableView.from_v2_input_batch: request-state row {int(states.max())} is outside the "
                f"mirrored block table of {table.shape[0]} rows"
            )
        return cls(
            req_ids,
            np.asarray(input_batch.num_computed_tokens_np)[:num_reqs],
            table[states],
            block_size=int(table_block_size),
            expected_block_size=block_size,
            num_blocks_per_row=np.asarray(num_blocks_per_state)[states],
        )

    def row_of(self, req_id: ReqId) -> int:
        try:
            return self._row_of[req_id]
        except KeyError:
            raise ValueError(
                f"BlockTableView: request {req_id!r} is not in the batch {list(self.req_ids)}"
            ) from None

    def blocks_of(self, req_id: ReqId) -> tuple[int, ...]:
        """The request's allocated KV-manager block ids (its row, up to its block count; a
        kernel-block table's runs read back as the manager blocks they split)."""
        row = self.row_of(req_id)
        k = self.kernel_blocks_per_block
        return tuple(int(b) // k for b in self._table[row, : self._limits[row] : k].tolist())

    def slots_for_spans(self, spans: Sequence[tuple[ReqId, int, int]]) -> torch.Tensor:
        """KV slots of positions ``[start, end)`` of each request, concatenated
        in the order given (int64, CPU)."""
        rows: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        for req_id, start, end in spans:
            start, end = operator.index(start), operator.index(end)
            if not 0 <= start <= end:
                raise ValueError(f"BlockTableView: bad span [{start}, {end}) for {req_id!r}")
            rows.append(self.row_of(req_id))
            starts.append(start)
            counts.append(end - start)
        return self._slots(rows, starts, counts)

    def slots_for_counts(self, counts: Sequence[int]) -> torch.Tensor:
        """KV slots of each row's next ``counts[i]`` positions (``[num_computed_tokens[i],
        num_computed_tokens[i] + counts[i])``), rows in batch order, concatenated (int64, CPU).
        ``counts`` has one non-negative count per row of the view (a row may be 0)."""
        per_row = counts if isinstance(counts, list) else _cpu_ints(counts, "counts")
        if len(per_row) != len(self.req_ids):
            raise ValueError(f"BlockTableView: {len(per_row)} counts for a batch of {len(self.req_ids)} requests")
        for row, count in enumerate(per_row):
            try:
                negative = operator.index(count) < 0
            except TypeError:
                raise ValueError(f"BlockTableView: token count {count!r} for {self.req_ids[row]!r} is not an "
                                 "integer") from None
            if negative:
                raise ValueError(f"BlockTableView: negative token count {count} for {self.req_ids[row]!r}")
        return self._slots(range(len(per_row)), self.num_computed_tokens, per_row)

    def _slots(self, rows: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
        """Slots of positions ``[starts[j], starts[j] + counts[j])`` of view rows ``rows[j]``, in order.

        Up to ``_SMALL_STEP_TOKENS`` tokens (a decode step, a short prefill) in Python, reading the
        table with one fancy index; more in one vectorized numpy pass (no Python per token)."""
        total = sum(counts)
        if total == 0:
            return torch.empty(0, dtype=torch.int64)
        bs = self.block_size
        if total > _SMALL_STEP_TOKENS:
            return self._slots_vectorized(np.array(rows, dtype=np.int64), np.array(starts, dtype=np.int64),
                                          np.array(counts, dtype=np.int64), total)
        row_t: list[int] = []
        pos_t: list[int] = []
        for row, start, count in zip(rows, starts, counts, strict=True):
            if count:
                row_t.extend([row] * count)
                pos_t.extend(range(start, start + count))
        block_idx = [p // bs for p in pos_t]
        limits = self._limits
        for row, pos, block in zip(row_t, pos_t, block_idx, strict=True):
            if block >= limits[row]:
                raise self._past_row(row, pos, block)
        block_ids = self._table[row_t, block_idx].tolist()
        return torch.from_numpy(np.array([b * bs + p % bs for b, p in zip(block_ids, pos_t, strict=True)],
                                         dtype=np.int64))

    def _slots_vectorized(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, total: int) -> torch.Tensor:
        """``_slots`` of a large step: one vectorized pass."""
        row_t = np.repeat(rows, counts)
        # position of every token: its entry's start plus its offset within the entry
        offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        pos_t = np.repeat(starts, counts) + offsets
        block_idx = pos_t // self.block_size
        limit = np.array(self._limits, dtype=np.int64)[row_t]
        bad = block_idx >= limit
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise self._past_row(int(row_t[i]), int(pos_t[i]), int(block_idx[i]))
        block_ids = self._table[row_t, block_idx]
        return torch.from_numpy(block_ids * self.block_size + pos_t % self.block_size)

    def _past_row(self, row: int, pos: int, block: int) -> ValueError:
        return ValueError(
            f"BlockTableView: position {pos} of request {self.req_ids[row]!r} needs block index "
            f"{block} but its row holds {self._limits[row]} blocks; the view is stale or "
            "the step's blocks were not appended yet"
        )


class V2BlockTableMirror:
    """A CPU copy of one KV-cache group (the output group) of Model Runner V2's ``BlockTables``.

    V2 keeps block ids only on the device (staged writes applied by a kernel).
    ``install`` wraps the instance's ``append_block_ids(req_index,
    new_block_ids, overwrite)`` -- the one door through which the runner
    changes a row -- so every row change is applied here too, from the same
    arguments; the block counts are V2's own CPU ``num_blocks.np``, checked
    against the mirror's at every view.
    """

    def __init__(self, block_tables: Any, max_num_reqs: int, max_num_blocks: int, group_id: int = 0) -> None:
        self.block_tables = block_tables
        self.group_id = group_id  # the output KV-cache group (PrefixCacheConfig.output_group_id)
        self.block_size = int(block_tables.block_sizes[group_id])
        self.table = np.zeros((max_num_reqs, max_num_blocks), dtype=np.int64)
        self.counts = np.zeros(max_num_reqs, dtype=np.int64)

    @classmethod
    def install(cls, block_tables: Any, group_id: int = 0) -> V2BlockTableMirror:
        installed = getattr(block_tables, "omni_cache_mirror", None)
        if installed is not None:
            if installed.group_id != group_id:
                raise ValueError(f"V2BlockTableMirror: this BlockTables already mirrors KV-cache group "
                                 f"{installed.group_id}, not {group_id}")
            return installed
        counts = np.asarray(block_tables.num_blocks.np)
        if not 0 <= group_id < counts.shape[0]:
            raise ValueError(f"V2BlockTableMirror: KV-cache group {group_id} is outside the runner's "
                             f"{counts.shape[0]} block tables")
        max_blocks = int(block_tables.block_tables[group_id].gpu.shape[1])
        mirror = cls(block_tables, int(counts.shape[1]), max_blocks, group_id)
        real = block_tables.append_block_ids

        def append_block_ids(req_index: int, new_block_ids: Any, overwrite: bool) -> None:
            real(req_index, new_block_ids, overwrite)
            mirror.append(req_index, new_block_ids, overwrite)

        block_tables.append_block_ids = append_block_ids
        block_tables.omni_cache_mirror = mirror
        return mirror

    def append(self, req_index: int, new_block_ids: Any, overwrite: bool) -> None:
        ids = [int(b) for b in new_block_ids[self.group_id]]
        start = 0 if overwrite else int(self.counts[req_index])
        end = start + len(ids)
        if end > self.table.shape[1]:
            raise ValueError(f"V2BlockTableMirror: row {req_index} overflows ({end} > {self.table.shape[1]} blocks)")
        self.table[req_index, start:end] = ids
        self.counts[req_index] = end

    def view(self, input_batch: Any, *, block_size: int) -> BlockTableView:
        engine_counts = np.asarray(self.block_tables.num_blocks.np)[self.group_id]
        num_reqs = int(input_batch.num_reqs)
        states = np.asarray(input_batch.idx_mapping_np)[:num_reqs]
        if not np.array_equal(engine_counts[states], self.counts[states]):
            raise RuntimeError(
                f"V2BlockTableMirror: block counts {self.counts[states].tolist()} differ from the runner's "
                f"{engine_counts[states].tolist()} (a row changed outside append_block_ids)"
            )
        return BlockTableView.from_v2_input_batch(
            input_batch, self.table, self.counts, table_block_size=self.block_size, block_size=block_size
        )
