"""The simulated paged KV allocator: chained block hashes, hits, ref counts, LRU reuse."""

from __future__ import annotations

import random

import pytest

from omni_cache.harness.sim_engine.allocator import BlockAllocator
from omni_cache.harness.sim_engine.request import SimRequest, chain_block_hash


def _hashes(tokens: list[int], bs: int = 4) -> list[int]:
    return SimRequest("r", tokens, max_tokens=1, block_size=bs).block_hashes


def test_block_hashes_chain_over_full_blocks_only() -> None:
    h = _hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(h) == 2  # the partial third block has no hash
    assert h[0] == chain_block_hash(None, (1, 2, 3, 4))
    assert h[1] == chain_block_hash(h[0], (5, 6, 7, 8))
    # Same block tokens behind a different prefix: a different hash (no false hit).
    assert _hashes([0, 2, 3, 4, 5, 6, 7, 8])[1] != h[1]
    req = SimRequest("r", [1, 2, 3], max_tokens=2, block_size=4)
    assert req.block_hashes == []
    req.append_output(4)
    assert req.block_hashes == [h[0]]  # an output token completing a block hashes it


def _publish(alloc: BlockAllocator, tokens: list[int]) -> list[int]:
    hashes = _hashes(tokens)
    blocks = alloc.allocate(alloc.blocks_needed(0, len(tokens)))
    alloc.cache_full_blocks(blocks, hashes, 0, len(tokens) // alloc.block_size)
    return blocks


def test_find_hit_is_the_longest_cached_prefix_and_leaves_one_token() -> None:
    alloc = BlockAllocator(8, 4)
    blocks = _publish(alloc, list(range(1, 13)))  # 3 full blocks
    assert alloc.find_hit(_hashes([*range(1, 13), 99]), 13) == blocks
    # Whole prompt cached: the last block is not a hit (one token must be computed).
    assert alloc.find_hit(_hashes(list(range(1, 13))), 12) == blocks[:2]
    # Divergence in block 2 stops the hit there.
    assert alloc.find_hit(_hashes([1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13]), 13) == blocks[:1]
    assert alloc.find_hit(_hashes([9, 9, 9, 9, 9]), 5) == []


def test_ref_counts_touch_and_free() -> None:
    alloc = BlockAllocator(4, 4)
    blocks = _publish(alloc, list(range(8)))
    assert alloc.num_free_blocks == 2
    alloc.touch(blocks)  # a second request shares them
    assert [alloc.blocks[b].ref_cnt for b in blocks] == [2, 2]
    alloc.free(blocks)
    assert alloc.num_free_blocks == 2  # still held by the other request
    alloc.free(blocks)
    assert alloc.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        alloc.free(blocks)
    alloc.check()


def test_freed_cached_blocks_stay_findable_until_reused_lru_first() -> None:
    alloc = BlockAllocator(4, 4)
    a = _publish(alloc, [1, 1, 1, 1, 2, 2, 2, 2])
    alloc.free(a)  # reverse order: the tail block (a[1]) is evicted before the head
    b = _publish(alloc, [7, 7, 7, 7])  # takes a never-used free block first (LRU front)
    alloc.free(b)
    probe = _hashes([1, 1, 1, 1, 2, 2, 2, 2, 3])
    assert alloc.find_hit(probe, 9) == a  # freed but still cached
    # Touching a free cached block takes it out of the free queue; can_allocate counts that.
    assert alloc.can_allocate(2, a) and not alloc.can_allocate(3, a)
    # Free queue now: [3 (never used), a[1], a[0], b[0]] -- least recently freed first.
    assert alloc.allocate(1) == [3] and alloc.stats.evictions == 0
    assert alloc.find_hit(probe, 9) == a
    assert alloc.allocate(1) == [a[1]]  # reuse evicts: the tail block goes before the shared head
    assert alloc.stats.evictions == 1
    assert alloc.find_hit(probe, 9) == a[:1]
    assert alloc.blocks[a[1]].block_hash is None and alloc.blocks[a[1]].ref_cnt == 1
    alloc.check()


def test_reuse_evicts_the_hash_and_random_ops_keep_the_books_consistent() -> None:
    rng = random.Random(3)
    alloc = BlockAllocator(16, 2)
    held: list[list[int]] = []
    for _ in range(400):
        if held and (rng.random() < 0.5 or alloc.num_free_blocks < 3):
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            tokens = [rng.randrange(3) for _ in range(rng.randint(1, 6))]
            hashes = _hashes(tokens, 2)
            hit = alloc.find_hit(hashes, len(tokens))
            need = alloc.blocks_needed(len(hit), len(tokens))
            if not alloc.can_allocate(need, hit):
                continue
            alloc.touch(hit)
            blocks = hit + alloc.allocate(need)
            alloc.cache_full_blocks(blocks, hashes, len(hit), len(tokens) // 2)
            held.append(blocks)
        alloc.check()
        # A block held by anyone is never in the free queue, and ref counts add up.
        refs: dict[int, int] = {}
        for blocks in held:
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        assert all(alloc.blocks[b].ref_cnt == n for b, n in refs.items())
    assert alloc.stats.evictions > 0
