"""The dense-shrink LoRA update (``add_lora_slices_dense``: one batched GEMM of every row
against every slot, then the expand reading each tile's own slot's block) against the
float64 oracle and the segmented path. A measured candidate for decode-size batches
(``scripts/dense_shrink_probe.py``), off in the engine unless MLORA_LORA_DENSE_MAX_ROWS. The expand runs under
``TRITON_INTERPRET=1`` on the CPU (small shapes); on a GPU the same tests run it compiled."""

import pytest
import torch
from test_kernels_reference import TOL
from test_kernels_slices import _dev, sliced_case, sliced_oracle

from mlora.kernels import build_plan, make_launch_plan, to_rank_pitched
from mlora.kernels.triton_sgmv import add_lora_slices_dense, add_lora_slices_triton


def _case(seed, dtype=torch.float32, R=16, widths=(24, 8, 8)):
    """sliced_case with a slot no row uses poisoned whole (its z is NaN and must never be read)."""
    y, x, a, b, rs, ranks, scales, widths = sliced_case(seed, T=33, S=5, R=R, d_in=32, widths=widths, dtype=dtype)
    rs[rs == 4] = 2
    a[4] = float("nan")
    b[4] = float("nan")
    return y, x, a, b, rs, ranks, scales, widths


@pytest.mark.parametrize("seed, dtype", [(0, torch.float32), (1, torch.bfloat16), (2, torch.float16)])
@pytest.mark.parametrize("layout", ["padded", "rank-pitched"])
def test_dense_shrink_matches_the_oracle(seed, dtype, layout):
    """Every row's update within tolerance of the float64 oracle, NaN past each rank and in an
    unused slot never reaching y, rows with no slot untouched bit for bit; the segmented path
    agrees (exactly in float32 up to summation order, within 16-bit rounding otherwise)."""
    y, x, a, b, rs, ranks, scales, widths = _case(seed, dtype)
    ref = sliced_oracle(y, x, a, b, rs, ranks, scales, widths)
    bank = to_rank_pitched(b, ranks, widths) if layout == "rank-pitched" else b
    y, x, a, bank, rs, ranks, scales = _dev(y, x, a, bank, rs, ranks, scales)
    lp = make_launch_plan(build_plan(rs), 16)
    dense = add_lora_slices_dense(y.clone(), x, a, bank, lp, ranks, scales, widths, b_pitched=layout != "padded")
    segmented = add_lora_slices_triton(y.clone(), x, a, bank, lp, ranks, scales, widths, config=dict(fused=False),
                                       b_pitched=layout != "padded")
    assert torch.isfinite(dense).all()
    assert torch.equal(dense[rs < 0], y[rs < 0])
    err = (dense.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype], float(err)
    gap = (dense.double() - segmented.double()).abs().max() / segmented.double().abs().max()
    assert gap < TOL[dtype], float(gap)


def test_dense_shrink_over_a_slot_major_layer_view():
    """A layer's view of a slot-major bank ([S, L, n, R, d_in][:, layer], strided over slots)
    is read in place (a slot's block is contiguous); a bank whose slot block is not is refused."""
    y, x, a, b, rs, ranks, scales, widths = _case(3)
    full = torch.randn(a.shape[0], 3, *a.shape[1:])
    full[:, 1] = a
    ref = sliced_oracle(y, x, a, b, rs, ranks, scales, widths)
    y, x, full, b, rs, ranks, scales = _dev(y, x, full, b, rs, ranks, scales)
    lp = make_launch_plan(build_plan(rs), 16)
    out = add_lora_slices_dense(y.clone(), x, full[:, 1], b, lp, ranks, scales, widths)
    err = (out.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[torch.float32], float(err)
    padded_rows = torch.zeros(*a.shape[:3], a.shape[3] + 8, device=x.device)[..., : a.shape[3]]  # row stride 40
    with pytest.raises(ValueError, match="contiguous"):
        add_lora_slices_dense(y.clone(), x, padded_rows, b, lp, ranks, scales, widths)
