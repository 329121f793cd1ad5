"""Reference paths for the segmented LoRA update.

Owns the three slow, obviously-right implementations every fast path is tested
against. All share the semantics of :func:`mlora.kernels.add_lora`::

    for every row t with s = row_slots[t] >= 0:
        y[t] += scales[s] * (x[t] @ lora_a[s, :ranks[s]].T) @ lora_b[s, :, :ranks[s]].T
    rows with s = -1 are left exactly as they were;
    columns / rows at or beyond ranks[s] are never read (they may hold NaN).

* :func:`lora_oracle_f64` - per row, float64, exact-rank slices: the oracle.
* :func:`lora_loop` - per active slot over a SegmentPlan, in the input dtype
  with float32 accumulation (PEFT's way: one pair of GEMMs per adapter).
* :func:`lora_gather_bmm` - gather each row's factors (tails masked to zero
  with ``where``, so NaN tails cannot leak) and run two batched matmuls.
* :func:`lora_loop_reduced` - :func:`lora_loop` over every slice in two phases, all
  shrinks, then a caller's in-place reduction of z, then all expands (the torch
  backend of ``add_lora_slices(..., reduce_z=...)``).
"""

from __future__ import annotations

import torch

from mlora.kernels.plan import SegmentPlan, build_plan


def default_ranks_scales(lora_a: torch.Tensor, ranks, scales):
    """``ranks`` and ``scales`` with None replaced by full rank R and scale 1."""
    S, R = lora_a.shape[0], lora_a.shape[1]
    if ranks is None:
        ranks = torch.full((S,), R, dtype=torch.int32, device=lora_a.device)
    if scales is None:
        scales = torch.ones(S, dtype=torch.float32, device=lora_a.device)
    return ranks, scales


def lora_oracle_f64(y, x, lora_a, lora_b, row_slots, ranks=None, scales=None) -> torch.Tensor:
    """Exact per-row float64 result ``y + delta`` (a new float64 tensor)."""
    ranks, scales = default_ranks_scales(lora_a, ranks, scales)
    out = y.detach().to(torch.float64).clone()
    for t, s in enumerate(row_slots.tolist()):
        if s < 0:
            continue
        r = int(ranks[s])
        a = lora_a[s, :r].to(torch.float64)
        b = lora_b[s, :, :r].to(torch.float64)
        out[t] += float(scales[s]) * ((x[t].to(torch.float64) @ a.T) @ b.T)
    return out


def lora_loop(y, x, lora_a, lora_b, row_slots, ranks=None, scales=None, plan: SegmentPlan | None = None,
              b_view=None):
    """One shrink and one expand GEMM per active slot (float32 accumulation); y updated in place.
    ``b_view(s, r)``: slot ``s``'s ``[d_out, r]`` B (default ``lora_b[s, :, :r]``; a rank-pitched
    bank passes :func:`mlora.kernels.pitch.pitched_view`)."""
    ranks, scales = default_ranks_scales(lora_a, ranks, scales)
    plan = plan or build_plan(row_slots)
    rows_all = plan.sorted_rows.long()
    starts = plan.starts.tolist()
    for t, s in enumerate(plan.slot_ids.tolist()):
        r = int(ranks[s])
        rows = rows_all[starts[t] : starts[t + 1]]
        if r == 0:
            continue
        z = x[rows].float() @ lora_a[s, :r].float().T
        b = lora_b[s, :, :r] if b_view is None else b_view(s, r)
        delta = (z @ b.float().T) * scales[s].float()
        y[rows] = (y[rows].float() + delta).to(y.dtype)
    return y


def lora_gather_bmm(y, x, lora_a, lora_b, row_slots, ranks=None, scales=None):
    """Gather per-row factors, mask rank tails, two BMMs (float32); y updated in place."""
    ranks, scales = default_ranks_scales(lora_a, ranks, scales)
    rows = torch.nonzero(row_slots >= 0, as_tuple=True)[0]
    if rows.numel() == 0:
        return y
    slots = row_slots[rows].long()
    R = lora_a.shape[1]
    keep = torch.arange(R, device=x.device)[None, :] < ranks[slots].long()[:, None]  # [N, R]
    a = torch.where(keep[:, :, None], lora_a[slots].float(), 0.0)  # [N, R, d_in]
    b = torch.where(keep[:, None, :], lora_b[slots].float(), 0.0)  # [N, d_out, R]
    z = torch.bmm(a, x[rows].float()[:, :, None])  # [N, R, 1]
    delta = torch.bmm(b, z)[:, :, 0] * scales[slots].float()[:, None]
    y[rows] = (y[rows].float() + delta).to(y.dtype)
    return y


def lora_loop_reduced(y, x, lora_a, lora_b, plan: SegmentPlan, ranks, scales, widths, out_offsets, reduce_z,
                      b_view=None):
    """The multi-slice update (``lora_a`` [S, n, R, d_in], ``lora_b`` [S, sum(widths), R], ranks
    and scales [n, S]) with ``reduce_z`` between the shrinks and the expands; y updated in place.

    Every segment's shrink goes into one float32 z ``[N, n * R]`` (row u = the plan's grouped
    row u, slice j at columns ``j * R``, zero past each rank), then ``reduce_z(z)`` updates it
    in place, then every segment's expand reads it (float32, as :func:`lora_loop`), slice j
    into y's columns from ``out_offsets[j]``. ``b_view(s, off, w, r)``: slot ``s``'s ``[w, r]``
    B of the slice at row ``off`` (default ``lora_b[s, off:off + w, :r]``)."""
    n, R = lora_a.shape[1], lora_a.shape[2]
    rows_all = plan.sorted_rows.long()
    starts = plan.starts.tolist()
    slots = plan.slot_ids.tolist()
    host_ranks, host_scales = ranks.tolist(), scales.tolist()
    z = torch.zeros((rows_all.numel(), n * R), dtype=torch.float32, device=x.device)
    for t, s in enumerate(slots):
        xs = x[rows_all[starts[t] : starts[t + 1]]].float()
        for j in range(n):
            r = int(host_ranks[j][s])
            if r:
                z[starts[t] : starts[t + 1], j * R : j * R + r] = xs @ lora_a[s, j, :r].float().T
    reduce_z(z)
    for t, s in enumerate(slots):
        rows = rows_all[starts[t] : starts[t + 1]]
        off = 0
        for j, w in enumerate(widths):
            r = int(host_ranks[j][s])
            if r:
                b = lora_b[s, off : off + w, :r] if b_view is None else b_view(s, off, w, r)
                delta = (z[starts[t] : starts[t + 1], j * R : j * R + r] @ b.float().T) * host_scales[j][s]
                cols = slice(out_offsets[j], out_offsets[j] + w)
                y[rows, cols] = (y[rows, cols].float() + delta).to(y.dtype)
            off += w
    return y
