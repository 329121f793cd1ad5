"""A tensor-parallel follower's host cache of its adapter cuts (``adapters/cutcache.py``), without
processes: least recently used images leave first once their bytes pass the bound; a load waits
for its adapter's hinted build instead of reading it again; a hinted build that fails is counted,
not raised, and the load reads again (raising what that read raises); at most as many hinted
builds are in flight as the cache holds images; 0 bytes keeps nothing and builds no hint; images
sit in a pool's blocks while one is free, and an evicted image's block serves a later one."""

import threading
from types import SimpleNamespace

import pytest
import torch

from mlora.batch.adapters.catalog import AdapterError
from mlora.batch.adapters.cutcache import CutCache, pinned_blocks, pinned_pool
from mlora.batch.adapters.residency.pinned import PinnedPool

ROW_BYTES = 2 * 64  # one row's A and B below, each 16 float32 (64 bytes, already aligned)


def adapter(name: str):
    return SimpleNamespace(id=name, semantic_sha256=f"sha-{name}")


class Reads:
    """A ``build`` that counts its calls per adapter id, can be held at a gate or made to fail."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.gate: threading.Event | None = None
        self.started = threading.Event()
        self.fail: dict[str, int | None] = {}  # adapter id -> reads left to fail (None: every one)

    def __call__(self, p):
        self.calls[p.id] = self.calls.get(p.id, 0) + 1
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if p.id in self.fail and self.fail[p.id] != 0:
            self.fail[p.id] = None if self.fail[p.id] is None else self.fail[p.id] - 1
            raise AdapterError("E_ADAPTER_CHANGED", f"adapter {p.id!r} cannot be read", p.id)
        a = torch.arange(16, dtype=torch.float32).view(4, 4) + ord(p.id[0])
        b = torch.arange(16, 32, dtype=torch.float32).view(4, 4).t() + ord(p.id[0])  # a strided view
        self.built = (a, b)
        return [(0, "qkv", 0, a, b, 4, 0.5)]


def test_an_image_holds_the_rows_in_a_buffer_of_its_own():
    reads = Reads()
    image = CutCache(None, reads, ROW_BYTES).get(adapter("a"))
    [(layer, group, j, a, b, r, scale)] = image.placed
    assert (layer, group, j, r, scale) == (0, "qkv", 0, 4, 0.5) and image.nbytes == ROW_BYTES
    assert torch.equal(a, reads.built[0]) and torch.equal(b, reads.built[1]) and b.is_contiguous()
    # one buffer of their own, not the build's tensors (views may hold a whole adapter's factors)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert all(a.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in reads.built)


def test_the_least_recently_used_image_leaves_once_the_bytes_pass_the_bound():
    reads = Reads()
    cache = CutCache(2 * ROW_BYTES, reads, ROW_BYTES)
    cache.get(adapter("a"))
    cache.get(adapter("b"))
    cache.get(adapter("a"))  # a is the most recently used: c evicts b
    cache.get(adapter("c"))
    assert cache.cached(adapter("a")) and cache.cached(adapter("c")) and not cache.cached(adapter("b"))
    assert cache.bytes == 2 * ROW_BYTES and reads.calls == {"a": 1, "b": 1, "c": 1}
    cache.get(adapter("b"))  # read again; a leaves
    assert reads.calls["b"] == 2 and not cache.cached(adapter("a"))
    assert (cache.hits, cache.misses) == (1, 4)


def test_a_load_waits_for_its_hinted_build_instead_of_reading_again():
    reads = Reads()
    reads.gate = threading.Event()
    cache = CutCache(None, reads, ROW_BYTES)
    assert cache.hint([adapter("a")]) == 1 and reads.started.wait(10)
    threading.Timer(0.05, reads.gate.set).start()  # the build finishes while get() waits
    image = cache.get(adapter("a"))
    assert reads.calls == {"a": 1} and image.placed[0][5] == 4
    assert (cache.hits, cache.misses, cache.hinted) == (1, 0, 1)
    assert cache.hint([adapter("a")]) == 0  # cached: no second build
    cache.close()


def test_a_failed_hinted_build_is_counted_and_the_load_reads_again():
    reads = Reads()
    reads.fail["a"] = 1
    cache = CutCache(None, reads, ROW_BYTES)
    cache.hint([adapter("a")])
    assert cache.get(adapter("a")).placed and reads.calls == {"a": 2} and cache.cached(adapter("a"))
    assert (cache.hint_failures, cache.misses, cache.hits) == (1, 1, 0)
    cache.close()


def test_a_load_whose_read_fails_after_a_failed_hinted_build_raises_the_reads_error():
    reads = Reads()
    reads.fail["a"] = None
    cache = CutCache(None, reads, ROW_BYTES)
    cache.hint([adapter("a")])
    with pytest.raises(AdapterError) as e:  # as without a cache
        cache.get(adapter("a"))
    assert e.value.code == "E_ADAPTER_CHANGED" and reads.calls == {"a": 2} and not cache.cached(adapter("a"))
    assert (cache.hint_failures, cache.misses, cache.hits) == (1, 1, 0)
    cache.close()


def test_hinted_builds_in_flight_stay_within_the_images_the_cache_holds():
    reads = Reads()
    reads.gate = threading.Event()
    cache = CutCache(2 * ROW_BYTES, reads, ROW_BYTES)
    assert cache.hint([adapter(n) for n in "abcd"]) == 2 and cache.hinted == 2
    reads.gate.set()
    cache.close()
    assert CutCache(ROW_BYTES - 1, reads, ROW_BYTES).hint([adapter("e")]) == 0


def test_no_cache_keeps_nothing_and_builds_no_hint():
    reads = Reads()
    cache = CutCache(0, reads, ROW_BYTES)
    assert cache.hint([adapter("a")]) == 0
    cache.get(adapter("a"))
    cache.get(adapter("a"))
    assert reads.calls == {"a": 2} and not cache.cached(adapter("a")) and cache.bytes == 0
    assert cache.report() == {"host_cache_hits": 0, "host_cache_misses": 2, "hinted_builds": 0,
                              "hinted_build_failures": 0}


def test_an_evicted_images_block_serves_a_later_image():
    """Blocks of ordinary memory here (a GPU rank's are page-locked: ``pinned_pool``)."""
    reads = Reads()
    pool = PinnedPool(ROW_BYTES, 2, pin=False)
    cache = CutCache(2 * ROW_BYTES, reads, ROW_BYTES, pool)
    for name in "abc":  # c finds no free block (pageable), then evicts a
        cache.get(adapter(name))
    assert (pool.takes, pool.exhausted) == (2, 1)
    cache.get(adapter("d"))  # a's block, given back when its image left, is d's: b leaves
    assert (pool.takes, pool.exhausted) == (3, 1) and cache.cached(adapter("d")) and not cache.cached(adapter("b"))
    cache.collect()
    assert pool.in_use == 1  # d's; b's given back
    assert pinned_pool(0, ROW_BYTES, 10) is None and pinned_pool(None, ROW_BYTES, 10) is None


def test_a_followers_pinned_blocks_stay_within_its_cache_the_jobs_adapters_and_rank_0s_pool():
    """One block per cached image plus two for builds in flight, no more than the job's adapters
    need, and never more bytes than rank 0 pinned (images beyond stay pageable)."""
    assert pinned_blocks(10 * ROW_BYTES, ROW_BYTES, 100) == 12
    assert pinned_blocks(10 * ROW_BYTES, ROW_BYTES, 3) == 5
    assert pinned_blocks(10 * ROW_BYTES, ROW_BYTES, 100, most_bytes=4 * ROW_BYTES) == 4
    assert pinned_blocks(10 * ROW_BYTES, ROW_BYTES, 100, most_bytes=ROW_BYTES // 2) == 1
    assert pinned_blocks(0, ROW_BYTES, 100) == pinned_blocks(None, ROW_BYTES, 100) == 0
