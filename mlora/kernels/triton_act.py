"""The gate/up LoRA expand fused with the SiLU product (Triton).

Owns one kernel: for a gate/up group (two slices of width ``inter``, laid out
``[gate | up]`` in the base GEMM's output), it adds each row's LoRA deltas to
its gate and up values and writes ``silu(gate) * up`` of the sums, so the
sums never go to memory: the plain path's expand reads and writes all of
``gate_up`` (a read-modify-write of ``2 * inter`` values per row) and the SiLU
kernel reads it again. Semantics, per row ``t`` with slot ``s`` (-1: none) and
element type ``dt``::

    g = dt(gate_up[t, c]         + scales[0, s] * z_0[t] @ B[s, c, :ranks[0, s]])
    u = dt(gate_up[t, inter + c] + scales[1, s] * z_1[t] @ B[s, inter + c, :ranks[1, s]])
    out[t, c] = dt(dt(silu(g)) * u)         (a slot-less row, or a rank of 0: no delta)

which is, bit for bit where the dots round alike, the plain expand
(``add_lora_slices``) followed by ``mlora.kernels.elementwise.silu_mul_triton``. The
shrink (``z``) is the plain path's own launch. The grid: the LaunchPlan's
tiles (rows of one slot, in plan order), then tiles of ``block_m`` of the
plan's rows with no adapter (``LaunchPlan.base_rows``), times column tiles of
``inter``; every row of the invocation is written by exactly one program per
column tile. Must not know the model or the bank: the caller passes the
factor banks, tables and plan (``mlora.batch.adapters.slots``'s context decides when).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlora.kernels.launch import LaunchPlan
from mlora.kernels.pitch import check_pitched
from mlora.kernels.triton_sgmv import (
    _b_tile,
    _config,
    _kernel_operands,
    _load_z,
    _pdl_supported,
    _rank_round8,
    _shrink,
    _tile,
)

#: Column tiles of gate (and of up) each program of the fused launch covers: z is loaded once
#: per group, as the plain expand's column groups do.
SILU_GROUP_TILES = 4


@triton.jit
def _slice_b(b_ptr, slot, rank, R, n_lo, stride_bs, stride_bn, B_PITCHED: tl.constexpr):
    """(address of row ``n_lo`` of slot ``slot``'s B, the row stride) for one slice: rows step by
    the slot's pitch in a rank-pitched bank (row ``n_lo + c`` at ``n_lo * R + c * pitch``,
    ``mlora.kernels.pitch``), by ``stride_bn`` otherwise."""
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    if B_PITCHED:
        return b_base + n_lo * R, _rank_round8(rank, R)
    return b_base + n_lo * stride_bn, stride_bn


@triton.jit
def _slice_z(zp_ptr, b_ptr, u, m_ok, j, rank, scale, R, stride_zu, BLOCK_R: tl.constexpr,
             NATIVE_DOT: tl.constexpr):
    """``scale * z_j`` of the tile's rows (zero past ``rank``: ``triton_sgmv._load_z``), in the
    dot's input type (B's with ``NATIVE_DOT``, else fp32)."""
    z = _load_z(zp_ptr, u, m_ok, j, rank, R, stride_zu, BLOCK_R) * scale
    if NATIVE_DOT:
        z = z.to(b_ptr.dtype.element_ty)
    return z


@triton.jit
def _tile_delta(z, b_base, stride_bn, cols, c_ok, rank, R, BLOCK_R: tl.constexpr, NATIVE_DOT: tl.constexpr):
    """fp32 ``z @ B[cols, :rank].T`` of one column tile (``_b_tile``: whole-vector loads)."""
    bt = _b_tile(b_base, cols, c_ok, tl.arange(0, BLOCK_R), rank, R, stride_bn)
    if NATIVE_DOT:
        acc = tl.dot(z, tl.trans(bt))
    else:
        acc = tl.dot(z, tl.trans(bt.to(tl.float32)), input_precision="ieee")
    return acc


@triton.jit
def _silu_product(g, u, dt: tl.constexpr):
    """``silu(g) * u`` as torch rounds it in ``dt``: silu in fp32 rounded to ``dt``, then the
    product rounded to ``dt``; also the body of ``mlora.kernels.elementwise``'s SiLU kernel."""
    g = g.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt)
    return (act.to(tl.float32) * u.to(tl.float32)).to(dt)


# tile_cap (a bound) and the scalar metadata never specialised: each 16-divisibility or alignment
# variant would be one more compile of this kernel (mlora.kernels.triton_sgmv._shrink_kernel)
@triton.jit(do_not_specialize=["group_tiles", "tile_cap", "ranks_ptr", "scales_ptr"])
def _expand_silu_kernel(
    zp_ptr, b_ptr, gu_ptr, out_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    base_rows_ptr, num_base_ptr, ranks_ptr, scales_ptr,
    tile_cap, inter, R, group_tiles, stride_rj, stride_rs, stride_zu, stride_bs, stride_bn, stride_g, stride_o,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, NATIVE_DOT: tl.constexpr,
    USE_PDL: tl.constexpr, B_PITCHED: tl.constexpr,
):
    """One row tile x ``group_tiles`` column tiles of ``inter`` (a runtime argument: one
    compiled kernel for every grouping): a plan tile (its slot's deltas added; z loaded once
    for the group) for ``program_id(0) < tile_cap``, else a tile of the rows with no adapter
    (the SiLU product alone). With ``USE_PDL`` the kernel is the shrink's programmatic
    dependent: z is read only after the grid-dependency wait (the plan, ranks and scales
    before it)."""
    pid_t = tl.program_id(0)
    c0 = tl.program_id(1) * group_tiles * BLOCK_N
    dt = out_ptr.dtype.element_ty
    if pid_t < tile_cap:
        valid, slot, u, m_ok, rows = _tile(pid_t, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
                                           num_tiles_ptr, BLOCK_M)
        if not valid:
            return
        rank_g = tl.load(ranks_ptr + slot * stride_rs)
        rank_u = tl.load(ranks_ptr + stride_rj + slot * stride_rs)
        scale_g = tl.load(scales_ptr + slot * stride_rs)
        scale_u = tl.load(scales_ptr + stride_rj + slot * stride_rs)
        bg, sg = _slice_b(b_ptr, slot, rank_g, R, 0, stride_bs, stride_bn, B_PITCHED)
        bu, su = _slice_b(b_ptr, slot, rank_u, R, inter, stride_bs, stride_bn, B_PITCHED)
        if USE_PDL:  # z is the shrink's output
            tl.extra.cuda.gdc_wait()
        zg = _slice_z(zp_ptr, b_ptr, u, m_ok, 0, rank_g, scale_g, R, stride_zu, BLOCK_R, NATIVE_DOT)
        zu = _slice_z(zp_ptr, b_ptr, u, m_ok, 1, rank_u, scale_u, R, stride_zu, BLOCK_R, NATIVE_DOT)
        for t in range(0, group_tiles):
            cols = c0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
            c_ok = cols < inter
            mask = m_ok[:, None] & c_ok[None, :]
            gp = gu_ptr + rows[:, None] * stride_g + cols[None, :]
            gs = tl.load(gp, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            us = tl.load(gp + inter, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if rank_g > 0:
                gs += _tile_delta(zg, bg, sg, cols, c_ok, rank_g, R, BLOCK_R, NATIVE_DOT)
            if rank_u > 0:
                us += _tile_delta(zu, bu, su, cols, c_ok, rank_u, R, BLOCK_R, NATIVE_DOT)
            tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], _silu_product(gs.to(dt), us.to(dt), dt),
                     mask=mask)
    else:
        b0 = (pid_t - tile_cap) * BLOCK_M
        n_base = tl.load(num_base_ptr)
        if b0 >= n_base:
            return
        k = b0 + tl.arange(0, BLOCK_M)
        m_ok = k < n_base
        rows = tl.load(base_rows_ptr + k, mask=m_ok, other=0).to(tl.int64)
        for t in range(0, group_tiles):
            cols = c0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = m_ok[:, None] & (cols < inter)[None, :]
            gp = gu_ptr + rows[:, None] * stride_g + cols[None, :]
            g = tl.load(gp, mask=mask, other=0.0)
            up = tl.load(gp + inter, mask=mask, other=0.0)
            tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], _silu_product(g, up, dt), mask=mask)


def lora_silu_mul_triton(gate_up, x, lora_a, lora_b, lp: LaunchPlan, ranks, scales, inter: int, config=None,
                         b_pitched: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate + dgate) * (up + dup)`` of every row (module docstring) as the shrink and one
    fused launch; ``gate_up`` [T, 2 * inter] is read, not written; returns a new [T, inter].
    ``lora_a`` [S, 2, R, d_in], ``lora_b`` [S, 2 * inter, R] (rank-pitched with ``b_pitched``),
    ``ranks``/``scales`` [2, S]; ``lp`` covers the T rows (``base_rows``: the slot-less ones).
    No host synchronisation: capturable in a CUDA graph. Callers have checked shapes and
    values (``mlora.kernels.lora_silu_mul``). ``out``: write there (row-major [T, inter]).
    ``config``: ``launch_config`` overrides, plus ``silu_group_tiles``, the column tiles each
    program covers (default ``SILU_GROUP_TILES``)."""
    T = gate_up.shape[0]
    if out is None:
        out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    assert gate_up.stride(1) == 1 and lora_a.shape[1] == 2 and lora_b.shape[1] == 2 * inter
    S, n, R, d_in = lora_a.shape
    if b_pitched:
        check_pitched(lora_b)
    pitched = b_pitched and R % 8 == 0  # else the pitch is R for every rank: the padded layout
    x, lora_a, lora_b, ranks, scales, native_a, native_b = _kernel_operands(x, lora_a, lora_b, ranks, scales)
    widths = [inter, inter]
    config = dict(config or {})
    group = int(config.pop("silu_group_tiles", SILU_GROUP_TILES))
    cfg = _config(lp, x, lora_a, widths, native_a, config or None)
    pdl = cfg["pdl"] and _pdl_supported(x.device)
    zp = _shrink(x, lora_a, lp, ranks, cfg, native_a, pdl)
    bm, bn = lp.block_m, cfg["block_n"]
    base_tiles = triton.cdiv(lp.base_rows.numel(), bm)
    extra = dict(launch_pdl=True) if pdl else {}
    _expand_silu_kernel[(lp.tile_capacity + base_tiles, triton.cdiv(triton.cdiv(inter, bn), group))](
        zp, lora_b, gate_up, out, lp.sorted_rows, lp.tile_slot, lp.tile_start, lp.tile_end, lp.num_tiles,
        lp.base_rows, lp.num_base, ranks, scales,
        lp.tile_capacity, inter, R, group, ranks.stride(0), ranks.stride(1), zp.stride(1), lora_b.stride(0),
        lora_b.stride(1), gate_up.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=cfg["block_r_expand"], NATIVE_DOT=native_b, USE_PDL=pdl,
        B_PITCHED=pitched, num_warps=cfg["expand_warps"], num_stages=cfg["expand_stages"], **extra,
    )
    return out
