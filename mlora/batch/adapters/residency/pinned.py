"""Page-locked host blocks for adapter images, pinned once before the job runs.

Why: pinning host memory (``cudaHostAlloc``, what ``torch.empty(pin_memory=True)``
does on a cache miss) holds a process-wide CUDA driver lock for a time that grows
with the bytes pinned, and every other CUDA call of the process waits behind it.
Pinning one buffer per host image while the job runs would make the engine
thread's event records wait behind the prefetch threads' pinning for the whole job
(BENCHMARKS.md, residency). A :class:`PinnedPool` pins all
its bytes in its constructor (a few large allocations, before the first row) and
afterwards only hands out and takes back fixed-size blocks: no driver call.

Semantics:
- The constructor pins ``blocks`` blocks; when the host refuses to lock that much
  memory it keeps the blocks it could pin (``blocks`` < ``requested``,
  ``pin_error`` says why, reported in the job's bank stats): images beyond them
  stay pageable, slower but correct.
- ``take(nbytes)`` returns a free block (a uint8 tensor of ``block_bytes``) or None
  when ``nbytes`` exceeds a block or every block is taken; the caller then keeps
  its image in pageable memory (correct, the copy is merely synchronous) and the
  pool counts an ``exhausted`` miss. Thread-safe (prefetch threads build images).
- ``give(block)`` returns a block whose owner is gone (any thread, e.g. a
  ``weakref.finalize`` of the owning image). It is not reusable yet: a host-to-device
  copy from it may still be queued on the copy stream.
- ``reclaim()`` (the engine's thread) fences the blocks given back since the last
  call with one event from ``fence`` (recorded on the copy stream, where every copy
  from a pinned image runs) and frees the blocks of every completed fence. A block
  is reused only after a copy-stream event recorded after its release completed.
Must not know adapters, slots or the host cache's policy.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Callable

import torch

BLOCK_ALIGN = 4096
CHUNK_BYTES = 1 << 30  # pinned in chunks of this size (torch rounds a pinned allocation up to a power of two)


class PinnedPool:
    """``blocks`` host blocks of ``block_bytes`` (rounded up to 4 KiB), page-locked when
    ``pin`` (tests use ordinary memory), handed out by ``take`` and reused after ``give``
    and a completed ``fence`` (semantics: module docstring)."""

    def __init__(self, block_bytes: int, blocks: int, *, fence: Callable[[], object] | None = None, pin: bool = True,
                 chunk_bytes: int = CHUNK_BYTES):
        if block_bytes <= 0 or blocks < 0:
            raise ValueError(f"PinnedPool needs block_bytes > 0 and blocks >= 0, got {block_bytes}, {blocks}")
        self.block_bytes = -(-block_bytes // BLOCK_ALIGN) * BLOCK_ALIGN
        self.pin, self._fence = pin, fence
        per_chunk = max(1, chunk_bytes // self.block_bytes)
        t0 = time.perf_counter()
        self._chunks: list[torch.Tensor] = []
        self._free: list[torch.Tensor] = []
        self.requested, self.pin_error = blocks, None
        left = blocks
        while left > 0:
            n = min(per_chunk, left)
            try:
                chunk = torch.empty(n * self.block_bytes, dtype=torch.uint8, pin_memory=pin)
            except RuntimeError as exc:  # the host cannot lock that much memory: keep what it could
                self.pin_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                break
            self._chunks.append(chunk)
            self._free.extend(chunk[i * self.block_bytes:(i + 1) * self.block_bytes] for i in range(n))
            left -= n
        self.blocks = len(self._free)
        self.pin_seconds = time.perf_counter() - t0
        self._lock = threading.Lock()  # the free list and the released list (any thread)
        self._reclaiming = threading.Lock()  # the fenced list (reclaim)
        self._given: list[torch.Tensor] = []  # released, not yet fenced
        self._fenced: list[tuple[object, list[torch.Tensor]]] = []  # (event, blocks) oldest first
        self.exhausted = 0  # takes that found no free block (the image stayed pageable)
        self.takes = 0
        self.taken_peak = 0

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def in_use(self) -> int:
        with self._lock:
            return self.blocks - len(self._free)

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A free block for an image of ``nbytes`` (None: too large, or none free)."""
        with self._lock:
            if nbytes > self.block_bytes or not self._free:
                self.exhausted += 1
                return None
            block = self._free.pop()
            self.takes += 1
            self.taken_peak = max(self.taken_peak, self.blocks - len(self._free))
            return block

    def give(self, block: torch.Tensor) -> None:
        """``block``'s owner is gone; it becomes free after the next completed fence."""
        with self._lock:
            self._given.append(block)

    def own(self, owner: object, block: torch.Tensor) -> None:
        """Give ``block`` back when ``owner`` is garbage collected."""
        weakref.finalize(owner, self.give, block)

    def reclaim(self) -> int:
        """Fence the blocks given back since the last call; free those whose fence completed.
        Returns the number freed."""
        with self._reclaiming:  # one caller at a time (the engine's thread; a lock costs nothing there)
            with self._lock:
                given, self._given = self._given, []
            if given:
                self._fenced.append((self._fence() if self._fence is not None else None, given))
            freed = []
            while self._fenced and (self._fenced[0][0] is None or self._fenced[0][0].query()):
                freed.extend(self._fenced.pop(0)[1])
            if freed:
                with self._lock:
                    self._free.extend(freed)
            return len(freed)

    def stats(self) -> dict:
        short = {} if self.pin_error is None else dict(pinned_pool_requested=self.requested,
                                                       pinned_pool_error=self.pin_error)
        return short | dict(pinned_pool_blocks=self.blocks, pinned_pool_bytes=self.nbytes,
                    pinned_pool_pin_seconds=round(self.pin_seconds, 3), pinned_pool_peak_blocks=self.taken_peak,
                    pinned_pool_takes=self.takes, pinned_pool_exhausted=self.exhausted)
