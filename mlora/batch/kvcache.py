"""The paged KV cache: block storage and the block allocator.

Owns the K/V tensors of every layer, cut into fixed-size blocks, and the free
list of block ids. A block id names the same block in every layer, so one
allocation holds ``block_size`` tokens of one sequence across the whole model.
Must not know about sequences, adapters or scheduling: the scheduler owns the
block tables and decides who gets blocks (spec 0x04-0x05, joint admission).

Addressing: token ``p`` of a sequence with block table ``bt`` lives at slot
``bt[p // block_size] * block_size + p % block_size``; ``slot_mapping`` is that
slot for every new row of one invocation.
"""

from __future__ import annotations

from collections import deque

import torch


class KVCacheFull(RuntimeError):
    """Not enough free blocks for an allocation; nothing was allocated."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"E_KV_FULL: need {needed} KV blocks, {free} free")
        self.needed = needed
        self.free = free


class KVCache:
    """``k[layer]`` and ``v[layer]``: [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError("KVCache dimensions must be positive")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store rows ``k[t]``, ``v[t]`` ([T, kv_heads, head_dim]) at slot ``slot_mapping[t]``."""
        flat_shape = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        self.k[layer].view(flat_shape).index_copy_(0, slot_mapping, k.to(self.dtype))
        self.v[layer].view(flat_shape).index_copy_(0, slot_mapping, v.to(self.dtype))

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

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise KVCacheFull(n, len(self._free))
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        blocks = list(blocks)
        bad = [b for b in blocks if b not in self._used]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"freeing blocks that are not allocated (double free or foreign id): {bad or blocks}")
        self._used.difference_update(blocks)
        self._free.extend(blocks)
