"""A tensor-parallel follower's host cache of its cut of adapters, and the builds rank 0 hints at.

Owns adapter content identity (``semantic_sha256``) -> :class:`CutImage` (the rank's placed
factors, verified and cut, packed into one host buffer: a block of a pinned pool on a GPU),
least recently used first, at most ``capacity_bytes`` (None: unbounded; 0: nothing is kept and
no hint is built), and one background thread that builds the images rank 0's prefetch names
(docs/scaleout.md, "One model over several GPUs"). Must not know slots or the
group: ``build(pinned)`` (``SlotBank.host_cut``) reads, verifies, cuts and places.

Semantics: ``get`` returns the cached image (a hit), else the image of a hinted build in flight
(waiting for it: one read, not two), else builds it on the calling thread (a miss: a disk read)
and keeps it. A hinted build that fails keeps its exception on its future and is dropped (counted):
the next ``get`` of that adapter builds again, on the calling thread, and raises whatever a load
without a cache raises. The cache and its counters change on the calling thread only (``collect``
moves finished builds in); at most as many hinted builds are in flight as the cache holds images.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from mlora.batch.adapters.catalog import PinnedAdapter
from mlora.batch.adapters.residency.host import image_buffer, packed_offsets
from mlora.batch.adapters.residency.pinned import PinnedPool


@dataclass(eq=False)
class CutImage:
    """One adapter's placed rows ``(layer, group, slice, A, B, rank, scale)`` with A and B in one
    host buffer of ``nbytes``."""

    placed: list[tuple]
    nbytes: int


class CutCache:
    """Host images of one rank's cut of adapters (module docstring). ``image_bytes``: an upper
    bound on one image's bytes (a slot's factors), which bounds the hinted builds in flight;
    ``pool``: the blocks images are packed into while one is free (:func:`pinned_pool`)."""

    def __init__(self, capacity_bytes: int | None, build: Callable[[PinnedAdapter], list[tuple]], image_bytes: int,
                 pool: PinnedPool | None = None):
        self.capacity_bytes, self.build, self.pool = capacity_bytes, build, pool
        self._cache: OrderedDict[str, CutImage] = OrderedDict()
        self._inflight: dict[str, Future] = {}
        self.bytes = 0
        self.hits = self.misses = 0  # loads served from the cache (or a hinted build), loads that read
        self.hinted = self.hint_failures = 0  # hinted builds started, and those that failed
        # hinted builds in flight at most: the images the cache holds (None: no bound)
        self.max_hinted = None if capacity_bytes is None else capacity_bytes // max(image_bytes, 1)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mlora-tp-hint") if capacity_bytes != 0 else None

    def get(self, p: PinnedAdapter) -> CutImage:
        """``p``'s image: cached, or its hinted build's, or read now (raising the read's error)."""
        key = p.semantic_sha256
        self.collect()
        image = self._cache.get(key)
        if image is None and key in self._inflight:
            image = self._landed(key, self._inflight.pop(key))  # waits for it
        if image is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return image
        self.misses += 1
        image = self._pack(self.build(p))
        self._put(key, image)
        return image

    def hint(self, adapters: Iterable[PinnedAdapter]) -> int:
        """Start building the images of ``adapters`` not cached nor in flight, on the background
        thread, while the hinted builds in flight stay within the bound; returns how many started."""
        if self._thread is None:
            return 0
        self.collect()
        started = 0
        for p in adapters:
            key = p.semantic_sha256
            if key in self._cache or key in self._inflight:
                continue
            if self.max_hinted is not None and len(self._inflight) >= self.max_hinted:
                break
            self._inflight[key] = self._thread.submit(lambda p=p: self._pack(self.build(p)))
            self.hinted += 1
            started += 1
        return started

    def collect(self) -> None:
        """Move finished hinted builds into the cache; drop failed ones (a load reads again)."""
        if self.pool is not None:
            self.pool.reclaim()
        for key, fut in list(self._inflight.items()):
            if fut.done():
                del self._inflight[key]
                self._landed(key, fut)

    def _landed(self, key: str, fut: Future) -> CutImage | None:
        """The image of a hinted build (waiting for it), kept; None if it failed."""
        try:
            image = fut.result()
        except Exception:  # noqa: BLE001 - the load of this adapter reads again and raises its own error
            self.hint_failures += 1
            return None
        self._put(key, image)
        return image

    def _pack(self, placed: list[tuple]) -> CutImage:
        """``placed`` with its A and B copied into one host buffer (a pool block when one is free)."""
        tensors = [t for row in placed for t in row[3:5]]
        sizes = [t.numel() * t.element_size() for t in tensors]
        buf, offsets, pooled = image_buffer(sizes, False, self.pool)
        packed = []
        for t, off in zip(tensors, offsets):
            dst = buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            packed.append(dst.copy_(t))
        rows = [(*row[:3], packed[2 * i], packed[2 * i + 1], *row[5:]) for i, row in enumerate(placed)]
        image = CutImage(rows, packed_offsets(sizes)[1])  # its bytes, not its block's
        if pooled:
            self.pool.own(image, buf)
        return image

    def _put(self, key: str, image: CutImage) -> None:
        """Keep ``image`` under ``key``, evicting the least recently used beyond the bound (at 0
        bytes: itself at once)."""
        old = self._cache.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        self._cache[key] = image
        self.bytes += image.nbytes
        while self.capacity_bytes is not None and self.bytes > self.capacity_bytes and self._cache:
            self.bytes -= self._cache.popitem(last=False)[1].nbytes

    def cached(self, p: PinnedAdapter) -> bool:
        return p.semantic_sha256 in self._cache

    def report(self) -> dict[str, int]:
        return {"host_cache_hits": self.hits, "host_cache_misses": self.misses, "hinted_builds": self.hinted,
                "hinted_build_failures": self.hint_failures}

    def close(self) -> None:
        """Stop the background thread (a build in flight is finished, queued ones cancelled)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
        self._inflight.clear()


def pinned_pool(capacity_bytes: int | None, image_bytes: int, expected: int,
                most_bytes: int | None = None) -> PinnedPool | None:
    """Page-locked blocks for a GPU rank's cache of ``capacity_bytes`` (None when unbounded or 0),
    :func:`pinned_blocks` of them, pinned now, before the first row: pinning during the job stalls
    the rank's CUDA calls (residency/pinned.py). A load's copies from them are synchronous, so no
    fence guards a block."""
    blocks = pinned_blocks(capacity_bytes, image_bytes, expected, most_bytes)
    return PinnedPool(image_bytes, blocks) if blocks else None


def pinned_blocks(capacity_bytes: int | None, image_bytes: int, expected: int, most_bytes: int | None = None) -> int:
    """One block per image the cache holds, ``expected`` (the job's adapters) at most, and two for
    builds in flight; no more than ``most_bytes`` (rank 0's pinned pool: a follower pins no more
    than rank 0 does; images beyond stay pageable); 0 for a cache of 0 or unbounded bytes."""
    if not capacity_bytes:
        return 0
    blocks = min(expected, capacity_bytes // max(image_bytes, 1)) + 2
    return blocks if most_bytes is None else min(blocks, max(1, most_bytes // max(image_bytes, 1)))
