"""`mlora compress`: bundles from adapter directories, the --max-error gate, immutability,
tamper detection, and export round trips through `mlora validate` and PEFT."""

import json
import os

import factory
import pytest
import torch
from conftest import DEMO
from safetensors.torch import save_file

from mlora.compress.bundle import read_bundle
from mlora.compress.collection import load_collection
from mlora.compress.solvers import CompressError

LAYERS, MODULES = 2, ("q_proj", "v_proj")


def write_peft(path, factors, r, alpha, base_name="org/tiny-llama"):
    """A PEFT adapter directory with exactly ``factors``: {module name: (A [r, in], B [out, r])}."""
    os.makedirs(path)
    tensors = {}
    for module, (a, b) in factors.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.float().contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.float().contiguous()
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "target_modules": list(MODULES),
           "base_model_name_or_path": base_name, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
           "use_dora": False, "lora_dropout": 0.0, "inference_mode": True}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("base") / "tiny")
    factory.save_base(factory.tiny_model("llama", seed=0), path)
    return path


def _dims(base):
    cfg = json.load(open(os.path.join(base, "config.json")))
    h = cfg["hidden_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    return {"q_proj": (cfg["num_attention_heads"] * hd, h), "v_proj": (cfg["num_key_value_heads"] * hd, h)}


def shared_collection(root, base, n=5, true_rank=3, r=4, seed=0, noise=0.0):
    """n adapters whose updates share one rank-``true_rank`` basis per module (plus optional noise)."""
    g = torch.Generator().manual_seed(seed)
    dims = _dims(base)
    basis = {(layer, m): (torch.randn(dims[m][0], true_rank, generator=g), torch.randn(dims[m][1], true_rank, generator=g))
             for layer in range(LAYERS) for m in MODULES}
    for i in range(n):
        factors = {}
        for layer in range(LAYERS):
            for m in MODULES:
                U0, V0 = basis[(layer, m)]
                s = torch.randn(true_rank, true_rank, generator=g)
                b = torch.zeros(dims[m][0], r)
                a = torch.zeros(r, dims[m][1])
                b[:, :true_rank] = U0 @ s
                a[:true_rank] = V0.T
                if noise:
                    b += noise * torch.randn(b.shape, generator=g)
                    a += noise * torch.randn(a.shape, generator=g)
                factors[f"model.layers.{layer}.self_attn.{m}"] = (a, b)
        write_peft(os.path.join(root, f"a{i}"), factors, r, 2 * r)
    return os.path.join(root)


def test_shared_bases_compress_to_near_zero_error_and_members_round_trip(tmp_path, base, run_cli):
    src = shared_collection(str(tmp_path / "src"), base)
    out = tmp_path / "bundle"
    code, stdout, stderr = run_cli("compress", "fit", src, "-o", out, "--rank", 3, "--json", "--base", base)
    assert code == 0, stderr
    res = json.loads(stdout)
    assert res["ok"] and max(res["max_error_by_member"].values()) < 1e-8
    b = read_bundle(str(out))
    assert b.member_ids() == [f"a{i}" for i in range(5)] and b.method == "jd-full"
    assert all(os.stat(out / f).st_mode & 0o222 == 0 for f in os.listdir(out))  # read-only files
    col = load_collection([src], base)
    for module, per in col.modules.items():
        for member, delta in per.items():
            bb, aa = b.member_delta(member, module)
            torch.testing.assert_close((bb @ aa).double(), delta.dense(), rtol=1e-4, atol=1e-4)
    # inspect reads and verifies it
    code, stdout, _ = run_cli("compress", "inspect", out, "--json")
    assert code == 0 and json.loads(stdout)["bundle_sha256"] == res["bundle_sha256"]
    # deterministic: the same inputs and seed give the same bundle identity
    code, stdout, _ = run_cli("compress", "fit", src, "-o", tmp_path / "again", "--rank", 3, "--json", "--base", base)
    assert json.loads(stdout)["bundle_sha256"] == res["bundle_sha256"]


def test_the_gate_refuses_and_writes_nothing(tmp_path, base, run_cli):
    src = shared_collection(str(tmp_path / "src"), base, true_rank=4, r=4, noise=0.5, seed=3)
    out = tmp_path / "bundle"
    code, stdout, stderr = run_cli("compress", "fit", src, "-o", out, "--rank", 1, "--max-error", 0.05, "--json")
    assert code == 1 and "E_COMPRESS_MAX_ERROR" in stderr
    res = json.loads(stdout)
    assert not res["ok"] and res["offenders"] and all(o["error"] > 0.05 for o in res["offenders"])
    assert not out.exists() and [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temp left


def test_clusters_auto_meets_the_bound_that_one_cluster_misses(tmp_path, base, run_cli):
    # two groups of adapters with different shared bases: one rank-2 basis cannot hold both
    root = tmp_path / "src"
    shared_collection(str(root / "g1"), base, n=3, true_rank=2, r=2, seed=11)
    shared_collection(str(root / "g2"), base, n=3, true_rank=2, r=2, seed=12)
    for g in ("g1", "g2"):  # unique member ids across the two groups
        for d in os.listdir(root / g):
            os.rename(root / g / d, root / g / f"{g}-{d}")
    code, _, _ = run_cli("compress", "fit", root / "g1", root / "g2", "-o", tmp_path / "one", "--rank", 2, "--max-error", 1e-6)
    assert code == 1
    code, stdout, stderr = run_cli("compress", "fit", root / "g1", root / "g2", "-o", tmp_path / "auto", "--rank", 2,
                                   "--clusters", "auto", "--max-error", 1e-6, "--json")
    assert code == 0, stderr
    man = read_bundle(str(tmp_path / "auto")).manifest
    assert max(man["max_error_by_member"].values()) <= 1e-6
    for m in man["modules"].values():  # two clusters, one per group
        a = m["assignments"]
        assert m["clusters"] == 2
        assert len({a[f"g1-a{i}"] for i in range(3)}) == 1 and {a["g1-a0"], a["g2-a0"]} == {0, 1}


def test_existing_outputs_are_never_overwritten(tmp_path, base, run_cli):
    src = shared_collection(str(tmp_path / "src"), base, n=2)
    out = tmp_path / "bundle"
    out.mkdir()
    code, _, stderr = run_cli("compress", "fit", src, "-o", out, "--rank", 3)
    assert code == 1 and "E_BUNDLE_EXISTS" in stderr and os.listdir(out) == []
    code, _, _ = run_cli("compress", "fit", src, "-o", tmp_path / "b2", "--rank", 3)
    assert code == 0
    (tmp_path / "ex").mkdir()
    code, _, stderr = run_cli("compress", "export", tmp_path / "b2", "a0", "-o", tmp_path / "ex")
    assert code == 1 and "E_EXPORT_EXISTS" in stderr


@pytest.mark.parametrize("damage, code", [
    ("json", "E_BUNDLE_TAMPERED"), ("tensor", "E_BUNDLE_TAMPERED"), ("truncate", "E_BUNDLE_TAMPERED"),
    ("missing", "E_BUNDLE_MISSING"),
])
def test_tampering_is_detected(tmp_path, base, run_cli, damage, code):
    src = shared_collection(str(tmp_path / "src"), base, n=2)
    out = tmp_path / "bundle"
    assert run_cli("compress", "fit", src, "-o", out, "--rank", 3)[0] == 0
    for f in os.listdir(out):
        os.chmod(out / f, 0o644)
    if damage == "json":
        man = json.loads((out / "bundle.json").read_text())
        man["options"]["max_error"] = 0.99
        (out / "bundle.json").write_text(json.dumps(man))
    elif damage == "tensor":
        data = bytearray((out / "cores.safetensors").read_bytes())
        data[-3] ^= 0x40  # a bit of the last core value
        (out / "cores.safetensors").write_bytes(bytes(data))
    elif damage == "truncate":
        data = (out / "bases.safetensors").read_bytes()
        (out / "bases.safetensors").write_bytes(data[: len(data) // 2])
    else:
        os.remove(out / "bases.safetensors")
    with pytest.raises(CompressError) as e:
        read_bundle(str(out))
    assert e.value.code == code
    rc, _, stderr = run_cli("compress", "inspect", out)
    assert rc == 1 and code in stderr


def test_export_is_a_peft_adapter_with_the_compressed_delta(tmp_path, base, run_cli):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    src = shared_collection(str(tmp_path / "src"), base, n=3, noise=0.05, seed=5)
    assert run_cli("compress", "fit", src, "-o", tmp_path / "b", "--rank", 3, "--method", "jd-diag", "--max-error", 0.9)[0] == 0
    code, stdout, stderr = run_cli("compress", "export", tmp_path / "b", "a1", "-o", tmp_path / "ex", "--json")
    assert code == 0, stderr and json.loads(stdout)["modules"] == LAYERS * len(MODULES)
    code, stdout, _ = run_cli("validate", tmp_path / "ex", "--base", base, "--json")
    man = json.loads(stdout.splitlines()[0])
    assert code == 0 and man["valid"] and man["servable"]
    b = read_bundle(str(tmp_path / "b"))
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(tmp_path / "ex"))
    for layer in range(LAYERS):
        for m in MODULES:
            module = f"model.layers.{layer}.self_attn.{m}"
            got = peft.base_model.model.get_submodule(module).get_delta_weight("default")
            bb, aa = b.member_delta("a1", module)
            torch.testing.assert_close(got, bb @ aa, rtol=1e-5, atol=1e-6)
    code, _, stderr = run_cli("compress", "export", tmp_path / "b", "nobody", "-o", tmp_path / "ex2")
    assert code == 1 and "E_BUNDLE_MEMBER" in stderr


def test_batch_run_serves_bundle_members_exactly_as_their_exports(tmp_path, run_cli):
    import pyarrow.parquet as pq
    from conftest import DEMO

    bundle = tmp_path / "bundle"
    assert run_cli("compress", "fit", os.path.join(DEMO, "adapters"), "-o", bundle, "--rank", 32, "--max-error", 0.9)[0] == 0
    members = read_bundle(str(bundle)).member_ids()
    for m in members:
        assert run_cli("compress", "export", bundle, m, "-o", tmp_path / "ex" / m)[0] == 0
    common = ("--base", os.path.join(DEMO, "base"), "--max-new-tokens", 8, "--device", "cpu", "--dtype", "float32", "-q")
    prompts = os.path.join(DEMO, "prompts.parquet")
    assert run_cli("batch-run", prompts, tmp_path / "from-bundle", "--adapters", bundle, *common)[0] == 0
    assert run_cli("batch-run", prompts, tmp_path / "materialized", "--adapters", bundle, *common,
                   "--bundle-operator", "materialized")[0] == 0
    assert run_cli("batch-run", prompts, tmp_path / "from-exports", "--adapters", tmp_path / "ex", *common)[0] == 0
    a = pq.read_table(str(tmp_path / "from-bundle")).to_pydict()  # auto: the three-stage operator
    m = pq.read_table(str(tmp_path / "materialized")).to_pydict()
    b = pq.read_table(str(tmp_path / "from-exports")).to_pydict()
    assert all(e is None for e in a["error_code"]) and set(a["adapter"]) >= set(members)
    assert m["completion_token_ids"] == b["completion_token_ids"]  # the same float32 factors: the same tokens
    # the three-stage operator evaluates the same update in another order: float32 rounding
    # only, which leaves these greedy tokens unchanged
    assert a["completion_token_ids"] == b["completion_token_ids"]
    metrics = json.loads((tmp_path / "from-bundle" / "_metrics.json").read_text())["metrics"]
    assert sum(metrics["adapter_loads"].values()) == 0  # every member resident from the start: no loads
    sha = {r: s for r, s in zip(a["adapter"], a["adapter_sha256"]) if r}
    assert len(set(sha.values())) == len(members)  # one identity per member
    # two core slots for the members: cores loaded and evicted as rows need them, same tokens
    assert run_cli("batch-run", prompts, tmp_path / "two-slots", "--adapters", bundle, *common,
                   "--max-gpu-adapters", 2)[0] == 0
    two = pq.read_table(str(tmp_path / "two-slots")).to_pydict()
    assert two["completion_token_ids"] == a["completion_token_ids"] and all(e is None for e in two["error_code"])
    metrics = json.loads((tmp_path / "two-slots" / "_metrics.json").read_text())["metrics"]
    assert sum(metrics["adapter_loads"].values()) >= len(members) and sum(metrics["evictions"].values()) >= 1

    # a tampered bundle serves nothing: every member's rows fail closed with the bundle's code
    for f in os.listdir(bundle):
        os.chmod(bundle / f, 0o644)
    data = bytearray((bundle / "bases.safetensors").read_bytes())
    data[-5] ^= 0x10
    (bundle / "bases.safetensors").write_bytes(bytes(data))
    assert run_cli("batch-run", prompts, tmp_path / "tampered", "--adapters", bundle, *common)[0] == 0
    t = pq.read_table(str(tmp_path / "tampered")).to_pydict()
    codes = {c for r, c in zip(t["adapter"], t["error_code"]) if r and r != "__base__"}
    assert codes == {"E_BUNDLE_TAMPERED"}


def test_a_catalog_file_entry_may_name_a_bundle_member(tmp_path, run_cli):
    from conftest import DEMO

    from mlora.batch.adapters.catalog import load_catalog, load_factors

    bundle = tmp_path / "bundle"
    assert run_cli("compress", "fit", os.path.join(DEMO, "adapters"), "-o", bundle, "--rank", 32, "--max-error", 0.9)[0] == 0
    cat = tmp_path / "catalog.json"
    cat.write_text(json.dumps({"up": {"path": "bundle", "member": "upper"},
                               "ghost": {"path": "bundle", "member": "nobody"},
                               "plain": os.path.join(DEMO, "adapters", "spell")}))
    pinned = load_catalog(None, str(cat)).pin({"up", "ghost", "plain"}, os.path.join(DEMO, "base"))
    assert pinned["up"].ok and pinned["up"].bundle_member == "upper" and pinned["plain"].ok
    assert not pinned["ghost"].ok and pinned["ghost"].error_code == "E_ADAPTER_UNKNOWN"
    b = read_bundle(str(bundle))
    factors = load_factors(pinned["up"], torch.float32, "cpu")
    module = pinned["up"].modules[0]
    a, bb, scale = factors[(module.layer, module.role)]
    want_b, want_a = b.member_delta("upper", module.name)
    assert scale == 1.0 and torch.equal(a, want_a) and torch.equal(bb, want_b)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"x": {"path": "bundle", "member": "upper", "artifact_sha256": "0" * 64}}))
    with pytest.raises(Exception, match="E_CATALOG_INVALID"):
        load_catalog(None, str(bad))


def test_pinning_every_member_reads_and_verifies_the_bundle_once(tmp_path, run_cli, monkeypatch):
    """One read of the bundle per pin, not one per member (a large bundle hashed once per member
    would take members x bundle bytes to pin); a tampered bundle still fails every member."""
    from conftest import DEMO

    import mlora.batch.adapters.bundles as served
    from mlora.batch.adapters.catalog import load_catalog

    bundle = tmp_path / "bundle"
    assert run_cli("compress", "fit", os.path.join(DEMO, "adapters"), "-o", bundle, "--rank", 32, "--max-error", 0.9)[0] == 0
    reads = []
    real = served.read_bundle
    monkeypatch.setattr(served, "read_bundle", lambda path: reads.append(path) or real(path))
    catalog = load_catalog(str(bundle), None)
    members = set(catalog.entries)
    assert len(members) >= 3
    pinned = catalog.pin(members, os.path.join(DEMO, "base"))
    assert all(p.ok for p in pinned.values()) and len(reads) == 1
    for f in os.listdir(bundle):
        os.chmod(bundle / f, 0o644)
    data = bytearray((bundle / "cores.safetensors").read_bytes())
    data[-3] ^= 0x01
    (bundle / "cores.safetensors").write_bytes(bytes(data))
    pinned = load_catalog(str(bundle), None).pin(members, os.path.join(DEMO, "base"))
    assert len(reads) == 2 and {p.error_code for p in pinned.values()} == {"E_BUNDLE_TAMPERED"}


def test_three_stage_refuses_a_job_that_is_not_one_bundle(tmp_path, run_cli):
    """--bundle-operator three-stage never serves a non-member another way: exit 2, named code;
    auto serves the same mixed job with slots."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import DEMO

    bundle = tmp_path / "bundle"
    assert run_cli("compress", "fit", os.path.join(DEMO, "adapters"), "-o", bundle, "--rank", 32, "--max-error", 0.9)[0] == 0
    cat = tmp_path / "catalog.json"
    cat.write_text(json.dumps({"up": {"path": "bundle", "member": "upper"}, "plain": os.path.join(DEMO, "adapters", "spell")}))
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["hello", "world"], "adapter": ["up", "plain"]}), str(inp))
    common = ("--base", os.path.join(DEMO, "base"), "--catalog", cat, "--max-new-tokens", 2, "--device", "cpu", "-q")
    code, _, stderr = run_cli("batch-run", inp, tmp_path / "out", *common, "--bundle-operator", "three-stage")
    assert code == 2 and "E_BUNDLE_OPERATOR" in stderr
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    assert run_cli("batch-run", inp, tmp_path / "auto", *common)[0] == 0
    rows = pq.read_table(str(tmp_path / "auto")).to_pydict()
    assert rows["error_code"] == [None, None]
    # a bundle job is not served from one arena: --memory-ledger joint refused, never silently split;
    # the members through slots (materialized) do go into one arena
    cat.write_text(json.dumps({"up": {"path": "bundle", "member": "upper"}}))
    pq.write_table(pa.table({"prompt": ["hello"], "adapter": ["up"]}), str(inp))
    code, _, stderr = run_cli("batch-run", inp, tmp_path / "joint", *common, "--memory-ledger", "joint")
    assert code == 2 and "E_MEMORY_LEDGER" in stderr and "three-stage" in stderr, stderr
    assert not (tmp_path / "joint" / "_SUCCESS").exists()
    assert run_cli("batch-run", inp, tmp_path / "joint-slots", *common, "--memory-ledger", "joint",
                   "--bundle-operator", "materialized")[0] == 0


def test_three_stage_triton_is_refused_off_cuda_and_for_mixed_jobs(tmp_path, run_cli):
    """--bundle-operator three-stage-triton (the Triton kernels' operator, experimental) needs a
    CUDA device: on the CPU a bundle job fails closed (exit 2, E_BUNDLE_OPERATOR, no output)
    instead of falling back to the torch operator; a mixed job is refused as three-stage is."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import DEMO

    bundle = tmp_path / "bundle"
    assert run_cli("compress", "fit", os.path.join(DEMO, "adapters"), "-o", bundle, "--rank", 32, "--max-error", 0.9)[0] == 0
    common = ("--base", os.path.join(DEMO, "base"), "--max-new-tokens", 2, "--device", "cpu", "-q",
              "--bundle-operator", "three-stage-triton")
    cat = tmp_path / "catalog.json"
    cat.write_text(json.dumps({"up": {"path": "bundle", "member": "upper"}}))
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["hello"], "adapter": ["up"]}), str(inp))
    code, _, stderr = run_cli("batch-run", inp, tmp_path / "out", *common[:-2], "--catalog", cat, *common[-2:])
    assert code == 2 and "E_BUNDLE_OPERATOR" in stderr and "CUDA" in stderr, stderr
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    cat.write_text(json.dumps({"up": {"path": "bundle", "member": "upper"}, "plain": os.path.join(DEMO, "adapters", "spell")}))
    pq.write_table(pa.table({"prompt": ["hello", "world"], "adapter": ["up", "plain"]}), str(inp))
    code, _, stderr = run_cli("batch-run", inp, tmp_path / "mixed", *common[:-2], "--catalog", cat, *common[-2:])
    assert code == 2 and "three-stage-triton serves the members of one bundle" in " ".join(stderr.split()), stderr


def test_the_summary_says_why_there_is_no_single_break_even_size(tmp_path, run_cli):
    """The demo's adapters adapt different module sets (rot13 only the MLP): the ledger has no
    single break-even n, and the human summary says why instead of printing "None"."""
    code, stdout, stderr = run_cli("compress", "fit", os.path.join(DEMO, "adapters"), "-o", tmp_path / "b", "--rank", 16)
    assert code == 0, stderr
    assert "members adapt different module sets" in stdout and "None" not in stdout
    assert read_bundle(str(tmp_path / "b")).manifest["ledger"]["break_even_n"] is None
