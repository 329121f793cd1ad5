"""One-pass Triton check numbers of a 16-bit device view (``host.view_stats`` on a GPU).

Owns the kernel behind :func:`mlora.batch.residency.host.view_stats` for large
bfloat16/float16 views: each program reduces ``TILES`` blocks of words to the
non-finite count, the non-zero count, the sum of the words and the sum of
word x ((position mod ``MOD``) + 1), and adds its four numbers atomically into
one int64 row of the caller's (zeroed) output. Integer sums: exact and
independent of the order the programs finish in (deterministic). A 16-bit
element is one word, so its bits decide finiteness and zero directly. One
launch per view and no reduction afterwards: a load's validation issues
few operations (the engine thread enqueues them between iterations). Must
not know views, slots or artifacts: the caller passes the words, the masks
and the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # words per step: four int64 accumulators of 4096 spilled 2.8 KB per thread to local memory (sm_90)
TILES = 32  # blocks of words per program: 32K words, so a 9 MB view is ~150 programs and ~600 atomics


@triton.jit
def _word_stats_kernel(w_ptr, n, out_ptr, EXP: tl.constexpr, MAG: tl.constexpr, MOD: tl.constexpr,
                       BLOCK: tl.constexpr, TILES: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * (BLOCK * TILES)
    bad_acc = tl.zeros((BLOCK,), dtype=tl.int64)
    nz_acc = tl.zeros((BLOCK,), dtype=tl.int64)
    sum_acc = tl.zeros((BLOCK,), dtype=tl.int64)
    wsum_acc = tl.zeros((BLOCK,), dtype=tl.int64)
    for t in range(TILES):
        offs = first + t * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        w = tl.load(w_ptr + offs, mask=ok, other=0).to(tl.int32)
        bad_acc += (((w & EXP) == EXP) & ok).to(tl.int64)
        nz_acc += ((w & MAG) != 0).to(tl.int64)
        w64 = w.to(tl.int64)
        sum_acc += w64
        wsum_acc += w64 * (offs % MOD + 1)
    tl.atomic_add(out_ptr + 0, tl.sum(bad_acc, axis=0))
    tl.atomic_add(out_ptr + 1, tl.sum(nz_acc, axis=0))
    tl.atomic_add(out_ptr + 2, tl.sum(sum_acc, axis=0))
    tl.atomic_add(out_ptr + 3, tl.sum(wsum_acc, axis=0))


def word_stats_into(words: torch.Tensor, out: torch.Tensor, exp_mask: int, mag_mask: int, modulus: int) -> None:
    """Add (non-finite count, non-zero count, sum, weighted sum) of a contiguous 1-D int16
    tensor holding 16-bit floats into ``out`` (int64 [4] on the words' device, contiguous;
    zero it first for the numbers themselves). One launch."""
    n = words.numel()
    if n == 0:
        return
    programs = -(-n // (BLOCK * TILES))
    _word_stats_kernel[(programs,)](words, n, out, EXP=exp_mask, MAG=mag_mask, MOD=modulus, BLOCK=BLOCK, TILES=TILES)


def word_stats(words: torch.Tensor, exp_mask: int, mag_mask: int, modulus: int) -> torch.Tensor:
    """int64 [4] on the words' device: (non-finite count, non-zero count, sum, weighted sum)
    of a contiguous 1-D int16 tensor holding 16-bit floats."""
    out = torch.zeros(4, dtype=torch.int64, device=words.device)
    word_stats_into(words, out, exp_mask, mag_mask, modulus)
    return out
