"""The row-parallel LoRA (o and down under tensor parallelism) through the segmented kernels:
``add_lora_slices(..., reduce_z=...)`` and ``add_bundle_slices_triton(..., reduce_z=...)`` with a
fake two-rank all-reduce in one process (x and A cut by input columns, each half's bottleneck
summed with the other's between the shrink and the expand) equal the uncut call and the float64
oracle, on the torch backend and the Triton kernels (interpreted on the CPU); and two gloo ranks
whose slot banks run the Triton kernels (on the GPU where there is one, both ranks on it) give the
logits of their torch banks and of one rank.
"""

import factory
import pytest
import torch
from test_batch_model import Runner, random_model, tokens
from test_bundle_triton import _bits, _case, _oracle
from test_kernels_reference import TOL
from test_kernels_slices import DEVICE, poison_rank_tails, sliced_case, sliced_oracle

from mlora.batch.adapters.catalog import load_catalog
from mlora.batch.adapters.slots import SlotBank, TPShard
from mlora.batch.model.decoder import DecoderModel, load_config
from mlora.batch.model.tp import TPLayout
from mlora.batch.model.tpgroup import run_ranks
from mlora.kernels import (
    add_lora_slices,
    build_plan,
    empty_launch_plan,
    make_launch_plan,
    tile_capacity,
    to_rank_pitched,
)
from mlora.kernels.triton_sgmv import add_bundle_slices_triton


def read_mask(z_shape, rs, ranks, R):
    """The entries of a bottleneck z (``[rows, n * R]``, grouped row order) the expand reads:
    row u < N (the plan's active rows), slice j's columns below the rank of row u's slot."""
    plan = build_plan(rs)
    slots = rs[plan.sorted_rows.long()].long()
    mask = torch.zeros(z_shape, dtype=torch.bool)
    cols = torch.arange(R)
    for j in range(ranks.shape[0]):
        mask[: slots.numel(), j * R : (j + 1) * R] = cols[None, :] < ranks[j, slots][:, None]
    return mask


class FakeAllReduce:
    """Two ranks' reduction in one process: ``keep`` records rank 1's bottleneck, ``__call__``
    (rank 0's ``reduce_z``) adds it in place; with ``poison`` every entry the expand does not
    read is then NaN (so they need no sum). Counts its calls."""

    def __init__(self, mask=None):
        self.other, self.mask, self.calls = None, mask, 0

    def keep(self, z):
        self.other = z.clone()

    def __call__(self, z):
        assert z.dtype == torch.float32 and z.is_contiguous()
        z += self.other
        if self.mask is not None:
            z[~self.mask.to(z.device)] = float("nan")
        self.calls += 1


def _slice_cases():
    one = list(sliced_case(31, T=23, S=5, R=8, d_in=32, widths=(24,), base_frac=0.25))  # o/down: one slice
    one[5][0] = torch.tensor([8, 0, 3, 5, 6], dtype=torch.int32)  # slot 1 does not adapt the module
    poison_rank_tails(one[2], one[3], one[5], one[7])
    one[4][:3] = torch.tensor([1, -1, 1], dtype=torch.int32)
    three = list(sliced_case(32, T=17, S=4, R=16, d_in=32, widths=(16, 8, 8)))
    return {"one-slice": one, "three-slices": three}


@pytest.mark.parametrize("name, backend, pitched, static", [
    ("one-slice", "torch", False, False),
    ("one-slice", "torch", True, False),
    ("one-slice", "triton", False, False),
    ("one-slice", "triton", True, False),
    ("one-slice", "triton", True, True),  # launch buffers larger than the plan: z has rows no tile covers
    ("three-slices", "torch", True, False),
    ("three-slices", "triton", True, True),
])
def test_halves_summed_between_shrink_and_expand_equal_the_uncut_call(name, backend, pitched, static):
    """Poisoned base rows stay bit-identical, a rank-0 slot's columns untouched, and the entries of
    z the expand does not read are NaN after the reduction (the sum need not cover them)."""
    y, x, a, b, rs, ranks, scales, widths = _slice_cases()[name]
    y[rs < 0] = float("nan")  # base rows: poisoned, must stay bit-identical
    R, cut = a.shape[2], x.shape[1] // 2
    ref = sliced_oracle(y, x, a, b, rs, ranks, scales, widths)
    layout = "rank-pitched" if pitched else "padded"
    if pitched:
        b = to_rank_pitched(b, ranks, widths)
    plan = None
    if backend == "triton":
        plan = make_launch_plan(build_plan(rs))
        if static:
            plan = empty_launch_plan(rs.numel() + 8, tile_capacity(rs.numel() + 8, a.shape[0], 16), 16, "cpu") \
                .copy_from(plan)
        plan = plan.to(DEVICE)
    y, x, a, b, rs, ranks, scales = (t.to(DEVICE) for t in (y, x, a, b, rs, ranks, scales))
    kw = dict(widths=widths, ranks=ranks, scales=scales, backend=backend, plan=plan, b_layout=layout)
    z_rows = plan.row_capacity if backend == "triton" else int((rs >= 0).sum())
    reduce = FakeAllReduce(read_mask((z_rows, len(widths) * R), rs.cpu(), ranks.cpu(), R))
    add_lora_slices(torch.zeros_like(y), x[:, cut:], a[..., cut:], b, rs, reduce_z=reduce.keep, **kw)  # rank 1
    got = add_lora_slices(y.clone(), x[:, :cut], a[..., :cut], b, rs, reduce_z=reduce, **kw)  # rank 0
    uncut = add_lora_slices(y.clone(), x, a, b, rs, **kw)
    assert reduce.calls == 1
    got, uncut, y, rs, ranks = got.cpu(), uncut.cpu(), y.cpu(), rs.cpu(), ranks.cpu()
    assert torch.equal(_bits(got[rs < 0]), _bits(y[rs < 0]))
    idle = (rs == 1) & (ranks[0, 1] == 0)  # a slot of rank 0 for slice 0: its columns untouched
    assert torch.equal(_bits(got[idle, : widths[0]]), _bits(y[idle, : widths[0]]))
    act = rs >= 0
    assert torch.isfinite(got[act]).all()
    assert (got[act] - uncut[act]).abs().max() <= 1e-5 * uncut[act].abs().max()
    err = (got[act].double() - ref[act]).abs().max() / ref[act].abs().max()
    assert err < TOL[torch.float32], float(err)


@pytest.mark.parametrize("diag", [False], ids=["jd-full"])  # JD-Diag differs only in the core, after the sum
def test_bundle_partial_projections_summed_before_the_core(diag):
    """Row-parallel bundles: each rank's ``V_c^T x`` over its input columns, summed, then the
    member's core, then the expand; equals the float64 oracle of the uncut operator."""
    x, y0, A, B, rs, ranks, bank_rows, cores, widths, out_offsets = _case(3, diag, d_in=32)
    cut = x.shape[1] // 2
    lp = make_launch_plan(build_plan(rs)).to(DEVICE)
    dev = [t.to(DEVICE) for t in (x, A, B, ranks, bank_rows, cores)]
    xd, Ad = dev[0], dev[1]
    rest = (dev[2], lp, dev[3], dev[4], dev[5], widths, out_offsets)
    reduce = FakeAllReduce()
    add_bundle_slices_triton(y0.to(DEVICE, copy=True), xd[:, cut:], Ad[..., cut:], *rest, diag=diag,
                             reduce_z=reduce.keep)
    y = y0.to(DEVICE, copy=True)
    add_bundle_slices_triton(y, xd[:, :cut], Ad[..., :cut], *rest, diag=diag, reduce_z=reduce)
    y = y.cpu()
    assert reduce.calls == 1
    assert torch.equal(_bits(y[rs < 0]), _bits(y0[rs < 0]))
    want = _oracle(y0, x, A, B, rs, ranks, bank_rows, cores, widths, out_offsets, diag)
    act = rs >= 0
    assert torch.allclose(y[act].double(), want[act], rtol=1e-4, atol=1e-4), float((y[act] - want[act]).abs().max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU (runs on the device)")
def test_cuda_graph_replays_the_reduction_between_the_launches():
    """A call with ``reduce_z`` is captured once over static launch buffers (the reduction adds
    rank 1's bottleneck from a static tensor inside the graph) and replayed with new row slots."""
    T, S = 40, 5
    y, x, a, b, rs, ranks, scales, widths = (t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in
                                             sliced_case(9, T=T, S=S, R=16, d_in=64, widths=(48,), dtype=torch.bfloat16))
    cut, R = x.shape[1] // 2, a.shape[2]
    static = empty_launch_plan(T, tile_capacity(T, S, 16), 16, DEVICE)
    other = torch.zeros(T, R, dtype=torch.float32, device=DEVICE)  # rank 1's z, refilled before each replay
    kw = dict(widths=widths, ranks=ranks, scales=scales, backend="triton", plan=static, check_values=False)
    y_static = y.clone()
    static.copy_from(make_launch_plan(build_plan(rs), 16))
    add_lora_slices(y_static, x[:, :cut], a[..., :cut], b, rs, reduce_z=lambda z: z.add_(other), **kw)  # warm-up: compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora_slices(y_static, x[:, :cut], a[..., :cut], b, rs, reduce_z=lambda z: z.add_(other), **kw)
    for seed in range(3):
        rs_new = torch.randint(-1, S, (T,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32).to(DEVICE)
        static.copy_from(make_launch_plan(build_plan(rs_new), 16))
        add_lora_slices(torch.zeros_like(y), x[:, cut:], a[..., cut:], b, rs_new, reduce_z=other.copy_, **kw)
        y_static.copy_(y)
        graph.replay()
        uncut = add_lora_slices(y.clone(), x, a, b, rs_new, **kw)
        torch.cuda.synchronize()
        assert torch.equal(y_static[rs_new < 0], y[rs_new < 0])
        act = rs_new >= 0
        err = (y_static[act].double() - uncut[act].double()).abs().max() / uncut[act].double().abs().max()
        assert err < TOL[torch.bfloat16], float(err)
        ref = sliced_oracle(y.cpu(), x.cpu(), a.cpu(), b.cpu(), rs_new.cpu(), ranks.cpu(), scales.cpu(), widths)
        err = (y_static.cpu()[act.cpu()].double() - ref[act.cpu()]).abs().max() / ref.abs().max()
        assert err < TOL[torch.bfloat16], float(err)


# ---------------------------------------------------------------- two gloo ranks, Triton banks

ROWS = {"r4": (6, 1), "r6": (5, 2), None: (4, 3)}  # adapter -> (prompt length, seed): mixed ranks, a base row


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-kernels")
    base = factory.save_base(random_model(factory.tiny_config("llama", layers=1), seed=4), str(root / "base"))
    seven = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    factory.make_adapters(str(root / "adapters"), base, {
        "r4": dict(r=4, lora_alpha=8, target_modules=seven, seed=21),
        "r6": dict(r=6, lora_alpha=6, target_modules=seven, seed=22),
    })
    return base, str(root / "adapters")


def prefill(model: DecoderModel, base: str, adapters: str, backend: str, shard: TPShard) -> torch.Tensor:
    """Every row's logits of one packed prefill of three sequences (adapters r4, r6, none)
    through a slot bank of ``backend`` holding the shard's cut of both adapters."""
    pinned = load_catalog(adapters, None).pin({"r4", "r6"}, base)
    bank = SlotBank.for_rank(shard, 2, 8, torch.float32, torch.device(DEVICE), backend=backend)
    slot = bank.ensure(["r4", "r6"], pinned)
    items = [(str(a), tokens(n, seed)) for a, (n, seed) in ROWS.items()]
    row_slots = torch.tensor([slot.get(a, -1) for a, (n, _) in ROWS.items() for _ in range(n)], dtype=torch.int32)
    runner = Runner(model, seed=5, attention="torch", device=DEVICE)
    return torch.cat(runner.step(items, lora=bank.context(row_slots.to(DEVICE)), sample="all")).cpu()


def rank_prefill(collective, base: str, adapters: str) -> dict:
    torch.set_num_threads(1)
    model = DecoderModel.from_pretrained(base, dtype=torch.float32, tp=collective.layout, collective=collective)
    shard = TPShard(load_config(base), collective.layout, collective)
    return {backend: prefill(model, base, adapters, backend, shard) for backend in ("triton", "torch")}


def test_two_ranks_with_triton_banks_give_the_logits_of_one_rank(workspace):
    base, adapters = workspace
    ranks = run_ranks(rank_prefill, 2, (base, adapters), timeout_s=120)
    torch.set_num_threads(1)
    model = DecoderModel.from_pretrained(base, dtype=torch.float32)
    one = prefill(model, base, adapters, "torch", TPShard(model.config, TPLayout(0, 1), None))
    plain = torch.cat(Runner(model, seed=5, attention="torch", device=DEVICE).step(
        [(str(a), tokens(n, seed)) for a, (n, seed) in ROWS.items()], sample="all")).cpu()
    assert (one[:11] - plain[:11]).abs().max() > 1e-2  # the adapters change the logits of their rows
    for rank in ranks:
        assert (rank["triton"] - rank["torch"]).abs().max() <= 1e-5
        assert (rank["triton"] - one).abs().max() <= 1e-5
