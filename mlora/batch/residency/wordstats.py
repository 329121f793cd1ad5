"""One-pass Triton check numbers of a 16-bit device view (``host.view_stats`` on a GPU).

Owns the kernel behind :func:`mlora.batch.residency.host.view_stats` for large
bfloat16/float16 views: per block of words, the non-finite count, the non-zero
count, the sum of the words and the sum of word x ((position mod ``MOD``) + 1),
written as int64 partials per block and summed by one reduction (exact integer
sums: deterministic). A 16-bit element is one word, so
its bits decide finiteness and zero directly. Must not know views, slots or
artifacts: the caller passes the words and the masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _word_stats_kernel(w_ptr, n, out_ptr, EXP: tl.constexpr, MAG: tl.constexpr, MOD: tl.constexpr,
                       BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    w = tl.load(w_ptr + offs, mask=ok, other=0).to(tl.int32)
    bad = ((w & EXP) == EXP) & ok
    nz = (w & MAG) != 0
    w64 = w.to(tl.int64)
    row = out_ptr + tl.program_id(0) * 4
    tl.store(row + 0, tl.sum(bad.to(tl.int64), axis=0))
    tl.store(row + 1, tl.sum(nz.to(tl.int64), axis=0))
    tl.store(row + 2, tl.sum(w64, axis=0))
    tl.store(row + 3, tl.sum(w64 * (offs % MOD + 1), axis=0))


def word_stats(words: torch.Tensor, exp_mask: int, mag_mask: int, modulus: int) -> torch.Tensor:
    """int64 [4] on the words' device: (non-finite count, non-zero count, sum, weighted sum)
    of a contiguous 1-D int16 tensor holding 16-bit floats."""
    n = words.numel()
    blocks = -(-n // BLOCK)
    partial = torch.empty(blocks, 4, dtype=torch.int64, device=words.device)
    _word_stats_kernel[(blocks,)](words, n, partial, EXP=exp_mask, MAG=mag_mask, MOD=modulus, BLOCK=BLOCK)
    return partial.sum(dim=0)
