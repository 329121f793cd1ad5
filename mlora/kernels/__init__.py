"""Segmented LoRA execution (spec 0x02-0x03, 0x06A-0x06E).

Public entry point::

    add_lora(y, x, lora_a, lora_b, row_slots, *, ranks=None, scales=None, backend="auto", plan=None) -> y
      x:         [T, d_in]           bf16 / fp16 / fp32
      y:         [T, d_out]          updated in place and returned
      lora_a:    [S, R, d_in]        slot bank, logical orientation (R = physical max rank)
      lora_b:    [S, d_out, R]
      row_slots: int32 [T]           slot of each row, -1 = base only
      ranks:     int32 [S] or None   true rank per slot; columns/rows >= ranks[s] are never read
      scales:    float32 [S] or None
      semantics: for every t with s = row_slots[t] >= 0:
         y[t] += scales[s] * (x[t] @ lora_a[s, :ranks[s]].T) @ lora_b[s, :, :ranks[s]].T
      rows with s = -1 are left exactly as they were.

Backends: ``"torch"`` (the per-slot loop over a SegmentPlan; CPU and GPU) and
``"triton"`` (segmented shrink and expand kernels, ``triton_sgmv.py``; runs on
CPU under ``TRITON_INTERPRET=1``). ``"auto"`` picks Triton for CUDA tensors and
torch otherwise. The Triton path is a first version: correct against the
oracle, not yet tuned, split-K, multi-slice or graph-capturable (step 2).

This package imports nothing else from mlora.
"""

from __future__ import annotations

import torch

from .plan import PlanError, SegmentPlan, build_plan, validate_plan
from .reference import default_ranks_scales, lora_gather_bmm, lora_loop, lora_oracle_f64

__all__ = [
    "PlanError", "SegmentPlan", "add_lora", "build_plan", "check_bank", "lora_gather_bmm", "lora_loop",
    "lora_oracle_f64", "validate_plan",
]

_FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_bank(y, x, lora_a, lora_b, row_slots, ranks=None, scales=None) -> None:
    """Shape, dtype and device checks of an add_lora call; PlanError names the mismatch."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise PlanError("E_BANK_SHAPE", f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [T, d_in] and [T, d_out]")
    if lora_a.dim() != 3 or lora_b.dim() != 3:
        raise PlanError("E_BANK_SHAPE", "lora_a must be [S, R, d_in] and lora_b [S, d_out, R]")
    S, R, d_in = lora_a.shape
    if lora_b.shape[0] != S or lora_b.shape[2] != R:
        raise PlanError("E_BANK_SHAPE", f"lora_b {tuple(lora_b.shape)} does not match lora_a {tuple(lora_a.shape)}")
    if x.shape[1] != d_in or y.shape[1] != lora_b.shape[1]:
        raise PlanError("E_BANK_SHAPE", f"x/y widths {x.shape[1]}/{y.shape[1]} do not match the bank {d_in}/{lora_b.shape[1]}")
    if row_slots.shape != (x.shape[0],) or row_slots.dtype not in (torch.int32, torch.int64):
        raise PlanError("E_BANK_SHAPE", "row_slots must be an int32 vector with one entry per row")
    for name, t in (("x", x), ("y", y), ("lora_a", lora_a), ("lora_b", lora_b)):
        if t.dtype not in _FLOAT_TYPES:
            raise PlanError("E_BANK_DTYPE", f"{name} is {t.dtype}; use bfloat16, float16 or float32")
    if lora_a.dtype != lora_b.dtype:
        raise PlanError("E_BANK_DTYPE", f"lora_a is {lora_a.dtype} but lora_b is {lora_b.dtype}")
    if ranks is not None and (ranks.shape != (S,) or ((ranks < 0) | (ranks > R)).any()):
        raise PlanError("E_BANK_RANK_EXCEEDS_R", f"ranks must be [S] with values in [0, R={R}]")
    if scales is not None and scales.shape != (S,):
        raise PlanError("E_BANK_SHAPE", f"scales must be [S={S}]")
    if row_slots.numel() and (row_slots.max() >= S or row_slots.min() < -1):
        raise PlanError("E_PLAN_SLOT_RANGE", f"row_slots must lie in [-1, {S})")
    devices = {t.device for t in (y, x, lora_a, lora_b, row_slots)}
    if len(devices) != 1:
        raise PlanError("E_BANK_DEVICE", f"all tensors must be on one device, got {sorted(map(str, devices))}")


def add_lora(y, x, lora_a, lora_b, row_slots, *, ranks=None, scales=None, backend="auto", plan=None):
    """Add the segmented LoRA delta to ``y`` in place and return it (semantics above)."""
    check_bank(y, x, lora_a, lora_b, row_slots, ranks, scales)
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    if backend == "torch":
        return lora_loop(y, x, lora_a, lora_b, row_slots, ranks, scales, plan)
    if backend == "triton":
        from .triton_sgmv import add_lora_triton  # deferred: importing triton is slow

        ranks, scales = default_ranks_scales(lora_a, ranks, scales)
        plan = plan or build_plan(row_slots)
        return add_lora_triton(y, x, lora_a, lora_b, plan, ranks.to(torch.int32), scales.to(torch.float32))
    raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'torch' or 'triton'")
