"""Triton segmented shrink and expand kernels over a LaunchPlan tile list.

Owns the Triton fast path of :func:`mlora.kernels.add_lora_slices` (and so of
``add_lora``, its one-slice case). For slice ``j`` of ``n`` (q/k/v or
gate/up share one launch), tile ``i`` with slot ``s`` and grouped rows ``u``::

    shrink:  zp[k, u, j*R : j*R + ranks[j,s]] = x[g[u], K_k] @ lora_a[s, j, :ranks[j,s], K_k].T   (fp32)
    expand:  y[g[u], off_j : off_j + w_j]   += scales[j,s] * (sum_k zp[k, u, j*R :][:ranks[j,s]])
                                                 @ lora_b[s, off_j : off_j + w_j, :ranks[j,s]].T
    rows outside the plan (base-only rows) are never touched.

Local kernel ABI (spec 0x01G), recorded here and in ``KERNEL_ABI``:
  * A bank ``[S, n, R, d_in]`` and B bank ``[S, sum(w_j), R]``, row-major, the
    logical orientation of PEFT checkpoints; slice ``j`` of B is the row block
    ``[off_j, off_j + w_j)``; ranks and scales are ``[n, S]`` tables; the
    scale multiplies the summed z in fp32 before the expand dot (never folded
    into B).
  * Indexed rows: x and y stay in scheduler order; the LaunchPlan's
    ``sorted_rows`` is the row-address vector.
  * Split-K shrink: ``SPLIT`` programs each reduce one contiguous chunk of
    d_in into their own fp32 partial ``zp[k]``; expand sums the partials in a
    fixed order (deterministic: no atomics). Decode-like batches (few rows
    per slot) get enough programs to stream the factors at full bandwidth.
  * Tensor cores where the inputs allow it: the shrink dot runs on 16-bit
    tensor cores when x and A share a 16-bit dtype, the expand dot when B is
    16-bit (z is rounded to B's dtype, as PEFT's own bf16 forward rounds it);
    fp32 operands use IEEE fp32 dots (never TF32). Accumulation is fp32.

Variable rank inside one launch: a shrink rank tile at or beyond ``ranks[j,s]``
exits at once, and every load of z, A or B past the true rank is masked (never
issued), so padded tails cost no bytes and may hold NaN.

Launch grids depend only on the LaunchPlan's capacity and the bank shape:
shrink ``(tile_capacity, n * rank tiles, SPLIT)``, expand ``(tile_capacity,
column groups of all slices)`` where each expand program keeps its tile's z in
registers and streams ``GROUP_TILES`` column tiles; programs past
``num_tiles`` exit. Together with no host synchronisation this makes a call
capturable in a CUDA graph. Launch defaults come from ``scripts/kernel_sweep.py``
on the H200 (BENCHMARKS.md); see docs/kernels.md.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import LaunchPlan

# The CPU interpreter mis-computes 16-bit tl.dot; there the fp32 path runs
# (GPU runs of the same tests cover the native path).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

KERNEL_ABI = "mlora-sgmv-v1: A[S,n,R,d_in] B[S,sum(w),R] row-major; ranks/scales [n,S]; fp32 split-K partials; scale on z in fp32 before the expand"

_NUM_SMS: dict[int, int] = {}
_CONFIGS: dict[tuple, dict] = {}


@triton.jit
def _tile(pid_t, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M: tl.constexpr):
    """(slot, grouped rows u, row mask, scheduler rows) of tile ``pid_t``."""
    slot = tl.load(tile_slot_ptr + pid_t)
    u0 = tl.load(tile_start_ptr + pid_t)
    u1 = tl.load(tile_end_ptr + pid_t)
    u = u0 + tl.arange(0, BLOCK_M)
    m_ok = u < u1
    rows = tl.load(rows_ptr + u, mask=m_ok, other=0).to(tl.int64)
    return slot, u.to(tl.int64), m_ok, rows


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, zp_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr, ranks_ptr,
    d_in, R, S, k_per_split,
    stride_xt, stride_as, stride_aj, stride_ar, stride_zk, stride_zu,
    RANK_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    RANK_CLASS: tl.constexpr, NATIVE_DOT: tl.constexpr,
):
    pid_t = tl.program_id(0)
    if pid_t >= tl.load(num_tiles_ptr):
        return
    pid_r = tl.program_id(1)
    j = pid_r // RANK_TILES
    r0 = (pid_r % RANK_TILES) * BLOCK_R
    slot, u, m_ok, rows = _tile(pid_t, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M)
    rank = tl.load(ranks_ptr + j * S + slot)
    if r0 >= rank:
        return
    if BLOCK_R > RANK_CLASS:  # narrow path for low-rank slots in a wide bank (mixed ranks)
        if rank <= RANK_CLASS:
            _shrink_rows(x_ptr, a_ptr, zp_ptr, slot, u, m_ok, rows, rank, j, r0, d_in, R, k_per_split,
                         stride_xt, stride_as, stride_aj, stride_ar, stride_zk, stride_zu,
                         BLOCK_M, RANK_CLASS, BLOCK_K, NATIVE_DOT)
        else:
            _shrink_rows(x_ptr, a_ptr, zp_ptr, slot, u, m_ok, rows, rank, j, r0, d_in, R, k_per_split,
                         stride_xt, stride_as, stride_aj, stride_ar, stride_zk, stride_zu,
                         BLOCK_M, BLOCK_R, BLOCK_K, NATIVE_DOT)
    else:
        _shrink_rows(x_ptr, a_ptr, zp_ptr, slot, u, m_ok, rows, rank, j, r0, d_in, R, k_per_split,
                     stride_xt, stride_as, stride_aj, stride_ar, stride_zk, stride_zu,
                     BLOCK_M, BLOCK_R, BLOCK_K, NATIVE_DOT)


@triton.jit
def _shrink_rows(
    x_ptr, a_ptr, zp_ptr, slot, u, m_ok, rows, rank, j, r0, d_in, R, k_per_split,
    stride_xt, stride_as, stride_aj, stride_ar, stride_zk, stride_zu,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, NATIVE_DOT: tl.constexpr,
):
    """z partial of one tile, rank columns [r0, r0 + BLOCK_R) clipped to the true rank."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    k_lo = tl.program_id(2) * k_per_split
    a_base = a_ptr + slot.to(tl.int64) * stride_as + j * stride_aj
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < d_in
        xt = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0,
                     eviction_policy="evict_last")
        if NATIVE_DOT:  # x and A share a 16-bit dtype: tensor-core dot, fp32 accumulation
            acc += tl.dot(xt, tl.trans(at))
        else:  # fp32 (or mixed) inputs: exact fp32 products, no TF32 rounding
            acc += tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), input_precision="ieee")
    zp = zp_ptr + tl.program_id(2) * stride_zk + u[:, None] * stride_zu + (j * R + offs_r)[None, :]
    tl.store(zp, acc, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    zp_ptr, b_ptr, y_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    ranks_ptr, scales_ptr, col_meta_ptr,
    R, S,
    stride_zk, stride_zu, stride_bs, stride_bn, stride_yt,
    N_SLICES: tl.constexpr, SPLIT: tl.constexpr, GROUP_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, RANK_CLASS: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):
    """One row tile x one group of GROUP_TILES column tiles of one slice: the
    tile's z (split partials summed once, in fixed order) stays in registers
    while the group's columns stream B and y."""
    pid_t = tl.program_id(0)
    if pid_t >= tl.load(num_tiles_ptr):
        return
    pid_g = tl.program_id(1)
    # col_meta = [first column group of slice 0..n, first column of slice 0..n]
    j = 0
    for jj in tl.static_range(1, N_SLICES):
        if pid_g >= tl.load(col_meta_ptr + jj):
            j = jj
    slot, u, m_ok, rows = _tile(pid_t, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M)
    rank = tl.load(ranks_ptr + j * S + slot)
    if rank == 0:
        return
    n_lo = tl.load(col_meta_ptr + N_SLICES + 1 + j)
    n_hi = tl.load(col_meta_ptr + N_SLICES + 2 + j)
    n_first = n_lo + (pid_g - tl.load(col_meta_ptr + j)) * (GROUP_TILES * BLOCK_N)
    # narrow code path for low-rank slots in a wide bank (mixed ranks): their
    # z, B tiles and dots are RANK_CLASS wide instead of BLOCK_R
    if BLOCK_R > RANK_CLASS:
        if rank <= RANK_CLASS:
            _expand_columns(zp_ptr, b_ptr, y_ptr, scales_ptr, slot, u, m_ok, rows, rank, j, S, R, n_first, n_hi,
                            stride_zk, stride_zu, stride_bs, stride_bn, stride_yt,
                            SPLIT, GROUP_TILES, BLOCK_N, RANK_CLASS, NATIVE_DOT)
        else:
            _expand_columns(zp_ptr, b_ptr, y_ptr, scales_ptr, slot, u, m_ok, rows, rank, j, S, R, n_first, n_hi,
                            stride_zk, stride_zu, stride_bs, stride_bn, stride_yt,
                            SPLIT, GROUP_TILES, BLOCK_N, BLOCK_R, NATIVE_DOT)
    else:
        _expand_columns(zp_ptr, b_ptr, y_ptr, scales_ptr, slot, u, m_ok, rows, rank, j, S, R, n_first, n_hi,
                        stride_zk, stride_zu, stride_bs, stride_bn, stride_yt,
                        SPLIT, GROUP_TILES, BLOCK_N, BLOCK_R, NATIVE_DOT)


@triton.jit
def _expand_columns(
    zp_ptr, b_ptr, y_ptr, scales_ptr, slot, u, m_ok, rows, rank, j, S, R, n_first, n_hi,
    stride_zk, stride_zu, stride_bs, stride_bn, stride_yt,
    SPLIT: tl.constexpr, GROUP_TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):
    """The expand of one tile over its column group, z and B BLOCK_R wide (>= rank)."""
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank  # the true rank: z and B past it are never read
    zmask = m_ok[:, None] & r_ok[None, :]
    zaddr = zp_ptr + u[:, None] * stride_zu + (j * R + offs_r)[None, :]
    z = tl.load(zaddr, mask=zmask, other=0.0)
    for k in tl.static_range(1, SPLIT):  # fixed order: deterministic
        z += tl.load(zaddr + k * stride_zk, mask=zmask, other=0.0)
    z = z * tl.load(scales_ptr + j * S + slot)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    if NATIVE_DOT:
        zd = z.to(b_ptr.dtype.element_ty)
    else:
        zd = z
    for g in range(0, GROUP_TILES):
        offs_n = n_first + g * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_hi
        yp = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        # y streams through once: issue its load first (its latency overlaps B and the
        # dot) and keep it out of L2's way; B stays cached for the slot's other tiles
        old = tl.load(yp, mask=mask, other=0.0, eviction_policy="evict_first")
        bt = tl.load(b_base + offs_n[:, None] * stride_bn + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                     other=0.0, eviction_policy="evict_last")
        if NATIVE_DOT:
            acc = tl.dot(zd, tl.trans(bt))
        else:
            acc = tl.dot(zd, tl.trans(bt.to(tl.float32)), input_precision="ieee")
        tl.store(yp, (old.to(tl.float32) + acc).to(old.dtype), mask=mask, eviction_policy="evict_first")


# Plain-Python helpers: triton.cdiv / next_power_of_2 are JIT functions whose
# Python calls cost microseconds each, which the host path cannot afford.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, 1 << (max(n, 1) - 1).bit_length()))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def launch_config(tiles: int, n_slices: int, R: int, d_in: int, widths, device: torch.device, native: bool,
                  tiles_bm: int = 16, **override) -> dict:
    """Block sizes, warps and split factor for a launch; depends only on static
    shapes. ``override`` replaces any entry (used by the benchmark's sweeps)."""
    block_r = override.get("block_r") or _pow2(R, 16, 64)
    block_k = override.get("block_k") or (128 if not _INTERPRET else _pow2(d_in, 16, 32))
    rank_tiles = _cdiv(R, block_r)
    # split d_in until the shrink launch has about ``waves`` programs per SM,
    # keeping chunks of at least 2 K-blocks
    want = override.get("waves", 4) * _num_sms(device)
    have = tiles * n_slices * rank_tiles
    max_split = max(1, d_in // (2 * block_k))
    split = override.get("split") or max(1, min(max_split, _cdiv(want, have)))
    k_per_split = _cdiv(_cdiv(d_in, split), block_k) * block_k
    split = _cdiv(d_in, k_per_split)
    cfg = dict(
        block_r=block_r, block_k=block_k, rank_tiles=rank_tiles, split=split, k_per_split=k_per_split,
        block_n=override.get("block_n") or _pow2(min(widths), 16, 64 if tiles_bm >= 32 else 128), block_r_expand=_pow2(R, 16, 1 << 20),
        shrink_warps=4, shrink_stages=4, expand_warps=4, expand_stages=2, rank_class=16,
    )
    # column groups: each expand program loads its tile's z once and streams
    # up to 8 column tiles, while keeping about ``expand_waves`` programs per SM
    col_tiles = sum(_cdiv(w, cfg["block_n"]) for w in widths)
    programs = tiles * col_tiles
    cfg["group_tiles"] = override.get("group_tiles") or max(
        1, min(8, programs // (override.get("expand_waves", 4) * _num_sms(device))))
    cfg.update({k: v for k, v in override.items() if k in cfg and k not in ("split", "block_r", "block_k", "block_n")})
    return cfg


def add_lora_slices_triton(y, x, lora_a, lora_b, lp: LaunchPlan, ranks, scales, widths, config=None):
    """Shrink then expand over ``lp``; y updated in place and returned. No host
    synchronisation: capturable in a CUDA graph. Callers have checked shapes,
    dtypes, devices and value ranges (add_lora_slices). ``config`` overrides
    entries of :func:`launch_config`."""
    S, n, R, d_in = lora_a.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    assert y.stride(1) == 1, "y must be row-major"
    native_a = x.dtype == lora_a.dtype and x.dtype in (torch.bfloat16, torch.float16) and not _INTERPRET
    native_b = lora_b.dtype in (torch.bfloat16, torch.float16) and not _INTERPRET
    key = (lp.tile_capacity, lp.row_capacity, n, R, d_in, tuple(widths), str(x.device), native_a, lp.block_m)
    cfg = _CONFIGS.get(key) if config is None else None
    if cfg is None:
        cfg = launch_config(lp.tile_capacity, n, R, d_in, widths, x.device, native_a, lp.block_m, **(config or {}))
        if config is None:
            _CONFIGS[key] = cfg
    bm = lp.block_m
    zp = torch.empty((cfg["split"], lp.row_capacity, n * R), dtype=torch.float32, device=x.device)
    _shrink_kernel[(lp.tile_capacity, n * cfg["rank_tiles"], cfg["split"])](
        x, lora_a, zp, lp.sorted_rows, lp.tile_slot, lp.tile_start, lp.tile_end, lp.num_tiles, ranks,
        d_in, R, S, cfg["k_per_split"],
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), zp.stride(0), zp.stride(1),
        RANK_TILES=cfg["rank_tiles"], BLOCK_M=bm, BLOCK_R=cfg["block_r"], BLOCK_K=cfg["block_k"],
        RANK_CLASS=cfg["rank_class"], NATIVE_DOT=native_a, num_warps=cfg["shrink_warps"], num_stages=cfg["shrink_stages"],
    )
    bn, gt = cfg["block_n"], cfg["group_tiles"]
    col_groups = [0]
    col_offs = [0]
    for w in widths:
        col_groups.append(col_groups[-1] + _cdiv(w, bn * gt))
        col_offs.append(col_offs[-1] + w)
    col_meta = _col_meta(tuple(col_groups + col_offs), x.device)
    _expand_kernel[(lp.tile_capacity, col_groups[-1])](
        zp, lora_b, y, lp.sorted_rows, lp.tile_slot, lp.tile_start, lp.tile_end, lp.num_tiles,
        ranks, scales, col_meta,
        R, S,
        zp.stride(0), zp.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        N_SLICES=n, SPLIT=cfg["split"], GROUP_TILES=gt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=cfg["block_r_expand"],
        RANK_CLASS=cfg["rank_class"], NATIVE_DOT=native_b,
        num_warps=cfg["expand_warps"], num_stages=cfg["expand_stages"],
    )
    return y


_COL_META: dict[tuple, torch.Tensor] = {}


def _col_meta(values: tuple, device: torch.device) -> torch.Tensor:
    """Slice column metadata as a cached device tensor (created once per shape, so
    a call inside CUDA graph capture finds it already resident)."""
    key = (values, str(device))
    t = _COL_META.get(key)
    if t is None:
        t = torch.tensor(values, dtype=torch.int32, device=device)
        _COL_META[key] = t
    return t
