"""The prefix cache's block index (mlora.batch.model.prefixcache): sharing, LRU eviction before
the cache is full, and its invariants under random operation sequences."""

import random

import pytest

from mlora.batch.model.kvcache import BlockAllocator, KVCacheFull
from mlora.batch.model.prefixcache import PrefixCache


def _cache(n):
    return PrefixCache(BlockAllocator(n))


def test_a_published_chain_is_matched_shared_and_cached_when_released():
    c = _cache(8)
    row = c.allocate(3)
    assert all(c.publish(k, b) for k, b in zip("xyz", row))
    other = c.match(["x", "y", "w"])
    assert other == row[:2] and c.num_shared == 2
    c.free(row)
    assert c.num_cached == 1 and c.num_free == 5 + 1  # z is cached; x and y are still held
    c.free(other)
    assert c.num_cached == 3 and c.num_free == 8
    assert c.match(["x", "y", "z"], limit=2) == row[:2]  # a cached block comes back with a reference
    assert c.stats.hit_blocks == 4 and c.stats.looked_up_blocks == 5


def test_cached_blocks_are_evicted_oldest_first_before_the_cache_is_full():
    c = _cache(4)
    a, b = c.allocate(2), c.allocate(2)
    c.publish("a0", a[0]), c.publish("a1", a[1]), c.publish("b0", b[0])
    c.free(a)  # a0, a1 cached (oldest)
    c.free(b)  # b0 cached, b[1] private: back to the allocator
    assert c.num_free == 4 and c.num_cached == 3
    got = c.allocate(2)  # one free block, then the oldest cached one (a0)
    assert c.stats.evictions == 1 and c.match(["a0"]) == [] and c.match(["a1"]) == [a[1]]
    assert c.match(["b0"]) == [b[0]]
    with pytest.raises(KVCacheFull):
        c.allocate(1)  # every block is held now: nothing to evict
    assert sorted(got + [a[1], b[0]]) == [0, 1, 2, 3]


def test_blocks_no_row_matched_are_evicted_before_matched_ones():
    """A shared prefix (matched by a second row) outlives a row's own blocks released after it."""
    c = _cache(4)
    shared, own = c.allocate(1), c.allocate(2)
    c.publish("ctx", shared[0]), c.publish("q0", own[0]), c.publish("q1", own[1])
    reader = c.match(["ctx"])
    c.free(shared), c.free(reader)  # ctx: matched, released first (the oldest)
    c.free(own)  # q0, q1: never matched, released after it
    c.allocate(3)  # the free block, then q0 and q1: ctx stays
    assert c.stats.evictions == 2 and c.match(["q0"]) == [] and c.match(["ctx"]) == shared
    c.free(shared)
    c.allocate(1)  # only matched blocks are left to evict: ctx goes
    assert c.match(["ctx"]) == [] and c.stats.evictions == 3


def test_publishing_a_known_key_keeps_the_first_block():
    c = _cache(4)
    first, second = c.allocate(1), c.allocate(1)
    assert c.publish("k", first[0]) and not c.publish("k", second[0])
    assert not c.is_published(second[0]) and c.match(["k"]) == first
    with pytest.raises(ValueError):
        c.publish("j", c.allocator.allocate(1)[0])  # a block no row holds through the cache


def test_double_frees_are_refused_without_changing_anything():
    c = _cache(4)
    blocks = c.allocate(2)
    c.free(blocks[:1])
    with pytest.raises(ValueError):
        c.free(blocks)  # blocks[0] is no longer held
    assert c.num_free == 3
    c.free(blocks[1:])
    assert c.num_free == 4


def test_invariants_hold_under_random_operations():
    """Every block is free, held or cached, exactly once; references match what the rows hold."""
    rng = random.Random(11)
    n = 12
    c = _cache(n)
    rows: list[list[int]] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.35:
            k = rng.randint(1, 4)
            if c.has(k):
                rows.append(c.allocate(k))
            else:
                with pytest.raises(KVCacheFull):
                    c.allocate(k)
        elif op < 0.55 and rows:
            row = rng.choice(rows)
            c.publish(f"k{rng.randrange(20)}", rng.choice(row))
        elif op < 0.75:
            keys = [f"k{rng.randrange(20)}" for _ in range(rng.randint(1, 3))]
            run = c.cached_run(keys)
            got = c.match(keys)
            assert len(got) == run, step
            if got:
                rows.append(got)
        elif rows:
            c.free(rows.pop(rng.randrange(len(rows))))
        held = [b for r in rows for b in r]
        refs = {b: held.count(b) for b in set(held)}
        assert refs == c._refs, step
        free = set(c.allocator._free)
        cached = set(c._cold) | set(c._hot)
        assert not (set(c._cold) & set(c._hot)) and set(c._hot) <= c._matched <= set(c._key_of), step
        assert not (free & cached) and not (free & set(refs)) and not (cached & set(refs)), step
        assert free | cached | set(refs) == set(range(n)), step
        assert cached <= set(c._key_of) and {c._block_of[k] for k in c._block_of} == set(c._key_of), step
        assert c.num_free == len(free) + len(cached), step
        assert c.num_shared == sum(1 for b, r in refs.items() if r > 1 and b in c._key_of), step
    assert c.stats.evictions > 0 and c.stats.hit_blocks > 0
