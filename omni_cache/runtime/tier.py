"""The hidden-state tier: a block's per-token rows stored under its content identity.

Owns: ``HiddenTier`` -- block hash (bytes, vLLM's ``BlockHash``: it names the
block's tokens and, through the parent hash, the whole prefix before them) ->
the block's rows of every per-token key (hidden states and mm keys), each a
private ``(block_size, ...)`` host tensor. Host memory is held under
``budget_bytes`` with least-recently-used eviction; with ``directory`` set, an
entry evicted from memory is written there as one safetensors file (a second
level, read back and promoted on a memory miss). Guarded by one lock, held
across every file operation too: the worker thread that applies the KV
connector's plan is the only caller in vLLM, but tests call from several threads.

Upholds the tier half of contract section 4.10: ``get(h)`` returns exactly the
rows the newest ``put(h, ...)`` stored (a put replaces an entry whole, never a
mix of two versions), or ``None`` -- never zeros, never another block's rows.
Rows of a block are never split: an entry that does not fit the budget is not
stored (``put`` returns False). On disk:

- the newest put wins: a put removes the hash's older file before it returns
  (one it cannot remove is never read again until a spill replaces it,
  counted ``stale_files``); a spill writes to a temporary name and renames it atomically, and a spill
  that fails removes the older file and is counted (``spill_failures``), so a
  lost entry is a counted miss, never an older version served; a promotion
  from disk happens under the same lock hold as the read, so it never
  overwrites a newer put.
- a tier reads only its own files: each instance spills into its own fresh
  subdirectory of ``directory`` (two engines or a restart sharing one
  directory never read each other's rows); every file also carries the
  instance id, the block hash and a digest of its rows (every key's name, dtype,
  shape and bytes) in its metadata and is served only when all three match.
- a damaged file (truncated, foreign, not safetensors, rows whose bytes changed
  on disk) is a miss with ``load_failures`` counted and the file removed -- never
  raised out of ``get``, never served.
- a removed ``directory`` is recreated by the next spill.
- ``directory`` needs the ``safetensors`` package: refused at construction
  when it is missing, never at the first spill.
- ``close`` (the connector's shutdown) drops every entry and removes this
  instance's subdirectory with its files (no other tier can read them), so a
  restarted server leaves no spill files behind; a closed tier refuses ``put``
  and ``get``. A subdirectory it cannot remove is logged with its path.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import shutil
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["HiddenTier", "TierStats"]

log = logging.getLogger(__name__)

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
    spill_failures: int = 0  # evicted entries that could not be written (lost, counted)
    stale_files: int = 0  # older spill files a put could not remove (never read: a miss until replaced)
    load_failures: int = 0  # files that could not be read back (damaged, foreign): misses


def _nbytes(rows: Rows) -> int:
    return sum(t.numel() * t.element_size() for t in rows.values())


def _digest(rows: Rows) -> str:
    """A digest of every key's name, dtype, shape and bytes (a spill file's rows, checked on read)."""
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(rows):
        t = rows[key].contiguous()
        h.update(f"{key}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _check_hash(what: str, block_hash: object) -> None:
    if not isinstance(block_hash, bytes) or not block_hash:
        raise ValueError(f"HiddenTier.{what}: a block hash is non-empty bytes (vLLM's BlockHash), "
                         f"got {block_hash!r}")


def _budget(budget_bytes: object) -> int:
    """``budget_bytes`` as a non-negative integer, or one ValueError naming it."""
    value: int | None = None
    if isinstance(budget_bytes, int) and not isinstance(budget_bytes, bool):
        value = budget_bytes
    elif isinstance(budget_bytes, float) and math.isfinite(budget_bytes) and budget_bytes.is_integer():
        value = int(budget_bytes)
    if value is None or value < 0:
        raise ValueError(f"HiddenTier: budget_bytes must be a non-negative whole number of bytes, "
                         f"got {budget_bytes!r}")
    return value


class HiddenTier:
    """Host rows by block hash, LRU under a byte budget, optionally spilled to safetensors files."""

    def __init__(self, budget_bytes: int, directory: str | None = None) -> None:
        self.budget_bytes = _budget(budget_bytes)
        self.instance = uuid.uuid4().hex
        self.directory = directory
        self._spill_dir: str | None = None
        if directory is not None:
            try:
                import safetensors.torch  # noqa: F401
            except ImportError as exc:
                raise ValueError("HiddenTier: a tier directory needs the 'safetensors' package "
                                 "(pip install safetensors)") from exc
            self._spill_dir = os.path.join(directory, f"tier-{self.instance}")
            os.makedirs(self._spill_dir, exist_ok=True)
        self._lock = threading.Lock()
        # block hash -> rows, least recently used first; guarded by _lock.
        self._entries: OrderedDict[bytes, Rows] = OrderedDict()
        # hashes whose older spill file a put could not remove: their file is never read (guarded by _lock)
        self._stale: set[bytes] = set()
        self._stats = TierStats()
        self._closed = False  # guarded by _lock; set once by close()

    @property
    def spill_directory(self) -> str | None:
        """This instance's own subdirectory of ``directory`` (None without one)."""
        return self._spill_dir

    # ------------------------------------------------------------------ API
    def put(self, block_hash: bytes, rows: Rows) -> bool:
        """Store private copies of ``rows`` under ``block_hash`` (replacing any entry)."""
        _check_hash("put", block_hash)
        if not rows:
            raise ValueError("HiddenTier.put: no rows to store")
        bad = [k for k, t in rows.items() if not isinstance(t, torch.Tensor) or t.dim() < 1]
        if bad:
            raise ValueError(f"HiddenTier.put: the rows of {bad[0]!r} are not a tensor of one row per token "
                             f"(got {type(rows[bad[0]]).__name__})")
        lengths = {int(t.shape[0]) for t in rows.values()}
        if len(lengths) != 1:
            raise ValueError(f"HiddenTier.put: keys have different row counts {sorted(lengths)}")
        copy = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in rows.items()}
        with self._lock:
            self._check_open_locked("put")
            return self._put_locked(block_hash, copy)

    def get(self, block_hash: bytes) -> Rows | None:
        """The rows stored for ``block_hash`` (private copies), or ``None``."""
        _check_hash("get", block_hash)
        with self._lock:
            self._check_open_locked("get")
            rows = self._entries.get(block_hash)
            if rows is not None:
                self._entries.move_to_end(block_hash)
                self._stats.hits += 1
                return {k: t.clone() for k, t in rows.items()}
            rows = self._read_file_locked(block_hash)
            if rows is None:
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            self._stats.disk_hits += 1
            if _nbytes(rows) <= self.budget_bytes:  # promote, in the same hold as the read (not a put)
                self._put_locked(block_hash, {k: t.clone() for k, t in rows.items()}, promoted=True)
            return rows

    def __contains__(self, block_hash: object) -> bool:
        """Whether an entry is held, in memory or as a file (a non-bytes hash never is). A file is only
        read by ``get``: one damaged on disk is ``in`` the tier until a ``get`` finds it damaged (a miss)."""
        if not isinstance(block_hash, bytes):
            return False
        with self._lock:
            self._check_open_locked("__contains__")
            if block_hash in self._entries:
                return True
            path = self._path(block_hash)
            return path is not None and block_hash not in self._stale and os.path.exists(path)

    def discard(self, block_hash: bytes) -> None:
        """Drop ``block_hash``'s entry and its file, if any (an entry its reader found unusable)."""
        _check_hash("discard", block_hash)
        with self._lock:
            self._check_open_locked("discard")
            self._drop_locked(block_hash)
            self._sync_locked()

    def stats(self) -> TierStats:
        with self._lock:
            self._sync_locked()
            return TierStats(**vars(self._stats))

    def close(self) -> None:
        """Drop every entry and remove this instance's spill subdirectory (idempotent).

        NOTE: under the lock, so a spill racing the close can neither recreate the
        subdirectory nor leave a file in it; ``directory`` itself (the user's) stays.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._entries.clear()
            self._stats.bytes = 0
            self._sync_locked()
            if self._spill_dir is not None and os.path.isdir(self._spill_dir):
                try:
                    shutil.rmtree(self._spill_dir)
                except OSError as exc:
                    log.warning("omni-cache: the hidden-state tier could not remove its spill directory %s: %s",
                                self._spill_dir, exc)

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    # ------------------------------------------------------------- internals
    def _check_open_locked(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"HiddenTier.{what}: the tier is closed (its entries and files were removed)")

    def _sync_locked(self) -> None:
        self._stats.entries = len(self._entries)

    def _drop_locked(self, block_hash: bytes) -> None:
        """Forget ``block_hash``'s entry and remove its file: no older version outlives what follows."""
        old = self._entries.pop(block_hash, None)
        if old is not None:
            self._stats.bytes -= _nbytes(old)
        self._remove_file_locked(block_hash)

    def _put_locked(self, block_hash: bytes, copy: Rows, *, promoted: bool = False) -> bool:
        self._drop_locked(block_hash)  # an older spilled version never outlives this put
        size = _nbytes(copy)
        if size > self.budget_bytes and self._spill_dir is None:
            self._stats.refused += 1
            self._sync_locked()
            return False
        self._entries[block_hash] = copy
        self._stats.bytes += size
        self._stats.puts += not promoted
        for h, evicted in self._evict_locked():
            self._write_file_locked(h, evicted)
        return True

    def _evict_locked(self) -> list[tuple[bytes, Rows]]:
        spill: list[tuple[bytes, Rows]] = []
        while self._stats.bytes > self.budget_bytes and self._entries:
            h, rows = self._entries.popitem(last=False)
            self._stats.bytes -= _nbytes(rows)
            self._stats.evictions += 1
            if self._spill_dir is not None:
                spill.append((h, rows))
        self._sync_locked()
        return spill

    def _path(self, block_hash: bytes) -> str | None:
        if self._spill_dir is None:
            return None
        return os.path.join(self._spill_dir, hashlib.sha256(block_hash).hexdigest() + ".safetensors")

    def _remove_file_locked(self, block_hash: bytes) -> None:
        """Remove ``block_hash``'s spill file, if any. Never raises: a directory that is gone or
        is no longer a directory holds no file (NOTE: every put runs this, so a broken directory
        must cost spills, counted, never the puts); a file another failure leaves is never read again
        until a spill of the hash replaces it (counted ``stale_files``)."""
        path = self._path(block_hash)
        if path is None:
            return
        try:
            os.remove(path)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as exc:  # the older file stays: never read again until a spill replaces it
            self._stale.add(block_hash)
            self._stats.stale_files += 1
            log.warning("omni-cache: the hidden-state tier could not remove its spill file %s: %s", path, exc)

    def _save(self, rows: Rows, path: str, metadata: dict[str, str]) -> None:
        from safetensors.torch import save_file

        save_file(rows, path, metadata=metadata)

    def _write_file_locked(self, block_hash: bytes, rows: Rows) -> None:
        path = self._path(block_hash)
        assert path is not None and self._spill_dir is not None, "spill without a directory: tier bug"
        tmp = path + ".tmp"
        try:
            os.makedirs(self._spill_dir, exist_ok=True)  # recreated if removed while running
            self._save(rows, tmp, {"block_hash": block_hash.hex(), "tier": self.instance, "rows": _digest(rows)})
            os.replace(tmp, path)  # a reader sees no file or the whole new one
            self._stale.discard(block_hash)  # the file is this put's rows now
        except Exception:
            self._stats.spill_failures += 1
            for stale in (tmp, path):
                with contextlib.suppress(OSError):
                    os.remove(stale)
            return
        self._stats.spilled += 1

    def _read_file_locked(self, block_hash: bytes) -> Rows | None:
        path = self._path(block_hash)
        if path is None or block_hash in self._stale or not os.path.exists(path):
            return None
        try:
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("block_hash") != block_hash.hex() or meta.get("tier") != self.instance:
                    raise ValueError("another tier's or another block's file")
                rows = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no __iter__)
            if not rows or len({int(t.shape[0]) for t in rows.values()}) != 1:
                raise ValueError("no rows or ragged rows")
            if meta.get("rows") != _digest(rows):
                raise ValueError("rows changed on disk")
            return rows
        except Exception:
            self._stats.load_failures += 1
            with contextlib.suppress(OSError):
                os.remove(path)
            return None
