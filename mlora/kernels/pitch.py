"""Rank-pitched B banks: the B layout in which a low-rank slot's rows are contiguous.

In the padded layout a slot's B is ``[sum(widths), R]`` with row stride R, so a slot of
rank r < R reads ``r`` of every ``R`` entries of its rows: for rank 8 or 16 in a rank-64
bank that is 16 or 32 bytes of every 128-byte row, scattered, which DRAM delivers at well
below its rate. In the rank-pitched layout the same
``sum(widths) * R`` elements of each slot hold slice j's B (rows ``[O_j, O_j + w_j)`` in the
padded layout, ``O_j = sum(widths[:j])``) as a row-major ``[w_j, p]`` block starting at
element ``O_j * R``, with the pitch ``p = b_pitch(rank of slice j, R)``: the rank rounded up
to 8 (whole 16-byte vectors), at most R. Entries ``[r, p)`` of each row and everything
after the block up to ``O_{j+1} * R`` are padding: they never reach y (the expand zeroes
rank columns past r before use, exactly as in the padded layout), and an engine bank keeps
them zero (docs/design.md, Logical and physical rank). A rank equal to R gives the padded layout, so a bank whose slots all
have rank R is the same bytes either way. When R is not a multiple of 8 the pitch is R for
every rank (rows could not be whole vectors), i.e. the padded layout.

This is part of the local kernel ABI (docs/kernels.md): ``add_lora_slices(..., b_layout=
"rank-pitched")`` reads it on every backend; the public one-slice ``add_lora`` takes the
padded (logical) layout only.
"""

from __future__ import annotations

import torch

B_LAYOUTS = ("padded", "rank-pitched")


def b_pitch(rank: int, R: int) -> int:
    """Row pitch of a rank-``rank`` slice in a rank-pitched bank of physical rank ``R``."""
    if R % 8:
        return R
    return min(-(-int(rank) // 8) * 8, R)


def pitched_span(off: int, width: int, rank: int, R: int) -> tuple[slice, int]:
    """(elements of a slot's flat ``[sum(widths) * R]`` run, pitch) of the rank-``rank`` slice at
    B rows ``[off, off + width)``: its ``[width, pitch]`` block, row-major."""
    p = b_pitch(rank, R)
    return slice(off * R, off * R + width * p), p


def pitched_view(lora_b: torch.Tensor, s: int, off: int, width: int, rank: int) -> torch.Tensor:
    """``[width, rank]`` view of slot ``s``'s slice at B rows ``[off, off + width)`` of the
    rank-pitched bank ``lora_b`` (``[S, sum(widths), R]``, each slot's ``[sum(widths), R]``
    contiguous): the logical ``lora_b[s, off:off + width, :rank]`` of the padded layout."""
    span, p = pitched_span(off, width, rank, lora_b.shape[2])
    return lora_b[s].view(-1)[span].view(width, p)[:, :rank]  # a view, never a copy


def to_rank_pitched(lora_b: torch.Tensor, ranks: torch.Tensor, widths) -> torch.Tensor:
    """A rank-pitched copy of the padded bank ``lora_b`` ``[S, sum(widths), R]`` for the slice
    ranks ``ranks`` ``[n, S]``: padding zero, columns at or past each rank dropped."""
    S, _, R = lora_b.shape
    out = torch.zeros_like(lora_b, memory_format=torch.contiguous_format)
    ranks = ranks.cpu().tolist()
    for s in range(S):
        off = 0
        for j, w in enumerate(int(w) for w in widths):
            r = int(ranks[j][s])
            if r:
                pitched_view(out, s, off, w, r).copy_(lora_b[s, off : off + w, :r])
            off += w
    return out


def check_pitched(lora_b: torch.Tensor) -> None:
    """A rank-pitched bank must hold each slot's ``[sum(widths), R]`` contiguously."""
    if lora_b.stride(2) != 1 or lora_b.stride(1) != lora_b.shape[2]:
        raise ValueError(f"a rank-pitched B bank needs each slot's [sum(widths), R] contiguous; strides "
                         f"{tuple(lora_b.stride())} for shape {tuple(lora_b.shape)}")
