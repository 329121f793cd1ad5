"""The fused shrink + expand launch (triton_fused) and the rule that selects it.

Fused launches are forced with ``config={"fused": True}`` and compared with the
float64 per-slice oracle on fresh random inputs: NaN rank tails, NaN-poisoned
rows outside the plan (compared bit for bit), rank-0 slices, uneven slices at
out offsets. On the CPU under TRITON_INTERPRET=1 (small shapes); on a GPU the
same tests run the compiled kernel.
"""

import pytest
import torch
from test_kernels_reference import TOL
from test_kernels_slices import DEVICE, _dev, sliced_case, sliced_oracle

from mlora.kernels import build_plan, make_launch_plan, tile_capacity
from mlora.kernels import triton_fused as tf
from mlora.kernels import triton_sgmv as ts
from mlora.kernels.triton_sgmv import add_lora_slices_triton

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _poisoned(case):
    """The case with every row outside the plan (slot -1) set to NaN in y."""
    y, x, a, b, rs, ranks, scales, widths = case
    y = y.clone()
    y[rs < 0] = float("nan")
    return y, x, a, b, rs, ranks, scales, widths


def _run(case, bm=16, out_offsets=None, **config):
    """One add_lora_slices_triton call on DEVICE; returns (y before, y after, row slots) on the CPU."""
    y, x, a, b, rs, ranks, scales, widths = _dev(*case)
    y, y0 = y.clone(), y.clone()  # the case's own y untouched (on the CPU _dev returns the same tensors)
    lp = make_launch_plan(build_plan(rs), bm)
    add_lora_slices_triton(y, x, a, b, lp, ranks, scales, widths, config=config, out_offsets=out_offsets)
    return y0.cpu(), y.cpu(), rs.cpu()


def _check(case, y0, y, dtype, ref):
    """Rows outside the plan bit-identical (NaN poison included), rank-0 slices untouched, the rest
    within the dtype's tolerance of the oracle."""
    rs = case[4]
    assert torch.equal(y[rs < 0].view(BITS[dtype]), y0[rs < 0].view(BITS[dtype]))
    active = rs >= 0
    assert torch.isfinite(y[active]).all()  # NaN tails never read
    err = (y[active].double() - ref[active]).abs().max() / ref[active].abs().max()
    assert err < TOL[dtype], float(err)


@pytest.mark.parametrize("bm", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_matches_the_oracle(dtype, bm):
    case = _poisoned(sliced_case(30, T=29, S=4, R=16, d_in=48, widths=(24, 8, 8), dtype=dtype))
    ref = sliced_oracle(*case)
    y0, y, rs = _run(case, bm, fused=True)
    _check(case, y0, y, dtype, ref)
    w0 = case[7][0]  # sliced_case gives slot 1 rank 0 in slice 1: those columns are exactly untouched
    assert torch.equal(y[rs == 1, w0 : w0 + 8], y0[rs == 1, w0 : w0 + 8])


@pytest.mark.parametrize("config", [dict(fused_block_n=16, fused_group=3), dict(fused_block_n=16, fused_group=1)])
def test_fused_uneven_slices_at_out_offsets(config):
    """Uneven slices (ragged last column group), each at its own y columns; columns no slice owns
    and rows outside the plan stay bit-identical."""
    widths, out_offsets, y_width = (40, 24, 56), (3, 50, 80), 140
    y_bank, x, a, b, rs, ranks, scales, widths = sliced_case(31, T=21, S=3, d_in=96, widths=widths)
    ref_bank = sliced_oracle(y_bank, x, a, b, rs, ranks, scales, widths)
    y = torch.randn(y_bank.shape[0], y_width, generator=torch.Generator().manual_seed(32))
    ref = y.double().clone()
    owned = torch.zeros(y_width, dtype=torch.bool)
    off = 0
    for o, w in zip(out_offsets, widths):
        y[:, o : o + w] = y_bank[:, off : off + w]
        ref[:, o : o + w] = ref_bank[:, off : off + w]
        owned[o : o + w] = True
        off += w
    y[rs < 0] = float("nan")
    case = (y, x, a, b, rs, ranks, scales, widths)
    y0, y, rs = _run(case, out_offsets=list(out_offsets), fused=True, **config)
    assert torch.equal(y[:, ~owned].view(torch.int32), y0[:, ~owned].view(torch.int32))
    _check(case, y0, y, torch.float32, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forced_fused_and_two_launch_agree(dtype):
    """The same call forced down each path: within the dtype's tolerance of each other (split-K
    sums d_in in another order), rows outside the plan bit-identical on both."""
    case = _poisoned(sliced_case(34, T=7, S=3, R=16, d_in=256, widths=(24, 8), dtype=dtype))
    y0, fused, rs = _run(case, fused=True)
    _, pair, _ = _run(case, fused=False, split=4, block_k=16)
    assert torch.equal(fused[rs < 0].view(BITS[dtype]), pair[rs < 0].view(BITS[dtype]))
    act = rs >= 0
    err = (fused[act].double() - pair[act].double()).abs().max() / pair[act].double().abs().max()
    assert err < TOL[dtype], float(err)


@pytest.mark.parametrize("by_default", [True, False])
def test_the_rule_sends_small_batches_to_the_fused_launch(monkeypatch, by_default):
    """Without an override a small plan takes the fused launch where ``FUSED_BY_DEFAULT``
    (else the pair), ``fused=False`` the pair and ``fused=True`` the fused launch."""
    monkeypatch.setattr(tf, "FUSED_BY_DEFAULT", by_default)
    calls = []
    fused = tf.add_lora_slices_fused
    monkeypatch.setattr(tf, "add_lora_slices_fused", lambda *args: calls.append(1) or fused(*args))
    monkeypatch.setattr(ts, "_CONFIGS", {})
    case = sliced_case(35, T=9, S=3, widths=(16,))
    ref = sliced_oracle(*case)
    first = 1 if by_default else 0
    for config, n_calls in ((None, first), (dict(fused=False), first), (dict(fused=True), first + 1)):
        y, x, a, b, rs, ranks, scales, widths = _dev(*case)
        y = y.clone()  # on the CPU _dev returns the case's own tensors
        lp = make_launch_plan(build_plan(rs), 16)
        add_lora_slices_triton(y, x, a, b, lp, ranks, scales, widths, config=config)
        assert len(calls) == n_calls
        err = (y.cpu().double() - ref).abs().max() / ref.abs().max()
        assert err < TOL[torch.float32], float(err)


H200_SMS = 132
MODULES = {"4096": (4096, (4096,)), "14336": (4096, (14336,)), "qkv": (4096, (4096, 1024, 1024))}


def _decide(T, adapters, module, R, bm=16):
    d_in, widths = MODULES[module]
    return tf.fused_config(tile_capacity(T, adapters, bm), T, R, d_in, widths, 2, torch.device("cuda"))


@pytest.mark.parametrize("T, adapters, module, R, fused", [
    (1, 1, "4096", 16, True),  # decode, one adapter: launch-bound
    (16, 8, "qkv", 16, True),
    (64, 8, "14336", 16, True),
    (64, 64, "4096", 8, True),
    (64, 64, "4096", 64, False),  # 64 tiles re-reading 512 KiB of A per column group
    (256, 8, "4096", 16, False),  # more rows than a fused launch takes
    (4096, 64, "4096", 16, False),  # prefill: split-K's bandwidth wins
    (1, 1, "4096", 128, False),  # wider than one fused program's z
])
def test_selection_rule_on_representative_shapes(monkeypatch, T, adapters, module, R, fused):
    monkeypatch.setattr(ts, "_num_sms", lambda device: H200_SMS)
    monkeypatch.setattr(ts, "_INTERPRET", False)
    cfg = _decide(T, adapters, module, R)
    assert cfg["rule"] is fused, cfg
    assert cfg["fused"] is (fused and tf.FUSED_BY_DEFAULT)
    if fused:  # the rule's own bound
        assert cfg["a_bytes"] <= tf.FUSED_MAX_A_BYTES
    assert _decide(T, adapters, module, R) == cfg  # static shapes only


def test_fused_compiles_one_kernel_per_module_shape(monkeypatch):
    """Every decode bucket a fused launch takes, for each module shape of an 8B model and 8 or 64
    slots, reaches the kernel with one set of compile-time constants: the column group count
    varies with the batch size, as a runtime argument."""
    import inspect

    from mlora.batch.engine.graphs import BLOCK_M, buckets_for

    param = inspect.signature(tf._fused_kernel.fn).parameters["group_tiles"]
    assert param.annotation is inspect.Parameter.empty  # a runtime argument, not tl.constexpr
    monkeypatch.setattr(ts, "_num_sms", lambda device: H200_SMS)
    monkeypatch.setattr(ts, "_INTERPRET", False)
    shapes = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
              "down": (14336, (4096,))}
    keys = ("block_n", "block_r", "block_k", "warps", "stages")
    groups = set()
    for slots in (8, 64):
        for name, (d_in, widths) in shapes.items():
            seen = set()
            for b in buckets_for(256):
                cfg = tf.fused_config(tile_capacity(b, slots, BLOCK_M), b, 16, d_in, widths, 2, torch.device("cuda"))
                if cfg["rule"]:
                    seen.add(tuple(cfg[k] for k in keys))
                    groups.add(cfg["group"])
            assert len(seen) == 1, (slots, name, seen)  # every module shape takes the fused launch at b = 1
    assert len(groups) >= 2, groups  # the runtime group really varies
