"""Rank-pitched B banks (mlora.kernels.pitch): the layout rule, and every backend reading a
rank-pitched bank equal to the float64 oracle of the same factors, with NaN in every padding
entry of the bank, base-only rows untouched and the same bits as the padded layout. On the
CPU the Triton kernels run under TRITON_INTERPRET=1 (small shapes)."""

import pytest
import torch
from test_kernels_reference import TOL
from test_kernels_slices import sliced_case, sliced_oracle

from mlora.kernels import (
    PlanError,
    add_lora_slices,
    b_pitch,
    build_plan,
    make_launch_plan,
    pitched_view,
    to_rank_pitched,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_pitch_is_the_rank_rounded_up_to_whole_vectors():
    assert [b_pitch(r, 64) for r in (0, 1, 8, 9, 16, 17, 63, 64)] == [0, 8, 8, 16, 16, 24, 64, 64]
    assert [b_pitch(r, 24) for r in (5, 17, 24)] == [8, 24, 24]
    assert [b_pitch(r, 12) for r in (1, 8, 12)] == [12, 12, 12]  # R not a multiple of 8: the padded layout


def _covered(bank, ranks, widths):
    """True where a rank-pitched bank holds a factor entry (everything else is padding)."""
    cov = torch.zeros(bank.shape, dtype=torch.bool)
    for s in range(bank.shape[0]):
        off = 0
        for j, w in enumerate(widths):
            r = int(ranks[j, s])
            if r:
                pitched_view(cov, s, off, w, r).fill_(True)
            off += w
    return cov


def test_rank_pitched_layout_places_each_slice_at_its_padded_start():
    """Slice j of a slot starts at element O_j * R of the slot; its rows step by the pitch; the
    logical factors read back exactly; a slice of rank R is the padded bytes."""
    y, x, a, b, rs, ranks, scales, widths = sliced_case(3, S=3, R=16, widths=(24, 8, 8))
    ranks[:, 2] = torch.tensor([5, 16, 9], dtype=torch.int32)
    b = torch.randn(b.shape)  # the case poisoned slot 2 at its old ranks
    pitched = to_rank_pitched(b, ranks, widths)
    cov = _covered(pitched, ranks, widths)
    assert not torch.isnan(pitched[cov]).any() and (pitched[~cov] == 0).all()
    flat = pitched[2].reshape(-1)
    assert torch.equal(flat[: 24 * 8].view(24, 8)[:, :5], b[2, :24, :5])  # rank 5: pitch 8 from element 0
    assert torch.equal(pitched[2, 24:32], b[2, 24:32])  # rank 16 = R: the padded rows
    assert torch.equal(flat[32 * 16 : 32 * 16 + 8 * 16].view(8, 16)[:, :9], b[2, 32:40, :9])  # rank 9: pitch 16
    for s in range(3):
        off = 0
        for j, w in enumerate(widths):
            r = int(ranks[j, s])
            assert torch.equal(pitched_view(pitched, s, off, w, r), b[s, off : off + w, :r])
            off += w


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("R,dtype,widths", [(16, torch.float32, (24, 8, 8)), (24, torch.bfloat16, (16, 8)),
                                            (12, torch.float32, (8, 8)), (16, torch.float32, (8, 8, 8, 8, 8))])
def test_rank_pitched_bank_matches_the_oracle_and_the_padded_bits(backend, R, dtype, widths):
    """Fresh random factors with ranks 0..R, NaN in every padding entry of the pitched bank
    (past each rank inside a row's pitch, and after each slice's block): the result equals the
    oracle, base-only rows keep their bits, and equals the padded-layout call bit for bit.
    Five slices exercise the launches split at MAX_SLICES; R 12 falls back to the padded layout."""
    y, x, a, b, rs, ranks, scales, widths = sliced_case(17 + R, T=21, S=4, R=R, widths=widths, dtype=dtype)
    ranks[0, 2] = 1  # pitch 8 in a wide bank
    a[2, 0, 0], b[2, : widths[0], 0] = torch.randn(a.shape[-1]).to(dtype), torch.randn(widths[0]).to(dtype)
    a[2, 0, 1:], b[2, : widths[0], 1:] = float("nan"), float("nan")
    ref = sliced_oracle(y, x, a, b, rs, ranks, scales, widths)
    pitched = to_rank_pitched(b, ranks, widths)
    pitched[~_covered(pitched, ranks, widths)] = float("nan")
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    y, x, a, b, pitched, rs, ranks, scales = map(dev, (y, x, a, b, pitched, rs, ranks, scales))
    plan = make_launch_plan(build_plan(rs), 16) if backend == "triton" else None
    outs = []
    for layout, bank in (("rank-pitched", pitched), ("padded", b)):
        out = y.clone()
        add_lora_slices(out, x, a, bank, rs, widths=widths, ranks=ranks, scales=scales, backend=backend, plan=plan,
                        b_layout=layout)
        outs.append(out)
    got = outs[0]
    assert torch.isfinite(got).all()
    assert torch.equal(got[rs < 0], y[rs < 0])
    err = (got.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype], float(err)
    assert torch.equal(outs[0], outs[1])


def test_a_rank_pitched_bank_must_hold_each_slot_contiguously():
    y, x, a, b, rs, ranks, scales, widths = sliced_case(5, R=16, widths=(8, 8))
    strided = torch.zeros(b.shape[0], b.shape[1], 2 * b.shape[2])[:, :, ::2]
    with pytest.raises(PlanError, match="E_BANK_SHAPE"):
        add_lora_slices(y, x, a, strided, rs, widths=widths, ranks=ranks, scales=scales, b_layout="rank-pitched")
    with pytest.raises(ValueError, match="b_layout"):
        add_lora_slices(y, x, a, b, rs, widths=widths, ranks=ranks, scales=scales, b_layout="packed")
