"""The Triton three-stage bundle operator: ``add_bundle_slices_triton`` against a float64
oracle, and BundleBank's ``operator="triton"`` against its torch operator (its CUDA graph
replay: ``test_graph_replay_of_the_bundle_context_equals_eager`` in test_bundle_serving.py)."""

import pytest
import torch
from test_bundle_serving import apply_both, served  # noqa: F401 - the demo bundle fixture, jd-full and jd-diag
from test_kernels_slices import DEVICE  # the GPU where there is one, else the CPU (Triton interpreted)

from mlora.batch.adapters.bundle_bank import BundleBank
from mlora.batch.model.lora import GROUPS
from mlora.kernels import build_plan, make_launch_plan
from mlora.kernels.triton_sgmv import add_bundle_slices_triton


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float32 tensor (NaN and -0.0 compare exactly)."""
    return t.contiguous().view(torch.int32)


def _oracle(y0, x, A, B, row_slots, ranks, bank_rows, cores, widths, out_offsets, diag):
    """float64 ``y_t += U_c core_s V_c^T x_t`` per row t of slot s and slice j with ranks[j, s] > 0."""
    y = y0.double().clone()
    for t, s in enumerate(row_slots.tolist()):
        if s < 0:
            continue
        for j, w in enumerate(widths):
            r = int(ranks[j, s])
            if r == 0:
                continue
            c, off = int(bank_rows[j, s]), sum(widths[:j])
            Vt = A[c, j, :r].double()
            U = B[c, off : off + w, :r].double()
            core = torch.diag(cores[s, j, :r].double()) if diag else cores[s, j, :r, :r].double()
            y[t, out_offsets[j] : out_offsets[j] + w] += U @ core @ Vt @ x[t].double()
    return y


def _case(seed, diag, R=6, d_in=40, widths=(24, 8, 16), clusters=(3, 1, 2), S=5, T=13, gap=4):
    """Random bases (NaN in rows past each slice's clusters), slot tables with per-slice
    assignments and unadapted (rank 0) slices whose rows and cores are NaN, rows with base
    rows, and a y whose base rows and column gaps are poisoned."""
    g = torch.Generator().manual_seed(seed)
    n, K = len(widths), max(clusters)
    A = torch.full((K, n, R, d_in), float("nan"))
    B = torch.full((K, sum(widths), R), float("nan"))
    for j, (w, k) in enumerate(zip(widths, clusters)):
        off = sum(widths[:j])
        A[:k, j] = torch.randn(k, R, d_in, generator=g)
        B[:k, off : off + w] = torch.randn(k, w, R, generator=g)
    ranks = torch.where(torch.rand(n, S, generator=g) < 0.25, 0, R).to(torch.int32)
    ranks[:, 0] = R  # slot 0 adapts every slice
    bank_rows = torch.stack([torch.randint(0, k, (S,), generator=g) for k in clusters]).to(torch.int32)
    cores = torch.randn((S, n, R) if diag else (S, n, R, R), generator=g)
    cores[(ranks == 0).t()] = float("nan")  # never read: the slot does not adapt that slice
    bank_rows[ranks == 0] = 99  # never read either
    row_slots = torch.randint(-1, S, (T,), generator=g, dtype=torch.int32)
    row_slots[:2] = torch.tensor([-1, 0])
    out_offsets = [sum(widths[:j]) + j * gap for j in range(n)]
    y0 = torch.randn(T, out_offsets[-1] + widths[-1] + gap, generator=g)
    y0[row_slots < 0] = float("nan")
    y0[0, 0] = -0.0
    x = torch.randn(T, d_in, generator=g)
    return x, y0, A, B, row_slots, ranks, bank_rows, cores, list(widths), out_offsets


@pytest.mark.parametrize("diag", [False, True], ids=["jd-full", "jd-diag"])
@pytest.mark.parametrize("seed,config", [(0, None), (1, {"split": 2}), (2, {"block_r": 16, "group_tiles": 2})])
def test_bundle_kernel_equals_the_float64_oracle(diag, seed, config):
    x, y0, A, B, row_slots, ranks, bank_rows, cores, widths, out_offsets = _case(seed, diag)
    lp = make_launch_plan(build_plan(row_slots)).to(DEVICE)
    y = y0.to(DEVICE, copy=True)
    dev = [t.to(DEVICE) for t in (x, A, B, ranks, bank_rows, cores)]
    add_bundle_slices_triton(y, dev[0], dev[1], dev[2], lp, dev[3], dev[4], dev[5], widths, out_offsets, diag=diag,
                             config=config)
    y = y.cpu()
    want = _oracle(y0, x, A, B, row_slots, ranks, bank_rows, cores, widths, out_offsets, diag)
    assert torch.equal(_bits(y[row_slots < 0]), _bits(y0[row_slots < 0]))  # base rows, NaN and -0.0 included
    gaps = torch.ones(y.shape[1], dtype=torch.bool)
    for o, w in zip(out_offsets, widths):
        gaps[o : o + w] = False
    assert torch.equal(_bits(y[:, gaps]), _bits(y0[:, gaps]))  # columns no slice owns
    for j, (o, w) in enumerate(zip(out_offsets, widths)):  # unadapted slices: bit-identical
        idle = (row_slots >= 0) & (ranks[j, row_slots.clamp(min=0).long()] == 0)
        assert torch.equal(_bits(y[idle, o : o + w]), _bits(y0[idle, o : o + w]))
    act = row_slots >= 0
    assert not torch.isnan(y[act]).any()  # no NaN bank row, core or rank tail was read
    assert not torch.equal(y[act], y0[act])
    err = float((y[act].double() - want[act]).abs().max())
    assert torch.allclose(y[act].double(), want[act], rtol=1e-4, atol=1e-4), err


def test_triton_operator_equals_the_torch_operator(served):
    bundle, pinned, shapes, layers = served
    ref = BundleBank(bundle, layers, shapes, torch.float32, "cpu")
    tri = BundleBank(bundle, layers, shapes, torch.float32, DEVICE, operator="triton")
    assert tri.nbytes() <= BundleBank.bytes_needed(bundle, torch.float32)  # one K per module here: no padding
    _, changed = apply_both(ref, tri, served)
    assert changed > 0


def test_triton_static_plan_is_refilled_per_replay(served):
    """A graph's context over a static row buffer reads the static LaunchPlan that
    ``context(..., static=buf)`` refills: each refill serves its own rows (as a fresh
    context does, up to rounding: a larger plan capacity may split d_in differently)."""
    bundle, pinned, shapes, layers = served
    bb = BundleBank(bundle, layers, shapes, torch.float32, DEVICE, operator="triton")
    buf = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    graph_ctx = bb.graph_context(buf[:5])
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, shapes["qkv"][0], generator=g).to(DEVICE)
    y0 = torch.randn(5, sum(shapes["qkv"][1]), generator=g).to(DEVICE)
    empty = y0.clone()
    graph_ctx.apply(0, "qkv", x, empty)  # before any refill: no tiles, nothing changes
    assert torch.equal(empty, y0)
    for rows in ([0, -1, 1, 0, -1], [2, 2, -1, 1, 0], [-1] * 5):
        rows = torch.tensor(rows, dtype=torch.int32)
        bb.context(rows, static=buf)  # refill, as before a replay
        a, b = y0.clone(), y0.clone()
        graph_ctx.apply(0, "qkv", x, a)
        bb.context(rows).apply(0, "qkv", x, b)
        base = (rows < 0).to(DEVICE)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5) and torch.equal(a[base], y0[base])


def test_triton_static_plan_is_refilled_only_when_the_rows_change(served, monkeypatch):
    """Consecutive decode steps with the same row slots reuse the static plan as filled (no
    host plan built, nothing copied); other rows refill it, and the graph context serves them."""
    import mlora.kernels.launch as launch

    bundle, pinned, shapes, layers = served
    bb = BundleBank(bundle, layers, shapes, torch.float32, DEVICE, operator="triton")
    built = []
    real = launch.make_launch_plan
    monkeypatch.setattr(launch, "make_launch_plan", lambda *a, **k: built.append(1) or real(*a, **k))
    buf = torch.zeros(5, dtype=torch.int64, device=DEVICE)
    graph_ctx = bb.graph_context(buf)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, shapes["qkv"][0], generator=g).to(DEVICE)
    y0 = torch.randn(5, sum(shapes["qkv"][1]), generator=g).to(DEVICE)
    for rows, fills in (([0, -1, 1, 0, -1], 1), ([0, -1, 1, 0, -1], 1), ([1, 1, -1, 0, 2], 2), ([0, -1, 1, 0, -1], 3)):
        rows = torch.tensor(rows, dtype=torch.int32)
        bb.context(rows, static=buf)
        assert len(built) == fills
        a, b = y0.clone(), y0.clone()
        graph_ctx.apply(0, "qkv", x, a)
        monkeypatch.setattr(launch, "make_launch_plan", real)
        bb.context(rows).apply(0, "qkv", x, b)
        monkeypatch.setattr(launch, "make_launch_plan", lambda *a, **k: built.append(1) or real(*a, **k))
        base = (rows < 0).to(DEVICE)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5) and torch.equal(a[base], y0[base])


def test_triton_operator_with_fewer_core_slots(served):
    """Two core slots: loads copy a member's cores, clusters and ranks into its slot; the
    Triton operator then equals the all-resident torch operator."""
    bundle, pinned, shapes, layers = served
    members = bundle.member_ids()
    by_member = {p.bundle_member: a for a, p in pinned.items()}
    full = BundleBank(bundle, layers, shapes, torch.float32, "cpu", pinned=pinned)
    few = BundleBank(bundle, layers, shapes, torch.float32, DEVICE, pinned=pinned, core_slots=2, operator="triton")
    for step, names in enumerate([members[:2], members[2:3], [members[0], members[2]], members[-1:]]):
        ids = [by_member[m] for m in names]
        slot_f, slot_w = full.ensure(ids, pinned), few.ensure(ids, pinned)
        g = torch.Generator().manual_seed(10 + step)
        pick = [None] + ids + [ids[k] for k in torch.randint(0, len(ids), (5,), generator=g).tolist()]
        ctx_f = full.context(torch.tensor([-1 if a is None else slot_f[a] for a in pick], dtype=torch.int32))
        ctx_w = few.context(torch.tensor([-1 if a is None else slot_w[a] for a in pick], dtype=torch.int32))
        for layer in range(layers):
            for group in GROUPS:
                x = torch.randn(len(pick), shapes[group][0], generator=g)
                y = torch.randn(len(pick), sum(shapes[group][1]), generator=g)
                a, b = y.clone(), y.to(DEVICE, copy=True)
                ctx_f.apply(layer, group, x, a)
                ctx_w.apply(layer, group, x.to(DEVICE), b)
                b = b.cpu()
                assert torch.equal(b[0], y[0]) and torch.allclose(b, a, rtol=1e-5, atol=1e-5)
    assert few.stats.evictions >= 2


def _uneven_bundle(method: str, R: int = 3, layers: int = 2):
    """A bundle object (the fields BundleBank reads) adapting q (2 clusters) and v (3) but not
    k, and gate (1 cluster, members m0 and m1 only) but not up, with different assignments
    per module and layer; float32 values."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(21)
    members = ["m0", "m1", "m2", "m3"]
    shapes = {"qkv": (12, (12, 4, 4)), "gate_up": (12, (10, 10))}
    plan = {"self_attn.q_proj": (12, 2, members), "self_attn.v_proj": (4, 3, members),
            "mlp.gate_proj": (10, 1, members[:2])}
    modules, bases, cores = {}, {}, {}
    for layer in range(layers):
        for role, (d_out, K, users) in plan.items():
            name = f"model.layers.{layer}.{role}"
            modules[name] = {"d_out": d_out, "d_in": 12, "clusters": K,
                             "assignments": {m: (i + layer) % K for i, m in enumerate(users)}}
            for k in range(K):
                bases[f"{name}/cluster{k}/U"] = torch.randn(d_out, R, generator=g)
                bases[f"{name}/cluster{k}/V"] = torch.randn(12, R, generator=g)
            for m in users:
                cores[f"{name}/{m}"] = torch.randn((R,) if method == "jd-diag" else (R, R), generator=g)
    bundle = SimpleNamespace(manifest={"bundle_sha256": "f" * 64, "options": {"rank": R}, "modules": modules,
                                       "members": [{"id": m} for m in members]},
                             bases=bases, cores=cores, method=method, member_ids=lambda: members)
    return bundle, shapes, layers


@pytest.mark.parametrize("method", ["jd-full", "jd-diag"])
def test_triton_operator_with_unadapted_slices_and_uneven_clusters(method):
    """Slices the bundle does not adapt (k, up) keep their columns bit-identical, members that
    do not adapt gate keep their gate columns, and per-slice cluster counts differ within a
    group (the banks pad to the most): the Triton operator equals the torch one."""
    bundle, shapes, layers = _uneven_bundle(method)
    ref = BundleBank(bundle, layers, shapes, torch.float32, "cpu")
    tri = BundleBank(bundle, layers, shapes, torch.float32, DEVICE, operator="triton")
    rows = torch.tensor([1, -1, 0, 3, 2, 1, -1, 0], dtype=torch.int32)
    ctx_r, ctx_t = ref.context(rows), tri.context(rows)
    g = torch.Generator().manual_seed(22)
    for layer in range(layers):
        for group, (d_in, widths) in shapes.items():
            x = torch.randn(len(rows), d_in, generator=g)
            y0 = torch.randn(len(rows), sum(widths), generator=g)
            a, b = y0.clone(), y0.to(DEVICE, copy=True)
            ctx_r.apply(layer, group, x, a)
            ctx_t.apply(layer, group, x.to(DEVICE), b)
            b = b.cpu()
            assert torch.allclose(b, a, rtol=1e-5, atol=1e-5), (layer, group)
            idle = slice(12, 16) if group == "qkv" else slice(10, 20)  # k, up: no module
            assert torch.equal(b[:, idle], y0[:, idle]) and torch.equal(b[[1, 6]], y0[[1, 6]])
            if group == "gate_up":
                assert torch.equal(b[[3, 4]], y0[[3, 4]])  # m3, m2 do not adapt gate
            assert not torch.equal(b, y0)


def test_bytes_needed_counts_each_operators_bases_exactly():
    """The device bytes a job reserves for a bundle (E_BUNDLE_TOO_LARGE's check, the serving
    benchmark's matched slots) are what each operator's bank holds: the Triton banks pad a
    group's slices to its most clusters (q 2 and v 3 here), so they need more than the torch
    operator's per-module bases, and ``nbytes`` equals ``bytes_needed`` for both."""
    bundle, shapes, layers = _uneven_bundle("jd-full")
    for operator in ("torch", "triton"):
        bank = BundleBank(bundle, layers, shapes, torch.float32, "cpu" if operator == "torch" else DEVICE,
                          operator=operator)
        assert bank.nbytes() == BundleBank.bytes_needed(bundle, torch.float32, operator), operator
    torch_bases, per_slot = BundleBank.split_bytes(bundle, torch.float32, "torch")
    triton_bases, per_slot_t = BundleBank.split_bytes(bundle, torch.float32, "triton")
    assert per_slot == per_slot_t and triton_bases > torch_bases
    with pytest.raises(ValueError, match="unknown bundle operator"):
        BundleBank.split_bytes(bundle, torch.float32, "cuda")


def test_unknown_operator_is_refused(served):
    bundle, pinned, shapes, layers = served
    with pytest.raises(ValueError, match="unknown bundle operator"):
        BundleBank(bundle, layers, shapes, torch.float32, "cpu", operator="cuda")


@pytest.mark.parametrize("bad", ["model.layers.0.self_attn.rotary_proj", "model.layers.x.self_attn.q_proj",
                                 "lm_head", "model.layers.9.self_attn.q_proj"])
def test_a_bundle_module_the_model_does_not_have_is_refused(bad):
    """A module name with no role the banks know, no layer number, or a layer past the model's
    is E_BANK_SHAPE when the bank is built, whichever operator (never a KeyError or a skip)."""
    from mlora.batch.adapters.slots import BankError

    bundle, shapes, layers = _uneven_bundle("jd-full")
    mods = bundle.manifest["modules"]
    mods[bad] = dict(mods["model.layers.0.self_attn.q_proj"])
    for operator in ("torch", "triton"):
        with pytest.raises(BankError) as e:
            BundleBank(bundle, layers, shapes, torch.float32, "cpu" if operator == "torch" else DEVICE,
                       operator=operator)
        assert e.value.code == "E_BANK_SHAPE", (bad, operator)
