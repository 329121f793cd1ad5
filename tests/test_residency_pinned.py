"""The pinned block pool of host images (mlora.batch.adapters.residency.pinned): blocks are handed out
without driver calls, come back when their image is gone, and are reused only after a
copy-stream fence recorded after their release completed. On the CPU the blocks are
ordinary memory (``pin=False``); the semantics are the same."""

import gc
import random
import time

import pytest
import torch
from test_residency import LAYERS, SHAPES, _same, pinned, rbank  # noqa: F401 - pinned: the adapters fixture

from mlora.batch.adapters.residency import HostArtifact, HostCache, ManualEvent, Piece
from mlora.batch.adapters.residency.pinned import BLOCK_ALIGN, PinnedPool
from mlora.batch.adapters.slots import SlotBank


class Fences:
    """A fence factory whose events the test completes by hand."""

    def __init__(self):
        self.events = []

    def __call__(self):
        self.events.append(ManualEvent(label=f"fence{len(self.events)}"))
        return self.events[-1]


def test_blocks_are_reused_only_after_their_fence_completes():
    fences = Fences()
    pool = PinnedPool(10_000, 2, fence=fences, pin=False)
    assert pool.block_bytes == 12_288 and pool.block_bytes % BLOCK_ALIGN == 0 and pool.nbytes == 2 * 12_288
    a, b = pool.take(12_288), pool.take(100)
    assert a is not None and b is not None and a.data_ptr() != b.data_ptr()
    assert pool.take(1) is None and pool.exhausted == 1  # both taken
    a.fill_(7)
    pool.give(a)
    assert pool.reclaim() == 0 and pool.take(1) is None  # fenced, the fence not complete: a copy may still read it
    assert pool.exhausted == 2
    fences.events[0].complete()
    assert pool.reclaim() == 1
    again = pool.take(5)
    assert again is not None and again.data_ptr() == a.data_ptr()
    assert pool.take(12_289) is None  # larger than a block: never served, whatever is free
    assert pool.stats()["pinned_pool_peak_blocks"] == 2 and pool.takes == 3


def test_a_host_that_cannot_pin_everything_keeps_what_it_pinned(monkeypatch):
    """The constructor stops at the first refused allocation: the pool serves the blocks it
    has, says why it has fewer, and images beyond them stay pageable."""
    real, calls = torch.empty, []

    def empty(*a, **k):
        calls.append(a)
        if len(calls) > 1:
            raise RuntimeError("CUDA error: out of memory (host)\nmore")
        return real(*a, **k)

    monkeypatch.setattr(torch, "empty", empty)
    pool = PinnedPool(4096, 5, pin=False, chunk_bytes=2 * 4096)  # chunks of two blocks: the second is refused
    monkeypatch.setattr(torch, "empty", real)
    assert (pool.blocks, pool.requested) == (2, 5) and pool.pin_error == "CUDA error: out of memory (host)"
    st = pool.stats()
    assert st["pinned_pool_blocks"] == 2 and st["pinned_pool_requested"] == 5 and "out of memory" in st["pinned_pool_error"]
    assert pool.take(1) is not None and pool.take(1) is not None and pool.take(1) is None


def test_a_later_release_waits_for_its_own_fence():
    fences = Fences()
    pool = PinnedPool(64, 3, fence=fences, pin=False)
    x, y = pool.take(64), pool.take(64)
    pool.give(x)
    pool.reclaim()  # fence0 covers x
    pool.give(y)
    pool.reclaim()  # fence1 covers y
    fences.events[1].complete()
    assert pool.reclaim() == 0  # fences free in order: y waits behind x's incomplete fence
    fences.events[0].complete()
    assert pool.reclaim() == 2 and pool.in_use == 0


def test_threads_taking_and_giving_never_share_a_block():
    """Prefetch threads take and give blocks while the engine's thread reclaims: a block is
    never handed to two holders at once, and every block is free again at the end."""
    import threading

    pool = PinnedPool(4096, 5, pin=False, fence=lambda: ManualEvent(polls=2))  # each fence completes at its 2nd poll
    held, lock, errors = set(), threading.Lock(), []

    def worker(seed):
        rng, got, deadline = random.Random(seed), 0, time.monotonic() + 30
        while got < 25 and time.monotonic() < deadline:
            block = pool.take(rng.randrange(1, 4097))
            if block is None:
                time.sleep(0.0005)  # none free: wait for the engine thread's reclaim
                continue
            got += 1
            with lock:
                if block.data_ptr() in held:
                    errors.append(block.data_ptr())
                held.add(block.data_ptr())
            block.fill_(seed)  # the holder writes its block
            with lock:
                held.discard(block.data_ptr())
            pool.give(block)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        pool.reclaim()
    for t in threads:
        t.join()
    for _ in range(4):  # the last releases: fence, then free
        pool.reclaim()
    assert not errors and pool.in_use == 0 and pool.takes == 4 * 25  # every worker got its 25 blocks: they cycled


def _artifact(key: str, seed: int, n: int = 3) -> HostArtifact:
    g = torch.Generator().manual_seed(seed)
    pieces = [Piece("A", (i,), torch.randn(5, 7, generator=g)) for i in range(n)]
    pieces.append(Piece("r", (), torch.randint(0, 9, (4,), dtype=torch.int32, generator=g)))
    return HostArtifact(key, key, pieces, name=key)


def test_pinned_artifact_is_the_same_bytes_in_one_block_given_back_when_gone():
    pool = PinnedPool(4096, 1, pin=False)
    art = _artifact("a", 1)
    staged = art.pinned(pool)
    assert staged is not art and staged.transfer_ready and pool.in_use == 1
    for p, q in zip(art.pieces, staged.pieces):
        assert (p.view, p.index) == (q.view, q.index) and q.src.dtype == p.src.dtype and torch.equal(p.src, q.src)
    other = _artifact("b", 2)
    assert other.pinned(pool) is other and not other.transfer_ready  # no free block: stays pageable
    del staged
    gc.collect()
    assert pool.reclaim() == 1 and pool.in_use == 0  # no fence factory: a release is free at once
    assert other.pinned(pool).transfer_ready


def test_host_cache_recycles_blocks_as_it_evicts():
    pool = PinnedPool(4096, 3, pin=False)
    one = _artifact("x", 0).nbytes
    host = HostCache(2 * one, pin=True, pool=pool)
    for k in range(20):
        host.register(f"k{k}", f"k{k}", lambda k=k: _artifact(f"k{k}", k))
        art = host.get(f"k{k}")
        want = _artifact(f"k{k}", k)
        assert art.transfer_ready and all(torch.equal(p.src, q.src) for p, q in zip(art.pieces, want.pieces))
        del art
    gc.collect()
    host.reclaim()
    assert pool.takes == 20 and pool.exhausted == 0 and pool.in_use <= 2  # two cached images hold blocks


@pytest.mark.parametrize("blocks", [1, 2])
def test_bank_through_a_small_pool_equals_the_plain_bank(pinned, blocks):
    """Residency loads from pool blocks (one or two blocks for two slots and a one-image host
    cache: blocks recycle) give exactly the deltas of the plain SlotBank. A published adapter
    keeps no image (``HostArtifact.header``), so two blocks are enough for every image to be
    staged; with one, some images stay pageable, and the deltas are still the same."""
    pool = PinnedPool(rbank(2).layout.max_image_bytes(), blocks, pin=False)
    bank = rbank(2, pinned_pool=pool, host_cache_bytes=1)
    ref = SlotBank(LAYERS, SHAPES, 5, 8, torch.float32, "cpu")
    rng = random.Random(3)
    names = sorted(pinned)
    for step in range(16):
        _same(bank, ref, rng.sample(names, rng.choice([1, 2])), pinned, step)
        bank.residency.audit()
        gc.collect()
        assert all(not e.artifact.pieces for e in bank.residency.catalog.values())  # no host bytes kept
    assert bank.stats.evictions >= 5 and pool.takes > blocks  # blocks were reused
    assert pool.taken_peak == blocks and (pool.exhausted == 0) == (blocks == 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked blocks need CUDA")
def test_cuda_bank_images_live_in_the_pinned_pool(pinned):
    from mlora.batch.adapters.residency import ResidencyBank

    bank = ResidencyBank(LAYERS, SHAPES, 2, 8, torch.float32, "cuda", expected_adapters=len(pinned))
    assert bank.pinned_pool is not None and bank.pinned_pool.blocks == len(pinned) + 40  # at most the job's adapters
    bank.ensure(["qv"], pinned)
    art = bank.residency.host.get(pinned["qv"].semantic_sha256)
    assert art.transfer_ready and art.pieces[0].src.is_pinned() and bank.pinned_pool.takes >= 1


def _bank_tests():
    """test_residency's bank tests (they build banks through ``rbank``) that take only the
    ``pinned`` and ``tmp_path`` fixtures."""
    import inspect

    import test_residency as tr

    out = []
    for name, fn in vars(tr).items():
        if name.startswith("test_") and callable(fn) and not hasattr(fn, "pytestmark") \
                and "rbank(" in inspect.getsource(fn) and set(inspect.signature(fn).parameters) <= {"pinned", "tmp_path"}:
            out.append(name)
    return sorted(out)


@pytest.mark.parametrize("name", _bank_tests())
def test_bank_tests_hold_with_images_in_a_three_block_pool(name, pinned, tmp_path, monkeypatch):
    """Every bank test of test_residency (loads, evictions, rollbacks, fault injection,
    hotswap) again with host images staged through a pool of three blocks: blocks recycle,
    some images stay pageable, and nothing the tests check changes."""
    import inspect

    import test_residency as tr

    real, pools = tr.rbank, []

    def pooled(slots=2, **kw):
        if "pinned_pool" not in kw:
            kw["pinned_pool"] = PinnedPool(real(slots).layout.max_image_bytes(), 3, pin=False)
            pools.append(kw["pinned_pool"])
        return real(slots, **kw)

    monkeypatch.setattr(tr, "rbank", pooled)
    fn = getattr(tr, name)
    args = {"pinned": pinned, "tmp_path": tmp_path}
    fn(**{p: args[p] for p in inspect.signature(fn).parameters})
    assert pools and sum(p.takes for p in pools) > 0  # the test's banks really staged images in blocks


def test_the_pooled_bank_tests_are_many():
    assert len(_bank_tests()) >= 10  # the parametrisation above really covers the bank tests
