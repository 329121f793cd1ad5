"""The three-stage bundle operator (spec 0x06G4) in the engine's bank protocol:
BundleBank against the materialised-factor SlotBank and the reference operator."""

import os

import pytest
import torch
from conftest import DEMO

from mlora.batch.adapters.bundle_bank import BundleBank
from mlora.batch.adapters.catalog import load_catalog
from mlora.batch.adapters.slots import BankError, SlotBank
from mlora.batch.model.decoder import load_config
from mlora.batch.model.lora import GROUPS, group_shapes
from mlora.compress.bundle import read_bundle
from mlora.compress.operator import joint_apply

BASE = os.path.join(DEMO, "base")


@pytest.fixture(scope="module", params=["jd-full", "jd-diag"])
def served(request, tmp_path_factory):
    """(bundle, pinned members, model shapes, layers) of the demo adapters in two clusters."""
    from typer.testing import CliRunner

    from mlora.cli.app import app

    out = tmp_path_factory.mktemp(request.param) / "bundle"
    res = CliRunner().invoke(app, ["compress", "fit", os.path.join(DEMO, "adapters"), "-o", str(out), "--rank", "8",
                                   "--clusters", "2", "--method", request.param, "--max-error", "1.0"])
    assert res.exit_code == 0, res.output
    bundle = read_bundle(str(out))
    members = bundle.member_ids()
    pinned = load_catalog(str(out), None).pin(set(members), BASE)
    assert all(p.ok for p in pinned.values())
    c = load_config(BASE)
    shapes = group_shapes(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim)
    return bundle, pinned, shapes, c.num_layers


def _rows(members, T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = [None if k < 0 else members[k] for k in torch.randint(-1, len(members), (T,), generator=g).tolist()]
    ids[0], ids[1] = None, members[0]  # at least one base row and one member row
    return ids


def apply_both(first, second, served) -> tuple[int, int]:
    """The same 23 rows (base rows among them) through two banks, every (layer, group) on the
    same random x and y (a base row's y holds a -0.0): both leave the base rows' bits exactly
    as they were (no "+ 0", -0.0 stays -0.0) and agree to float32 rounding. Returns how many
    (layer, group) updates changed y, per bank."""
    bundle, pinned, shapes, layers = served
    members = bundle.member_ids()
    ids = _rows(members, 23, seed=1)
    used = sorted({i for i in ids if i})
    contexts = []
    for bank in (first, second):
        slot = bank.ensure(used, pinned)
        contexts.append(bank.context(torch.tensor([-1 if i is None else slot[i] for i in ids], dtype=torch.int32)))
    base_rows = torch.tensor([i is None for i in ids])
    g = torch.Generator().manual_seed(2)
    changed = [0, 0]
    for layer in range(layers):
        for group in GROUPS:
            d_in, widths = shapes[group]
            x = torch.randn(len(ids), d_in, generator=g)
            y0 = torch.randn(len(ids), sum(widths), generator=g)
            y0[0, 0] = -0.0
            ys = []
            for k, (bank, ctx) in enumerate(zip((first, second), contexts)):
                y = y0.to(bank.device, copy=True)  # each bank on its own device (the Triton one on the GPU there)
                ctx.apply(layer, group, x.to(bank.device), y)
                y = y.cpu()
                ys.append(y)
                assert torch.equal(y[base_rows].view(torch.int32), y0[base_rows].view(torch.int32))
                changed[k] += int(not torch.equal(y, y0))
            assert torch.allclose(ys[1], ys[0], rtol=1e-5, atol=1e-5), (layer, group, float((ys[1] - ys[0]).abs().max()))
    return changed[0], changed[1]


def test_three_stage_equals_the_materialised_factors(served):
    bundle, pinned, shapes, layers = served
    members = bundle.member_ids()
    assert any(m["clusters"] == 2 for m in bundle.manifest["modules"].values())  # several clusters really served
    bb = BundleBank(bundle, layers, shapes, torch.float32, "cpu")
    sb = SlotBank(layers, shapes, len(members), bb.max_rank, torch.float32, "cpu")
    checked, _ = apply_both(bb, sb, served)
    assert checked > 0  # some module really changed


def test_one_module_equals_the_reference_operator(served):
    bundle, pinned, shapes, layers = served
    bb = BundleBank(bundle, layers, shapes, torch.float32, "cpu")
    name = next(iter(bundle.manifest["modules"]))
    mod = bundle.manifest["modules"][name]
    layer, role = int(name.split(".")[2]), name.split(".")[-1]
    group = next(g for g, roles in GROUPS.items() if role in roles)
    j = GROUPS[group].index(role)
    member = next(iter(mod["assignments"]))
    c = mod["assignments"][member]
    d_in, widths = shapes[group]
    x = torch.randn(5, d_in, generator=torch.Generator().manual_seed(3))
    y = torch.zeros(5, sum(widths))
    bb.context(torch.full((5,), bb.index[member], dtype=torch.int32)).apply(layer, group, x, y)
    ref = joint_apply(x, bundle.bases[f"{name}/cluster{c}/U"], bundle.bases[f"{name}/cluster{c}/V"],
                      bundle.cores[f"{name}/{member}"])
    off = sum(widths[:j])
    assert torch.allclose(y[:, off : off + widths[j]], ref, rtol=1e-5, atol=1e-6)


def test_static_buffer_context_equals_a_fresh_one(served):
    bundle, pinned, shapes, layers = served
    bb = BundleBank(bundle, layers, shapes, torch.float32, "cpu")
    rows = torch.tensor([0, -1, 1, 0, -1], dtype=torch.int32)
    buf = torch.empty(8, dtype=torch.int64)
    graph_ctx = bb.graph_context(buf[:5])
    bb.context(rows, static=buf)  # refill, as before a replay
    x = torch.randn(5, shapes["qkv"][0], generator=torch.Generator().manual_seed(4))
    y0 = torch.randn(5, sum(shapes["qkv"][1]), generator=torch.Generator().manual_seed(5))
    a, b = y0.clone(), y0.clone()
    graph_ctx.apply(0, "qkv", x, a)
    bb.context(rows).apply(0, "qkv", x, b)
    assert torch.equal(a, b) and not torch.equal(a, y0)


def test_a_context_serving_two_passes_gathers_its_rows_again(served):
    """A graph's context serves a warm-up pass, then the captured one: the rows' tables are
    gathered again when a pass starts (a (layer, group) applied a second time), so a pass
    after the row members changed (as a replay's refill does) uses the new members."""
    bundle, pinned, shapes, layers = served
    bb = BundleBank(bundle, layers, shapes, torch.float32, "cpu")
    members = torch.empty(4, dtype=torch.int64)
    ctx = bb.graph_context(members)  # every row the base model's zero core
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, shapes["qkv"][0], generator=g)
    y0 = torch.randn(4, sum(shapes["qkv"][1]), generator=g)
    warm = y0.clone()
    for layer in range(layers):  # the warm-up pass: base rows only, nothing changes
        ctx.apply(layer, "qkv", x, warm if layer == 0 else torch.randn(4, sum(shapes["qkv"][1]), generator=g))
    assert torch.equal(warm, y0)
    bb.context(torch.tensor([0, -1, 1, 0], dtype=torch.int32), static=members)  # refill, as before a replay
    got, want = y0.clone(), y0.clone()
    ctx.apply(0, "qkv", x, got)  # the next pass
    bb.context(torch.tensor([0, -1, 1, 0], dtype=torch.int32)).apply(0, "qkv", x, want)
    assert torch.equal(got, want) and not torch.equal(got, y0) and torch.equal(got[1], y0[1])


def test_non_members_and_bad_slots_are_refused(served, tmp_path):
    bundle, pinned, shapes, layers = served
    bb = BundleBank(bundle, layers, shapes, torch.float32, "cpu")
    plain = load_catalog(os.path.join(DEMO, "adapters"), None).pin({"spell"}, BASE)
    with pytest.raises(BankError) as e:
        bb.ensure(["spell"], plain)
    assert e.value.code == "E_BANK_BUNDLE_MISMATCH"
    with pytest.raises(BankError) as e:
        bb.ensure(["nobody"], pinned)
    assert e.value.code == "E_ADAPTER_UNKNOWN"
    with pytest.raises(BankError) as e:
        bb.context(torch.tensor([len(bundle.member_ids())], dtype=torch.int32))
    assert e.value.code == "E_BANK_SLOT_EMPTY"
    assert bb.nbytes() <= BundleBank.bytes_needed(bundle, torch.float32)
    # residency is keyed by semantic identity, as the engine's admission reads it
    keyed = BundleBank(bundle, layers, shapes, torch.float32, "cpu", pinned=pinned).resident
    assert keyed == {p.semantic_sha256: bb.index[p.bundle_member] for p in pinned.values()}


def test_fewer_core_slots_serve_every_member_exactly_as_all_resident(served):
    """Two core slots for the demo's members: ensure loads cores into free slots, then evicts
    the least recently used member the call does not name; every invocation's deltas equal
    the all-resident bank's (poisoned outputs, fresh inputs), base rows stay bit-identical,
    and a call naming more members than slots, or a slot that holds no member, is refused."""
    bundle, pinned, shapes, layers = served
    members = bundle.member_ids()
    assert len(members) >= 3
    by_member = {p.bundle_member: a for a, p in pinned.items()}
    full = BundleBank(bundle, layers, shapes, torch.float32, "cpu", pinned=pinned)
    few = BundleBank(bundle, layers, shapes, torch.float32, "cpu", pinned=pinned, core_slots=2)
    assert few.num_slots == 2 and few.resident == {} and few.stats.loads == 0
    with pytest.raises(BankError) as e:
        few.context(torch.tensor([0, -1], dtype=torch.int32))
    assert e.value.code == "E_BANK_SLOT_EMPTY"
    calls = [members[:2], members[2:3], [members[0], members[2]], members[1:3], members[-1:]]
    for step, names in enumerate(calls):
        ids = [by_member[m] for m in names]
        slot_f, slot_w = full.ensure(ids, pinned), few.ensure(ids, pinned)
        assert len(set(slot_w.values())) == len(ids) and all(0 <= s < 2 for s in slot_w.values())
        g = torch.Generator().manual_seed(10 + step)
        pick = [None] + ids + [ids[k] for k in torch.randint(0, len(ids), (6,), generator=g).tolist()]
        ctx_f = full.context(torch.tensor([-1 if a is None else slot_f[a] for a in pick], dtype=torch.int32))
        ctx_w = few.context(torch.tensor([-1 if a is None else slot_w[a] for a in pick], dtype=torch.int32))
        changed = 0
        for layer in range(layers):
            for group in GROUPS:
                if group not in shapes:
                    continue
                x = torch.randn(len(pick), shapes[group][0], generator=g)
                y = torch.randn(len(pick), sum(shapes[group][1]), generator=g)  # fresh, non-zero outputs
                a, b = y.clone(), y.clone()
                ctx_f.apply(layer, group, x, a)
                ctx_w.apply(layer, group, x, b)
                assert torch.equal(a, b) and torch.equal(b[0], y[0])
                changed += not torch.equal(b[1:], y[1:])
        assert changed  # the members' deltas were really applied in this step
    # an obviously-right LRU over the same calls: which members stay, how many loads and evictions
    lru, loads, evictions = [], 0, 0
    for names in calls:
        for m in dict.fromkeys(names):
            if m in lru:
                lru.remove(m)
            else:
                loads += 1
                if len(lru) == 2:
                    lru.remove(next(x for x in lru if x not in names))
                    evictions += 1
            lru.append(m)
    assert (few.stats.loads, few.stats.evictions) == (loads, evictions) and evictions >= 3
    assert list(few.resident) == [pinned[by_member[m]].semantic_sha256 for m in lru]  # least recently used first
    with pytest.raises(BankError) as e:
        few.ensure([by_member[m] for m in members[:3]], pinned)
    assert e.value.code == "E_BANK_FULL"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU (runs on the device)")
@pytest.mark.parametrize("operator", ["torch", "triton"])
def test_graph_replay_of_the_bundle_context_equals_eager(served, operator):
    """A captured context replays the rows ``context(..., static=buf)`` refilled: equal to the
    same context run eagerly, and to a fresh context (the torch operator exactly; the Triton
    one within bf16 rounding: a fresh plan's smaller capacity may split d_in differently)."""
    bundle, pinned, shapes, layers = served
    bb = BundleBank(bundle, layers, shapes, torch.bfloat16, "cuda", operator=operator)
    buf = torch.zeros(8, dtype=torch.int64, device="cuda")
    ctx = bb.graph_context(buf)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(8, shapes["qkv"][0], generator=g).to("cuda", torch.bfloat16)
    y0 = torch.randn(8, sum(shapes["qkv"][1]), generator=g).to("cuda", torch.bfloat16)
    y = y0.clone()
    ctx.apply(0, "qkv", x, y)  # warm-up outside the capture (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ctx.apply(0, "qkv", x, y)
    for seed in range(3):
        rows = torch.randint(-1, bb.num_slots, (8,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        bb.context(rows, static=buf)
        y.copy_(y0)
        graph.replay()
        ref = y0.clone()
        ctx.apply(0, "qkv", x, ref)  # eager through the same static context: the same launches
        fresh = y0.clone()
        bb.context(rows).apply(0, "qkv", x, fresh)
        torch.cuda.synchronize()
        assert torch.equal(y, ref)
        if operator == "torch":
            assert torch.equal(y, fresh)
        else:
            assert torch.allclose(y.float(), fresh.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("method", ["jd-full", "jd-diag"])
def test_a_group_with_unadapted_slices_and_uneven_clusters(method):
    """A bundle adapting q and v but not k (and gate but not up, with a different cluster
    count per module): the grouped operator's one projection, one scatter and one masked
    update give each adapted slice the reference three-stage product of the row's member,
    leave the k and up columns bit-identical, and leave members that do not adapt a module
    (and base rows) untouched there."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(21)
    R, layers = 3, 2
    d_in, widths = 12, (12, 4, 4)
    gu = (10, 10)
    shapes = {"qkv": (d_in, widths), "gate_up": (d_in, gu)}
    members = ["m0", "m1", "m2", "m3"]
    modules, bases, cores = {}, {}, {}
    plan = {"self_attn.q_proj": (widths[0], 2), "self_attn.v_proj": (widths[2], 3), "mlp.gate_proj": (gu[0], 1)}
    for layer in range(layers):
        for role, (d_out, K) in plan.items():
            name = f"model.layers.{layer}.{role}"
            users = members if role != "mlp.gate_proj" else members[:2]  # m2, m3 do not adapt gate
            assign = {m: (i + layer) % K for i, m in enumerate(users)}
            modules[name] = {"d_out": d_out, "d_in": d_in, "clusters": K, "assignments": assign}
            for k in range(K):
                bases[f"{name}/cluster{k}/U"] = torch.randn(d_out, R, generator=g, dtype=torch.float64)
                bases[f"{name}/cluster{k}/V"] = torch.randn(d_in, R, generator=g, dtype=torch.float64)
            for m in users:
                # float32 values: the bank's host core tables are float32, as bundle files are
                cores[f"{name}/{m}"] = torch.randn((R,) if method == "jd-diag" else (R, R), generator=g).double()
    bundle = SimpleNamespace(manifest={"bundle_sha256": "f" * 64, "options": {"rank": R}, "modules": modules,
                                       "members": [{"id": m} for m in members]},
                             bases=bases, cores=cores, method=method, member_ids=lambda: members)
    bb = BundleBank(bundle, layers, shapes, torch.float64, "cpu")
    rows = [1, -1, 0, 3, 2, 1, -1, 0]
    ctx = bb.context(torch.tensor(rows, dtype=torch.int32))
    for layer in range(layers):
        for group, roles in (("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj"))):
            x = torch.randn(len(rows), d_in, generator=g, dtype=torch.float64)
            y0 = torch.randn(len(rows), sum(shapes[group][1]), generator=g, dtype=torch.float64)
            y = y0.clone()
            ctx.apply(layer, group, x, y)
            want = y0.clone()
            off = 0
            for role, w in zip(roles, shapes[group][1]):
                full = next((k for k in plan if k.endswith(role)), None)
                name = f"model.layers.{layer}.{full}" if full else None
                for t, slot in enumerate(rows):
                    if name and slot >= 0 and members[slot] in modules[name]["assignments"]:
                        c = modules[name]["assignments"][members[slot]]
                        want[t, off : off + w] += joint_apply(x[t : t + 1], bases[f"{name}/cluster{c}/U"],
                                                              bases[f"{name}/cluster{c}/V"],
                                                              cores[f"{name}/{members[slot]}"])[0]
                off += w
            assert torch.allclose(y, want, rtol=1e-12, atol=1e-12), (layer, group)
            changed = (y != y0)
            assert changed.any()
            untouched = torch.equal(y[:, widths[0] : widths[0] + widths[1]], y0[:, widths[0] : widths[0] + widths[1]]) \
                if group == "qkv" else torch.equal(y[:, gu[0]:], y0[:, gu[0]:])
            assert untouched  # k (or up) columns: no module, bit-identical
            assert torch.equal(y[[1, 6]], y0[[1, 6]])  # base rows
            if group == "gate_up":
                assert torch.equal(y[[3, 4]], y0[[3, 4]])  # m3, m2 do not adapt gate


@pytest.mark.parametrize("operator", ["torch", "triton"])
def test_emulated_decode_graphs_over_a_bundle_give_the_eager_tokens(served, operator):
    """The engine's decode graphs over a bundle bank (its ``graph_context``: a static row buffer
    the replays refill) give the eager engine's tokens; on the CPU the graphs are emulated
    (``mlora.batch.engine.graphs``), so the static-buffer protocol of the bundle path runs in CI."""
    import random

    from mlora.batch.config import EngineConfig
    from mlora.batch.engine.engine import Engine, Request
    from mlora.batch.model.decoder import DecoderModel

    bundle, pinned, shapes, layers = served
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = DecoderModel.from_pretrained(BASE, device=device, dtype=torch.float32)
    members = bundle.member_ids()
    rng = random.Random(31)
    # the Triton operator interpreted on the CPU is slow: fewer, shorter rows there (still
    # several decode buckets: 5 rows, then fewer as they finish)
    n, most = (5, 4) if operator == "triton" and device == "cpu" else (8, 6)
    reqs = [Request(row=i, id=str(i), prompt_ids=[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(3, 8))],
                    adapter=rng.choice([None, *members]), max_new_tokens=rng.randint(2, most)) for i in range(n)]
    outs = {}
    for graphs in (False, True):
        bank = BundleBank(bundle, layers, shapes, torch.float32, device, operator=operator)
        config = EngineConfig(block_size=4, max_num_seqs=5, max_batch_tokens=64, cuda_graphs=graphs, lookahead=False)
        eng = Engine(model, bank, pinned, config, num_blocks=128)
        for r in reqs:
            assert eng.add(r) is None
        outs[graphs] = {r.row: r.token_ids for r in eng.drain()}
        if graphs:
            assert eng.graphs.replays > 0 and len(eng.graphs.graphs) > 1
    assert any(r.adapter for r in reqs) and outs[True] == outs[False]
