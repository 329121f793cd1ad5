"""Triton paged attention for packed prefill-chunk and decode rows (the GPU path).

Owns one kernel and its launch: causal attention of each sequence's new rows
over that sequence's K/V in the paged cache, read through its block table.
Same semantics as the reference in ``mlora.batch.model.attention`` (which documents
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
``BLOCK_Q`` (16 stacked rows for decode, ``PREFILL_ROWS`` = 128 for prefill), so a decode row
never pays for a prefill-sized tile. Host work per invocation: one tile list per launch, built once
and shared by every layer (``PagedLayout``).

Split keys (flash-decoding) for decode launches of few programs: with
``splits > 1`` a decode tile's keys are cut into ``splits`` chunks (each a
multiple of ``BLOCK_N``, sized from the sequence's own context length inside
the kernel, so a captured graph serves any lengths), one program per (tile,
KV head, chunk) writes its unnormalised float32 accumulator and its softmax
statistics (running max, sum) to a scratch buffer, and a second launch merges
the chunks of each (tile, KV head) with the usual rescaling
(``exp2(m_s - max_s m_s)``). A chunk past the context writes an empty partial
(max -inf, sum 0) that the merge weighs 0. How many splits: :func:`decode_splits`.
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
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows
# Decode launches with fewer than this many programs per SM (tiles x KV heads / SMs) split
# their keys (flash-decoding): below it an SM would sit idle; above it splitting only adds
# the merge.
SPLIT_BELOW_PROGRAMS_PER_SM = 2
MAX_DECODE_SPLITS = 8
# Launch parameters of decode launches (one new row per sequence: the whole launch streams
# K/V), separate from prefill's. Two software-pipelining stages keep the next keys' block-table
# entries and K/V tiles in flight during this step's dots; 4 warps do not spill on sm_90 with
# the alignment marks a GPU launch gets (scripts/compile_kernels.py).
DECODE_BLOCK_N = 64
DECODE_WARPS = 4
DECODE_STAGES: int | None = 2


def longest_first(seqs, context_lens) -> list[int]:
    """``seqs`` (indices into ``context_lens``) longest context first, ties in their order: the
    order of decode tiles, so that the block scheduler fills the SMs with the short tiles last
    (longest-processing-time-first scheduling)."""
    return sorted(seqs, key=lambda b: -context_lens[b])


# Launch parameters of prefill launches (several new rows per sequence), from a sweep (figures
# in BENCHMARKS.md): 128 query rows x heads per tile (each K/V tile serves twice the queries of
# 64), 32 keys per step, 8 warps, 2 pipelining stages.
PREFILL_ROWS = 128  # query rows x heads of one prefill tile
PREFILL_BLOCK_N = 32
PREFILL_WARPS = 8
PREFILL_STAGES: int | None = 2


@triton.jit
def _tile_rows(tile, kvh, tile_seq_ptr, tile_q0_ptr, query_starts_ptr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
               BLOCK_Q: tl.constexpr):
    """The stacked rows of one (query tile, KV head): its sequence, first new row, the
    sequence's first packed row and new-row count, and per stacked row its index offs_m, its
    new-row index qi inside the sequence, its query head and whether it is real (row_ok)."""
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    row0 = tl.load(query_starts_ptr + seq)
    n = tl.load(query_starts_ptr + seq + 1) - row0
    offs_m = tl.arange(0, BLOCK_Q * GROUP_P)
    qi = q0 + offs_m // GROUP_P
    head = kvh * GROUP + offs_m % GROUP_P
    row_ok = (qi < n) & (offs_m % GROUP_P < GROUP)
    return seq, q0, row0, n, offs_m, qi, head, row_ok


# ``splits`` is a runtime argument (one compiled kernel whatever the count: a batch's
# count changes with its decode rows, and a lazily compiled variant would land inside
# a timed iteration); ``SPLIT`` says whether there is more than one
@triton.jit(do_not_specialize=["splits"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    block_tables_ptr, context_lens_ptr, query_starts_ptr, tile_seq_ptr, tile_q0_ptr,
    scale_log2e,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, block_size, part_ptr, stat_ptr, splits,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NATIVE_DOT: tl.constexpr, SPLIT: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
):
    if HEADS_FIRST:  # grid (KV heads, tiles, splits): a tile's heads are dispatched together
        kvh = tl.program_id(0)
        tile = tl.program_id(1)
        num_kvh = tl.num_programs(0)
    else:  # grid (tiles, KV heads, splits)
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        num_kvh = tl.num_programs(1)
    seq, q0, row0, n, offs_m, qi, head, row_ok = _tile_rows(tile, kvh, tile_seq_ptr, tile_q0_ptr, query_starts_ptr,
                                                            GROUP, GROUP_P, BLOCK_Q)
    ctx = tl.load(context_lens_ptr + seq)
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
    if SPLIT:  # this program's chunk of the keys: [kv_lo, kv_hi), one of ``splits``
        chunk = tl.cdiv(tl.cdiv(kv_end, splits), BLOCK_N) * BLOCK_N
        kv_lo = tl.program_id(2) * chunk
        kv_hi = tl.minimum(kv_end, kv_lo + chunk)
    else:
        kv_lo = 0
        kv_hi = kv_end
    for start in range(kv_lo, kv_hi, BLOCK_N):
        kpos = start + offs_n
        k_ok = kpos < kv_hi
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
    if SPLIT:  # the chunk's partial of the real rows: unnormalised accumulator, running max and sum
        part = (tile * num_kvh + kvh) * splits + tl.program_id(2)
        rows = part * (BLOCK_Q * GROUP_P) + offs_m
        tl.store(part_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(stat_ptr + rows * 2, m_i, mask=row_ok)
        tl.store(stat_ptr + rows * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (row0 + qi)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["splits"])
def _merge_splits_kernel(
    part_ptr, stat_ptr, out_ptr, query_starts_ptr, tile_seq_ptr, tile_q0_ptr, stride_ot, stride_oh, splits,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (tile, KV head): the softmax-weighted sum of its ``splits`` partials.
    Only real rows (``row_ok``) were written and are read: a decode tile stacks 16 rows of
    which ``GROUP`` are real, and the padding would otherwise be most of the traffic."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    _, _, row0, _, offs_m, qi, head, row_ok = _tile_rows(tile, kvh, tile_seq_ptr, tile_q0_ptr, query_starts_ptr,
                                                         GROUP, GROUP_P, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    first = (tile * tl.num_programs(1) + kvh) * splits
    m = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    for s in range(splits):
        m = tl.maximum(m, tl.load(stat_ptr + ((first + s) * (BLOCK_Q * GROUP_P) + offs_m) * 2, mask=row_ok,
                                  other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)
    for s in range(splits):
        rows = (first + s) * (BLOCK_Q * GROUP_P) + offs_m
        w = tl.exp2(tl.load(stat_ptr + rows * 2, mask=row_ok, other=float("-inf")) - m_safe)  # empty chunk: 0
        l += w * tl.load(stat_ptr + rows * 2 + 1, mask=row_ok, other=0.0)
        acc += w[:, None] * tl.load(part_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], mask=row_ok[:, None],
                                    other=0.0)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (row0 + qi)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def decode_splits(programs: int, device: torch.device) -> int:
    """Key splits of a decode launch of ``programs`` (tiles x KV heads) programs: 1 when the
    launch has at least ``SPLIT_BELOW_PROGRAMS_PER_SM`` programs per SM, else the power of
    two that brings it there (at most ``MAX_DECODE_SPLITS``). Depends only on static shapes:
    a captured graph keeps its count."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    splits = 1
    while splits < MAX_DECODE_SPLITS and programs * splits < SPLIT_BELOW_PROGRAMS_PER_SM * sms:
        splits *= 2
    return splits


# Every metadata array a kernel reads starts at a multiple of ALIGN int32s, and the block
# tables' row stride is one: Triton specialises a launch on each pointer's 16-byte alignment
# and each integer's divisibility by 16, so offsets that moved with the batch would compile a
# new kernel variant for every new combination, inside a job's timed part.
ALIGN = 16


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _aligned_concat(parts: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """One int32 array holding ``parts`` each from a multiple of ``ALIGN``; their offsets."""
    offsets, at = [], 0
    for p in parts:
        offsets.append(at)
        at += _round_up(max(p.size, 1), ALIGN)
    out = np.zeros(at, dtype=np.int32)
    for off, p in zip(offsets, parts):
        out[off : off + p.size] = p
    return out, offsets


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def pad_tables(block_tables: list[list[int]], width: int | None = None) -> np.ndarray:
    """int32 [B, width] block tables padded with 0 (width: the longest table, at least 1).
    Built from one flat array: a nested ``torch.tensor`` costs several times the host time."""
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
    of sequence ``tile_seq[i]`` (rows past the sequence's count are masked). ``decode``:
    every tile is one sequence's one new row (the launch may split its keys). Any order of
    the tiles gives the same numbers. Decode launches run their tiles longest context first
    (:func:`longest_first`) with ``heads_first``: a tile's KV heads are dispatched together."""

    block_q: int
    tile_seq: torch.Tensor  # int32 [tiles]
    tile_q0: torch.Tensor  # int32 [tiles]
    decode: bool = False
    heads_first: bool = False  # decode: grid (KV heads, tiles) instead of (tiles, KV heads)


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
        others to a prefill launch (``BLOCK_Q * pow2(group) = PREFILL_ROWS``); one
        host-to-device copy for everything. Decode tiles longest context first, heads first
        (:func:`longest_first`, :class:`TileList`)."""
        decode_q = decode_block_q(group)
        prefill_q = max(1, PREFILL_ROWS // _pow2(group))
        tiles = {prefill_q: ([], []), decode_q: ([], [])}
        for b in range(len(context_lens)):
            n = query_starts[b + 1] - query_starts[b]
            bq = decode_q if n == 1 else prefill_q
            for q0 in range(0, n, bq):
                tiles[bq][0].append(b)
                tiles[bq][1].append(q0)
        if decode_q != prefill_q:  # decode tiles longest context first (longest_first)
            seqs = longest_first(tiles[decode_q][0], context_lens)
            tiles[decode_q] = (seqs, [0] * len(seqs))
        B = len(context_lens)
        tables = pad_tables(block_tables, _round_up(max((len(t) for t in block_tables), default=1), ALIGN))
        parts = [tables.reshape(-1), np.asarray(context_lens, dtype=np.int32), np.asarray(query_starts, dtype=np.int32)]
        for bq, (seqs, q0s) in tiles.items():
            parts += [np.asarray(seqs, dtype=np.int32), np.asarray(q0s, dtype=np.int32)]
        data, at = _aligned_concat(parts)
        data = torch.from_numpy(data).to(device, non_blocking=True)
        layout = cls(data[at[0] : at[0] + tables.size].view(B, tables.shape[1]), data[at[1] : at[1] + B],
                     data[at[2] : at[2] + B + 1], [])
        for i, (bq, (seqs, _)) in enumerate(tiles.items()):
            k = len(seqs)
            if k:
                lo, hi = at[3 + 2 * i], at[4 + 2 * i]
                decode = bq == decode_q
                layout.launches.append(TileList(bq, data[lo : lo + k], data[hi : hi + k], decode, decode))
        return layout


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: PagedLayout,
                    scale: float, out: torch.Tensor | None = None, splits_override: int | None = None) -> torch.Tensor:
    """q [T, H, D], caches [num_blocks, block_size, H_kv, D] -> out [T, H, D] (q's dtype),
    written into ``out`` when given. Every row of ``q`` must belong to a sequence of ``layout``.
    ``splits_override``: the key splits of decode launches (tests; default :func:`decode_splits`)."""
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
    block_d = max(16, triton.next_power_of_2(D))
    for tl_ in layout.launches:
        tiles = tl_.tile_seq.numel()
        if not tl_.decode:
            splits = 1
        else:
            splits = decode_splits(tiles * Hkv, q.device) if splits_override is None else splits_override
        rows = tl_.block_q * _pow2(group)
        block_n, warps = (DECODE_BLOCK_N, DECODE_WARPS) if tl_.decode else (PREFILL_BLOCK_N, PREFILL_WARPS)
        stage_count = DECODE_STAGES if tl_.decode else PREFILL_STAGES
        stages = {} if stage_count is None else {"num_stages": stage_count}
        part = stat = out  # unused unless the keys are split
        if splits > 1:
            part = torch.empty(tiles * Hkv * splits * rows, block_d, dtype=torch.float32, device=q.device)
            stat = torch.empty(tiles * Hkv * splits * rows, 2, dtype=torch.float32, device=q.device)
        heads_first = tl_.decode and tl_.heads_first
        _paged_attention_kernel[(Hkv, tiles, splits) if heads_first else (tiles, Hkv, splits)](
            q, k_cache, v_cache, out,
            bt, layout.context_lens, layout.query_starts, tl_.tile_seq, tl_.tile_q0,
            scale * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            bt.stride(0), block_size, part, stat, splits,
            GROUP=group, GROUP_P=_pow2(group), BLOCK_Q=tl_.block_q, BLOCK_N=block_n,
            HEAD_DIM=D, BLOCK_D=block_d, NATIVE_DOT=native, SPLIT=splits > 1, HEADS_FIRST=heads_first,
            num_warps=warps, **stages,
        )
        if splits > 1:
            _merge_splits_kernel[(tiles, Hkv)](
                part, stat, out, layout.query_starts, tl_.tile_seq, tl_.tile_q0, out.stride(0), out.stride(1), splits,
                GROUP=group, GROUP_P=_pow2(group), BLOCK_Q=tl_.block_q, HEAD_DIM=D, BLOCK_D=block_d, num_warps=4,
            )
    return out
