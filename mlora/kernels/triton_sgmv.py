"""Triton segmented shrink and expand kernels over a LaunchPlan tile list.

Owns the Triton fast path of :func:`mlora.kernels.add_lora_slices` (and so of
``add_lora``, its one-slice case). For slice ``j`` of ``n`` (q/k/v or
gate/up share one launch), tile ``i`` with slot ``s`` and grouped rows ``u``::

    shrink:  zp[k, u, j*R : j*R + ranks[j,s]] = x[g[u], K_k] @ lora_a[s, j, :ranks[j,s], K_k].T   (fp32)
    expand:  y[g[u], off_j : off_j + w_j]   += scales[j,s] * (sum_k zp[k, u, j*R :][:ranks[j,s]])
                                                 @ lora_b[s, off_j : off_j + w_j, :ranks[j,s]].T
    rows outside the plan (base-only rows) are never touched.

A caller's ``reduce_z`` (a tensor-parallel rank's all-reduce of the row-parallel o and down
shrinks) runs on the summed fp32 z between the two launches (``_shrink_expand``).

Local kernel ABI (docs/kernels.md, Local kernel ABI), recorded here and in ``KERNEL_ABI``:
  * A bank ``[S, n, R, d_in]`` and B bank ``[S, sum(w_j), R]``, row-major, the
    logical orientation of PEFT checkpoints; slice ``j`` of B is the row block
    ``[off_j, off_j + w_j)`` and it writes y's columns from ``out_offsets[j]``
    (default ``off_j``); ranks and scales are ``[n, S]`` tables of any strides
    (the same for both: banks keep them slot-major, ``[S, L, n]``, and pass a
    layer's transposed view); the
    scale multiplies the summed z in fp32 before the expand dot (never folded
    into B).
  * Indexed rows: x and y stay in scheduler order; the LaunchPlan's
    ``sorted_rows`` is the row-address vector.
  * Split-K shrink: ``split`` programs each reduce one contiguous chunk of
    d_in into their own fp32 partial ``zp[k]``; the last of them to arrive
    (an acquire-release arrival counter per tile and rank tile, reset by that
    program) sums the partials in a fixed order (chunks of ``SUM_CHUNK`` loaded
    together and summed as a tree, chunks in sequence) into ``zp[0]``, which is
    all the expand reads (deterministic: the atomics decide who sums, never the
    order). Decode-like batches (few rows per slot) get enough
    programs to stream the factors at full bandwidth.
  * Programmatic dependent launch on Hopper and later (``USE_PDL``): the
    shrink lets the expand launch at once; the expand loads everything the
    shrink does not write (plan, rank, scale, its first B and y tiles) and
    then waits on the grid dependency before loading z. The shrink itself is
    launched normally, so whatever ran before it on the stream has completed.
  * Tensor cores where the inputs allow it: the shrink dot runs on 16-bit
    tensor cores when x and A share a 16-bit dtype, the expand dot when B is
    16-bit (z is rounded to B's dtype, as PEFT's own bf16 forward rounds it);
    fp32 operands use IEEE fp32 dots (never TF32). Accumulation is fp32.

Variable rank inside one launch: a shrink rank tile at or beyond ``ranks[j,s]``
exits at once, and every load of z, A or B past the true rank is masked (never
issued), so padded tails cost no bytes and may hold NaN.

Bundles (``add_bundle_slices_triton``; docs/design.md, Bundle and three-stage operator): the
same two launches with two
compile-time additions, off for plain LoRA (those variants compile as before):
``BANK_ROWS`` reads A and B row ``bank_rows[j, s]`` (an ``[n, S]`` table with the
strides of ``ranks``) instead of slot ``s``, so a bank holds a group's cluster bases
(``V_c^T``, ``U_c``) and the slot stays the member; ``CORE`` multiplies the tile's
summed z by the slot's core of slice j in the expand program, before its column
loop (``z @ core^T`` for JD-Full, ``z * core`` for JD-Diag, fp32), in place of the
scale.

Launch grids depend only on the LaunchPlan's capacity and the bank shape:
shrink ``(tile_capacity, n * rank tiles, split)``, expand ``(tile_capacity,
column groups of all slices)`` where each expand program keeps its tile's z in
registers and streams ``group_tiles`` column tiles; programs past
``num_tiles`` exit. Together with no host synchronisation this makes a call
capturable in a CUDA graph. ``split`` and ``group_tiles`` are runtime arguments
(unspecialised): they change with the batch size, and as compile-time constants
every new batch size would compile new kernels inside a job. Launch defaults come from
sweeps on the H200 (figures in BENCHMARKS.md); see docs/kernels.md.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mlora.kernels.launch import LaunchPlan
from mlora.kernels.pitch import check_pitched
from mlora.kernels.plan import PlanError

# The CPU interpreter mis-computes 16-bit tl.dot; there the fp32 path runs
# (GPU runs of the same tests cover the native path).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

KERNEL_ABI = "mlora-sgmv-v4: A[S,n,R,d_in] B[S,sum(w),R] row-major; per-slice y column offsets; ranks/scales [n,S] strided; fp32 split-K partials summed by the last split; scale on z in fp32 before the expand; PDL expand; bundles: [n,S] slot->bank-row map, core on z in the expand"

_NUM_SMS: dict[int, int] = {}
_CONFIGS: dict[tuple, dict] = {}


@triton.jit
def _tile(pid_t, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr, BLOCK_M: tl.constexpr):
    """(valid, slot, grouped rows u, row mask, scheduler rows) of tile ``pid_t``.

    The tile count and the tile's metadata are loaded together (one memory round
    trip, not two: entries past ``num_tiles`` are in bounds, merely stale), then
    the tile's rows."""
    n_tiles = tl.load(num_tiles_ptr)
    slot = tl.load(tile_slot_ptr + pid_t)
    u0 = tl.load(tile_start_ptr + pid_t)
    u1 = tl.load(tile_end_ptr + pid_t)
    valid = pid_t < n_tiles
    u = u0 + tl.arange(0, BLOCK_M)
    m_ok = u < tl.where(valid, u1, u0)  # no rows for a tile past the count
    rows = tl.load(rows_ptr + u, mask=m_ok, other=0).to(tl.int64)
    return valid, slot, u.to(tl.int64), m_ok, rows


@triton.jit
def _tile_rank(pid_t, j, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr, ranks_ptr,
               stride_rj, stride_rs, BLOCK_M: tl.constexpr):
    """:func:`_tile`'s (slot, grouped rows u, row mask, scheduler rows) of tile ``pid_t`` and
    the slot's true rank for slice ``j``: 0 for a tile past the count (not loaded), so a
    program whose rank is 0 (or at most its first rank column) has nothing to do."""
    valid, slot, u, m_ok, rows = _tile(pid_t, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
                                       BLOCK_M)
    rank = tl.load(ranks_ptr + j * stride_rj + slot * stride_rs, mask=valid, other=0)
    return slot, u, m_ok, rows, rank


# per-program scalar metadata (ranks, scales, bank rows, the tile count): never specialised on their
# 16-byte alignment, which varies between a bank's modules and buys nothing for one scalar load;
# each specialisation would be one more compile, some inside a job's timed part
@triton.jit(do_not_specialize=["split", "ranks_ptr", "bank_rows_ptr"])
def _shrink_kernel(
    x_ptr, a_ptr, zp_ptr, cnt_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr, ranks_ptr,
    bank_rows_ptr,
    d_in, R, stride_rj, stride_rs, k_per_split, split,
    stride_xt, stride_as, stride_aj, stride_ar, stride_zk, stride_zu,
    RANK_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    RANK_CLASS: tl.constexpr, NATIVE_DOT: tl.constexpr, USE_PDL: tl.constexpr, SPLIT_K: tl.constexpr,
    SUM_CHUNK: tl.constexpr, BANK_ROWS: tl.constexpr,
):
    """z partials of one (tile, slice, rank tile, split) program. With ``BANK_ROWS`` the A row
    read is ``bank_rows[j, slot]`` (same strides as ``ranks``), else the slot itself."""
    if USE_PDL:  # the expand may launch now: it reads z only after its grid-dependency wait
        tl.extra.cuda.gdc_launch_dependents()
    pid_t = tl.program_id(0)
    pid_r = tl.program_id(1)
    j = pid_r // RANK_TILES
    r0 = (pid_r % RANK_TILES) * BLOCK_R
    slot, u, m_ok, rows, rank = _tile_rank(pid_t, j, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
                                           num_tiles_ptr, ranks_ptr, stride_rj, stride_rs, BLOCK_M)
    if r0 >= rank:  # a tile past the count has rank 0
        return
    cnt = cnt_ptr + pid_t * tl.num_programs(1) + pid_r  # arrivals of this (tile, rank tile)'s splits
    a_row = slot
    if BANK_ROWS:  # a bundle's cluster basis: the slot's row of the A bank for slice j
        a_row = tl.load(bank_rows_ptr + j * stride_rj + slot * stride_rs)
    if BLOCK_R > RANK_CLASS:  # narrow path for low-rank slots in a wide bank (mixed ranks)
        if rank <= RANK_CLASS:
            _shrink_rows(x_ptr, a_ptr, zp_ptr, cnt, a_row, u, m_ok, rows, rank, j, r0, d_in, R, k_per_split,
                         stride_xt, stride_as, stride_aj, stride_ar, stride_zk, stride_zu,
                         split, BLOCK_M, RANK_CLASS, BLOCK_K, NATIVE_DOT, SPLIT_K, SUM_CHUNK)
        else:
            _shrink_rows(x_ptr, a_ptr, zp_ptr, cnt, a_row, u, m_ok, rows, rank, j, r0, d_in, R, k_per_split,
                         stride_xt, stride_as, stride_aj, stride_ar, stride_zk, stride_zu,
                         split, BLOCK_M, BLOCK_R, BLOCK_K, NATIVE_DOT, SPLIT_K, SUM_CHUNK)
    else:
        _shrink_rows(x_ptr, a_ptr, zp_ptr, cnt, a_row, u, m_ok, rows, rank, j, r0, d_in, R, k_per_split,
                     stride_xt, stride_as, stride_aj, stride_ar, stride_zk, stride_zu,
                     split, BLOCK_M, BLOCK_R, BLOCK_K, NATIVE_DOT, SPLIT_K, SUM_CHUNK)


@triton.jit
def _shrink_rows(
    x_ptr, a_ptr, zp_ptr, cnt, a_row, u, m_ok, rows, rank, j, r0, d_in, R, k_per_split,
    stride_xt, stride_as, stride_aj, stride_ar, stride_zk, stride_zu, split,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, NATIVE_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr, SUM_CHUNK: tl.constexpr,
):
    """z partial of one tile, rank columns [r0, r0 + BLOCK_R) clipped to the true rank, from
    row ``a_row`` of the A bank (the tile's slot, or its bank row).

    With ``SPLIT_K`` (``split > 1``) the last of the tile's ``split`` programs to
    arrive (an acquire-release counter) sums the ``split`` partials in the fixed
    order (chunks of ``SUM_CHUNK`` partials loaded together, each summed in a fixed
    tree, the chunks in order) into partial 0 and resets the counter: the result
    does not depend on which program arrives last, and the expand reads one z, not
    ``split``. ``split`` is a runtime argument, not a compile-time constant: each
    batch size gets its own split, and a constant would compile a kernel per
    value (seconds of Triton compiles inside a job)."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    k_lo = tl.program_id(2) * k_per_split
    a_base = a_ptr + a_row.to(tl.int64) * stride_as + j * stride_aj
    acc = _shrink_acc(x_ptr, a_base, m_ok, rows, offs_r, r_ok, k_lo, k_lo + k_per_split, d_in, stride_xt, stride_ar,
                      BLOCK_M, BLOCK_R, BLOCK_K, NATIVE_DOT)
    zmask = m_ok[:, None] & r_ok[None, :]
    z0 = zp_ptr + u[:, None] * stride_zu + (j * R + offs_r)[None, :]
    tl.store(z0 + tl.program_id(2) * stride_zk, acc, mask=zmask)
    if SPLIT_K:
        tl.debug_barrier()  # every thread's partial is written before the release below
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == split - 1:
            # partials in chunks of SUM_CHUNK: one chunk's loads are independent and in flight
            # together (one load per partial waits for each L2 round trip in turn);
            # chunks are added in order and each chunk sums in a fixed tree, so the result is
            # the same on every call. .cg: from L2, never a stale L1 line.
            offs_c = tl.arange(0, SUM_CHUNK)
            z = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for c0 in range(0, split, SUM_CHUNK):
                kk = c0 + offs_c
                part = tl.load(z0[None, :, :] + kk[:, None, None] * stride_zk,
                               mask=(kk < split)[:, None, None] & zmask[None, :, :], other=0.0, cache_modifier=".cg")
                z += tl.sum(part, axis=0)
            tl.store(z0, z, mask=zmask)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call (or graph replay)


@triton.jit
def _shrink_acc(x_ptr, a_base, m_ok, rows, offs_r, r_ok, k_lo, k_hi, d_in, stride_xt, stride_ar,
                BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, NATIVE_DOT: tl.constexpr):
    """fp32 ``x[rows, k] @ A[offs_r, k].T`` over ``k`` in ``[k_lo, k_hi)`` (clipped to ``d_in``),
    ``[BLOCK_M, BLOCK_R]``, with ``a_base`` the slot's (or bank row's) slice of the A bank; rows
    outside ``m_ok`` and rank rows outside ``r_ok`` read as zero (never loaded). A is loaded
    ``evict_last``: it stays in L2 for the slot's other tiles and column groups."""
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < d_in
        xt = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0,
                     eviction_policy="evict_last")
        if NATIVE_DOT:  # x and A share a 16-bit dtype: tensor-core dot, fp32 accumulation
            acc += tl.dot(xt, tl.trans(at))
        else:  # fp32 (or mixed) inputs: exact fp32 products, no TF32 rounding
            acc += tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), input_precision="ieee")
    return acc


@triton.jit
def _slice_of(pid_g, G1, G2, G3, O1, O2, O3, O4, D0, D1, D2, D3, N_SLICES: tl.constexpr):
    """(slice j, its first column group, its first and end B rows, its y column shift) of group ``pid_g``:
    ``G1..G3`` are the first groups of slices 1..3, ``O1..O4`` the first B rows of slices 1..4 (O_n = the
    total width), ``D0..D3`` each slice's y column = B row + D_j."""
    j = 0
    g_lo = 0
    n_lo = 0
    n_hi = O1
    dy = D0
    if N_SLICES > 1:
        if pid_g >= G1:
            j, g_lo, n_lo, n_hi, dy = 1, G1, O1, O2, D1
    if N_SLICES > 2:
        if pid_g >= G2:
            j, g_lo, n_lo, n_hi, dy = 2, G2, O2, O3, D2
    if N_SLICES > 3:
        if pid_g >= G3:
            j, g_lo, n_lo, n_hi, dy = 3, G3, O3, O4, D3
    return j, g_lo, n_lo, n_hi, dy


@triton.jit(do_not_specialize=["group_tiles", "G1", "G2", "G3", "num_tiles_ptr", "ranks_ptr", "scales_ptr",
                            "bank_rows_ptr"])  # the metadata: see _shrink_kernel
def _expand_kernel(
    zp_ptr, b_ptr, y_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    ranks_ptr, scales_ptr, bank_rows_ptr, core_ptr,
    R, stride_rj, stride_rs, G1, G2, G3, O1, O2, O3, O4, D0, D1, D2, D3, group_tiles,
    stride_zu, stride_bs, stride_bn, stride_yt, stride_cs, stride_cj, stride_cr, stride_ck,
    N_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, RANK_CLASS: tl.constexpr,
    NATIVE_DOT: tl.constexpr, USE_PDL: tl.constexpr, BANK_ROWS: tl.constexpr, CORE: tl.constexpr,
    B_PITCHED: tl.constexpr = False,
):
    """One row tile x one group of ``group_tiles`` column tiles of one slice (a runtime
    argument, like the shrink's ``split``: one compiled kernel for every batch size): the
    tile's z (split partials summed once, in fixed order) stays in registers
    while the group's columns stream B and y.

    Slice metadata are scalars (no loads): ``G1..G3`` are the first column
    groups of slices 1..3, ``O1..O4`` the first columns (rows of B) of slices
    1..4 (O_n = sum of widths), ``D0..D3`` each slice's shift of its columns in
    y (y column = B row + D_j; all 0 when the slices fill y side by side). With ``USE_PDL`` the kernel is launched as a programmatic
    dependent of the shrink: everything it reads that the shrink does not write
    (plan, ranks, scales, B, the first y tile) is loaded before the grid-
    dependency wait, z after it.

    Bundle options (compile-time; off: the plain LoRA expand): ``BANK_ROWS`` reads B
    row ``bank_rows[j, slot]`` instead of the slot's; ``CORE`` (1: JD-Diag, 2: JD-Full)
    multiplies the tile's z by the slot's core of slice j (``core_ptr`` with strides
    ``stride_cs, stride_cj, stride_cr, stride_ck``) in place of the scale.

    ``B_PITCHED``: B is rank-pitched (``mlora.kernels.pitch``; only launched with R a multiple
    of 8 and ``stride_bn == R``): slice j's rows start at element ``n_lo * R`` of the slot and
    step by the slot's pitch (its rank rounded up to 8) instead of R."""
    pid_t = tl.program_id(0)
    pid_g = tl.program_id(1)
    j, g_lo, n_lo, n_hi, dy = _slice_of(pid_g, G1, G2, G3, O1, O2, O3, O4, D0, D1, D2, D3, N_SLICES)
    y_ptr += dy  # this slice's columns of y (row stride unchanged)
    slot, u, m_ok, rows, rank = _tile_rank(pid_t, j, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
                                           num_tiles_ptr, ranks_ptr, stride_rj, stride_rs, BLOCK_M)
    if rank == 0:  # a tile past the count, or a slot that does not adapt slice j
        return
    if CORE == 0:
        scale = tl.load(scales_ptr + j * stride_rj + slot * stride_rs)
        core_base = core_ptr
    else:  # a bundle: the core carries the member's magnitude (scale 1)
        scale = 1.0
        core_base = core_ptr + slot.to(tl.int64) * stride_cs + j * stride_cj
    b_row = slot
    if BANK_ROWS:
        b_row = tl.load(bank_rows_ptr + j * stride_rj + slot * stride_rs)
    n_first = n_lo + (pid_g - g_lo) * (group_tiles * BLOCK_N)
    if B_PITCHED:  # row n of slice j at n_lo * R + (n - n_lo) * pitch = n_lo * (R - pitch) + n * pitch
        pitch = _rank_round8(rank, R)
        b_ptr += n_lo * (R - pitch)
        stride_bn = pitch
    # narrow code path for low-rank slots in a wide bank (mixed ranks): their
    # z, B tiles and dots are RANK_CLASS wide instead of BLOCK_R
    if BLOCK_R > RANK_CLASS:
        if rank <= RANK_CLASS:
            _expand_columns(zp_ptr, b_ptr, y_ptr, scale, b_row, core_base, u, m_ok, rows, rank, j, R, n_first, n_hi,
                            stride_zu, stride_bs, stride_bn, stride_yt, stride_cr, stride_ck,
                            group_tiles, BLOCK_N, RANK_CLASS, NATIVE_DOT, USE_PDL, CORE)
        else:
            _expand_columns(zp_ptr, b_ptr, y_ptr, scale, b_row, core_base, u, m_ok, rows, rank, j, R, n_first, n_hi,
                            stride_zu, stride_bs, stride_bn, stride_yt, stride_cr, stride_ck,
                            group_tiles, BLOCK_N, BLOCK_R, NATIVE_DOT, USE_PDL, CORE)
    else:
        _expand_columns(zp_ptr, b_ptr, y_ptr, scale, b_row, core_base, u, m_ok, rows, rank, j, R, n_first, n_hi,
                        stride_zu, stride_bs, stride_bn, stride_yt, stride_cr, stride_ck,
                        group_tiles, BLOCK_N, BLOCK_R, NATIVE_DOT, USE_PDL, CORE)


@triton.jit
def _expand_columns(
    zp_ptr, b_ptr, y_ptr, scale, b_row, core_base, u, m_ok, rows, rank, j, R, n_first, n_hi,
    stride_zu, stride_bs, stride_bn, stride_yt, stride_cr, stride_ck, group_tiles,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    NATIVE_DOT: tl.constexpr, USE_PDL: tl.constexpr, CORE: tl.constexpr,
):
    """The expand of one tile over its column group from row ``b_row`` of the B bank, z and
    B BLOCK_R wide (>= rank). ``CORE`` 0: z times ``scale``; 1 / 2: z times the core at
    ``core_base`` (loaded before the grid-dependency wait: the shrink does not write it).

    Narrow z (BLOCK_R <= 32): column tile g+1's B and y are loaded while tile
    g's dot and store run (register double buffering), and tile 0's before z
    is available. Wide z: one tile at a time (two 64-wide B tiles in registers
    spill), with only the plan metadata read before the wait."""
    offs_r = tl.arange(0, BLOCK_R)
    b_base = b_ptr + b_row.to(tl.int64) * stride_bs
    offs_n = n_first + tl.arange(0, BLOCK_N)
    mask = m_ok[:, None] & (offs_n < n_hi)[None, :]
    yp = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
    n_stop = tl.minimum(n_hi, n_first + group_tiles * BLOCK_N)  # end of this program's columns
    if BLOCK_R <= 32:
        # y streams through once (evict_first); B stays cached for the slot's other tiles
        old = tl.load(yp, mask=mask, other=0.0, eviction_policy="evict_first")
        bt = _b_tile(b_base, offs_n, offs_n < n_hi, offs_r, rank, R, stride_bn)
    if CORE != 0:
        core = _load_core(core_base, offs_r, rank, R, stride_cr, stride_ck, CORE)
    if USE_PDL:  # z is the shrink's output: wait for the shrink grid to finish and flush
        tl.extra.cuda.gdc_wait()
    z = _load_z(zp_ptr, u, m_ok, j, rank, R, stride_zu, BLOCK_R)
    if CORE == 0:
        z = z * scale
    else:
        z = _times_core(z, core, CORE)
    if NATIVE_DOT:
        zd = z.to(b_ptr.dtype.element_ty)
    else:
        zd = z
    if BLOCK_R <= 32:
        for g in range(0, group_tiles):
            offs_n2 = offs_n + BLOCK_N
            n_ok2 = offs_n2 < n_stop
            mask2 = m_ok[:, None] & n_ok2[None, :]
            yp2 = yp + BLOCK_N
            old2 = tl.load(yp2, mask=mask2, other=0.0, eviction_policy="evict_first")
            bt2 = _b_tile(b_base, offs_n2, n_ok2, offs_r, rank, R, stride_bn)
            _add_tile(yp, old, zd, bt, mask, NATIVE_DOT)
            offs_n, mask, yp, old, bt = offs_n2, mask2, yp2, old2, bt2
    else:
        _expand_group(zd, b_base, y_ptr, m_ok, rows, rank, R, n_first, n_hi, group_tiles, stride_bn, stride_yt,
                      BLOCK_N, BLOCK_R, NATIVE_DOT)


@triton.jit
def _expand_group(z, b_base, y_ptr, m_ok, rows, rank, R, n_first, n_hi, group_tiles, stride_bn, stride_yt,
                  BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, NATIVE_B: tl.constexpr):
    """``y[rows, c] += z @ B[c, :rank].T`` for the B rows ``c`` of ``group_tiles`` column tiles from
    ``n_first`` (clipped to ``n_hi``, the slice's end); ``y_ptr`` already shifted to the slice's columns."""
    offs_r = tl.arange(0, BLOCK_R)
    n_stop = tl.minimum(n_hi, n_first + group_tiles * BLOCK_N)
    for g in range(0, group_tiles):
        offs_n = n_first + g * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_stop
        mask = m_ok[:, None] & n_ok[None, :]
        yp = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
        old = tl.load(yp, mask=mask, other=0.0, eviction_policy="evict_first")
        bt = _b_tile(b_base, offs_n, n_ok, offs_r, rank, R, stride_bn)
        _add_tile(yp, old, z, bt, mask, NATIVE_B)


@triton.jit
def _load_z(zp_ptr, u, m_ok, j, rank, R, stride_zu, BLOCK_R: tl.constexpr):
    """fp32 z of slice ``j`` for the tile's grouped rows ``u`` (rows outside ``m_ok`` zero),
    ``[BLOCK_M, BLOCK_R]``: its columns past the rank were never written by the shrink, so they
    are loaded only within the rank's 16-byte vectors and zeroed (:func:`_rank_cols`)."""
    offs_r = tl.arange(0, BLOCK_R)
    r_load, r_ok = _rank_cols(offs_r, rank, R)
    z = tl.load(zp_ptr + u[:, None] * stride_zu + (j * R + offs_r)[None, :], mask=m_ok[:, None] & r_load[None, :],
                other=0.0)
    return tl.where(r_ok[None, :], z, 0.0)


@triton.jit
def _rank_cols(offs_r, rank, R):
    """(load mask, use mask) over a rank axis that is a tensor's contiguous one (B's and the
    cores' columns, z's). A load masked at the exact rank, a runtime value, cannot be vectorised:
    every element becomes its own 2- or 4-byte load. The load mask stops at the rank rounded up
    to 8 and clipped to the bank's physical rank ``R`` (never past a row of the tensor; a
    multiple of 8 still when R is one, the case where the rows are 16-byte aligned and vectors
    are possible at all), which Triton vectorises on; the use mask is the exact rank. A value in
    [rank, that) may be loaded (it lies in the 32-byte sector of the last true column: no extra
    DRAM traffic) and the caller replaces it by zero before use, so a NaN there never reaches y;
    ranks that are multiples of 8 load nothing past the rank."""
    return offs_r < _rank_round8(rank, R), offs_r < rank


@triton.jit
def _rank_round8(rank, R):
    """``rank`` rounded up to a multiple of 8 (whole 16-byte vectors of 16-bit values), at most
    ``R``: the load bound of :func:`_rank_cols` and a rank-pitched B row's pitch
    (``mlora.kernels.pitch.b_pitch``, launched only where R is a multiple of 8)."""
    return tl.minimum(tl.multiple_of((rank + 7) // 8 * 8, 8), R)


@triton.jit
def _b_tile(b_base, offs_n, n_ok, offs_r, rank, R, stride_bn):
    """The B tile ``[offs_n, offs_r]`` of one slot, zero for rows outside ``n_ok`` and for columns
    at or past ``rank``, in whole 16-byte loads (``_rank_cols``); B stays cached for the slot's
    other tiles (evict_last)."""
    r_load, r_ok = _rank_cols(offs_r, rank, R)
    bt = tl.load(b_base + offs_n[:, None] * stride_bn + offs_r[None, :], mask=n_ok[:, None] & r_load[None, :],
                 other=0.0, eviction_policy="evict_last")
    return tl.where(r_ok[None, :], bt, 0.0)


@triton.jit
def _add_tile(yp, old, z, bt, mask, NATIVE_B: tl.constexpr):
    """``y = old + z @ bt.T`` stored at ``yp`` under ``mask`` (fp32 sum, rounded to y's dtype;
    a 16-bit B on tensor cores, else an IEEE fp32 dot); y streams through once (evict_first)."""
    if NATIVE_B:
        acc = tl.dot(z, tl.trans(bt))
    else:
        acc = tl.dot(z, tl.trans(bt.to(tl.float32)), input_precision="ieee")
    tl.store(yp, (old.to(tl.float32) + acc).to(old.dtype), mask=mask, eviction_policy="evict_first")


@triton.jit
def _load_core(core_base, offs_r, rank, R, stride_cr, stride_ck, CORE: tl.constexpr):
    """A member's core of one slice in fp32, zero past the rank: ``[BLOCK_R]`` (``CORE`` 1,
    JD-Diag) or ``[BLOCK_R, BLOCK_R]`` with ``core[r, k]`` (``CORE`` 2, JD-Full); loaded in
    whole vectors along the contiguous axis (``_rank_cols``; ``R`` the cores' physical rank)."""
    r_load, r_ok = _rank_cols(offs_r, rank, R)
    if CORE == 1:
        core = tl.load(core_base + offs_r * stride_cr, mask=r_load, other=0.0)
        core = tl.where(r_ok, core, 0.0)
    else:
        core = tl.load(core_base + offs_r[:, None] * stride_cr + offs_r[None, :] * stride_ck,
                       mask=r_ok[:, None] & r_load[None, :], other=0.0)
        core = tl.where(r_ok[None, :], core, 0.0)
    return core.to(tl.float32)


@triton.jit
def _times_core(z, core, CORE: tl.constexpr):
    """``z[m, r] * core[r]`` (JD-Diag) or ``sum_k core[r, k] z[m, k]`` = ``z @ core^T`` (JD-Full),
    fp32 (IEEE dot, never TF32)."""
    if CORE == 1:
        out = z * core[None, :]
    else:
        out = tl.dot(z, tl.trans(core), input_precision="ieee")
    return out


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
    block_r_expand = _pow2(R, 16, 1 << 20)
    # split d_in until the shrink launch has about ``waves`` programs per SM, keeping chunks of
    # at least ``min_k_blocks`` K-blocks: more splits cost more partial traffic than they hide
    want = override.get("waves", 2) * _num_sms(device)
    have = tiles * n_slices * rank_tiles
    max_split = max(1, d_in // (override.get("min_k_blocks", 2) * block_k))
    split = override.get("split") or max(1, min(max_split, _cdiv(want, have)))
    k_per_split = _cdiv(_cdiv(d_in, split), block_k) * block_k
    split = _cdiv(d_in, k_per_split)
    cfg = dict(
        block_r=block_r, block_k=block_k, rank_tiles=rank_tiles, split=split, k_per_split=k_per_split,
        # the expand's column tile (:func:`_expand_block_n`), clipped to the narrowest slice
        block_n=override.get("block_n") or _pow2(min(widths), 16, _expand_block_n(tiles_bm, R)),
        block_r_expand=block_r_expand,
        # warps by shrink tile size: 8 for a 32-row tile with a 64-wide rank tile, 2 for a 16 x 16
        # tile (decode: small programs, many of them), 4 between
        shrink_warps=8 if tiles_bm * block_r >= 32 * 64 else 2 if tiles_bm * block_r <= 16 * 16 else 4,
        # 3 stages for a wide z (its column loop is pipelined by Triton, not by hand)
        shrink_stages=4, expand_warps=4, expand_stages=3 if block_r_expand > 32 else 2, rank_class=16,
        # split-K partials loaded per step of the final sum: one at a time (an override may chunk them)
        sum_chunk=1,
        pdl=override.get("pdl", True),
    )
    # column groups: each expand program loads its tile's z once and streams
    # up to 8 column tiles, while keeping about ``expand_waves`` programs per SM
    # (narrow z is cheap to reload: many small programs balance best; a 64-wide
    # z is worth streaming over a few tiles)
    col_tiles = sum(_cdiv(w, cfg["block_n"]) for w in widths)
    programs = tiles * col_tiles
    waves = override.get("expand_waves", 16 if cfg["block_r_expand"] <= 32 else 4)
    cfg["group_tiles"] = override.get("group_tiles") or max(1, min(8, programs // (waves * _num_sms(device))))
    cfg.update({k: v for k, v in override.items() if k in cfg and k not in ("split", "block_r", "block_k", "block_n")})
    return cfg


def _expand_block_n(tiles_bm: int, R: int) -> int:
    """The expand's column tile before clipping to the slices' widths (:func:`launch_config`):
    for 16-row tiles 64 at rank <= 16 (fewer registers, more programs per SM) and 128 above;
    for 32-row tiles (large batches, long segments) 128 at rank 9-16 and 64 otherwise."""
    if tiles_bm >= 32:
        return 128 if 8 < R <= 16 else 64
    return 64 if R <= 16 else 128


MAX_SLICES = 4  # slices per expand launch (their column metadata are scalar arguments)

# launch_config entries that reach the kernels as compile-time constants (with
# ``split > 1``): a new combination compiles new kernels. ``split``,
# ``k_per_split`` and ``group_tiles`` are runtime arguments, so batch sizes that
# differ only in those share one compiled kernel.
COMPILE_KEYS = ("rank_tiles", "block_r", "block_k", "rank_class", "block_n", "block_r_expand", "shrink_warps",
                "shrink_stages", "expand_warps", "expand_stages", "pdl", "sum_chunk")


def add_lora_slices_triton(y, x, lora_a, lora_b, lp: LaunchPlan, ranks, scales, widths, config=None,
                           out_offsets=None, b_pitched: bool = False, reduce_z=None):
    """Shrink then expand over ``lp``; y updated in place and returned. No host
    synchronisation: capturable in a CUDA graph. Callers have checked shapes,
    dtypes, devices and value ranges (add_lora_slices). ``config`` overrides
    entries of :func:`launch_config`. ``out_offsets``: each slice's first column
    in y (default: side by side from 0). More than ``MAX_SLICES`` slices run as
    several launches of at most that many (``reduce_z`` then runs once per launch
    pair). ``b_pitched``: ``lora_b`` is rank-pitched (``mlora.kernels.pitch``).
    ``reduce_z``: an in-place reduction of the summed z between the launches
    (:func:`_shrink_expand`)."""
    S, n, R, d_in = lora_a.shape
    if out_offsets is None:
        out_offsets = [sum(widths[:j]) for j in range(n)]
    if n > MAX_SLICES:
        off = 0
        for j0 in range(0, n, MAX_SLICES):
            ws = list(widths[j0 : j0 + MAX_SLICES])
            add_lora_slices_triton(y, x, lora_a[:, j0 : j0 + MAX_SLICES],
                                   lora_b[:, off : off + sum(ws)], lp, ranks[j0 : j0 + MAX_SLICES],
                                   scales[j0 : j0 + MAX_SLICES], ws, config, out_offsets[j0 : j0 + MAX_SLICES],
                                   b_pitched=b_pitched, reduce_z=reduce_z)
            off += sum(ws)
        return y
    assert y.stride(1) == 1, "y must be row-major"
    if b_pitched:
        check_pitched(lora_b)  # before _kernel_operands, which would copy a strided bank
    pitched = b_pitched and R % 8 == 0  # else the pitch is R for every rank: the padded layout
    x, lora_a, lora_b, ranks, scales, native_a, native_b = _kernel_operands(x, lora_a, lora_b, ranks, scales)
    cfg = _config(lp, x, lora_a, widths, native_a, config)
    return _shrink_expand(y, x, lora_a, lora_b, lp, ranks, scales, widths, out_offsets, cfg, native_a, native_b,
                          b_pitched=pitched, reduce_z=reduce_z)


def _config(lp: LaunchPlan, x, lora_a, widths, native_a: bool, config: dict | None) -> dict:
    """:func:`launch_config` of one call (cached per static shape unless ``config`` overrides)."""
    _, n, R, d_in = lora_a.shape
    key = (lp.tile_capacity, n, R, d_in, tuple(widths), str(x.device), native_a, lp.block_m)
    cfg = _CONFIGS.get(key) if config is None else None
    if cfg is None:
        cfg = launch_config(lp.tile_capacity, n, R, d_in, widths, x.device, native_a, lp.block_m, **(config or {}))
        if config is None:
            _CONFIGS[key] = cfg
    return cfg


def _kernel_operands(x, a, b, table, other):
    """``x``, the A bank ``[S, n, R, d_in]``, the B bank ``[S, sum(w), R]`` and two ``[n, S]``
    tables with the layout the kernels read (innermost strides 1; both tables indexed with one
    pair of strides), copied only where they differ, and whether the shrink (x and A) and the
    expand (B) dots run natively in 16 bits (never under the CPU interpreter)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if a.stride(3) != 1:
        a = a.contiguous()
    if b.stride(2) != 1:
        b = b.contiguous()
    if table.stride() != other.stride():
        table, other = table.contiguous(), other.contiguous()
    native_a = x.dtype == a.dtype and x.dtype in (torch.bfloat16, torch.float16) and not _INTERPRET
    native_b = b.dtype in (torch.bfloat16, torch.float16) and not _INTERPRET
    return x, a, b, table, other, native_a, native_b


def _shrink_expand(y, x, lora_a, lora_b, lp: LaunchPlan, ranks, scales, widths, out_offsets, cfg: dict,
                   native_a: bool, native_b: bool, bank_rows=None, cores=None, core_kind: int = 0,
                   b_pitched: bool = False, reduce_z=None):
    """The two launches (split-K shrink, then expand) of ``cfg`` (:func:`launch_config`) over
    ``lp``; y updated in place and returned. ``bank_rows`` (an ``[n, S]`` table with the
    strides of ``ranks``): the A and B rows to read per slice and slot instead of the slot.
    ``cores`` with ``core_kind`` 1 (JD-Diag, ``[S, n, R]``) or 2 (JD-Full, ``[S, n, R, R]``):
    the slot's core applied to z in place of ``scales``. Without them: the plain LoRA update.

    ``reduce_z(z)``, when given, runs on the current stream between the two launches with
    ``z = zp[0]``, the summed fp32 partial ``[lp.row_capacity, n * R]`` (contiguous; row u is
    grouped row u of ``lp``, slice j at columns ``j * R``), and must update it in place (a
    tensor-parallel rank's all-reduce: every rank's partial shrink summed, then each rank's
    expand; docs/kernels.md, Reducing z between the launches). The expand reads only the rows
    of ``lp``'s tiles and, of each, slice j's columns below its slot's rank (loaded up to the
    rank rounded up to 8, those past the rank replaced by zero): every other entry is never
    written by the shrink and may hold anything (NaN included), so summing the whole tensor
    is right and no entry needs clearing first. The expand is then an ordinary launch (no
    programmatic dependence on the shrink: other work sits between them on the stream)."""
    pdl = cfg["pdl"] and _pdl_supported(x.device) and reduce_z is None
    zp = _shrink(x, lora_a, lp, ranks, cfg, native_a, pdl, bank_rows)
    if reduce_z is not None:
        reduce_z(zp[0])
    return _expand(y, zp, lora_b, lp, ranks, scales, widths, out_offsets, cfg, native_b, pdl, bank_rows, cores,
                   core_kind, b_pitched)


def _shrink(x, lora_a, lp: LaunchPlan, ranks, cfg: dict, native_a: bool, pdl: bool, bank_rows=None) -> torch.Tensor:
    """Launch the split-K shrink on the current stream into new z partials ``[split, rows, n * R]``
    (float32); returns them (partial 0 holds the sum once the launch is done)."""
    _, n, R, d_in = lora_a.shape
    zp = torch.empty((cfg["split"], lp.row_capacity, n * R), dtype=torch.float32, device=x.device)
    cnt = _split_counters(x.device, lp.tile_capacity * n * cfg["rank_tiles"]) if cfg["split"] > 1 else zp
    rows_map = ranks if bank_rows is None else bank_rows  # never read without BANK_ROWS
    _shrink_kernel[(lp.tile_capacity, n * cfg["rank_tiles"], cfg["split"])](
        x, lora_a, zp, cnt, lp.sorted_rows, lp.tile_slot, lp.tile_start, lp.tile_end, lp.num_tiles, ranks,
        rows_map,
        d_in, R, ranks.stride(0), ranks.stride(1), cfg["k_per_split"], cfg["split"],
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), zp.stride(0), zp.stride(1),
        RANK_TILES=cfg["rank_tiles"], BLOCK_M=lp.block_m, BLOCK_R=cfg["block_r"], BLOCK_K=cfg["block_k"],
        RANK_CLASS=cfg["rank_class"], NATIVE_DOT=native_a, USE_PDL=pdl, SPLIT_K=cfg["split"] > 1,
        SUM_CHUNK=cfg["sum_chunk"], BANK_ROWS=bank_rows is not None,
        num_warps=cfg["shrink_warps"], num_stages=cfg["shrink_stages"],
    )
    return zp


def _expand(y, zp, lora_b, lp: LaunchPlan, ranks, scales, widths, out_offsets, cfg: dict, native_b: bool, pdl: bool,
            bank_rows=None, cores=None, core_kind: int = 0, b_pitched: bool = False):
    """Launch the expand of the shrink's ``zp`` on the current stream (with ``pdl``, as a
    programmatic dependent of the shrink launched just before it).
    ``b_pitched``: B rank-pitched (R a multiple of 8, each slot's rows contiguous)."""
    n = len(widths)
    R = zp.shape[2] // n
    rows_map = ranks if bank_rows is None else bank_rows
    bn, gt = cfg["block_n"], cfg["group_tiles"]
    g_args, o_args, d_args, n_groups = slice_args(widths, out_offsets, bn * gt)
    extra = dict(launch_pdl=True) if pdl else {}
    core_strides = (0, 0, 0, 0) if cores is None else tuple(cores.stride()) + (0,) * (4 - cores.dim())
    _expand_kernel[(lp.tile_capacity, n_groups)](
        zp, lora_b, y, lp.sorted_rows, lp.tile_slot, lp.tile_start, lp.tile_end, lp.num_tiles,
        ranks, scales, rows_map, scales if cores is None else cores,
        R, ranks.stride(0), ranks.stride(1), *g_args, *o_args, *d_args, gt,
        zp.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0), *core_strides,
        N_SLICES=n, BLOCK_M=lp.block_m, BLOCK_N=bn, BLOCK_R=cfg["block_r_expand"],
        RANK_CLASS=cfg["rank_class"], NATIVE_DOT=native_b, USE_PDL=pdl,
        BANK_ROWS=bank_rows is not None, CORE=core_kind, B_PITCHED=b_pitched,
        num_warps=cfg["expand_warps"], num_stages=cfg["expand_stages"], **extra,
    )
    return y


def add_bundle_slices_triton(y, x, bases_a, bases_b, lp: LaunchPlan, ranks, bank_rows, cores, widths,
                             out_offsets=None, diag: bool = False, config=None, reduce_z=None):
    """The three-stage bundle operator (docs/design.md, Bundle and three-stage operator) of one
    (layer, group) as one shrink and
    one expand launch over ``lp``, the slot being the member; y updated in place and returned.

    ``bases_a`` ``[Rows, n, R, d_in]`` and ``bases_b`` ``[Rows, sum(widths), R]``: the group's
    cluster bases, ``bases_a[c, j] = V_c^T`` and ``bases_b[c, off_j : off_j + w_j] = U_c`` of
    slice j's cluster c (``off_j = sum(widths[:j])``; any leading strides, innermost 1).
    ``ranks`` and ``bank_rows``: int32 ``[n, S]`` (any strides; both the same or copied);
    ``cores``: ``[S, n, R, R]`` (JD-Full) or, with ``diag``, ``[S, n, R]`` (JD-Diag), any
    strides. For every row ``t`` of tile slot ``s`` in ``lp`` and slice ``j`` with
    ``r = ranks[j, s] > 0`` and ``c = bank_rows[j, s]``::

        h  = x[t] @ bases_a[c, j, :r].T                                 (fp32, split-K as for LoRA)
        h  = core[s, j, :r, :r] @ h   |   core[s, j, :r] * h            (fp32, in the expand program)
        y[t, out_offsets[j] : out_offsets[j] + w_j] += h @ bases_b[c, off_j : off_j + w_j, :r].T

    i.e. ``y_t += U_c core_s V_c^T x_t`` (no scale: the core carries it). Rows outside the
    plan and slices with ``ranks[j, s] == 0`` are never touched (bit-identical); bank rows,
    cores and rank tails no (slot, slice) of the plan names are never read (may hold NaN). No host
    synchronisation, grids from static shapes: capturable in a CUDA graph. ``config``
    overrides :func:`launch_config` entries. At most ``MAX_SLICES`` slices. ``reduce_z``:
    an in-place reduction of the summed fp32 ``h`` before the core (:func:`_shrink_expand`;
    a row-parallel rank sums its partial projections ``V_c^T x`` with the other ranks')."""
    _check_bundle(y, x, bases_a, bases_b, ranks, bank_rows, cores, widths, diag)
    _, n, R, d_in = bases_a.shape
    if out_offsets is None:
        out_offsets = [sum(widths[:j]) for j in range(n)]
    assert y.stride(1) == 1, "y must be row-major"
    x, bases_a, bases_b, ranks, bank_rows, native_a, native_b = _kernel_operands(x, bases_a, bases_b, ranks,
                                                                                 bank_rows)
    cfg = _config(lp, x, bases_a, widths, native_a, config)
    return _shrink_expand(y, x, bases_a, bases_b, lp, ranks, ranks, widths, out_offsets, cfg, native_a, native_b,
                          bank_rows=bank_rows, cores=cores, core_kind=1 if diag else 2, reduce_z=reduce_z)


def _check_bundle(y, x, bases_a, bases_b, ranks, bank_rows, cores, widths, diag: bool) -> None:
    """Shape and dtype checks of a bundle call (no device synchronisation); E_BANK_SHAPE."""
    if bases_a.dim() != 4 or bases_b.dim() != 3:
        raise PlanError("E_BANK_SHAPE", "bases_a must be [Rows, n, R, d_in] and bases_b [Rows, sum(widths), R]")
    Rows, n, R, d_in = bases_a.shape
    S = ranks.shape[1] if ranks.dim() == 2 else -1
    core_shape = (S, n, R) if diag else (S, n, R, R)
    if not 1 <= n <= MAX_SLICES or len(widths) != n or bases_b.shape != (Rows, sum(widths), R):
        raise PlanError("E_BANK_SHAPE", f"bases_a {tuple(bases_a.shape)}, bases_b {tuple(bases_b.shape)} and widths "
                        f"{list(widths)} disagree (at most {MAX_SLICES} slices)")
    if ranks.shape != (n, S) or bank_rows.shape != (n, S) or tuple(cores.shape) != core_shape:
        raise PlanError("E_BANK_SHAPE", f"ranks {tuple(ranks.shape)}, bank_rows {tuple(bank_rows.shape)} must be "
                        f"[n, S] = [{n}, S] and cores {tuple(cores.shape)} [S, n, R{'' if diag else ', R'}]")
    if ranks.dtype != torch.int32 or bank_rows.dtype != torch.int32:
        raise PlanError("E_BANK_DTYPE", f"ranks and bank_rows must be int32, got {ranks.dtype} and {bank_rows.dtype}")
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or x.shape[1] != d_in:
        raise PlanError("E_BANK_SHAPE", f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [T, {d_in}] and [T, d_out]")


def slice_args(widths, out_offsets, cols_per_group: int) -> tuple[list, list, list, int]:
    """Scalar slice metadata of the expand kernels: first column group of slices 1..3, first B row of
    slices 1..4, y column shift of slices 0..3 (padded past the last slice), and the group count."""
    groups, offs = [0], [0]
    for w in widths:
        groups.append(groups[-1] + _cdiv(w, cols_per_group))
        offs.append(offs[-1] + w)
    n, m = len(widths), MAX_SLICES
    g_args = (groups[1:n] + [groups[-1]] * m)[: m - 1]
    o_args = (offs[1:] + [offs[-1]] * m)[:m]
    d_args = ([int(o) - b for o, b in zip(out_offsets, offs)] + [0] * m)[:m]
    return g_args, o_args, d_args, groups[-1]


_COUNTERS: dict[str, list[torch.Tensor]] = {}


def _split_counters(device: torch.device, numel: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for the split-K reduction, at least ``numel``.

    The shrink leaves every counter it used at zero again, so one buffer per
    device serves every later call and graph replay; a larger need allocates a
    larger buffer and keeps the old ones alive (graphs captured earlier still
    point at them). Inside a CUDA graph capture a missing buffer is allocated
    in the capture (its zeroing becomes part of the graph: correct, one node more)."""
    bufs = _COUNTERS.setdefault(str(device), [])
    if bufs and bufs[-1].numel() >= numel:
        return bufs[-1]
    buf = torch.zeros(max(numel, 4096), dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return buf
    bufs.append(buf)
    return buf


_PDL: dict[str, bool] = {}


def _pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA on compute capability >= 9 (Hopper) with
    a Triton that exposes the ``launch_pdl`` launch option. Never under the
    interpreter (its grid-dependency instructions are PTX)."""
    key = str(device)
    if key not in _PDL:
        ok = device.type == "cuda" and not _INTERPRET
        if ok:
            ok = torch.cuda.get_device_capability(device)[0] >= 9
        if ok:
            try:
                from triton.backends.nvidia.compiler import CUDAOptions
                ok = "launch_pdl" in CUDAOptions.__dataclass_fields__
            except Exception:  # noqa: BLE001 - any import or layout difference means: not available
                ok = False
        _PDL[key] = ok
    return _PDL[key]
