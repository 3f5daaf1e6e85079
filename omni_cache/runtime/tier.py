"""The hidden-state tier: a block's per-token rows stored under its content identity.

Owns: ``HiddenTier`` -- block hash (bytes, vLLM's ``BlockHash``: it names the
block's tokens and, through the parent hash, the whole prefix before them) ->
the block's rows of every per-token key (hidden states and mm keys), each a
private ``(block_size, ...)`` host tensor. Host memory is held under
``budget_bytes`` with least-recently-used eviction; with ``directory`` set, an
entry evicted from memory is written there as one safetensors file (a second
level, read back and promoted on a memory miss). Guarded by one lock: the
worker thread that applies the KV connector's plan is the only caller in vLLM,
but tests call from several threads.

Upholds the tier half of contract section 4.10: ``get(h)`` returns exactly the
rows the newest ``put(h, ...)`` stored (a put replaces an entry whole, never a
mix of two versions), or ``None`` -- never zeros, never another block's rows.
Rows of a block are never split: an entry that does not fit the budget is not
stored (``put`` returns False).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["HiddenTier", "TierStats"]

Rows = dict[str, torch.Tensor]


@dataclass
class TierStats:
    """Counters of one tier (read with ``HiddenTier.stats``)."""

    entries: int = 0
    bytes: int = 0
    puts: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    spilled: int = 0
    disk_hits: int = 0
    refused: int = 0


def _nbytes(rows: Rows) -> int:
    return sum(t.numel() * t.element_size() for t in rows.values())


class HiddenTier:
    """Host rows by block hash, LRU under a byte budget, optionally spilled to safetensors files."""

    def __init__(self, budget_bytes: int, directory: str | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"HiddenTier: budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.directory = directory
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        self._lock = threading.Lock()
        # block hash -> rows, least recently used first; guarded by _lock.
        self._entries: OrderedDict[bytes, Rows] = OrderedDict()
        self._stats = TierStats()

    # ------------------------------------------------------------------ API
    def put(self, block_hash: bytes, rows: Rows) -> bool:
        """Store private copies of ``rows`` under ``block_hash`` (replacing any entry)."""
        if not rows:
            raise ValueError("HiddenTier.put: no rows to store")
        lengths = {int(t.shape[0]) for t in rows.values()}
        if len(lengths) != 1:
            raise ValueError(f"HiddenTier.put: keys have different row counts {sorted(lengths)}")
        copy = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in rows.items()}
        size = _nbytes(copy)
        with self._lock:
            old = self._entries.pop(block_hash, None)
            if old is not None:
                self._stats.bytes -= _nbytes(old)
            if size > self.budget_bytes and self.directory is None:
                self._stats.refused += 1
                self._sync_locked()
                return False
            self._entries[block_hash] = copy
            self._stats.bytes += size
            self._stats.puts += 1
            spill = self._evict_locked()
        for h, evicted in spill:
            self._write_file(h, evicted)
        return True

    def get(self, block_hash: bytes) -> Rows | None:
        """The rows stored for ``block_hash`` (private copies), or ``None``."""
        with self._lock:
            rows = self._entries.get(block_hash)
            if rows is not None:
                self._entries.move_to_end(block_hash)
                self._stats.hits += 1
                return {k: t.clone() for k, t in rows.items()}
        rows = self._read_file(block_hash)
        if rows is None:
            with self._lock:
                self._stats.misses += 1
            return None
        with self._lock:
            self._stats.hits += 1
            self._stats.disk_hits += 1
        if _nbytes(rows) <= self.budget_bytes:  # promote
            self.put(block_hash, rows)
        return rows

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            if block_hash in self._entries:
                return True
        path = self._path(block_hash)
        return path is not None and os.path.exists(path)

    def stats(self) -> TierStats:
        with self._lock:
            self._sync_locked()
            return TierStats(**vars(self._stats))

    # ------------------------------------------------------------- internals
    def _sync_locked(self) -> None:
        self._stats.entries = len(self._entries)

    def _evict_locked(self) -> list[tuple[bytes, Rows]]:
        spill: list[tuple[bytes, Rows]] = []
        while self._stats.bytes > self.budget_bytes and self._entries:
            h, rows = self._entries.popitem(last=False)
            self._stats.bytes -= _nbytes(rows)
            self._stats.evictions += 1
            if self.directory is not None:
                spill.append((h, rows))
                self._stats.spilled += 1
        self._sync_locked()
        return spill

    def _path(self, block_hash: bytes) -> str | None:
        if self.directory is None:
            return None
        return os.path.join(self.directory, hashlib.sha256(block_hash).hexdigest() + ".safetensors")

    def _write_file(self, block_hash: bytes, rows: Rows) -> None:
        from safetensors.torch import save_file

        path = self._path(block_hash)
        assert path is not None, "spill without a directory: tier bug"
        tmp = path + ".tmp"
        save_file(rows, tmp, metadata={"block_hash": block_hash.hex()})
        os.replace(tmp, path)  # a reader sees the old file or the whole new one

    def _read_file(self, block_hash: bytes) -> Rows | None:
        path = self._path(block_hash)
        if path is None or not os.path.exists(path):
            return None
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            if (f.metadata() or {}).get("block_hash") != block_hash.hex():
                return None  # another block's file (a digest collision): never served
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
