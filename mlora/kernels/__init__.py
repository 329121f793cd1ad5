"""Segmented LoRA execution (docs/design.md: Segment plan, Launch plan, Logical and physical rank).

Public entry points::

    add_lora(y, x, lora_a, lora_b, row_slots, *, ranks=None, scales=None, backend="auto", plan=None) -> y
      x:         [T, d_in]           bf16 / fp16 / fp32
      y:         [T, d_out]          updated in place and returned
      lora_a:    [S, R, d_in]        slot bank, logical orientation (R = physical max rank)
      lora_b:    [S, d_out, R]
      row_slots: int32 [T]           slot of each row, -1 = base only
      ranks:     int32 [S] or None   true rank per slot; columns/rows >= ranks[s] never reach y (they may
                                     hold NaN; the Triton expand may load up to 7 of them past a rank that
                                     is not a multiple of 8 and discards them: docs/kernels.md)
      scales:    float32 [S] or None
      semantics: for every t with s = row_slots[t] >= 0:
         y[t] += scales[s] * (x[t] @ lora_a[s, :ranks[s]].T) @ lora_b[s, :, :ranks[s]].T
      rows with s = -1 are left exactly as they were.

    add_lora_slices(y, x, lora_a, lora_b, row_slots, *, widths, ranks=None, scales=None, backend="auto",
                    plan=None, check_values=True, out_offsets=None, b_layout="padded", reduce_z=None) -> y
      the fused multi-slice form (q/k/v, gate/up) in one shrink and one expand launch:
      lora_a [S, n, R, d_in], lora_b [S, sum(widths), R], ranks and scales [n, S];
      slice j owns the output columns [off_j, off_j + widths[j]) with off_j = sum(widths[:j]):
         y[t, off_j:off_j+w_j] += scales[j, s] * (x[t] @ lora_a[s, j, :ranks[j, s]].T)
                                                 @ lora_b[s, off_j:off_j+w_j, :ranks[j, s]].T
      a slot with ranks[j, s] == 0 leaves slice j of its rows untouched.
      ``out_offsets`` (optional, n ints): slice j owns y's columns [out_offsets[j], out_offsets[j] + w_j)
      instead (increasing, non-overlapping, within y): a bank holding only some slices of a fused
      projection (q and v of q/k/v) adds into the full projection output, the other columns untouched.
      ``b_layout="rank-pitched"``: lora_b holds each slot's slices with row stride = the slice's rank
      rounded up to 8 (``mlora.kernels.pitch``: contiguous rows for low-rank slots in a wide bank);
      ``lora_b[s, off_j:off_j+w_j, :r]`` above then means ``pitch.pitched_view(lora_b, s, off_j, w_j, r)``.
      ``reduce_z`` (optional, a callable): runs between the shrink of every row and the
      expands (once a call; Triton: once per launch pair of up to four slices) on the float32
      bottleneck z ``[rows, n * R]`` (slice j at columns j * R; row order and height are the
      backend's own) and updates it in place, e.g. sums it with the same call's z on the
      other ranks of a tensor-parallel group: the semantics above with
      ``x[t] @ lora_a[s, j, :r].T`` replaced by its result (a row-parallel module's partial
      shrinks summed before the expand). Entries past a slot's rank and rows of no tile may
      hold anything and never reach y; whether it is called depends only on the plan and
      the shapes, so ranks making the same call call it alike.

Backends: ``"torch"`` (the per-slot loop over a SegmentPlan; CPU and GPU) and
``"triton"`` (segmented split-K shrink and multi-slice expand over a
LaunchPlan tile list, ``triton_sgmv.py``; runs on CPU under
``TRITON_INTERPRET=1``). ``"auto"`` picks Triton for CUDA tensors and torch
otherwise. ``plan`` may be a SegmentPlan (either backend) or, for Triton, a
LaunchPlan; with a LaunchPlan and ``check_values=False`` a Triton call does
no host synchronisation and can be captured in a CUDA graph (the engine
checks ranks when it writes the bank and row slots when it builds the plan).

This package imports nothing else from mlora.
"""

from __future__ import annotations

import torch

from mlora.kernels.launch import LaunchPlan, choose_block_m, empty_launch_plan, make_launch_plan, tile_capacity
from mlora.kernels.pitch import B_LAYOUTS, b_pitch, check_pitched, pitched_span, pitched_view, to_rank_pitched
from mlora.kernels.plan import PlanError, SegmentPlan, build_plan, validate_plan
from mlora.kernels.reference import lora_gather_bmm, lora_loop, lora_loop_reduced, lora_oracle_f64
from mlora.kernels.triton_act import lora_silu_mul_triton
from mlora.kernels.triton_sgmv import add_lora_slices_triton

__all__ = [
    "B_LAYOUTS", "LaunchPlan", "PlanError", "SegmentPlan", "add_lora", "add_lora_slices", "b_pitch", "build_plan",
    "check_bank", "pitched_span", "pitched_view", "to_rank_pitched",
    "choose_block_m", "empty_launch_plan", "lora_gather_bmm", "lora_loop", "lora_oracle_f64", "lora_silu_mul",
    "make_launch_plan", "silu_mul_ref", "tile_capacity", "validate_plan",
]

_FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_shapes(y, x, lora_a, lora_b, row_slots, widths, ranks, scales, out_offsets=None) -> None:
    """Shape, dtype and device checks (no device synchronisation) of a sliced bank call."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise PlanError("E_BANK_SHAPE", f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [T, d_in] and [T, d_out]")
    if lora_a.dim() != 4 or lora_b.dim() != 3:
        raise PlanError("E_BANK_SHAPE", "lora_a must be [S, n, R, d_in] and lora_b [S, sum(widths), R]")
    S, n, R, d_in = lora_a.shape
    if len(widths) != n or any(int(w) <= 0 for w in widths):
        raise PlanError("E_BANK_SHAPE", f"widths {list(widths)} must give one positive width per slice ({n})")
    if lora_b.shape[0] != S or lora_b.shape[2] != R or lora_b.shape[1] != sum(widths):
        raise PlanError("E_BANK_SHAPE", f"lora_b {tuple(lora_b.shape)} does not match lora_a {tuple(lora_a.shape)} "
                        f"and widths {list(widths)}")
    if out_offsets is None:
        y_width_ok = y.shape[1] == lora_b.shape[1]
    else:
        ends = [int(o) + int(w) for o, w in zip(out_offsets, widths)]
        if len(out_offsets) != n or int(out_offsets[0]) < 0 or any(
                int(out_offsets[j + 1]) < ends[j] for j in range(n - 1)):
            raise PlanError("E_BANK_SHAPE", f"out_offsets {list(out_offsets)} must give one first column per slice "
                            f"({n}), increasing, each slice's columns (widths {list(widths)}) not overlapping the next")
        y_width_ok = y.shape[1] >= ends[-1]
    if x.shape[1] != d_in or not y_width_ok:
        raise PlanError("E_BANK_SHAPE", f"x/y widths {x.shape[1]}/{y.shape[1]} do not match the bank {d_in}/{lora_b.shape[1]}"
                        + ("" if out_offsets is None else f" at out_offsets {list(out_offsets)}"))
    if row_slots.shape != (x.shape[0],) or row_slots.dtype not in (torch.int32, torch.int64):
        raise PlanError("E_BANK_SHAPE", "row_slots must be an int32 vector with one entry per row")
    for name, t in (("x", x), ("y", y), ("lora_a", lora_a), ("lora_b", lora_b)):
        if t.dtype not in _FLOAT_TYPES:
            raise PlanError("E_BANK_DTYPE", f"{name} is {t.dtype}; use bfloat16, float16 or float32")
    if lora_a.dtype != lora_b.dtype:
        raise PlanError("E_BANK_DTYPE", f"lora_a is {lora_a.dtype} but lora_b is {lora_b.dtype}")
    if ranks is not None and ranks.shape != (n, S):
        raise PlanError("E_BANK_SHAPE", f"ranks must be [n={n}, S={S}], got {tuple(ranks.shape)}")
    if scales is not None and scales.shape != (n, S):
        raise PlanError("E_BANK_SHAPE", f"scales must be [n={n}, S={S}], got {tuple(scales.shape)}")
    tensors = [y, x, lora_a, lora_b, row_slots] + [t for t in (ranks, scales) if t is not None]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise PlanError("E_BANK_DEVICE", f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_values(row_slots, S, R, ranks) -> None:
    """Value checks (these synchronise with the device)."""
    if ranks is not None and ((ranks < 0) | (ranks > R)).any():
        raise PlanError("E_BANK_RANK_EXCEEDS_R", f"ranks must lie in [0, R={R}]")
    if row_slots.numel() and (row_slots.max() >= S or row_slots.min() < -1):
        raise PlanError("E_PLAN_SLOT_RANGE", f"row_slots must lie in [-1, {S})")


def check_bank(y, x, lora_a, lora_b, row_slots, ranks=None, scales=None) -> None:
    """Checks of a one-slice add_lora call; PlanError names the mismatch."""
    if lora_a.dim() != 3 or lora_b.dim() != 3:
        raise PlanError("E_BANK_SHAPE", "lora_a must be [S, R, d_in] and lora_b [S, d_out, R]")
    if ranks is not None and ranks.shape != (lora_a.shape[0],):
        raise PlanError("E_BANK_RANK_EXCEEDS_R" if ranks.dim() == 1 else "E_BANK_SHAPE",
                        f"ranks must be [S={lora_a.shape[0]}] with values in [0, R={lora_a.shape[1]}]")
    if scales is not None and scales.shape != (lora_a.shape[0],):
        raise PlanError("E_BANK_SHAPE", f"scales must be [S={lora_a.shape[0]}]")
    if lora_b.shape[0] != lora_a.shape[0] or lora_b.shape[2] != lora_a.shape[1]:
        raise PlanError("E_BANK_SHAPE", f"lora_b {tuple(lora_b.shape)} does not match lora_a {tuple(lora_a.shape)}")
    _check_shapes(y, x, lora_a[:, None], lora_b, row_slots, [lora_b.shape[1]],
                  None if ranks is None else ranks[None], None if scales is None else scales[None])
    _check_values(row_slots, lora_a.shape[0], lora_a.shape[1], ranks)


def add_lora(y, x, lora_a, lora_b, row_slots, *, ranks=None, scales=None, backend="auto", plan=None):
    """Add the segmented LoRA delta to ``y`` in place and return it (semantics above)."""
    check_bank(y, x, lora_a, lora_b, row_slots, ranks, scales)
    backend = _resolve(backend, x)
    if backend == "torch":
        if isinstance(plan, LaunchPlan):
            raise ValueError("the torch backend takes a SegmentPlan, not a LaunchPlan")
        return lora_loop(y, x, lora_a, lora_b, row_slots, ranks, scales, plan)
    return add_lora_slices(
        y, x, lora_a[:, None], lora_b, row_slots, widths=[lora_b.shape[1]],
        ranks=None if ranks is None else ranks[None], scales=None if scales is None else scales[None],
        backend=backend, plan=plan, check_values=False,
    )


def add_lora_slices(y, x, lora_a, lora_b, row_slots, *, widths, ranks=None, scales=None, backend="auto",
                    plan=None, check_values=True, out_offsets=None, b_layout="padded", reduce_z=None):
    """Add the fused multi-slice LoRA delta to ``y`` in place and return it (semantics above).
    ``b_layout``: ``"padded"`` or ``"rank-pitched"`` (``mlora.kernels.pitch``). ``reduce_z``:
    an in-place reduction of the bottleneck between the shrink and the expand (above)."""
    widths = [int(w) for w in widths]
    _check_shapes(y, x, lora_a, lora_b, row_slots, widths, ranks, scales, out_offsets)
    ranks, scales, pitched = _bank_tables(lora_a, lora_b, row_slots, ranks, scales, b_layout, check_values)
    if out_offsets is None:
        out_offsets = [sum(widths[:j]) for j in range(len(widths))]
    out_offsets = [int(o) for o in out_offsets]
    backend = _resolve(backend, x)
    if backend == "torch":
        if isinstance(plan, LaunchPlan):
            raise ValueError("the torch backend takes a SegmentPlan, not a LaunchPlan")
        plan = plan or build_plan(row_slots)
        if reduce_z is not None:
            view = (lambda s, off, w, r: pitched_view(lora_b, s, off, w, r)) if pitched else None
            return lora_loop_reduced(y, x, lora_a, lora_b, plan, ranks, scales, widths, out_offsets, reduce_z,
                                     b_view=view)
        off = 0
        for j, w in enumerate(widths):
            col = out_offsets[j]
            view = (lambda s, r, off=off, w=w: pitched_view(lora_b, s, off, w, r)) if pitched else None
            lora_loop(y[:, col : col + w], x, lora_a[:, j], lora_b[:, off : off + w], row_slots, ranks[j], scales[j], plan,
                      b_view=view)
            off += w
        return y
    plan = _launch_plan(plan, row_slots, x)
    if plan.row_capacity < 1 or plan.tile_capacity < 1:
        return y
    return add_lora_slices_triton(y, x, lora_a, lora_b, plan, ranks.to(torch.int32), scales.to(torch.float32), widths,
                                  out_offsets=out_offsets, b_pitched=pitched, reduce_z=reduce_z)


def silu_mul_ref(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate | up]`` [T, 2 * inter] in its dtype (silu rounded
    to it, then the product): the SiLU product every path of :func:`lora_silu_mul` ends with."""
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    return torch.nn.functional.silu(gate) * up


def lora_silu_mul(gate_up, x, lora_a, lora_b, row_slots, *, inter, ranks=None, scales=None, backend="auto",
                  plan=None, check_values=True, b_layout="padded"):
    """``silu(gate) * up`` after the gate/up LoRA deltas, without writing them into ``gate_up``:
    the same result as ``add_lora_slices(gate_up, x, lora_a, lora_b, row_slots, widths=(inter,
    inter), ...)`` then :func:`silu_mul_ref` (``gate_up`` [T, 2 * inter] is left as it was;
    returns a new [T, inter]). ``lora_a`` [S, 2, R, d_in], ``lora_b`` [S, 2 * inter, R]. The
    torch backend runs exactly those two steps on a copy; the Triton backend adds the deltas
    inside the SiLU product (``triton_act``: one launch after the shrink, no read-modify-write
    of ``gate_up``)."""
    widths = [int(inter), int(inter)]
    if lora_a.dim() != 4 or lora_a.shape[1] != 2:
        raise PlanError("E_BANK_SHAPE", f"lora_silu_mul takes a gate/up bank [S, 2, R, d_in], got "
                        f"{tuple(lora_a.shape)}")
    backend = _resolve(backend, x)
    if backend == "torch":
        y = add_lora_slices(gate_up.clone(), x, lora_a, lora_b, row_slots, widths=widths, ranks=ranks, scales=scales,
                            backend="torch", plan=plan, check_values=check_values, b_layout=b_layout)
        return silu_mul_ref(y, inter)
    _check_shapes(gate_up, x, lora_a, lora_b, row_slots, widths, ranks, scales)
    ranks, scales, pitched = _bank_tables(lora_a, lora_b, row_slots, ranks, scales, b_layout, check_values)
    return lora_silu_mul_triton(gate_up, x, lora_a, lora_b, _launch_plan(plan, row_slots, x), ranks.to(torch.int32),
                                scales.to(torch.float32), inter, b_pitched=pitched)


def _bank_tables(lora_a, lora_b, row_slots, ranks, scales, b_layout: str, check_values: bool):
    """(ranks, scales, whether B is rank-pitched) of a checked-shape call: the layout named and
    checked, the values checked when asked (``_check_values``: syncs), absent tables filled
    (every slot at the bank's rank R, scale 1)."""
    if b_layout not in B_LAYOUTS:
        raise ValueError(f"unknown b_layout {b_layout!r}; expected one of {B_LAYOUTS}")
    pitched = b_layout == "rank-pitched"
    if pitched:
        try:
            check_pitched(lora_b)
        except ValueError as e:
            raise PlanError("E_BANK_SHAPE", str(e)) from None
    S, n, R, _ = lora_a.shape
    if check_values:
        _check_values(row_slots, S, R, ranks)
    if ranks is None:
        ranks = torch.full((n, S), R, dtype=torch.int32, device=lora_a.device)
    if scales is None:
        scales = torch.ones((n, S), dtype=torch.float32, device=lora_a.device)
    return ranks, scales, pitched


def _launch_plan(plan, row_slots, x) -> LaunchPlan:
    """The LaunchPlan a Triton call launches over (``plan`` as given, or built from the
    SegmentPlan or the row slots), on x's device."""
    if not isinstance(plan, LaunchPlan):
        plan = make_launch_plan(plan or build_plan(row_slots))
    if plan.device != x.device:
        raise PlanError("E_BANK_DEVICE", f"launch plan is on {plan.device}, tensors on {x.device}")
    return plan


def _resolve(backend: str, x) -> str:
    if backend == "auto":
        return "triton" if x.is_cuda else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'torch' or 'triton'")
    return backend
