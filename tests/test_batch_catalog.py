"""The batch job's adapter catalog (pinning, verified loading) and the slot bank.

Reference for every delta: PEFT's own per-module math read straight from the
saved state dict, ``scaling * (x @ A.T) @ B.T`` with PEFT's resolved
``scaling`` (rank_pattern, alpha_pattern, rsLoRA), in float32.
"""

import dataclasses
import json
import os
import pickle
import struct

import pytest
import torch
from factory import (
    copy_adapter,
    load_tensors,
    make_adapter,
    read_config,
    save_base,
    save_tensors,
    tiny_model,
    write_config,
)

from mlora.batch.adapters.catalog import AdapterChanged, AdapterError, CatalogError, load_catalog, load_factors
from mlora.batch.adapters.slots import BankError, BankFull, SlotBank
from mlora.batch.model.lora import GROUPS, ROLE_SLICE, group_shapes
from mlora.lora_tools.manifest import inspect_paths

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LAYERS = 2
SHAPES = group_shapes(hidden=32, intermediate=64, num_heads=4, num_kv_heads=2, head_dim=8)  # factory.tiny_config
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8),
    "all": dict(r=8, lora_alpha=16, target_modules=ALL),
    "pattern": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj", "down_proj"],
        rank_pattern={"o_proj": 2, "model.layers.1.self_attn.q_proj": 6}, alpha_pattern={"down_proj": 3},
    ),
    "rslora": dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["gate_proj", "up_proj"]),
}


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A base, an --adapters directory of four PEFT adapters, and PEFT's reference
    (A, B, scaling) per adapter and (layer, role)."""
    from peft.tuners.lora import LoraLayer

    root = tmp_path_factory.mktemp("catalog")
    base = save_base(tiny_model("llama"), str(root / "base"))
    refs = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        path = str(root / "adapters" / name)
        peft_model = make_adapter(path, seed=10 + i, lora_dropout=0.0, **kw)
        state = load_tensors(path)
        ref = {}
        for mod_name, mod in peft_model.named_modules():
            if isinstance(mod, LoraLayer):
                canon = mod_name.split("base_model.model.", 1)[1]
                layer, role = int(canon.split(".")[2]), canon.rsplit(".", 1)[1]
                a = state[f"base_model.model.{canon}.lora_A.weight"]
                b = state[f"base_model.model.{canon}.lora_B.weight"]
                ref[(layer, role)] = (a, b, float(mod.scaling["default"]), mod)
        refs[name] = ref
    os.makedirs(root / "adapters" / ".hidden")
    os.makedirs(root / "adapters" / "not-an-adapter")
    return dict(root=root, base=base, adapters=str(root / "adapters"), refs=refs)


@pytest.fixture(scope="module")
def pinned(ws):
    return load_catalog(ws["adapters"], None).pin(set(ADAPTERS), ws["base"], workers=2)


# ---- catalog loading --------------------------------------------------------------


def test_adapters_dir_gives_one_id_per_adapter_subdirectory(ws):
    cat = load_catalog(ws["adapters"], None)
    assert cat.ids() == sorted(ADAPTERS)
    assert cat.entries["qv"].path == os.path.join(ws["adapters"], "qv")


def test_exactly_one_source(ws, tmp_path):
    for args in ((None, None), (ws["adapters"], str(tmp_path / "c.json"))):
        with pytest.raises(ValueError) as e:
            load_catalog(*args)
        assert not isinstance(e.value, CatalogError)


def test_adapters_dir_errors(ws, tmp_path):
    with pytest.raises(CatalogError) as e:
        load_catalog(str(tmp_path / "missing"), None)
    assert e.value.code == "E_CATALOG_NOT_FOUND" and str(e.value).startswith("E_CATALOG_NOT_FOUND: ")
    with pytest.raises(CatalogError) as e:
        load_catalog(str(tmp_path), None)
    assert e.value.code == "E_CATALOG_EMPTY"
    with pytest.raises(CatalogError) as e:  # a single adapter, not a directory of them
        load_catalog(os.path.join(ws["adapters"], "qv"), None)
    assert e.value.code == "E_CATALOG_EMPTY" and "parent" in str(e.value)
    copy_adapter(os.path.join(ws["adapters"], "qv"), str(tmp_path / "__base__"))
    with pytest.raises(CatalogError) as e:
        load_catalog(str(tmp_path), None)
    assert e.value.code == "E_CATALOG_INVALID"


def _write_catalog(path, doc):
    with open(path, "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_catalog_file_relative_paths_and_expected_digests(ws, tmp_path, monkeypatch, pinned):
    good = pinned["all"].artifact_sha256
    cat_dir = ws["root"]  # relative paths resolve against this directory, not the cwd
    file = _write_catalog(cat_dir / "catalog.json", {
        "plain": "adapters/qv",
        "expected": {"path": "adapters/all", "artifact_sha256": good},
        "wrong": {"path": "adapters/rslora", "artifact_sha256": "0" * 64},
        "absolute": {"path": os.path.join(ws["adapters"], "pattern")},
    })
    monkeypatch.chdir(tmp_path)
    cat = load_catalog(None, file)
    assert cat.entries["plain"].path == os.path.join(ws["adapters"], "qv")
    got = cat.pin({"plain", "expected", "wrong", "absolute"}, ws["base"])
    assert got["plain"].ok and got["expected"].ok and got["absolute"].ok
    assert got["plain"].semantic_sha256 == pinned["qv"].semantic_sha256
    assert got["expected"].artifact_sha256 == good
    assert not got["wrong"].ok and got["wrong"].error_code == "E_ADAPTER_DIGEST_MISMATCH"
    assert got["wrong"].modules == ()


@pytest.mark.parametrize("doc, code", [
    ("{not json", "E_CATALOG_INVALID"),
    (["adapters/qv"], "E_CATALOG_INVALID"),
    ({}, "E_CATALOG_EMPTY"),
    ({"__base__": "adapters/qv"}, "E_CATALOG_INVALID"),
    ({"": "adapters/qv"}, "E_CATALOG_INVALID"),
    ({"a": 3}, "E_CATALOG_INVALID"),
    ({"a": {"path": ""}}, "E_CATALOG_INVALID"),
    ({"a": {"path": "adapters/qv", "sha": "x"}}, "E_CATALOG_INVALID"),
    ({"a": {"path": "adapters/qv", "artifact_sha256": "ABC"}}, "E_CATALOG_INVALID"),
])
def test_catalog_file_errors(tmp_path, doc, code):
    with pytest.raises(CatalogError) as e:
        load_catalog(None, _write_catalog(tmp_path / "c.json", doc))
    assert e.value.code == code


def test_catalog_file_not_found(tmp_path):
    with pytest.raises(CatalogError) as e:
        load_catalog(None, str(tmp_path / "nope.json"))
    assert e.value.code == "E_CATALOG_NOT_FOUND"


# ---- pinning ----------------------------------------------------------------------


def test_pin_matches_step1_identities_and_peft_scales(ws, pinned):
    reports, _ = inspect_paths([ws["adapters"]], ws["base"])
    by_name = {r.artifact.name: r.manifest for r in reports}
    for name, p in pinned.items():
        assert p.ok and p.error_code is None
        assert p.artifact_sha256 == by_name[name]["artifact_sha256"]
        assert p.semantic_sha256 == by_name[name]["semantic_sha256"]
        ref = ws["refs"][name]
        assert {(m.layer, m.role) for m in p.modules} == set(ref)
        for m in p.modules:
            a, b, scaling, _ = ref[(m.layer, m.role)]
            assert (m.rank, m.d_in, m.d_out) == (a.shape[0], a.shape[1], b.shape[0])
            assert m.scale == pytest.approx(scaling, rel=1e-12)
        assert p.max_rank == max(a.shape[0] for a, *_ in ref.values())
    assert pinned["pattern"].max_rank == 6 and pinned["rslora"].max_rank == 2


def test_unknown_id(ws):
    got = load_catalog(ws["adapters"], None).pin({"qv", "zzz"}, ws["base"])
    assert got["qv"].ok
    assert not got["zzz"].ok and got["zzz"].error_code == "E_ADAPTER_UNKNOWN"
    assert "adapter 'zzz' is not in the catalog" in got["zzz"].error_message


def test_reserved_ids_are_not_pinned(ws):
    with pytest.raises(ValueError):
        load_catalog(ws["adapters"], None).pin({"__base__"}, ws["base"])


def _first_tensor(path, key_part):
    from mlora.lora_tools.safetensors_io import read_header

    header = read_header(os.path.join(path, "adapter_model.safetensors"))
    return next(t for k, t in sorted(header.tensors.items()) if key_part in k)


def test_invalid_and_unservable_adapters_keep_their_step1_codes(ws, tmp_path):
    src = os.path.join(ws["adapters"], "qv")
    nan = copy_adapter(src, str(tmp_path / "d" / "nan"))
    tensors = load_tensors(nan)
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")
    save_tensors(nan, tensors)
    trunc = copy_adapter(src, str(tmp_path / "d" / "trunc"))
    file = os.path.join(trunc, "adapter_model.safetensors")
    os.truncate(file, os.path.getsize(file) - 7)
    bias = copy_adapter(src, str(tmp_path / "d" / "bias"))
    write_config(bias, {**read_config(bias), "bias": "all"})
    tensors = load_tensors(bias)  # a trained bias: a base without biases cannot serve it
    tensors["base_model.model.model.layers.0.self_attn.q_proj.bias"] = torch.ones(32)
    save_tensors(bias, tensors)
    head = str(tmp_path / "d" / "head")
    make_adapter(head, r=2, lora_alpha=2, target_modules=["lm_head"])
    save_tensors(head, {k: v for k, v in load_tensors(head).items() if "lora_" in k})  # valid, servable PEFT
    got = load_catalog(str(tmp_path / "d"), None).pin({"nan", "trunc", "bias", "head"}, ws["base"])
    assert {i: p.error_code for i, p in got.items()} == {
        "nan": "E_NON_FINITE", "trunc": "E_SAFETENSORS_TRUNCATED", "bias": "U_BIAS",
        "head": "E_ADAPTER_MODULE_UNSUPPORTED",
    }
    assert not any(p.ok for p in got.values())
    assert "lm_head" in got["head"].error_message
    with pytest.raises(AdapterError) as e:
        load_factors(got["nan"], torch.float32, "cpu")
    assert e.value.code == "E_NON_FINITE"


def test_an_alora_adapter_pins_its_invocation_tokens(ws, pinned, tmp_path):
    """PEFT's aLoRA adapter is servable: pinned ok, with its invocation; the record survives the
    pickle that carries it to worker processes and Ray actors, and the engine's dataclasses.replace."""
    path = str(tmp_path / "d" / "act")
    make_adapter(path, seed=3, r=2, lora_alpha=4, task_type="CAUSAL_LM", alora_invocation_tokens=[7, 8, 9])
    got = load_catalog(str(tmp_path / "d"), None).pin({"act"}, ws["base"])["act"]
    [report], _ = inspect_paths([path], ws["base"])
    assert got.ok and got.error_code is None and got.invocation_tokens == (7, 8, 9)
    assert got.semantic_sha256 == report.manifest["semantic_sha256"]
    assert [f.code for f in got.findings] == ["I_ALORA"]
    assert pickle.loads(pickle.dumps(got)) == got
    assert dataclasses.replace(got, ok=False).invocation_tokens == (7, 8, 9)
    assert all(p.invocation_tokens is None for p in pinned.values())  # ordinary LoRA: always on


# ---- verified loading -------------------------------------------------------------


def test_load_factors_gives_peft_factors(ws, pinned):
    for name, p in pinned.items():
        factors = load_factors(p, torch.float32, "cpu")
        assert set(factors) == set(ws["refs"][name])
        for key, (a, b, scale) in factors.items():
            ra, rb, scaling, _ = ws["refs"][name][key]
            assert torch.equal(a, ra) and torch.equal(b, rb) and scale == pytest.approx(scaling, rel=1e-12)


def test_a_pickle_adapter_is_pinned_only_when_allowed_and_reread_verified(ws, pinned, tmp_path):
    path = copy_adapter(os.path.join(ws["adapters"], "qv"), str(tmp_path / "d" / "qv"))
    tensors = load_tensors(path)
    torch.save(tensors, os.path.join(path, "adapter_model.bin"))
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    cat = load_catalog(str(tmp_path / "d"), None)
    refused = cat.pin({"qv"}, ws["base"])["qv"]
    assert not refused.ok and refused.error_code == "E_PICKLE_REFUSED" and "--allow-pickle" in refused.error_message
    p = cat.pin({"qv"}, ws["base"], allow_pickle=True)["qv"]
    assert p.ok and p.semantic_sha256 == pinned["qv"].semantic_sha256  # the identity is not the container's
    want = load_factors(pinned["qv"], torch.float32, "cpu")
    got = load_factors(p, torch.float32, "cpu")
    assert got.keys() == want.keys() and all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
                                             for g, w in zip(got.values(), want.values()))
    key = sorted(tensors)[0]
    tensors[key][0, 0] += 1.0
    torch.save(tensors, os.path.join(path, "adapter_model.bin"))
    with pytest.raises(AdapterChanged, match="no longer hashes"):
        load_factors(p, torch.float32, "cpu")
    os.remove(os.path.join(path, "adapter_model.bin"))
    with pytest.raises(AdapterChanged, match="cannot be read"):
        load_factors(p, torch.float32, "cpu")


def test_unsupported_role_is_refused_at_load_time(pinned):
    p = pinned["qv"]
    sneaky = dataclasses.replace(p, modules=(dataclasses.replace(p.modules[0], role="lm_head", name="lm_head"),))
    with pytest.raises(AdapterError) as e:
        load_factors(sneaky, torch.float32, "cpu")
    assert e.value.code == "E_ADAPTER_MODULE_UNSUPPORTED"


def test_bytes_changed_after_pinning(ws, tmp_path):
    path = copy_adapter(os.path.join(ws["adapters"], "qv"), str(tmp_path / "d" / "qv"))
    cat = load_catalog(str(tmp_path / "d"), None)
    p = cat.pin({"qv"}, ws["base"])["qv"]
    load_factors(p, torch.float32, "cpu")  # unchanged: fine
    info = _first_tensor(path, "lora_B")
    with open(info.path, "r+b") as f:  # one factor value, same layout
        f.seek(info.offset)
        f.write(struct.pack("<f", 0.5))
    with pytest.raises(AdapterChanged) as e:
        load_factors(p, torch.float32, "cpu")
    assert e.value.code == "E_ADAPTER_CHANGED" and "old identity is never served" in str(e.value)
    assert "no longer hashes to its pinned digest" in str(e.value)
    bank = SlotBank(LAYERS, SHAPES, 2, 8, torch.float32, "cpu")
    with pytest.raises(AdapterChanged):
        bank.ensure(["qv"], {"qv": p})
    assert bank.resident == {} and bank.stats.loads == 0
    os.truncate(info.path, info.offset + 2)  # and a file that shrank: it ends inside the factor
    with pytest.raises(AdapterChanged, match="ends early in"):
        load_factors(p, torch.float32, "cpu")
    os.remove(info.path)
    with pytest.raises(AdapterChanged, match="cannot be read"):
        load_factors(p, torch.float32, "cpu")


# ---- slot bank ----------------------------------------------------------------------


def _reference_apply(ws, slot_adapter, layer, group, x, y, row_slots):
    """PEFT's per-module delta, slice by slice, for every row."""
    out = y.clone()
    widths = SHAPES[group][1]
    for t, s in enumerate(row_slots.tolist()):
        if s < 0:
            continue
        ref = ws["refs"][slot_adapter[s]]
        off = 0
        for role, w in zip(GROUPS[group], widths):
            if (layer, role) in ref:
                a, b, scaling, _ = ref[(layer, role)]
                out[t, off : off + w] += scaling * (x[t] @ a.T) @ b.T
            off += w
    return out


def _check_bank(ws, bank, slots, seed, T=23, layers=range(LAYERS), groups=GROUPS):
    g = torch.Generator().manual_seed(seed)
    slot_adapter = {s: name for name, s in slots.items()}
    choices = torch.tensor([-1] + sorted(slot_adapter), dtype=torch.int32)
    row_slots = choices[torch.randint(0, len(choices), (T,), generator=g)]
    row_slots[:2] = -1  # at least one base row
    row_slots[2 : 2 + len(slot_adapter)] = torch.tensor(sorted(slot_adapter), dtype=torch.int32)
    ctx = bank.context(row_slots)
    for layer in layers:
        for group in groups:
            d_in, widths = SHAPES[group]
            x = torch.randn(T, d_in, generator=g)
            y0 = torch.randn(T, sum(widths), generator=g)
            y = y0.clone()
            ctx.apply(layer, group, x, y)
            want = _reference_apply(ws, slot_adapter, layer, group, x, y0, row_slots)
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
            base = row_slots < 0
            assert torch.equal(y[base], y0[base])
            off = 0
            for role, w in zip(GROUPS[group], widths):  # untargeted slices untouched, bit for bit
                for s, name in slot_adapter.items():
                    if (layer, role) not in ws["refs"][name]:
                        rows = row_slots == s
                        assert torch.equal(y[rows, off : off + w], y0[rows, off : off + w])
                off += w


def test_reference_is_peft_module_delta(ws):
    x = torch.randn(5, 32)
    for name in ADAPTERS:
        for (layer, role), (a, b, scaling, mod) in ws["refs"][name].items():
            if role in ("o_proj", "down_proj"):
                continue  # d_in differs; q/k/v/gate/up cover every adapter's scaling rule
            mod.eval()
            with torch.no_grad():
                delta = mod(x) - mod.base_layer(x)
            torch.testing.assert_close(delta, scaling * (x @ a.T) @ b.T, rtol=1e-5, atol=1e-5)


def test_bank_applies_peft_deltas_slice_by_slice(ws, pinned):
    bank = SlotBank(LAYERS, SHAPES, 4, 8, torch.float32, "cpu")
    slots = bank.ensure(list(ADAPTERS), pinned)
    assert sorted(slots.values()) == [0, 1, 2, 3]
    _check_bank(ws, bank, slots, seed=0)
    _check_bank(ws, bank, {"rslora": slots["rslora"]}, seed=1)  # only gate_up deltas; other groups skipped
    assert bank.stats.as_dict() == {"hits": 0, "misses": 4, "loads": 4, "evictions": 0}
    assert bank.ensure(["qv", "qv"], pinned) == {"qv": slots["qv"]}
    assert bank.stats.hits == 1


def test_lru_eviction_reload_and_zeroed_tails(ws, pinned):
    bank = SlotBank(LAYERS, SHAPES, 2, 8, torch.float32, "cpu")
    a = bank.ensure(["all"], pinned)["all"]
    b = bank.ensure(["qv"], pinned)["qv"]
    bank.ensure(["all"], pinned)  # "qv" is now least recently used
    for g in GROUPS:  # poison qv's slot entirely: tails and untargeted slices must be rewritten
        bank.A[g][b] = float("nan")
        bank.B[g][b] = float("nan")
    c = bank.ensure(["pattern"], pinned)["pattern"]
    assert c == b and bank.stats.evictions == 1
    factors = load_factors(pinned["pattern"], torch.float32, "cpu")
    for g in GROUPS:
        want_a, want_b = torch.zeros_like(bank.A[g][c]), torch.zeros_like(bank.B[g][c])
        for (layer, role), (fa, fb, _) in factors.items():
            group, j = ROLE_SLICE[role]
            if group == g:
                off = sum(SHAPES[g][1][:j])
                want_a[layer, j, : fa.shape[0]] = fa
                want_b[layer, off : off + fb.shape[0], : fa.shape[0]] = fb
                assert bank.ranks[g][c, layer, j] == fa.shape[0]
        assert torch.equal(bank.A[g][c], want_a) and torch.equal(bank.B[g][c], want_b)
        targeted = torch.zeros_like(bank.ranks[g][c], dtype=torch.bool)
        for layer, role in factors:
            if ROLE_SLICE[role][0] == g:
                targeted[layer, ROLE_SLICE[role][1]] = True
        assert (bank.ranks[g][c][~targeted] == 0).all()
    _check_bank(ws, bank, {"all": a, "pattern": c}, seed=2)
    again = bank.ensure(["qv"], pinned)["qv"]  # reload: evicts "all", now the least recently used
    assert again == a and "all" not in bank.ensure(["pattern", "qv"], pinned)
    _check_bank(ws, bank, {"qv": again, "pattern": c}, seed=3)
    assert bank.stats.as_dict() == {"hits": 3, "misses": 4, "loads": 4, "evictions": 2}


def test_bank_refusals(ws, pinned):
    bank = SlotBank(LAYERS, SHAPES, 2, 6, torch.float32, "cpu")
    with pytest.raises(BankFull) as e:
        bank.ensure(["qv", "pattern", "rslora"], pinned)
    assert e.value.code == "E_BANK_FULL"
    with pytest.raises(BankError) as e:
        bank.ensure(["all"], pinned)  # rank 8 > the bank's 6
    assert e.value.code == "E_BANK_RANK_EXCEEDS_R"
    with pytest.raises(BankError) as e:
        bank.ensure(["nope"], pinned)
    assert e.value.code == "E_ADAPTER_UNKNOWN"
    assert bank.resident == {}
    slot = bank.ensure(["qv"], pinned)["qv"]
    with pytest.raises(BankError) as e:  # a row on an empty slot never silently runs the base
        bank.context(torch.tensor([slot, 1 - slot], dtype=torch.int32))
    assert e.value.code == "E_BANK_SLOT_EMPTY"


def test_two_ids_for_one_adapter_share_a_slot(ws, pinned):
    twin = dataclasses.replace(pinned["qv"], id="twin")
    bank = SlotBank(LAYERS, SHAPES, 1, 8, torch.float32, "cpu")
    assert bank.ensure(["qv", "twin"], {**pinned, "twin": twin}) == {"qv": 0, "twin": 0}


def test_bytes_per_slot_matches_the_allocation():
    bank = SlotBank(LAYERS, SHAPES, 3, 8, torch.bfloat16, "cpu")
    total = sum(t.numel() * t.element_size() for d in (bank.A, bank.B, bank.ranks, bank.scales) for t in d.values())
    assert SlotBank.bytes_per_slot(LAYERS, SHAPES, 8, torch.bfloat16) * 3 == total


@pytest.mark.parametrize("R", [8, 24])
def test_triton_backend_equals_torch(ws, pinned, R):
    """Both backends over the same bank contents; at R 24 every slot's B is rank-pitched with a
    pitch (8) below R, so the layout is read, not just the padded bytes; both equal a float64
    sum of each row's own adapter factors (from the catalog, not the bank)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton on CPU tensors needs the interpreter
    banks = {be: SlotBank(LAYERS, SHAPES, 3, R, torch.float32, device, backend=be) for be in ("torch", "triton")}
    g = torch.Generator().manual_seed(7)
    row_slots = torch.tensor([0, -1, 1, 2, 2, 0, -1, 1, 0], dtype=torch.int32)
    x = torch.randn(9, 32, generator=g)
    y0 = torch.randn(9, sum(SHAPES["qkv"][1]), generator=g)
    out = {}
    for be, bank in banks.items():
        assert bank.ensure(["all", "pattern", "qv"], pinned) == {"all": 0, "pattern": 1, "qv": 2}
        y = y0.to(device, copy=True)
        bank.context(row_slots.to(device)).apply(1, "qkv", x.to(device), y)
        out[be] = y.cpu()
    want = y0.double().clone()
    for row, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            continue
        p = pinned[("all", "pattern", "qv")[slot]]
        for (layer, role), (a, b, scale) in load_factors(p, torch.float64, "cpu").items():
            group, j = ROLE_SLICE[role]
            if layer == 1 and group == "qkv":
                col = sum(SHAPES["qkv"][1][:j])
                want[row, col : col + b.shape[0]] += scale * (b @ (a @ x[row].double()))
    torch.testing.assert_close(out["torch"].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["triton"], out["torch"], rtol=1e-5, atol=1e-5)
    assert torch.equal(out["triton"][row_slots < 0], y0[row_slots < 0])
    assert not torch.equal(out["torch"], y0)


@pytest.mark.parametrize("R", [8, 24])
def test_gate_up_deltas_fused_into_the_silu_product(ws, pinned, R):
    """``BankContext.apply_silu_mul`` on a Triton bank (the expand inside the SiLU product:
    ``mlora.kernels.lora_silu_mul``) against a torch bank's ``apply`` then the SiLU product,
    and against the same Triton bank's two launches; one adapter targets gate/up ("all"), two
    do not (their rows, like the slot-less ones, get the SiLU product alone); at R 24 B is
    rank-pitched with pitch 8. A batch of fewer than ``fuse_silu_min_rows`` rows (1,024 unless
    lowered) is left to the two launches."""
    from mlora.kernels.elementwise import ElementwiseOps, silu_mul_ref

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inter = SHAPES["gate_up"][1][0]
    g = torch.Generator().manual_seed(8)
    row_slots = torch.tensor([0, -1, 1, 2, 2, 0, -1, 1, 0, 0], dtype=torch.int32)
    x = torch.randn(10, 32, generator=g)
    gu0 = torch.randn(10, 2 * inter, generator=g)
    torch_bank = SlotBank(LAYERS, SHAPES, 3, R, torch.float32, "cpu", backend="torch")
    torch_bank.ensure(["all", "pattern", "qv"], pinned)
    gu = gu0.clone()
    torch_bank.context(row_slots).apply(0, "gate_up", x, gu)
    want = silu_mul_ref(gu, inter)
    assert not torch.equal(want, silu_mul_ref(gu0, inter))  # the adapter changes something
    ops = ElementwiseOps(True)  # the Triton element-wise kernels (interpreted on the CPU)
    bank = SlotBank(LAYERS, SHAPES, 3, R, torch.float32, device, backend="triton")
    assert bank.fuse_silu_min_rows == 1024
    bank.ensure(["all", "pattern", "qv"], pinned)
    outs = {}
    for min_rows in (1, 1024):  # a 10-row batch: fused, then the two launches
        bank.fuse_silu_min_rows = min_rows
        gu = gu0.to(device, copy=True)
        outs[min_rows] = bank.context(row_slots.to(device)).apply_silu_mul(0, x.to(device), gu, inter, ops).cpu()
        assert torch.equal(gu.cpu(), gu0) == (min_rows == 1)  # fused: the deltas never written into gate_up
    torch.testing.assert_close(outs[1], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1024], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1], outs[1024], rtol=1e-5, atol=1e-5)


def test_static_launch_plan_is_refilled_only_when_the_row_slots_change(ws, pinned):
    """SlotTensors._plans with a captured graph's LaunchPlan buffers: filled from the row
    slots, left as they are (same SegmentPlan) when the next replay has the same row slots,
    refilled when they change; another graph's buffers are filled on their own."""
    from mlora.kernels import empty_launch_plan, make_launch_plan, tile_capacity
    from mlora.kernels.plan import build_plan

    bank = SlotBank(LAYERS, SHAPES, 4, 8, torch.float32, "cpu", backend="triton")
    slots = bank.ensure(list(ADAPTERS), pinned)
    s = sorted(slots.values())
    static, other = (empty_launch_plan(8, tile_capacity(8, 4, 16), 16, "cpu") for _ in range(2))

    def same(lp, rows):
        want = make_launch_plan(build_plan(torch.tensor(rows, dtype=torch.int32)), block_m=16)
        n, k = want.row_capacity, want.tile_capacity
        return all(torch.equal(getattr(lp, f)[:m], getattr(want, f)) for f, m in
                   (("sorted_rows", n), ("tile_slot", k), ("tile_start", k), ("tile_end", k))) \
            and torch.equal(lp.num_tiles, want.num_tiles)

    rows = [s[0], s[1], -1, s[0], s[2], s[3], -1, s[1]]
    first = bank.context(torch.tensor(rows, dtype=torch.int32), static=static)
    assert same(static, rows)
    static.tile_slot.fill_(-7)  # only _plans writes these buffers: a skipped refill leaves this visible
    again = bank.context(torch.tensor(rows, dtype=torch.int32), static=static)
    assert again.plan is static and bool((static.tile_slot == -7).all())
    bank.context(torch.tensor(rows, dtype=torch.int32), static=other)
    assert same(other, rows)  # other buffers: filled, not taken for the first ones
    changed = [s[3], s[3], s[0], -1, -1, s[2], s[1], s[1]]
    bank.context(torch.tensor(changed, dtype=torch.int32), static=static)
    assert same(static, changed)
    assert first.plan is static
