"""A stream-K GEMM, ``y = x @ w.T``, for the base model's decode-size linear layers (issue step 7).

An experiment, not an engine path (nothing in ``mlora.batch`` calls it). At 256 running rows
the Llama-3-8B layer GEMMs are compute-bound and cuBLAS leaves their flop floor 1.3x away
(``scripts/gemm_probe.py``, twenty-fourth session): the fused gate/up GEMM runs 224 output
tiles of 256x128 on 132 SMs (1.7 waves, 99-100 us against 77), the down projection splits K
in a second, reducing launch. Stream-K (Osama et al., 2023) gives every SM the same number
of K-iterations instead of the same number of tiles: no partial last wave, no reduce launch.

Schedule, for ``P`` persistent programs over ``T`` output tiles of ``BM x BN``, each
``I = K / BK`` iterations deep:

* **data-parallel part**: the first ``D`` tiles, whole, program ``p`` taking tiles
  ``p, p + P, ...`` (``D`` is the largest multiple of ``P`` below ``T``, or ``T`` when ``P``
  divides it; ``mode="dp"``: ``D = T``, a plain persistent GEMM).
* **stream-K part**: the remaining ``T - D`` tiles' ``(T - D) * I`` iterations cut into ``P``
  contiguous runs whose lengths differ by at most one. A run that covers a whole tile stores
  it; a run over part of a tile adds its fp32 partial sum into the tile's workspace with
  atomic adds, then adds its iteration count to the tile's counter (acquire-release, after a
  barrier). The run that brings the counter to ``I`` is the last: it reads the workspace,
  stores the tile, and zeroes the workspace and the counter for the next call.

The workspace (fp32, one ``BM x BN`` block per stream-K tile) and counters are held per
device and grown on first use outside graph capture; every call leaves them zero, so calls in
one stream may share them (two streams at once may not). The sum over K is split at
iteration boundaries, so the result differs from one full-K dot product by fp32 rounding
only. Requirements: 2-D row-major ``x`` [M, K] and ``w`` [N, K] of one dtype, ``K % BK ==
0``; ``M`` and ``N`` need not divide the tiles (loads wrap, stores are masked).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MODES = ("hybrid", "dp", "sk")
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


@triton.jit
def _partial(x_ptr, w_ptr, M, N, sxm, swn, pid_m, pid_n, k_lo, k_hi,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 sum over K-iterations [k_lo, k_hi) of one output tile (rows and columns wrap)."""
    rm = (pid_m * BM + tl.arange(0, BM)) % M
    rn = (pid_n * BN + tl.arange(0, BN)) % N
    rk = tl.arange(0, BK)
    a_ptrs = x_ptr + rm[:, None] * sxm + rk[None, :]
    b_ptrs = w_ptr + rn[:, None] * swn + rk[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in tl.range(k_lo, k_hi, num_stages=STAGES):
        a = tl.load(a_ptrs + ki * BK)
        b = tl.load(b_ptrs + ki * BK)
        if NATIVE:  # 16-bit inputs: tensor-core dot, fp32 accumulation
            acc = tl.dot(a, tl.trans(b), acc)
        else:  # fp32 inputs, or the CPU interpreter (which mis-computes 16-bit dots): exact fp32 products
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    return acc


@triton.jit
def _partial_tma(x_desc, w_desc, pid_m, pid_n, k_lo, k_hi, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 STAGES: tl.constexpr):
    """:func:`_partial` through tensor descriptors (the bulk tensor copy engine; rows past M and
    columns past N read as zeros)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in tl.range(k_lo, k_hi, num_stages=STAGES):
        a = x_desc.load([pid_m * BM, ki * BK])
        b = w_desc.load([pid_n * BN, ki * BK])
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _tile(x_ptr, w_ptr, x_desc, w_desc, M, N, sxm, swn, pid_m, pid_n, k_lo, k_hi, BM: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, NATIVE: tl.constexpr, TMA: tl.constexpr):
    if TMA:
        acc = _partial_tma(x_desc, w_desc, pid_m, pid_n, k_lo, k_hi, BM, BN, BK, STAGES)
    else:
        acc = _partial(x_ptr, w_ptr, M, N, sxm, swn, pid_m, pid_n, k_lo, k_hi, BM, BN, BK, STAGES, NATIVE)
    return acc


@triton.jit
def _streamk_kernel(x_ptr, w_ptr, x_desc, w_desc, y_ptr, ws_ptr, cnt_ptr, M, N, K, sxm, swn, sym, tiles_m,
                    dp_tiles, sk_iters, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                    PROGS: tl.constexpr, NATIVE: tl.constexpr, TMA: tl.constexpr):
    pid = tl.program_id(0)
    iters = K // BK
    om = tl.arange(0, BM)
    on = tl.arange(0, BN)
    for t in range(pid, dp_tiles, PROGS):
        pid_n = t // tiles_m
        pid_m = t % tiles_m
        acc = _tile(x_ptr, w_ptr, x_desc, w_desc, M, N, sxm, swn, pid_m, pid_n, 0, iters, BM, BN, BK, STAGES, NATIVE, TMA)
        rm = pid_m * BM + om
        rn = pid_n * BN + on
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))
    base = sk_iters // PROGS
    rem = sk_iters % PROGS
    it = pid * base + tl.minimum(pid, rem)
    end = it + base + (pid < rem).to(tl.int32)
    while it < end:
        s = it // iters
        k_lo = it % iters
        k_hi = tl.minimum(iters, k_lo + end - it)
        t = dp_tiles + s
        pid_n = t // tiles_m
        pid_m = t % tiles_m
        acc = _tile(x_ptr, w_ptr, x_desc, w_desc, M, N, sxm, swn, pid_m, pid_n, k_lo, k_hi, BM, BN, BK, STAGES, NATIVE,
                    TMA)
        rm = pid_m * BM + om
        rn = pid_n * BN + on
        y_ptrs = y_ptr + rm[:, None] * sym + rn[None, :]
        inside = (rm[:, None] < M) & (rn[None, :] < N)
        if k_hi - k_lo == iters:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=inside)
        else:
            w_ptrs = ws_ptr + s * (BM * BN) + om[:, None] * BN + on[None, :]
            tl.atomic_add(w_ptrs, acc, sem="relaxed")
            tl.debug_barrier()  # every thread's adds issued before the counter's release
            done = tl.atomic_add(cnt_ptr + s, k_hi - k_lo, sem="acq_rel")
            if done + (k_hi - k_lo) == iters:
                total = tl.load(w_ptrs, cache_modifier=".cg")
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=inside)
                tl.store(w_ptrs, tl.zeros((BM, BN), dtype=tl.float32))
                tl.store(cnt_ptr + s, 0)
        it += k_hi - k_lo


def schedule(M: int, N: int, K: int, bm: int, bn: int, bk: int, programs: int, mode: str = "hybrid"):
    """``(tiles_m, dp_tiles, sk_tiles, sk_iters)`` of the module docstring's schedule."""
    if mode not in MODES:
        raise ValueError(f"stream-K mode must be one of {MODES}, got {mode!r}")
    tiles_m, tiles_n = triton.cdiv(M, bm), triton.cdiv(N, bn)
    tiles = tiles_m * tiles_n
    if mode == "dp" or tiles % programs == 0:
        dp = tiles
    elif mode == "sk":
        dp = 0
    else:
        dp = (tiles // programs) * programs
    return tiles_m, dp, tiles - dp, (tiles - dp) * (K // bk)


def _workspace(device: torch.device, tiles: int, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, bm, bn)
    held = _workspaces.get(key)
    if held is None or held[1].numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("streamk_linear: its workspace must be sized by a call outside graph capture first")
        held = (torch.zeros(max(tiles, 1) * bm * bn, dtype=torch.float32, device=device),
                torch.zeros(max(tiles, 1), dtype=torch.int32, device=device))
        _workspaces[key] = held
    return held


def streamk_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *, bm: int = 128,
                   bn: int = 128, bk: int = 64, stages: int = 4, warps: int = 8, programs: int | None = None,
                   mode: str = "hybrid", tma: bool = False) -> torch.Tensor:
    """``x @ w.T`` ([M, K] x [N, K] -> [M, N], x's dtype) by the stream-K schedule above; ``tma``:
    operand tiles through tensor descriptors (Hopper's bulk copies; 16-bit inputs on a GPU only)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != w.dtype:
        raise ValueError(f"streamk_linear: x [M, K] and w [N, K] of one dtype, got {tuple(x.shape)} {x.dtype} "
                         f"and {tuple(w.shape)} {w.dtype}")
    M, K = x.shape
    N = w.shape[0]
    if K % bk or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"streamk_linear: K ({K}) must be a multiple of bk ({bk}) and rows contiguous")
    if out is None:
        out = x.new_empty(M, N)
    if programs is None:
        programs = (torch.cuda.get_device_properties(x.device).multi_processor_count
                    if x.device.type == "cuda" else 4)
    tiles_m, dp, sk_tiles, sk_iters = schedule(M, N, K, bm, bn, bk, programs, mode)
    ws, cnt = _workspace(x.device, sk_tiles, bm, bn)
    native = x.dtype in (torch.float16, torch.bfloat16) and not _INTERPRET
    x_desc = w_desc = None
    if tma:
        if not native or x.device.type != "cuda":
            raise ValueError("streamk_linear: tma=True needs 16-bit inputs on a GPU")
        from triton.tools.tensor_descriptor import TensorDescriptor
        x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    _streamk_kernel[(programs,)](x, w, x_desc, w_desc, out, ws, cnt, M, N, K, x.stride(0), w.stride(0), out.stride(0), tiles_m, dp,
                                 sk_iters, BM=bm, BN=bn, BK=bk, STAGES=stages, PROGS=programs,
                                 NATIVE=native, TMA=tma, num_warps=warps)
    return out
