"""A one-slice LoRA expand fused into the residual add and RMSNorm after it
(``mlora.kernels.lora_add_rms_norm``, ``triton_norm``) against a float64 oracle and against
the plain path (expand, then the add+norm kernel), on fresh random inputs with NaN rank
tails and NaN-poisoned outputs; the Triton kernel under TRITON_INTERPRET=1 on the CPU (small
shapes), compiled on a GPU."""

import pytest
import torch
from test_kernels_reference import TOL
from test_kernels_slices import DEVICE, _dev, sliced_case, sliced_oracle

from mlora.batch.fused import add_rms_norm_triton
from mlora.kernels import (
    PlanError,
    add_rms_norm_ref,
    build_plan,
    empty_launch_plan,
    lora_add_rms_norm,
    make_launch_plan,
    tile_capacity,
    to_rank_pitched,
)
from mlora.kernels.triton_norm import lora_add_rms_norm_triton

EPS = 1e-5


def _case(seed, dtype=torch.float32, n=40, **kw):
    """(h, y, x, A, B, row slots, ranks, scales, widths, norm weight): a one-slice bank of width n."""
    kw = dict(dict(T=37, S=4, R=16, d_in=48, base_frac=0.25), **kw)
    y, x, a, b, rs, ranks, scales, widths = sliced_case(seed, dtype=dtype, widths=(n,), **kw)
    g = torch.Generator().manual_seed(seed + 1000)
    h = (torch.randn(y.shape, generator=g) * 2).to(dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    return h, y, x, a, b, rs, ranks, scales, widths, w


def _oracle(h, y, x, a, b, rs, ranks, scales, widths, w):
    """float64 (h + y + deltas, its norm times w), no intermediate rounding."""
    s = h.double() + sliced_oracle(y, x, a, b, rs, ranks, scales, widths)
    return s, w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)


def _err(got, ref):
    return float((got.cpu().double() - ref).abs().max() / ref.abs().max())


def _poisoned(y):
    return torch.full_like(y, float("nan")), torch.full_like(y, float("nan"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("seed, dtype, kw", [
    (0, torch.float32, {}),
    (1, torch.bfloat16, {}),
    (2, torch.float32, dict(base_frac=0.0)),  # every row has an adapter: no base program has work
    (3, torch.float32, dict(R=40, S=3)),  # ranks up to 40 in a 40-wide bank (z not a multiple of 16 wide)
    (4, torch.float16, dict(T=70, base_frac=0.6)),
    (5, torch.float32, dict(n=300)),  # wider than one column step of the default launch
])
@pytest.mark.parametrize("layout", ["padded", "rank-pitched"])
def test_fused_add_norm_matches_the_oracle(backend, seed, dtype, kw, layout):
    """Every row: h + y + its slot's delta and that sum's norm (rows with no adapter and slots of
    rank 0 included); h and y left as they were."""
    h, y, x, a, b, rs, ranks, scales, widths, w = _case(seed, dtype, **kw)
    ref_h, ref_x = _oracle(h, y, x, a, b, rs, ranks, scales, widths, w)
    if layout == "rank-pitched":
        b = to_rank_pitched(b, ranks, widths)
    h, y, x, a, b, rs, ranks, scales, w = _dev(h, y, x, a, b, rs, ranks, scales, w)
    h0, y0 = h.clone(), y.clone()
    hout, out = lora_add_rms_norm(h, y, x, a, b, rs, weight=w, eps=EPS, ranks=ranks, scales=scales, backend=backend,
                                  b_layout=layout)
    assert torch.equal(h, h0) and torch.equal(y, y0)
    assert hout.shape == out.shape == y.shape and hout.dtype == out.dtype == y.dtype
    assert torch.isfinite(hout).all() and torch.isfinite(out).all()
    assert _err(hout, ref_h) < TOL[dtype] * 2, _err(hout, ref_h)  # y's rounding, then the add's
    assert _err(out, ref_x) < TOL[dtype] * 4, _err(out, ref_x)  # and the norm's two


@pytest.mark.parametrize("rows, block_n", [(1, 16), (2, 64), (4, 16), (16, 32), (16, 64)])
@pytest.mark.parametrize("bm", [16, 32])
def test_fused_equals_the_plain_expand_then_the_add_norm_kernel(bm, rows, block_n):
    """float32 under the interpreter: the plain path's values (its dot and this kernel's
    products sum in other orders, so to float32 rounding), into NaN-poisoned outputs, for every
    split of a plan tile into programs and ragged column steps (40 columns in 16 or 32)."""
    h, y, x, a, b, rs, ranks, scales, widths, w = _dev(*_case(11, T=45, S=5))
    lp = make_launch_plan(build_plan(rs), bm)
    from mlora.kernels.triton_sgmv import add_lora_slices_triton

    plain = add_lora_slices_triton(y.clone(), x, a, b, lp, ranks, scales, widths, config=dict(fused=False))
    want_h, want_x = add_rms_norm_triton(h, plain, w, EPS)
    hout, out = lora_add_rms_norm_triton(h, y, x, w, EPS, a, b, lp, ranks, scales, out=_poisoned(y),
                                         config=dict(norm_rows=rows, norm_block_n=block_n))
    assert torch.isfinite(hout).all() and torch.isfinite(out).all()
    assert torch.allclose(hout, want_h, rtol=1e-5, atol=1e-5)
    assert torch.allclose(out, want_x, rtol=1e-5, atol=1e-5)


def test_static_plan_refilled_with_fewer_base_rows_never_reads_stale_ones():
    """A captured batch size's static plan, filled with many base rows then with few: the
    entries past ``num_base`` are stale (they name rows that now have adapters) and must not be
    written with the base path's value."""
    h, y, x, a, b, rs, ranks, scales, widths, w = _case(21, T=33, base_frac=0.7)
    h, y, x, a, b, rs, ranks, scales, w = _dev(h, y, x, a, b, rs, ranks, scales, w)
    T = y.shape[0]
    static = empty_launch_plan(T, tile_capacity(T, 4, 16), 16, y.device)
    static.fill_from_rows(rs.cpu())
    assert int(static.num_base) == int((rs < 0).sum()) > 20
    rs2 = rs.clone()
    rs2[rs2 < 0] = torch.arange(int((rs2 < 0).sum()), device=rs2.device, dtype=rs2.dtype) % 4
    rs2[:3] = -1  # now three base rows
    static.fill_from_rows(rs2.cpu())
    assert int(static.num_base) == 3
    hout, out = lora_add_rms_norm_triton(h, y, x, w, EPS, a, b, static, ranks, scales, out=_poisoned(y))
    ref_h, ref_x = _oracle(*[t.cpu() for t in (h, y, x, a, b, rs2, ranks, scales)], widths, w.cpu())
    assert torch.isfinite(hout).all() and torch.isfinite(out).all()
    assert _err(hout, ref_h) < TOL[torch.float32] * 2 and _err(out, ref_x) < TOL[torch.float32] * 4


def test_a_batch_with_no_adapter_rows_is_the_add_norm_alone():
    """No plan tile at all (every row slot-less): the base programs write every row, exactly
    the add+norm kernel's values."""
    h, y, x, a, b, rs, ranks, scales, widths, w = _dev(*_case(31))
    rs = torch.full_like(rs, -1)
    lp = make_launch_plan(build_plan(rs))
    assert int(lp.num_tiles) == 0 and int(lp.num_base) == y.shape[0]
    hout, out = lora_add_rms_norm_triton(h, y, x, w, EPS, a, b, lp, ranks, scales, out=_poisoned(y))
    want_h, want_x = add_rms_norm_triton(h, y, w, EPS)
    assert torch.equal(hout, want_h)
    assert torch.allclose(out, want_x, rtol=1e-6, atol=1e-6)  # the sum of squares in column steps


def test_the_torch_backend_is_the_plain_path():
    """The torch backend: add_lora_slices on a copy of y, then the add+norm reference."""
    h, y, x, a, b, rs, ranks, scales, widths, w = _case(41)
    from mlora.kernels import add_lora_slices

    plain = add_lora_slices(y.clone(), x, a, b, rs, widths=widths, ranks=ranks, scales=scales, backend="torch")
    want = add_rms_norm_ref(h, plain, w, EPS)
    got = lora_add_rms_norm(h, y, x, a, b, rs, weight=w, eps=EPS, ranks=ranks, scales=scales, backend="torch")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_bank_of_more_than_one_slice_or_mismatched_shapes_is_refused():
    h, y, x, a, b, rs, ranks, scales, widths, w = _case(51)
    with pytest.raises(PlanError, match="E_BANK_SHAPE"):
        lora_add_rms_norm(h, y, x, a.expand(-1, 2, -1, -1), b, rs, weight=w, eps=EPS)
    with pytest.raises(PlanError, match="E_BANK_SHAPE"):
        lora_add_rms_norm(h[:, :-1], y, x, a, b, rs, weight=w, eps=EPS)
    with pytest.raises(PlanError, match="E_BANK_SHAPE"):
        lora_add_rms_norm(h, y, x, a, b, rs, weight=w[:-1], eps=EPS)
