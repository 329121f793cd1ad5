"""Causal attention over the paged KV cache for packed, mixed prefill/decode rows.

Owns ``AttentionMetadata`` (which packed rows belong to which sequence, and
where each sequence's K/V lives) and the reference attention. Must not touch
the cache's allocation or the scheduler's block tables: it only reads them.

Semantics, for sequence ``b`` with ``n`` new rows and ``c = context_lens[b]``::

    K, V  = cache rows of positions 0 .. c-1, read through block_tables[b]
    row i = query_starts[b] + i sits at position p = c - n + i
    out[row i] = softmax(scale * q[row i] . K[0..p]^T) V[0..p]     (GQA: head h reads kv head h // (H / H_kv))

Two backends, chosen by ``AttentionMetadata.backend``:

- ``"torch"``, the reference: consecutive sequences are grouped and each group
  is one ``scaled_dot_product_attention`` call with an explicit boolean
  block-diagonal causal mask (a row never sees another sequence's keys).
- ``"triton"``: the paged kernel of ``mlora.kernels.paged_attention`` (decode and
  prefill-chunk launches reading K/V through the block tables), tested against
  the reference.

``"auto"`` (the default) runs the kernel on CUDA tensors and the reference elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mlora.batch.model.kvcache import KVCache
from mlora.kernels.paged_attention import PagedLayout, paged_attention

# Largest query rows x keys of one grouped SDPA call (the mask's element count).
GROUP_ELEMENTS = 1 << 16


@dataclass
class AttentionMetadata:
    """One model invocation's attention layout, shared by every layer.

    ``query_starts`` (len B+1): packed rows of sequence b are [query_starts[b], query_starts[b+1]).
    ``context_lens`` (len B): tokens of sequence b in the cache once this step's K/V are written.
    ``block_tables`` (len B): block ids of sequence b, in position order.
    ``slot_mapping`` (int64 [T]): cache slot of every packed row.
    ``backend``: "auto" (Triton kernel on CUDA, reference elsewhere), "torch" or "triton".
    """

    query_starts: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor
    backend: str = "auto"
    _views: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def sequence_views(self, block_size: int, device: torch.device) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """Per group of consecutive sequences ``(row_start, row_end, kv_slots [c], mask [n, c])``,
        built on the first layer's call and reused by the others."""
        key = (block_size, str(device))
        if key not in self._views:
            self._views[key] = self._build_views(block_size, torch.device(device))
        return self._views[key]

    def _build_views(self, block_size: int, device: torch.device):
        """Consecutive sequences grouped so that one SDPA call serves each group
        with a block-diagonal causal mask (rows x keys of a group kept under
        ``GROUP_ELEMENTS``; a long sequence forms a group of its own)."""
        self._check(block_size)
        groups: list[list[int]] = []
        rows = keys = 0
        for b in range(self.num_seqs):
            n, c = self.query_starts[b + 1] - self.query_starts[b], self.context_lens[b]
            if groups and (rows + n) * (keys + c) <= GROUP_ELEMENTS:
                groups[-1].append(b)
                rows, keys = rows + n, keys + c
            else:
                groups.append([b])
                rows, keys = n, c
        views = []
        for g in groups:
            slots: list[int] = []
            seq_of_key: list[int] = []
            key_pos: list[int] = []
            query_seq: list[int] = []
            query_pos: list[int] = []
            for i, b in enumerate(g):
                table, ctx = self.block_tables[b], self.context_lens[b]
                n = self.query_starts[b + 1] - self.query_starts[b]
                slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx))
                seq_of_key.extend([i] * ctx)
                key_pos.extend(range(ctx))
                query_seq.extend([i] * n)
                query_pos.extend(range(ctx - n, ctx))
            t = dict(dtype=torch.int64)
            ks, kp = torch.tensor(seq_of_key, **t), torch.tensor(key_pos, **t)
            qs, qp = torch.tensor(query_seq, **t), torch.tensor(query_pos, **t)
            mask = (qs[:, None] == ks[None, :]) & (kp[None, :] <= qp[:, None])
            start, end = self.query_starts[g[0]], self.query_starts[g[-1] + 1]
            views.append((start, end, torch.tensor(slots, **t).to(device), mask.to(device)))
        return views

    def _check(self, block_size: int) -> None:
        b = self.num_seqs
        if len(self.query_starts) != b + 1 or len(self.block_tables) != b:
            raise ValueError(f"AttentionMetadata: {len(self.query_starts)} query_starts, {b} context_lens, "
                             f"{len(self.block_tables)} block_tables (want B+1, B, B)")
        if self.query_starts[0] != 0:
            raise ValueError("AttentionMetadata: query_starts[0] must be 0")
        for i in range(b):
            n = self.query_starts[i + 1] - self.query_starts[i]
            ctx = self.context_lens[i]
            if n < 0 or n > ctx:
                raise ValueError(f"AttentionMetadata: sequence {i} has {n} new rows but context_len {ctx}")
            if len(self.block_tables[i]) * block_size < ctx:
                raise ValueError(f"AttentionMetadata: sequence {i} needs {ctx} slots, "
                                 f"its {len(self.block_tables[i])} blocks hold {len(self.block_tables[i]) * block_size}")


    def paged_layout(self, block_size: int, group: int, device: torch.device):
        """The Triton kernel's device metadata, built on the first layer's call."""
        key = ("paged", block_size, group, str(device))
        if key not in self._views:
            self._check(block_size)
            self._views[key] = PagedLayout.build(self.query_starts, self.context_lens, self.block_tables, group,
                                                 torch.device(device))
        return self._views[key]


def attention(q: torch.Tensor, layer: int, kv: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, head_dim] -> out [T, heads, head_dim], after ``layer``'s new K/V were written."""
    if q.shape[0] != meta.query_starts[-1]:
        raise ValueError(f"attention: {q.shape[0]} query rows, metadata covers {meta.query_starts[-1]}")
    if meta.backend not in ("auto", "torch", "triton"):
        raise ValueError(f"attention backend {meta.backend!r}; expected 'auto', 'torch' or 'triton'")
    heads = q.shape[1]
    if meta.backend == "triton" or (meta.backend == "auto" and q.is_cuda):
        layout = meta.paged_layout(kv.block_size, heads // kv.num_kv_heads, q.device)
        return paged_attention(q, kv.k[layer], kv.v[layer], layout, scale)
    group = heads // kv.num_kv_heads
    out = torch.empty_like(q)
    for start, end, slots, mask in meta.sequence_views(kv.block_size, q.device):
        if start == end:
            continue
        k, v = kv.read(layer, slots)
        k, v = k.to(q.dtype), v.to(q.dtype)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        # [rows, heads, dim] -> [heads, rows, dim] for SDPA
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out
