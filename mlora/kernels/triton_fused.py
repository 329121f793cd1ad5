"""Fused shrink + expand: the segmented LoRA update in one Triton launch, for small batches.

Same semantics and local kernel ABI as :mod:`mlora.kernels.triton_sgmv` (its
module docstring, ``KERNEL_ABI``): A bank ``[S, n, R, d_in]``, B bank
``[S, sum(w_j), R]``, ranks and scales ``[n, S]`` tables of any (shared)
strides, per-slice y column offsets, x and y in scheduler order with the
LaunchPlan's ``sorted_rows`` as row addresses. For tile ``i`` (slot ``s``,
grouped rows ``u``) and column group ``g`` of slice ``j``::

    z            = scales[j,s] * (x[g[u]] @ lora_a[s, j, :ranks[j,s]].T)      (fp32, the whole d_in)
    y[g[u], c]  += z @ lora_b[s, c, :ranks[j,s]].T            for the B rows c of group g, at y column c + D_j
    rows outside the plan are never touched; ranks[j,s] == 0 leaves slice j of the tile's rows untouched.

Grid ``(tile_capacity, column groups of all slices)``, the same tile list and
slice metadata (scalar arguments) as the two-launch expand; programs past
``num_tiles`` exit. Every program recomputes its tile's z over the whole
d_in (no split-K, no partials, no arrival counters) and streams
``group_tiles`` column tiles of B and y with z in registers. The shrink is
thus repeated once per column group: ``tiles x groups x R x d_in x itemsize``
bytes of A traffic (from L2 after the first program of a slot) instead of the
second launch, the split-K sum and the z round trip through memory. That is
the right trade only for small batches: :func:`fused_config` decides.

Numerics as in the two-launch path: fp32 accumulation; the shrink dot on
16-bit tensor cores when x and A share a 16-bit dtype, the expand dot when B
is 16-bit (z, scaled in fp32, rounded to B's dtype first); IEEE fp32 dots
otherwise (never TF32); the interpreter runs the fp32 path. Loads past the
true rank are masked (never issued), so rank tails may hold NaN. No host
synchronisation and a grid that depends only on the plan's capacities and the
bank shape: capturable in a CUDA graph. ``group_tiles`` is a runtime argument
(one compiled kernel for every batch size of a module shape).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlora.kernels import triton_sgmv as sgmv
from mlora.kernels.launch import LaunchPlan
from mlora.kernels.triton_sgmv import _expand_group, _shrink_acc, _slice_of, _tile_rank, slice_args

# Selection rule (fused_config). Estimates; `scripts/kernel_sweep.py --fused` times every
# launch-bound case with the fused launch forced on and off next to this rule's choice. On the
# H200 (fourteenth session) the fused launch was slower in every case (1.19-2.50x the two
# launches), so the rule only reports (FUSED_BY_DEFAULT below).
# Most rows (LaunchPlan row capacity) a fused launch takes: the launch-bound
# bench cases the fused launch is for have T <= 64; x is re-read per column
# group too, and at more rows split-K's bandwidth wins.
FUSED_MAX_ROWS = 64
# Most redundant A traffic (tiles x column groups x R x d_in x itemsize) a fused
# launch may cost: 32 MiB is about 4 us of L2 reads at ~8 TB/s, less than the
# ~5 us fixed cost of the expand launch plus the split-K sum it saves (H200,
# BENCHMARKS.md tenth session).
FUSED_MAX_A_BYTES = 32 << 20
# Widest bank a fused program takes: z and the A and B tiles are R wide in one
# program (no rank tiles), and 64 is the widest that compile_kernels.py checks.
FUSED_MAX_R = 64
# Whether the rule picks the fused launch without an override. Off: the H200 calibration
# (BENCHMARKS.md, fourteenth session) found it slower than shrink + expand in all 74
# launch-bound cases. `config={"fused": True}` (tests, the sweep) forces it.
FUSED_BY_DEFAULT = False
# Column tiles one program streams at most: the groups keep the launch at about
# one program per SM (each program's shrink is its fixed cost, so fewer,
# longer programs repeat it less).
FUSED_MAX_GROUP = 8


@triton.jit(do_not_specialize=["group_tiles", "G1", "G2", "G3"])
def _fused_kernel(
    x_ptr, a_ptr, b_ptr, y_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    ranks_ptr, scales_ptr,
    d_in, R, stride_rj, stride_rs, G1, G2, G3, O1, O2, O3, O4, D0, D1, D2, D3, group_tiles,
    stride_xt, stride_as, stride_aj, stride_ar, stride_bs, stride_bn, stride_yt,
    N_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, NATIVE_A: tl.constexpr, NATIVE_B: tl.constexpr,
):
    """One row tile x one column group of one slice: its z, then its columns of y."""
    pid_t = tl.program_id(0)
    pid_g = tl.program_id(1)
    j, g_lo, n_lo, n_hi, dy = _slice_of(pid_g, G1, G2, G3, O1, O2, O3, O4, D0, D1, D2, D3, N_SLICES)
    slot, u, m_ok, rows, rank = _tile_rank(pid_t, j, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
                                           num_tiles_ptr, ranks_ptr, stride_rj, stride_rs, BLOCK_M)
    if rank == 0:  # a tile past the count, or a slot that does not adapt slice j
        return
    scale = tl.load(scales_ptr + j * stride_rj + slot * stride_rs)
    a_base = a_ptr + slot.to(tl.int64) * stride_as + j * stride_aj
    offs_r = tl.arange(0, BLOCK_R)
    z = _shrink_acc(x_ptr, a_base, m_ok, rows, offs_r, offs_r < rank, 0, d_in, d_in, stride_xt, stride_ar,
                    BLOCK_M, BLOCK_R, BLOCK_K, NATIVE_A) * scale  # the whole d_in: no split-K
    if NATIVE_B:  # a 16-bit expand dot: z rounded to B's dtype, as the two-launch expand does
        zd = z.to(b_ptr.dtype.element_ty)
    else:
        zd = z
    n_first = n_lo + (pid_g - g_lo) * (group_tiles * BLOCK_N)
    _expand_group(zd, b_ptr + slot.to(tl.int64) * stride_bs, y_ptr + dy, m_ok, rows, rank, R, n_first, n_hi,
                  group_tiles, stride_bn, stride_yt, BLOCK_N, BLOCK_R, NATIVE_B)


def fused_config(tiles: int, rows: int, R: int, d_in: int, widths, itemsize: int, device: torch.device,
                 **override) -> dict:
    """Launch parameters of a fused launch and whether to take it (``"fused"``); depends only on
    static shapes (the plan's tile and row capacities, the bank), so a captured graph and its
    warm-up agree.

    Rule (``"rule"``): fused when ``rows <= FUSED_MAX_ROWS``, ``R <= FUSED_MAX_R`` and the
    redundant A traffic ``a_bytes = tiles x column groups x R x d_in x itemsize`` (every
    program re-reads its slot's A, mostly from L2) is at most ``FUSED_MAX_A_BYTES``; it
    decides ``"fused"`` only where ``FUSED_BY_DEFAULT`` (off: measured slower). ``override``: ``fused``
    (True / False forces the choice), ``fused_block_n``, ``fused_group``, ``fused_warps``,
    ``fused_stages`` (the sweep's variants)."""
    block_n = override.get("fused_block_n") or sgmv._pow2(min(widths), 16, 128)
    col_tiles = sum(sgmv._cdiv(w, block_n) for w in widths)
    # about one program per SM: more programs would repeat the shrink without adding bandwidth
    group = override.get("fused_group") or max(1, min(FUSED_MAX_GROUP,
                                                      sgmv._cdiv(tiles * col_tiles, sgmv._num_sms(device))))
    groups = sum(sgmv._cdiv(w, block_n * group) for w in widths)
    a_bytes = tiles * groups * R * d_in * itemsize
    rule = rows <= FUSED_MAX_ROWS and R <= FUSED_MAX_R and a_bytes <= FUSED_MAX_A_BYTES
    fused = override.get("fused")
    if fused is None:
        fused = FUSED_BY_DEFAULT and rule
    return dict(
        fused=fused, rule=rule, a_bytes=a_bytes, block_n=block_n, group=group, block_r=sgmv._pow2(R, 16, 1 << 20),
        block_k=128 if not sgmv._INTERPRET else sgmv._pow2(d_in, 16, 32),
        # 4 warps: no spill on sm_90 up to a 64-wide bank (scripts/compile_kernels.py: 138 registers, no stack)
        warps=override.get("fused_warps", 4), stages=override.get("fused_stages", 4),
    )


def add_lora_slices_fused(y, x, lora_a, lora_b, lp: LaunchPlan, ranks, scales, widths, out_offsets, cfg: dict,
                          native_a: bool, native_b: bool):
    """The whole update in one launch over ``lp``; y updated in place and returned. The caller
    (``add_lora_slices_triton``) has made the innermost strides 1, given ranks and scales the same
    strides, kept to at most ``MAX_SLICES`` slices and chosen ``cfg`` (:func:`fused_config`)."""
    n, d_in = lora_a.shape[1], lora_a.shape[3]
    g_args, o_args, d_args, n_groups = slice_args(widths, out_offsets, cfg["block_n"] * cfg["group"])
    _fused_kernel[(lp.tile_capacity, n_groups)](
        x, lora_a, lora_b, y, lp.sorted_rows, lp.tile_slot, lp.tile_start, lp.tile_end, lp.num_tiles, ranks, scales,
        d_in, lora_b.shape[2], ranks.stride(0), ranks.stride(1), *g_args, *o_args, *d_args, cfg["group"],
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), lora_b.stride(0), lora_b.stride(1),
        y.stride(0),
        N_SLICES=n, BLOCK_M=lp.block_m, BLOCK_N=cfg["block_n"], BLOCK_R=cfg["block_r"], BLOCK_K=cfg["block_k"],
        NATIVE_A=native_a, NATIVE_B=native_b, num_warps=cfg["warps"], num_stages=cfg["stages"],
    )
    return y
