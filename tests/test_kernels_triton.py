"""The Triton segmented kernels against the float64 oracle.

On the CPU they run under TRITON_INTERPRET=1 (set in conftest), so shapes stay
small; on a GPU the same tests run the compiled kernels on CUDA tensors.
"""

import pytest
import torch
from test_kernels_reference import ROW_SLOTS, TOL, Y_FINAL, random_case, spec_inputs

from mlora.kernels import add_lora, lora_oracle_f64

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _to(device, *ts):
    return [t.to(device) for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_spec_trace_exact(dtype):
    x, y, a, b, s = _to(DEVICE, *spec_inputs(dtype))
    out = add_lora(y, x, a, b, ROW_SLOTS.to(DEVICE), scales=s, backend="triton")
    expected = torch.tensor([[float(v) for v in row] for row in Y_FINAL], dtype=torch.float64)
    assert torch.equal(out.cpu().double(), expected)


@pytest.mark.parametrize(
    "seed, dtype, shape",
    [
        (0, torch.float32, dict()),
        (1, torch.bfloat16, dict()),
        (2, torch.float16, dict()),
        (3, torch.float32, dict(T=3, S=3, R=8, d_in=16, d_out=40)),  # decode-like: few rows per slot
        (4, torch.bfloat16, dict(T=70, S=2, R=64, d_in=48, d_out=24, base_frac=0.0)),  # long segments, R > block
        # physical ranks that are not multiples of 16 / 8: the expand loads rank columns up to the rank
        # rounded up to 8, clipped to R, and zeroes the NaN-poisoned ones it loads past the rank
        (5, torch.bfloat16, dict(T=11, S=4, R=12, d_in=16, d_out=24)),
        (6, torch.float32, dict(T=11, S=4, R=40, d_in=16, d_out=24)),
    ],
)
def test_triton_matches_the_oracle(seed, dtype, shape):
    y, x, a, b, rs, ranks, scales = random_case(seed, dtype=dtype, **shape)
    ref = lora_oracle_f64(y, x, a, b, rs, ranks, scales)
    y, x, a, b, rs, ranks, scales = _to(DEVICE, y, x, a, b, rs, ranks, scales)
    y0 = y.clone()
    out = add_lora(y, x, a, b, rs, ranks=ranks, scales=scales, backend="triton")
    assert out is y
    assert torch.isfinite(out).all()  # NaN-poisoned rank tails never read
    assert torch.equal(out[rs < 0], y0[rs < 0])  # base-only rows bit-identical
    err = (out.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype], float(err)


def test_triton_equals_torch_backend_per_row_after_reordering():
    y, x, a, b, rs, ranks, scales = _to(DEVICE, *random_case(9))
    out_t = add_lora(y.clone(), x, a, b, rs, ranks=ranks, scales=scales, backend="torch")
    perm = torch.randperm(rs.numel(), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out_p = add_lora(y[perm].clone(), x[perm], a, b, rs[perm], ranks=ranks, scales=scales, backend="triton")
    torch.testing.assert_close(out_p, out_t[perm], rtol=1e-5, atol=1e-5)
