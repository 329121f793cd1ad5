"""A one-slice LoRA expand fused into the residual add and RMSNorm after it (Triton).

Owns one kernel. In a decoder layer the o and down projections' outputs are added to the
residual stream and normalised at once (``mlora.batch.fused.add_rms_norm``); their LoRA
deltas can be added there too, so the plain path's expand launch (a read-modify-write of
the projection's output between the shrink and the norm) disappears. Semantics, per row
``t`` with slot ``s`` (-1: none), element type ``dt``, width ``n``::

    y'[t]  = dt(y[t] + scales[0, s] * z[t] @ B[s, :, :ranks[0, s]].T)   (no delta: y'[t] = y[t])
    h'[t]  = dt(h[t] + y'[t])                                           (written to ``h_out``)
    x[t]   = dt(w * dt(h'[t] / sqrt(mean(h'[t]^2) + eps)))               (statistics in fp32)

which is the plain expand (``add_lora_slices``) followed by
``mlora.batch.fused.add_rms_norm_triton``: the same roundings in the same places; the delta's
fp32 sum and the row's sum of squares run in another order (last-bit differences). ``z`` is
scaled in fp32 and, where the plain expand's dot runs natively in 16 bits, rounded to B's dtype
before the products, as there. ``y`` is read, never written.

The grid: each plan tile (rows of one slot, plan order) in ``BLOCK_M / ROWS`` programs of
``ROWS`` rows, then programs of ``ROWS`` of the plan's slot-less rows (``base_rows``). A program
walks its rows' whole width twice in ``BLOCK_N`` columns: the delta, the add, the stored h'
and the sum of squares; then h' again (its own stores, from cache) for the norm. B is read
once per program, so the rows per program trade B traffic (``T / ROWS`` reads of a slot's
``n x r`` block) against parallelism. For decode-sized invocations: at prefill sizes the
plain expand's column-tiled grid reads B far less often. Must not know the model or the
bank: the caller passes the factor bank, tables and plan (``mlora.batch.bank`` decides when).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LaunchPlan
from .pitch import check_pitched
from .triton_act import _slice_b
from .triton_sgmv import _b_tile, _config, _kernel_operands, _load_z, _pdl_supported, _shrink

#: Launch defaults: rows per program, columns per step, warps (H200 sweep:
#: ``scripts/kernel_sweep.py --norm``; BENCHMARKS.md, twenty-seventh session).
NORM_ROWS = 1
NORM_BLOCK_N = 4096
NORM_WARPS = 8


@triton.jit
def _norm_rows(y_ptr, h_ptr, w_ptr, hout_ptr, x_ptr, rows, m_ok, z, b_base, stride_b, rank, R, n, eps,
               stride_y, stride_h, stride_ho, stride_x,
               ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, HAS_LORA: tl.constexpr,
               ONE_PASS: tl.constexpr):
    """The module docstring's three lines for ``ROWS`` rows (``m_ok``: which are real). ``z``:
    the rows' scaled z ``[ROWS, BLOCK_R]`` fp32 (zero past the rank), read with ``HAS_LORA`` only.
    ``ONE_PASS`` (``BLOCK_N >= n``): one step over the whole width, h' never read back."""
    dt = hout_ptr.dtype.element_ty
    if ONE_PASS:  # the whole width in registers (BLOCK_N >= n): every load issued at once, nothing read back
        cols = tl.arange(0, BLOCK_N)
        c_ok = cols < n
        mask = m_ok[:, None] & c_ok[None, :]
        yv = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0)
        hv = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0)
        w = tl.load(w_ptr + cols, mask=c_ok, other=0.0)
        if HAS_LORA:
            bt = _b_tile(b_base, cols, c_ok, tl.arange(0, BLOCK_R), rank, R, stride_b).to(tl.float32)
            yv = (yv.to(tl.float32) + tl.sum(z[:, None, :] * bt[None, :, :], axis=2)).to(dt)
        hn = (hv.to(tl.float32) + yv.to(tl.float32)).to(dt)
        tl.store(hout_ptr + rows[:, None] * stride_ho + cols[None, :], hn, mask=mask)
        hf = hn.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=1) / n + eps)
        normed = (hf * inv[:, None]).to(dt)
        out = (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + rows[:, None] * stride_x + cols[None, :], out, mask=mask)
    else:
        ss = tl.zeros((ROWS,), dtype=tl.float32)
        for c0 in range(0, n, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            c_ok = cols < n
            mask = m_ok[:, None] & c_ok[None, :]
            yv = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0)
            if HAS_LORA:  # y + z @ B[cols].T in fp32, rounded to the activations' dtype
                bt = _b_tile(b_base, cols, c_ok, tl.arange(0, BLOCK_R), rank, R, stride_b).to(tl.float32)
                delta = tl.sum(z[:, None, :] * bt[None, :, :], axis=2)
                yv = (yv.to(tl.float32) + delta).to(dt)
            hv = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0)
            hn = (hv.to(tl.float32) + yv.to(tl.float32)).to(dt)
            tl.store(hout_ptr + rows[:, None] * stride_ho + cols[None, :], hn, mask=mask)
            hf = hn.to(tl.float32)
            ss += tl.sum(hf * hf, axis=1)
        inv = 1.0 / tl.sqrt(ss / n + eps)
        tl.debug_barrier()  # h' stored by every thread before any reads it back
        for c0 in range(0, n, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            c_ok = cols < n
            mask = m_ok[:, None] & c_ok[None, :]
            hf = tl.load(hout_ptr + rows[:, None] * stride_ho + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            normed = (hf * inv[:, None]).to(dt)
            w = tl.load(w_ptr + cols, mask=c_ok, other=0.0)
            out = (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + rows[:, None] * stride_x + cols[None, :], out, mask=mask)


# tile_cap (a bound) and the scalar metadata never specialised (mlora.kernels.triton_sgmv._shrink_kernel)
@triton.jit(do_not_specialize=["tile_cap", "ranks_ptr", "scales_ptr"])
def _lora_add_rms_norm_kernel(
    zp_ptr, b_ptr, y_ptr, h_ptr, w_ptr, hout_ptr, x_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
    num_tiles_ptr, base_rows_ptr, num_base_ptr, ranks_ptr, scales_ptr,
    tile_cap, n, eps, R, stride_rs, stride_zu, stride_bs, stride_bn, stride_y, stride_h, stride_ho, stride_x,
    SUB: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    ROUND_Z: tl.constexpr, USE_PDL: tl.constexpr, B_PITCHED: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """``ROWS`` rows of one plan tile (``SUB`` programs per tile of ``SUB * ROWS`` rows, for
    ``program_id(0) < tile_cap * SUB``: the slot's
    delta added) or of the slot-less rows. With ``USE_PDL`` the kernel is the shrink's
    programmatic dependent: z is read only after the grid-dependency wait (y and h were
    complete before the shrink started)."""
    pid = tl.program_id(0)
    if pid < tile_cap * SUB:
        t = pid // SUB
        n_tiles = tl.load(num_tiles_ptr)
        slot = tl.load(tile_slot_ptr + t)
        u0 = tl.load(tile_start_ptr + t) + (pid % SUB) * ROWS
        u1 = tl.load(tile_end_ptr + t)
        if (t >= n_tiles) | (u0 >= u1):
            return
        u = (u0 + tl.arange(0, ROWS)).to(tl.int64)
        m_ok = u < u1
        rows = tl.load(rows_ptr + u, mask=m_ok, other=0).to(tl.int64)
        rank = tl.load(ranks_ptr + slot * stride_rs)
        scale = tl.load(scales_ptr + slot * stride_rs)
        b_base, stride_b = _slice_b(b_ptr, slot, rank, R, 0, stride_bs, stride_bn, B_PITCHED)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        z = _load_z(zp_ptr, u, m_ok, 0, rank, R, stride_zu, BLOCK_R) * scale
        if ROUND_Z:  # as the plain expand's native 16-bit dot sees it
            z = z.to(b_ptr.dtype.element_ty).to(tl.float32)
        _norm_rows(y_ptr, h_ptr, w_ptr, hout_ptr, x_ptr, rows, m_ok, z, b_base, stride_b, rank, R, n, eps,
                   stride_y, stride_h, stride_ho, stride_x, ROWS, BLOCK_N, BLOCK_R, True, ONE_PASS)
    else:
        b0 = (pid - tile_cap * SUB) * ROWS
        n_base = tl.load(num_base_ptr)
        if b0 >= n_base:
            return
        k = b0 + tl.arange(0, ROWS)
        m_ok = k < n_base
        rows = tl.load(base_rows_ptr + k, mask=m_ok, other=0).to(tl.int64)
        z = tl.zeros((ROWS, BLOCK_R), dtype=tl.float32)
        _norm_rows(y_ptr, h_ptr, w_ptr, hout_ptr, x_ptr, rows, m_ok, z, b_ptr, stride_bn, 0, R, n, eps,
                   stride_y, stride_h, stride_ho, stride_x, ROWS, BLOCK_N, BLOCK_R, False, ONE_PASS)


def lora_add_rms_norm_triton(h, y, x, weight, eps: float, lora_a, lora_b, lp: LaunchPlan, ranks, scales,
                             b_pitched: bool = False, config: dict | None = None, out=None):
    """(h + y + the LoRA deltas of ``x``, its RMSNorm times ``weight``) as the shrink and one
    fused launch (module docstring); ``h``, ``y`` [T, n] are read, not written; returns two new
    [T, n] tensors. ``lora_a`` [S, 1, R, d_in], ``lora_b`` [S, n, R] (rank-pitched with
    ``b_pitched``), ``ranks``/``scales`` [1, S]; ``lp`` covers the T rows. No host
    synchronisation: capturable in a CUDA graph. Callers have checked shapes and values
    (``mlora.kernels.lora_add_rms_norm``). ``config``: ``launch_config`` overrides for the
    shrink, plus ``norm_rows``, ``norm_block_n``, ``norm_warps`` (the module's defaults).
    ``out``: (h', x) tensors to write (row-major [T, n]) instead of new ones."""
    T, n = y.shape
    hout, out = out if out is not None else (torch.empty_like(y), torch.empty_like(y))
    if T == 0:
        return hout, out
    assert lora_a.shape[1] == 1 and lora_b.shape[1] == n and y.stride(1) == 1 and h.stride(1) == 1
    S, _, R, d_in = lora_a.shape
    if b_pitched:
        check_pitched(lora_b)
    pitched = b_pitched and R % 8 == 0  # else the pitch is R for every rank: the padded layout
    x, lora_a, lora_b, ranks, scales, native_a, native_b = _kernel_operands(x, lora_a, lora_b, ranks, scales)
    config = dict(config or {})
    rows = int(config.pop("norm_rows", NORM_ROWS))
    block_n = int(config.pop("norm_block_n", NORM_BLOCK_N))
    warps = int(config.pop("norm_warps", NORM_WARPS))
    block_n = min(block_n, triton.next_power_of_2(n))
    bm = lp.block_m
    if bm % rows:
        rows = bm
    cfg = _config(lp, x, lora_a, [n], native_a, config or None, fusable=False)
    pdl = cfg["pdl"] and _pdl_supported(x.device)
    zp = _shrink(x, lora_a, lp, ranks, cfg, native_a, pdl)
    grid = (lp.tile_capacity * (bm // rows) + triton.cdiv(lp.base_rows.numel(), rows),)
    extra = dict(launch_pdl=True) if pdl else {}
    _lora_add_rms_norm_kernel[grid](
        zp, lora_b, y, h, weight, hout, out, lp.sorted_rows, lp.tile_slot, lp.tile_start, lp.tile_end, lp.num_tiles,
        lp.base_rows, lp.num_base, ranks, scales,
        lp.tile_capacity, n, eps, R, ranks.stride(1), zp.stride(1), lora_b.stride(0), lora_b.stride(1),
        y.stride(0), h.stride(0), hout.stride(0), out.stride(0),
        SUB=bm // rows, ROWS=rows, BLOCK_N=block_n, BLOCK_R=cfg["block_r_expand"],
        ROUND_Z=native_b, USE_PDL=pdl, B_PITCHED=pitched, ONE_PASS=block_n >= n, num_warps=warps, **extra,
    )
    return hout, out
