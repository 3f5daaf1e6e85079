"""A paged KV block allocator with automatic prefix caching (vLLM v1 style).

Owns: every KV block's ref count and hash, the free queue, and the map from
chained block hash to cached block. Mirrors vLLM's ``BlockPool`` /
``KVCacheManager``:

- Full blocks are published under a chained hash (parent hash, block tokens)
  as soon as they are scheduled for computation (``cache_full_blocks``), so a
  request scheduled later in the same step can already hit them.
- ``find_hit`` returns the longest run of leading cached blocks, capped so
  that at least one token is still computed (``num_tokens - 1``).
- A freed block keeps its hash: it stays findable in the free queue (LRU,
  evicted from the front) until ``allocate`` hands it to a new tenant -- that
  reuse *is* the cache's eviction (README.md), and it is what the omni
  cache must follow (I7 no stale tenant).
- Requests free their blocks in reverse order, so a request's tail blocks are
  evicted before its shared head.

Upholds nothing (the engine's allocator, simulated).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class KVBlock:
    """One KV block: its ref count and, once published, its chained hash."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


@dataclass
class AllocatorStats:
    queries: int = 0
    """Tokens looked up (new and resumed requests)."""
    hits: int = 0
    """Tokens found in the cache."""
    evictions: int = 0
    """Cached blocks reused for a new tenant."""
    allocations: int = 0


class BlockAllocator:
    """``num_blocks`` blocks of ``block_size`` tokens with prefix caching."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Blocks with ref_cnt == 0, least recently freed first (the eviction order).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Published blocks: chained hash -> block id (first publisher wins).
        self._cached: dict[int, int] = {}
        self.stats = AllocatorStats()

    # ---- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def find_hit(self, block_hashes: Sequence[int], num_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix; leaves >= 1 token to compute."""
        max_blocks = max(0, (num_tokens - 1) // self.block_size)
        hit: list[int] = []
        for block_hash in block_hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def blocks_needed(self, num_held: int, num_tokens: int) -> int:
        """New blocks a request holding ``num_held`` needs to hold ``num_tokens``."""
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def can_allocate(self, num_new: int, hit_blocks: Sequence[int] = ()) -> bool:
        """Whether ``num_new`` fresh blocks fit after touching ``hit_blocks``."""
        touched_free = sum(1 for b in hit_blocks if self.blocks[b].ref_cnt == 0)
        return num_new <= self.num_free_blocks - touched_free

    # ---- mutations -------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on hit blocks (removes free ones from the free queue)."""
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_cnt == 0:
                del self._free[b]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks from the front of the free queue, evicting their hashes."""
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with {len(self._free)} free blocks")
        out: list[int] = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            block = self.blocks[b]
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) == b:
                    del self._cached[block.block_hash]
                block.block_hash = None
                self.stats.evictions += 1
            block.ref_cnt = 1
            out.append(b)
        self.stats.allocations += n
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; tail blocks reach the free queue first."""
        for b in reversed(block_ids):
            block = self.blocks[b]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"free of block {b} with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[b] = None

    def cache_full_blocks(
        self, block_ids: Sequence[int], block_hashes: Sequence[int], num_cached: int, num_full: int
    ) -> int:
        """Publish blocks ``[num_cached, num_full)`` of a request; returns the new count.

        A hash already published by another block keeps its first block (the
        duplicate stays unpublished, as in vLLM).
        """
        for i in range(num_cached, num_full):
            block = self.blocks[block_ids[i]]
            if block.block_hash is not None:
                continue  # a hit block: already published
            h = block_hashes[i]
            if h not in self._cached:
                self._cached[h] = block.block_id
                block.block_hash = h
        return max(num_cached, num_full)

    def check(self) -> None:
        """Internal consistency (tests): free queue == blocks with ref 0; map agrees."""
        free = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        if free != set(self._free):
            raise AssertionError("free queue disagrees with ref counts")
        for h, b in self._cached.items():
            if self.blocks[b].block_hash != h:
                raise AssertionError(f"cached map says block {b} holds hash {h}")
