"""Triton segmented shrink and expand kernels over a SegmentPlan (first version).

Owns the Triton fast path of :func:`mlora.kernels.add_lora` (same semantics)::

    shrink:  z[u, :ranks[s]]  = x[g[u]] @ lora_a[s, :ranks[s]].T        (fp32, grouped row order u)
    expand:  y[g[u]]         += scales[s] * z[u, :ranks[s]] @ lora_b[s, :, :ranks[s]].T
    where s = slot_ids[t] for u in [starts[t], starts[t+1]); rows outside the plan are untouched.

Local kernel ABI (spec 0x01G): factors in the logical orientation of the slot
bank (A [S, R, d_in], B [S, d_out, R], row-major), scale applied in the expand
epilogue, fp32 intermediate ``z`` in grouped order, indexed rows (x and y stay
in scheduler order; ``sorted_rows`` is the row-address vector). Shrink uses a
tensor-core dot when x and A share a 16-bit dtype, else IEEE fp32 (never TF32);
expand runs in IEEE fp32 from the fp32 ``z`` (correct first; tuning is step 2 work).

Variable rank inside one launch: a rank tile at or beyond ``ranks[s]`` exits
at once and loads past the true rank are masked (never read), so padded tails
cost nothing and may hold anything, NaN included.

Grid: (segment, row tile, rank or column tile). NOT YET: split-K for decode,
multi-slice outputs, a tile list sized to the active (slot, tile) pairs, CUDA
graph capture (the grid depends on ``max_count``), tuning.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .plan import SegmentPlan

# The CPU interpreter mis-computes 16-bit tl.dot; there the fp32 path runs
# (GPU runs of the same tests cover the native path).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _segment(starts_ptr, slots_ptr, ranks_ptr):
    """(first grouped row, row count, slot, true rank) of this program's segment."""
    seg = tl.program_id(0)
    start = tl.load(starts_ptr + seg)
    count = tl.load(starts_ptr + seg + 1) - start
    slot = tl.load(slots_ptr + seg)
    return start, count, slot, tl.load(ranks_ptr + slot)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, z_ptr, rows_ptr, starts_ptr, slots_ptr, ranks_ptr,
    d_in, R,
    stride_xt, stride_as, stride_ar, stride_zu,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, NATIVE_DOT: tl.constexpr,
):
    start, count, slot, rank = _segment(starts_ptr, slots_ptr, ranks_ptr)
    pid_m = tl.program_id(1)
    pid_r = tl.program_id(2)
    if pid_m * BLOCK_M >= count or pid_r * BLOCK_R >= rank:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_ok = offs_m < count
    r_ok = offs_r < rank
    rows = tl.load(rows_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < d_in
        xt = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(
            a_ptr + slot.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :],
            mask=r_ok[:, None] & k_ok[None, :], other=0.0,
        )
        if NATIVE_DOT:  # x and A share a 16-bit dtype: tensor-core dot, fp32 accumulation
            acc += tl.dot(xt, tl.trans(at))
        else:  # fp32 (or mixed) inputs: exact fp32 products, no TF32 rounding
            acc += tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), input_precision="ieee")
    u = (start + offs_m).to(tl.int64)
    tl.store(z_ptr + u[:, None] * stride_zu + offs_r[None, :], acc, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    z_ptr, b_ptr, y_ptr, rows_ptr, starts_ptr, slots_ptr, ranks_ptr, scales_ptr,
    d_out, R,
    stride_zu, stride_bs, stride_bn, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    start, count, slot, rank = _segment(starts_ptr, slots_ptr, ranks_ptr)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    if pid_m * BLOCK_M >= count or rank == 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < count
    n_ok = offs_n < d_out
    u = (start + offs_m).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # no iterations past the true rank
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < rank
        zt = tl.load(z_ptr + u[:, None] * stride_zu + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        bt = tl.load(
            b_ptr + slot.to(tl.int64) * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
            mask=n_ok[:, None] & r_ok[None, :], other=0.0,
        )
        acc += tl.dot(zt, tl.trans(bt.to(tl.float32)), input_precision="ieee")
    acc = acc * tl.load(scales_ptr + slot)
    rows = tl.load(rows_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
    yp = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    old = tl.load(yp, mask=mask, other=0.0)
    tl.store(yp, (old.to(tl.float32) + acc).to(old.dtype), mask=mask)


def _block(n: int, lo: int = 16, hi: int = 64) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def add_lora_triton(y, x, lora_a, lora_b, plan: SegmentPlan, ranks, scales):
    """Shrink then expand over ``plan``; y updated in place and returned.
    Callers (add_lora) have checked shapes, dtypes and devices."""
    if plan.num_active == 0:
        return y
    S, R, d_in = lora_a.shape
    d_out = lora_b.shape[1]
    x, lora_a, lora_b = x.contiguous(), lora_a.contiguous(), lora_b.contiguous()
    assert y.stride(1) == 1, "y must be row-major"
    z = torch.empty((plan.num_active, R), dtype=torch.float32, device=x.device)
    block_m = _block(plan.max_count)
    block_r = _block(R)
    grid = (plan.num_segments, triton.cdiv(plan.max_count, block_m), triton.cdiv(R, block_r))
    _shrink_kernel[grid](
        x, lora_a, z, plan.sorted_rows, plan.starts, plan.slot_ids, ranks,
        d_in, R, x.stride(0), lora_a.stride(0), lora_a.stride(1), z.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=_block(d_in, 16, 128),
        NATIVE_DOT=x.dtype == lora_a.dtype and x.dtype in (torch.bfloat16, torch.float16) and not _INTERPRET,
    )
    block_n = _block(d_out, 16, 128)
    grid = (plan.num_segments, triton.cdiv(plan.max_count, block_m), triton.cdiv(d_out, block_n))
    _expand_kernel[grid](
        z, lora_b, y, plan.sorted_rows, plan.starts, plan.slot_ids, ranks, scales,
        d_out, R, z.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
    )
    return y
