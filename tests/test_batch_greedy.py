"""The device's greedy choice (``mlora.kernels.greedy``) against ``torch.argmax`` bit for bit:
fresh random logits in every float dtype, ties planted within and across chunks, NaN and
infinities, a vocabulary that is not a multiple of the chunk; the Triton launches under
TRITON_INTERPRET=1 on the CPU (small chunks), compiled on a GPU."""

import pytest
import torch

from mlora.kernels.greedy import _greedy_triton, greedy_tokens

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(seed, rows, vocab, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 4).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, vocab, block", [(7, 1000, 128), (3, 64, 64), (5, 130, 32), (1, 1, 16)])
def test_greedy_equals_torch_argmax(dtype, rows, vocab, block):
    x = _logits(rows * vocab + block, rows, vocab, dtype).to(DEVICE)
    got = _greedy_triton(x, block)
    assert got.dtype == torch.int64 and got.device == x.device
    assert torch.equal(got, torch.argmax(x, dim=-1))


def test_ties_take_the_lowest_index_within_and_across_chunks():
    """Equal maxima: within one chunk, in two chunks (the later chunk's index is lower inside
    its own chunk), at the last column, at column 0."""
    x = _logits(1, 5, 300, torch.bfloat16)
    top = x.abs().max() + 1
    x[0, [40, 7, 90]] = top  # one chunk (block 64): 7
    x[1, [200, 70]] = top  # chunks 3 and 1: 70
    x[2, [299, 150]] = top  # 150
    x[3, [0, 299]] = top  # 0
    x[4, :] = top  # every column: 0
    x = x.to(DEVICE)
    got = _greedy_triton(x, 64)
    assert got.tolist() == [7, 70, 150, 0, 0]
    assert torch.equal(got, torch.argmax(x, dim=-1))


def test_nan_and_infinities_as_torch_orders_them():
    """A NaN outranks every number, +inf included (the first NaN's index); +inf outranks the
    rest; a row of -inf gives 0; a row with -inf and one finite value gives that value."""
    x = _logits(2, 5, 200, torch.float32)
    x[0, 150] = float("nan")
    x[0, 20] = float("inf")
    x[1, [90, 30]] = float("nan")
    x[2, 77] = float("inf")
    x[3, :] = float("-inf")
    x[4, :] = float("-inf")
    x[4, 123] = -5.0
    x = x.to(DEVICE)
    got = _greedy_triton(x, 32)
    assert got.tolist() == [150, 30, 77, 0, 123]
    assert torch.equal(got, torch.argmax(x, dim=-1))


def test_strided_rows_and_the_public_function():
    """Rows of a wider buffer (the decode graph's logits are a slice of a static tensor); the
    public function is torch.argmax on the CPU and the two launches on CUDA."""
    full = _logits(3, 9, 500, torch.bfloat16).to(DEVICE)
    x = full[2:8, 50:450]  # row stride 500, 400 columns
    assert torch.equal(_greedy_triton(x, 128), torch.argmax(x, dim=-1))
    assert torch.equal(greedy_tokens(x), torch.argmax(x, dim=-1))
    assert greedy_tokens(full[:0]).shape == (0,)


def test_written_into_a_given_buffer():
    """``out``: the tokens land in the given int64 buffer (the decode graph's token ids), rows
    past it untouched, on both paths."""
    x = _logits(5, 6, 700, torch.bfloat16).to(DEVICE)
    for fn in (lambda t, out: _greedy_triton(t, 128, out), lambda t, out: greedy_tokens(t, out=out)):
        buf = torch.full((9,), -7, dtype=torch.int64, device=DEVICE)
        got = fn(x, buf[:6])
        assert got.data_ptr() == buf.data_ptr()
        assert torch.equal(buf[:6], torch.argmax(x, dim=-1)) and buf[6:].tolist() == [-7, -7, -7]
