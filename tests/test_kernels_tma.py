"""The shrink's experimental TMA path for A (``launch_config``'s ``a_tma``: whole rank tiles
read through a tensor descriptor, the others as before) against the float64 oracle and
bit for bit against the default path, on fresh random inputs with NaN past every slot's
true rank and a NaN-poisoned output; under TRITON_INTERPRET=1 on the CPU (small shapes),
compiled on a GPU."""

import pytest
import torch
from test_kernels_reference import TOL
from test_kernels_slices import _dev, sliced_case, sliced_oracle

from mlora.kernels import build_plan, make_launch_plan
from mlora.kernels.triton_sgmv import _a_descriptor, add_lora_slices_triton, launch_config


@pytest.mark.parametrize("seed, dtype, kw, block_r", [
    (0, torch.float32, {}, None),
    (1, torch.bfloat16, dict(d_in=48), None),  # the last K block runs past d_in: the descriptor zero-fills it
    (2, torch.float16, dict(T=45, S=3, widths=(40, 40)), None),
    (3, torch.float32, dict(R=40, S=3, T=40), 16),  # 16-wide rank tiles: whole ones by TMA, the clipped one not
])
def test_tma_shrink_equals_the_default_path_and_the_oracle(seed, dtype, kw, block_r):
    y, x, a, b, rs, ranks, scales, widths = sliced_case(seed, dtype=dtype, **kw)
    tile = block_r or 16  # launch_config's rank tile at R <= 16
    used = torch.zeros_like(ranks, dtype=torch.bool)
    used[:, rs[rs >= 0].long()] = True
    assert bool(((ranks >= tile) & used).any())  # some (slice, slot) in use has a whole rank tile
    ref = sliced_oracle(y, x, a, b, rs, ranks, scales, widths)
    y, x, a, b, rs, ranks, scales = _dev(y, x, a, b, rs, ranks, scales)
    lp = make_launch_plan(build_plan(rs))
    outs = []
    for tma in (False, True):
        out = add_lora_slices_triton(y.clone(), x, a, b, lp, ranks, scales, widths,
                                     config=dict(fused=False, a_tma=tma, block_r=block_r))
        assert torch.isfinite(out).all()  # no NaN rank tail reached the output
        outs.append(out)
    assert torch.equal(outs[0], outs[1])  # the same A values into the same dots
    err = float((outs[1].cpu().double() - ref).abs().max() / ref.abs().max())
    assert err <= TOL[dtype], err


def test_descriptor_only_for_16_byte_aligned_banks():
    """A bank TMA cannot address (a stride that is not a multiple of 16 bytes) gets no
    descriptor, so the launch keeps the pointer path instead of failing."""
    cfg = launch_config(4, 2, 16, 64, [32, 32], torch.device("cpu"), True, block_k=32)
    good = torch.zeros(3, 2, 16, 64, dtype=torch.bfloat16)
    assert _a_descriptor(good, cfg) is not None
    odd = torch.zeros(3, 2, 16, 68, dtype=torch.bfloat16)[..., :60]  # row stride 136 bytes
    assert _a_descriptor(odd, cfg) is None
