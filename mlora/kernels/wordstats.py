"""One-pass Triton check numbers of 16-bit device views (``host.view_stats`` on a GPU).

Owns the kernel behind :func:`mlora.batch.adapters.residency.host.view_stats` for large
bfloat16/float16 views: each chunk of ``TILES`` blocks of words is reduced to four
numbers -- the non-finite count, the non-zero count, the sum of the words and
the sum of word x ((position mod ``MOD``) + 1) -- and stores them in its own
int64 row of the output (no atomics, nothing to zero first). A view's numbers
are the sum of its chunks' rows, taken wherever the rows are read (a load's
validation reads them on the host anyway). Integer sums: exact and independent
of order (deterministic). A 16-bit element is one word, so its bits decide
finiteness and zero directly. One launch covers up to two views of one dtype
(a slot group's A and B), so a load's validation is one kernel and one
read-back per group. Must not know views, slots or artifacts: the caller
passes the words and the masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # words per step: four int64 accumulators of 4096 words spill to local memory (sm_90)
TILES = 32  # blocks of words per chunk (one row of partials): 32K words, so a 9 MB view is ~150 chunks
# How the chunks are launched (the rows and numbers do not depend on it): at most PROGRAMS
# programs, each walking chunks pid, pid + PROGRAMS, ... (None: one program per chunk), each
# step loading UNROLL blocks before using any (more bytes in flight per program). One
# program per chunk and one block per step keep a load's validation fastest beside a
# decode-like graph.
PROGRAMS: int | None = None
UNROLL = 1


@triton.jit
def _word_partials(w_ptr, n, chunk, row_ptr, EXP: tl.constexpr, MAG: tl.constexpr, MOD: tl.constexpr,
                   BLOCK: tl.constexpr, TILES: tl.constexpr, UNROLL: tl.constexpr):
    """The four numbers of words [chunk * BLOCK * TILES, + BLOCK * TILES) of one view, stored at
    row_ptr; UNROLL blocks loaded per step before any is used."""
    first = tl.cast(chunk, tl.int64) * (BLOCK * TILES)
    bad_acc = tl.zeros((BLOCK,), dtype=tl.int64)
    nz_acc = tl.zeros((BLOCK,), dtype=tl.int64)
    sum_acc = tl.zeros((BLOCK,), dtype=tl.int64)
    wsum_acc = tl.zeros((BLOCK,), dtype=tl.int64)
    for t in range(0, TILES, UNROLL):
        base = first + t * BLOCK
        offs = base + tl.arange(0, BLOCK * UNROLL)
        ok = offs < n
        w = tl.reshape(tl.load(w_ptr + offs, mask=ok, other=0).to(tl.int32), (UNROLL, BLOCK))
        ok2 = tl.reshape(ok, (UNROLL, BLOCK))
        pos = tl.reshape(offs % MOD + 1, (UNROLL, BLOCK))
        bad_acc += tl.sum((((w & EXP) == EXP) & ok2).to(tl.int64), axis=0)
        nz_acc += tl.sum(((w & MAG) != 0).to(tl.int64), axis=0)
        w64 = w.to(tl.int64)
        sum_acc += tl.sum(w64, axis=0)
        wsum_acc += tl.sum(w64 * pos, axis=0)
    tl.store(row_ptr + 0, tl.sum(bad_acc, axis=0))
    tl.store(row_ptr + 1, tl.sum(nz_acc, axis=0))
    tl.store(row_ptr + 2, tl.sum(sum_acc, axis=0))
    tl.store(row_ptr + 3, tl.sum(wsum_acc, axis=0))


@triton.jit
def _word_partials_kernel(w0_ptr, n0, w1_ptr, n1, chunks0, chunks, out_ptr, EXP: tl.constexpr, MAG: tl.constexpr,
                          MOD: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr, UNROLL: tl.constexpr):
    """Chunks [0, chunks0) cover view 0, the rest view 1; chunk c writes row c of out. Program
    p takes chunks p, p + programs, ... (one chunk each when there are as many programs)."""
    for c in range(tl.program_id(0), chunks, tl.num_programs(0)):
        if c < chunks0:
            _word_partials(w0_ptr, n0, c, out_ptr + c * 4, EXP, MAG, MOD, BLOCK, TILES, UNROLL)
        else:
            _word_partials(w1_ptr, n1, c - chunks0, out_ptr + c * 4, EXP, MAG, MOD, BLOCK, TILES, UNROLL)


def chunks_for(n: int) -> int:
    """Chunks (rows of partials) of a view of ``n`` words."""
    return -(-n // (BLOCK * TILES))


def word_partials(words: list[torch.Tensor], exp_mask: int, mag_mask: int, modulus: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [sum of chunks_for(n), 4] on the words' device, one launch: each row the
    (non-finite count, non-zero count, sum, weighted sum) of one chunk's words of one or
    two contiguous 1-D int16 tensors holding 16-bit floats of one dtype, the first view's
    rows first. A view's numbers are the sum of its rows (:func:`split_sums`). ``out``: written
    instead of a new tensor (int64, exactly that shape, contiguous)."""
    if not 1 <= len(words) <= 2 or any(w.numel() == 0 for w in words):
        raise ValueError("word_partials takes one or two non-empty views")
    p0 = chunks_for(words[0].numel())
    second = words[1] if len(words) == 2 else words[0]
    p1 = chunks_for(second.numel()) if len(words) == 2 else 0
    if out is None:
        out = torch.empty((p0 + p1, 4), dtype=torch.int64, device=words[0].device)
    elif out.shape != (p0 + p1, 4) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"word_partials: out must be contiguous int64 [{p0 + p1}, 4], got {out.dtype} {tuple(out.shape)}")
    grid = (min(p0 + p1, PROGRAMS or p0 + p1),)
    _word_partials_kernel[grid](words[0], words[0].numel(), second, second.numel() if p1 else 0, p0, p0 + p1, out,
                                EXP=exp_mask, MAG=mag_mask, MOD=modulus, BLOCK=BLOCK, TILES=TILES, UNROLL=UNROLL)
    return out


def split_sums(partials: torch.Tensor, counts: list[int]) -> list[list[int]]:
    """Each view's four numbers from the rows of :func:`word_partials` (``counts``: the
    number of words of each view, in order)."""
    rows = partials.tolist()
    out, start = [], 0
    for n in counts:
        p = chunks_for(n)
        out.append([sum(r[k] for r in rows[start : start + p]) for k in range(4)])
        start += p
    return out


def word_stats(words: torch.Tensor, exp_mask: int, mag_mask: int, modulus: int) -> torch.Tensor:
    """int64 [4] on the words' device: (non-finite count, non-zero count, sum, weighted sum)
    of a contiguous 1-D int16 tensor holding 16-bit floats."""
    return word_partials([words], exp_mask, mag_mask, modulus).sum(dim=0)
