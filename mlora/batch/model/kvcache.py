"""The paged KV cache: block storage and the block allocator.

Owns the K/V tensors of every layer, cut into fixed-size blocks, and the free
list of block ids. A block id names the same block in every layer, so one
allocation holds ``block_size`` tokens of one sequence across the whole model.
Must not know about sequences, adapters or scheduling: the scheduler owns the
block tables and decides who gets blocks (docs/design.md, KV block and Joint memory ledger).

Addressing: token ``p`` of a sequence with block table ``bt`` lives at slot
``bt[p // block_size] * block_size + p % block_size``; ``slot_mapping`` is that
slot for every new row of one invocation.

Two storage layouts, the same views (``k[layer]``, ``v[layer]``: [num_blocks,
block_size, kv_heads, head_dim]) and the same addressing:

* ``layer-major`` (default): one contiguous tensor per layer for K and for V.
* ``page-major``: one tensor ``[num_blocks, layers, 2, block_size, kv_heads,
  head_dim]``, so one block id's K and V of every layer are one contiguous page
  (``bytes_per_block``); the per-layer views are strided (block stride = a page).
  The joint memory mode carves these pages from the one arena it shares with the
  adapter slots (``pages=``; docs/sizing.md). Selected with ``layout="page-major"``
  or by passing ``pages``; the paged attention kernel reads it through its strides.
"""

from __future__ import annotations

from collections import deque

import torch

LAYOUTS = ("layer-major", "page-major")


class KVCacheFull(RuntimeError):
    """Not enough free blocks for an allocation; nothing was allocated."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"E_KV_FULL: need {needed} KV blocks, {free} free")
        self.needed = needed
        self.free = free


class KVCache:
    """``k[layer]`` and ``v[layer]``: [num_blocks, block_size, num_kv_heads, head_dim] (views of
    one page-major tensor with ``layout="page-major"``; see the module docstring)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", layout: str | None = None,
                 pages: torch.Tensor | None = None):
        """``pages``: the page-major storage to use (``arena.PageArena.kv_pages``: the KV blocks
        share one arena with the adapter slots), ``[num_blocks, layers, 2, block_size, kv_heads,
        head_dim]``; the layout is then page-major. ``layout``: ``"layer-major"`` (the default
        without ``pages``) or ``"page-major"``."""
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError("KVCache dimensions must be positive")
        if pages is not None:
            want = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
            if tuple(pages.shape) != want or pages.dtype != dtype:
                raise ValueError(f"KV pages {tuple(pages.shape)} {pages.dtype}, expected {want} {dtype}")
            layout = "page-major"
        layout = layout or "layer-major"
        if layout not in LAYOUTS:
            raise ValueError(f"KV cache layout {layout!r}: expected one of {LAYOUTS}")
        self.layout = layout
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if layout == "page-major":
            if pages is None:
                pages = torch.zeros((num_blocks, num_layers, 2) + shape[1:], dtype=dtype, device=self.device)
            self.pages = pages
            self.k = [self.pages[:, layer, 0] for layer in range(num_layers)]
            self.v = [self.pages[:, layer, 1] for layer in range(num_layers)]
        else:
            self.pages = None
            self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._split: tuple | None = None  # begin(): (slot_mapping, its version, its blocks, its offsets)

    def begin(self, slot_mapping: torch.Tensor) -> None:
        """Split ``slot_mapping`` into (block id, offset in the block) once for the invocation
        that is about to write every layer at it (page-major; nothing to do for layer-major).
        The model calls it at the start of each forward, so inside a CUDA graph capture the
        split is captured too and replays recompute it from the static slot buffer. A split is
        used only by writes with this very tensor; any other write computes its own."""
        if self.pages is not None:
            self._split = (slot_mapping, slot_mapping._version,
                           slot_mapping // self.block_size, slot_mapping % self.block_size)

    def _blocks_offsets(self, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, offset in the block) of every slot: :meth:`begin`'s split when it was made
        for this tensor and the tensor was not modified in place since (its version counter),
        else computed now. The engine's graph buffers are the same tensor objects on every call
        with new contents copied in place, so identity alone would let graph replays write at
        the warm-up's slots."""
        if self._split is not None and self._split[0] is slot_mapping and self._split[1] == slot_mapping._version:
            return self._split[2], self._split[3]
        return slot_mapping // self.block_size, slot_mapping % self.block_size

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store rows ``k[t]``, ``v[t]`` ([T, kv_heads, head_dim]) at slot ``slot_mapping[t]``."""
        if self.pages is not None:
            blocks, offsets = self._blocks_offsets(slot_mapping)
            self.k[layer].index_put_((blocks, offsets), k.to(self.dtype))
            self.v[layer].index_put_((blocks, offsets), v.to(self.dtype))
            return
        flat_shape = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        self.k[layer].view(flat_shape).index_copy_(0, slot_mapping, k.to(self.dtype))
        self.v[layer].view(flat_shape).index_copy_(0, slot_mapping, v.to(self.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows ([len(slots), kv_heads, head_dim]) of ``layer`` at ``slots`` (copies)."""
        if self.pages is not None:
            blocks, offsets = slots // self.block_size, slots % self.block_size
            return self.k[layer][blocks, offsets], self.v[layer][blocks, offsets]
        flat_shape = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        return (self.k[layer].view(flat_shape).index_select(0, slots),
                self.v[layer].view(flat_shape).index_select(0, slots))

    def bytes_per_block(self) -> int:
        return self.block_bytes(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block id: K and V of ``block_size`` tokens in every layer."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @classmethod
    def blocks_for_budget(cls, bytes_budget: int, num_layers: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype) -> int:
        """How many whole blocks fit in ``bytes_budget``."""
        return max(0, int(bytes_budget) // cls.block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype))


class BlockAllocator:
    """Free list of block ids ``0 .. num_blocks-1``. All or nothing: ``allocate``
    either returns ``n`` blocks or raises ``KVCacheFull`` having taken none.
    Freeing a block that is not allocated is a bug and raises ``ValueError``."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def has(self, n: int) -> bool:
        """Whether ``n`` blocks are free."""
        return n <= len(self._free)

    def allocate(self, n: int, owner=None) -> list[int]:
        """``n`` free blocks (``owner``: who gets them, unused here; ``joint.LedgerBlocks`` needs it)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise KVCacheFull(n, len(self._free))
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int], owner=None) -> None:
        blocks = list(blocks)
        bad = [b for b in blocks if b not in self._used]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"freeing blocks that are not allocated (double free or foreign id): {bad or blocks}")
        self._used.difference_update(blocks)
        self._free.extend(blocks)
