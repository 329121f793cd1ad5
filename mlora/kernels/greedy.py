"""The greedy choice on the device: each row's argmax over ``[rows, vocab]`` logits.

Owns one function, :func:`greedy_tokens`, with ``torch.argmax(logits, dim=-1)``'s exact
semantics: the lowest index among a row's maxima, and a row holding NaN gives its first
NaN's index (torch orders NaN above every number). On CUDA it runs as two Triton launches
instead of torch's reduction, which gives each row to one block and so reads a large
vocabulary's logits far below the memory bandwidth, on every decode iteration's critical
path. Here the first launch splits every row into ``BLOCK``-wide chunks, each writing its
chunk's maximum, that maximum's first index and its first NaN's index; the second picks, per
row, the first chunk with a NaN, else the first chunk holding the largest maximum. Elsewhere
(the CPU) it is ``torch.argmax``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Columns per first-stage program (a 16 KB chunk of fp32 logits, 8 KB of bf16).
BLOCK = 4096


@triton.jit
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, nan_ptr, vocab, stride_x, chunks, BLOCK: tl.constexpr):
    """Chunk ``program_id(1)`` of row ``program_id(0)``: its largest non-NaN value (fp32,
    -inf if none), that value's first index, and its first NaN's index (``vocab`` if none)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
    nan = x != x
    key = tl.where(nan, float("-inf"), x)
    best = tl.max(key, axis=0)
    first = tl.min(tl.where(key == best, cols, vocab), axis=0)
    first_nan = tl.min(tl.where(nan, cols, vocab), axis=0)
    out = row * chunks + c
    tl.store(val_ptr + out, best)
    tl.store(idx_ptr + out, first)
    tl.store(nan_ptr + out, first_nan)


@triton.jit
def _pick_kernel(val_ptr, idx_ptr, nan_ptr, tok_ptr, vocab, chunks, CHUNKS: tl.constexpr):
    """Row ``program_id(0)``'s token from its chunks' summaries (module docstring)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    ok = c < chunks
    val = tl.load(val_ptr + row * chunks + c, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * chunks + c, mask=ok, other=vocab)
    first_nan = tl.min(tl.load(nan_ptr + row * chunks + c, mask=ok, other=vocab), axis=0)
    best = tl.max(val, axis=0)
    # chunks hold ascending columns, so the smallest index among the best chunks is the row's first
    # maximum; an all -inf row (no NaN) has every chunk at -inf and gives index 0, as torch does
    tok = tl.min(tl.where(ok & (val == best), idx, vocab), axis=0)
    tl.store(tok_ptr + row, tl.where(first_nan < vocab, first_nan, tok).to(tl.int64))


def greedy_tokens(logits: torch.Tensor, block: int = BLOCK, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` of a ``[rows, vocab]`` float tensor, int64 ``[rows]`` on
    its device (module docstring); no host synchronisation. ``block``: the first stage's chunk
    width (a power of two; tests use small ones). ``out``: an int64 ``[rows]`` tensor on the same
    device to write instead of a new one (the decode graph's token-id buffer: no extra copy)."""
    rows, vocab = logits.shape
    if logits.device.type != "cuda" or rows == 0 or vocab == 0:
        tok = torch.argmax(logits, dim=-1)
        return tok if out is None else out.copy_(tok)
    return _greedy_triton(logits, block, out)


def _greedy_triton(logits: torch.Tensor, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The two launches (the CPU reaches them only through tests, under TRITON_INTERPRET=1)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(vocab, block)
    dev = logits.device
    val = torch.empty((rows, chunks), dtype=torch.float32, device=dev)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=dev)
    nan = torch.empty((rows, chunks), dtype=torch.int32, device=dev)
    tok = torch.empty(rows, dtype=torch.int64, device=dev) if out is None else out
    assert tok.shape == (rows,) and tok.dtype == torch.int64 and tok.stride(0) == 1 and tok.device == dev
    _chunk_max_kernel[(rows, chunks)](logits, val, idx, nan, vocab, logits.stride(0), chunks, BLOCK=block,
                                      num_warps=8 if block >= 2048 else 4)
    _pick_kernel[(rows,)](val, idx, nan, tok, vocab, chunks, CHUNKS=triton.next_power_of_2(chunks), num_warps=1)
    return tok
