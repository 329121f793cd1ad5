"""Triton paged attention for packed prefill-chunk and decode rows (the GPU path).

Owns one kernel and its launch: causal attention of each sequence's new rows
over that sequence's K/V in the paged cache, read through its block table.
Same semantics as the reference in ``mlora.batch.attention`` (which documents
them and which the tests compare against): for sequence ``b`` with ``n`` new
rows and ``c = context_lens[b]``, new row ``i`` sits at position ``c - n + i``
and attends to keys ``0 .. c - n + i``; query head ``h`` reads KV head
``h // (H / H_kv)``.

Work split: one program per (query tile, KV head). A query tile is up to
``BLOCK_Q`` consecutive new rows of one sequence; the program stacks those rows
times the ``GROUP = H / H_kv`` query heads that share the KV head into one
``BLOCK_Q * GROUP``-row matrix (``GROUP`` padded to a power of two, masked), so every K/V tile is read once per KV head
(grouped-query attention) and fed to tensor-core dots. Keys are visited in
``BLOCK_N`` steps up to the tile's last position with an online softmax
(float32 statistics and accumulator, base-2 exponentials). Decode rows (one
per sequence) and prefill chunks get separate launches with different
``BLOCK_Q`` (16 stacked rows for decode, 64 for prefill), so a decode row
never pays for a prefill-sized tile. Host work per invocation: one tile list per launch, built once
and shared by every layer (``PagedLayout``).

Not built here: splitting one sequence's keys over several programs
(flash-decoding) for batches of very few, very long sequences; CUDA-graph
static buffers (step 7).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# The CPU interpreter mis-computes 16-bit tl.dot: there (and for float32 inputs)
# the dots run in IEEE float32; 16-bit inputs on a GPU use tensor cores with
# float32 accumulation (P is rounded to the input dtype before P @ V).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
PREFILL_ROWS = 64  # query rows x heads of one prefill tile
BLOCK_N = 64
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows
# Warps per attention program. At 4, both tile shapes of an 8B model (head_dim 128) use all 255
# registers and spill to local memory on sm_90 (`scripts/compile_kernels.py` prints the stack
# bytes); at 8 they do not, but the job is slower (H200, tenth session: prefill +30%, decode
# +7-13%; BENCHMARKS.md, `bash scripts/gpu_session.sh attention-warps`), so 4 stays.
ATTENTION_WARPS = 4


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    block_tables_ptr, context_lens_ptr, query_starts_ptr, tile_seq_ptr, tile_q0_ptr,
    scale_log2e,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, block_size,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NATIVE_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    row0 = tl.load(query_starts_ptr + seq)
    n = tl.load(query_starts_ptr + seq + 1) - row0
    ctx = tl.load(context_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_Q * GROUP_P)
    qi = q0 + offs_m // GROUP_P  # new-row index inside the sequence
    head = kvh * GROUP + offs_m % GROUP_P
    row_ok = (qi < n) & (offs_m % GROUP_P < GROUP)
    qpos = ctx - n + qi
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (row0 + qi)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)
    kv_end = tl.minimum(ctx, ctx - n + q0 + BLOCK_Q)  # one past the tile's last query position
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, kv_end, BLOCK_N):
        kpos = start + offs_n
        k_ok = kpos < kv_end
        blk = tl.load(block_tables_ptr + seq * stride_bt + kpos // block_size, mask=k_ok, other=0).to(tl.int64)
        inner = kpos % block_size
        kt = tl.load(k_ptr + blk[:, None] * stride_kb + inner[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                     mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        vt = tl.load(v_ptr + blk[:, None] * stride_vb + inner[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                     mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if NATIVE_DOT:
            s = tl.dot(q, tl.trans(kt))
        else:
            s = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
        s = s * scale_log2e
        visible = (kpos[None, :] <= qpos[:, None]) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if NATIVE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (row0 + qi)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def pad_tables(block_tables: list[list[int]], width: int | None = None) -> np.ndarray:
    """int32 [B, width] block tables padded with 0 (width: the longest table, at least 1).
    Built from one flat array: about 5x faster than a nested ``torch.tensor`` at 256 rows."""
    lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=len(block_tables))
    if width is None:
        width = max(int(lens.max()) if len(lens) else 0, 1)
    out = np.zeros((len(block_tables), width), dtype=np.int32)
    if len(lens):
        out[np.arange(width)[None, :] < lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(lens.sum()))
    return out


def decode_block_q(group: int) -> int:
    """Query rows of a decode tile: ``BLOCK_Q * pow2(group) = 16`` (at least 1)."""
    return max(1, MIN_DOT_ROWS // _pow2(group))


@dataclass
class TileList:
    """One launch: query tile ``i`` covers new rows ``[tile_q0[i], tile_q0[i] + block_q)``
    of sequence ``tile_seq[i]`` (rows past the sequence's count are masked)."""

    block_q: int
    tile_seq: torch.Tensor  # int32 [tiles]
    tile_q0: torch.Tensor  # int32 [tiles]


@dataclass
class PagedLayout:
    """Device metadata of one invocation, shared by every layer."""

    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with 0
    context_lens: torch.Tensor  # int32 [B]
    query_starts: torch.Tensor  # int32 [B + 1]
    launches: list[TileList]

    @classmethod
    def build(cls, query_starts: list[int], context_lens: list[int], block_tables: list[list[int]], group: int,
              device: torch.device) -> PagedLayout:
        """Tile lists from the host metadata: sequences with one new row go to a
        decode launch (``BLOCK_Q * pow2(group) = 16``, or ``BLOCK_Q = 1``), the
        others to a prefill launch (``BLOCK_Q * pow2(group) = 64``); one
        host-to-device copy for everything."""
        decode_q = decode_block_q(group)
        prefill_q = max(1, PREFILL_ROWS // _pow2(group))
        tiles = {prefill_q: ([], []), decode_q: ([], [])}
        for b in range(len(context_lens)):
            n = query_starts[b + 1] - query_starts[b]
            bq = decode_q if n == 1 else prefill_q
            for q0 in range(0, n, bq):
                tiles[bq][0].append(b)
                tiles[bq][1].append(q0)
        tables = pad_tables(block_tables)
        width = tables.shape[1]
        parts = [tables.reshape(-1), np.asarray(context_lens, dtype=np.int32), np.asarray(query_starts, dtype=np.int32)]
        for bq, (seqs, q0s) in tiles.items():
            parts += [np.asarray(seqs, dtype=np.int32), np.asarray(q0s, dtype=np.int32)]
        data = torch.from_numpy(np.concatenate(parts)).to(device, non_blocking=True)
        B = len(context_lens)
        at = B * width
        layout = cls(data[:at].view(B, width), data[at : at + B], data[at + B : at + 2 * B + 1], [])
        at += 2 * B + 1
        for bq, (seqs, _) in tiles.items():
            k = len(seqs)
            if k:
                layout.launches.append(TileList(bq, data[at : at + k], data[at + k : at + 2 * k]))
            at += 2 * k
        return layout


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: PagedLayout,
                    scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], caches [num_blocks, block_size, H_kv, D] -> out [T, H, D] (q's dtype),
    written into ``out`` when given. Every row of ``q`` must belong to a sequence of ``layout``."""
    T, H, D = q.shape
    num_blocks, block_size, Hkv, Dk = k_cache.shape
    if Dk != D or H % Hkv or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"paged_attention: q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention: the head dimension must be contiguous")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"paged_attention: out {tuple(out.shape)} {out.dtype} does not match q")
    group = H // Hkv
    native = q.dtype in (torch.bfloat16, torch.float16) and not _INTERPRET
    if k_cache.dtype != q.dtype:
        raise ValueError(f"paged_attention: q is {q.dtype}, the cache is {k_cache.dtype}")
    bt = layout.block_tables
    for tl_ in layout.launches:
        grid = (tl_.tile_seq.numel(), Hkv)
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out,
            bt, layout.context_lens, layout.query_starts, tl_.tile_seq, tl_.tile_q0,
            scale * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            bt.stride(0), block_size,
            GROUP=group, GROUP_P=_pow2(group), BLOCK_Q=tl_.block_q, BLOCK_N=BLOCK_N,
            HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), NATIVE_DOT=native, num_warps=ATTENTION_WARPS,
        )
    return out
