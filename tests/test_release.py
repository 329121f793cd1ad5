"""`mlora merge`, `mlora unmerge`, `mlora release verify` (docs/release.md)."""

import json
import os
import shutil

import factory
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import DEMO
from safetensors.torch import load_file, save_file

from mlora.batch.model.decoder import DecoderModel, ModelError
from mlora.lora_tools import release as release_mod
from mlora.lora_tools.release import ReleaseError, verify

SPECS = {
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=31),
    "pattern": dict(r=6, lora_alpha=6, rank_pattern={"v_proj": 3}, alpha_pattern={"v_proj": 9},
                    target_modules=["q_proj", "v_proj", "down_proj"], seed=32),
    "rslora": dict(r=2, lora_alpha=4, use_rslora=True, target_modules="all-linear", seed=33),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("release")
    base = str(root / "base")
    factory.save_base(factory.tiny_model("llama", seed=0), base)
    refs = factory.make_adapters(str(root / "adapters"), base, SPECS)
    return root, base, refs


def _weights(path):
    out = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def test_merge_equals_peft_merge_and_unload(workspace, tmp_path, run_cli):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, base, _ = workspace
    for name in SPECS:
        out = tmp_path / name
        code, stdout, stderr = run_cli("merge", "--base", base, "--adapter", root / "adapters" / name, "-o", out, "--json")
        assert code == 0, stderr
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(root / "adapters" / name))
        want = peft.merge_and_unload().state_dict()
        got = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()  # transformers loads the release
        assert set(got) == set(want)
        for k in want:
            assert (got[k] - want[k]).abs().max() <= 1e-6, (name, k)
        assert json.loads(stdout)["changed"] > 0
        assert verify(str(out), base)["ok"]
        assert "warnings" not in json.loads((out / "release.json").read_text())  # a clean merge has none


def test_two_adapters_with_weights_in_order_and_bf16_within_one_ulp(workspace, tmp_path, run_cli):
    root, base, refs = workspace
    out = tmp_path / "two"
    code, _, stderr = run_cli("merge", "--base", base, "--adapter", root / "adapters" / "plain", "--weight", 0.5,
                              "--adapter", root / "adapters" / "pattern", "--weight", -1.5, "-o", out,
                              "--dtype", "bfloat16")
    assert code == 0, stderr
    got, base_w = _weights(out), _weights(base)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"
    for k, w in base_w.items():
        want = w.double()
        module = k[: -len(".weight")]
        for name, coef in (("plain", 0.5), ("pattern", -1.5)):
            sub = refs[name].base_model.model
            try:
                layer = sub.get_submodule(module)
            except AttributeError:
                continue
            if hasattr(layer, "get_delta_weight"):
                want = want + coef * layer.get_delta_weight("default").double()
        g = got[k]
        assert g.dtype == torch.bfloat16
        ref = want.to(torch.bfloat16)  # the correctly rounded merge
        ulp = (release_mod._ordered_ints(g) - release_mod._ordered_ints(ref)).abs().max()
        assert int(ulp) <= 1, k


def test_merged_release_generates_the_live_adapters_tokens(tmp_path, run_cli):
    rel = tmp_path / "rel"
    assert run_cli("merge", "--base", os.path.join(DEMO, "base"), "--adapter", os.path.join(DEMO, "adapters", "upper"),
                   "-o", rel)[0] == 0
    prompts = pq.read_table(os.path.join(DEMO, "prompts.parquet")).to_pydict()
    rows = [i for i, a in enumerate(prompts["adapter"]) if a == "upper"]
    live = tmp_path / "live.parquet"
    merged = tmp_path / "merged.parquet"
    pq.write_table(pa.table({"id": [prompts["id"][i] for i in rows], "prompt": [prompts["prompt"][i] for i in rows],
                             "adapter": ["upper"] * len(rows)}), live)
    pq.write_table(pa.table({"id": [prompts["id"][i] for i in rows], "prompt": [prompts["prompt"][i] for i in rows],
                             "adapter": pa.array([None] * len(rows), pa.string())}), merged)
    common = ("--max-new-tokens", 12, "--device", "cpu", "--dtype", "float32", "-q")
    assert run_cli("batch-run", live, tmp_path / "out-live", "--base", os.path.join(DEMO, "base"), "--adapters",
                   os.path.join(DEMO, "adapters"), *common)[0] == 0
    assert run_cli("batch-run", merged, tmp_path / "out-merged", "--base", rel, "--adapters",
                   os.path.join(DEMO, "adapters"), *common)[0] == 0
    a = pq.read_table(str(tmp_path / "out-live")).to_pydict()
    b = pq.read_table(str(tmp_path / "out-merged")).to_pydict()
    assert a["completion_token_ids"] == b["completion_token_ids"] and any(a["completion_token_ids"])


def _fp16_fixture(tmp_path):
    """A binary16 base weight 2048 and an adapter adding exactly 1 there (half an ULP at 2048:
    the merge rounds it away, so arithmetic unmerge cannot restore the base)."""
    model = factory.tiny_model("llama", seed=0)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = 2048.0
    base = str(tmp_path / "base16")
    model.half().save_pretrained(base, safe_serialization=True)
    w = model.model.layers[0].self_attn.q_proj.weight
    a = torch.zeros(1, w.shape[1])
    b = torch.zeros(w.shape[0], 1)
    a[0, 0], b[0, 0] = 1.0, 1.0
    adapter = tmp_path / "plus-one"
    adapter.mkdir()
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b},
              str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 1, "lora_alpha": 1, "target_modules": ["q_proj"],
        "layers_to_transform": [0], "base_model_name_or_path": "org/base16", "bias": "none"}))
    return base, str(adapter)


def test_binary16_merge_then_unmerge_drifts_and_says_so(tmp_path, run_cli):
    base, adapter = _fp16_fixture(tmp_path)
    rel, back = tmp_path / "rel", tmp_path / "back"
    assert run_cli("merge", "--base", base, "--adapter", adapter, "-o", rel)[0] == 0
    key = "model.layers.0.self_attn.q_proj.weight"
    assert float(_weights(rel)[key][0, 0]) == 2048.0  # 2048 + 1 rounds back to 2048 in binary16
    code, stdout, stderr = run_cli("unmerge", "--release", rel, "-o", back, "--base", base, "--json")
    assert code == 0, stderr
    assert float(_weights(back)[key][0, 0]) == 2047.0  # the arithmetic inverse is not the base
    drift = json.loads(stdout)["drift"]
    assert drift == {"tensors_differing": 1, "elements_differing": 1, "max_abs": 1.0, "max_ulp": 1, "exact": False,
                     "note": drift["note"]} and "clean base" in drift["note"]
    man = json.loads((back / "release.json").read_text())
    assert man["kind"] == "arithmetic-unmerge" and "not exact" in man["exact_rollback"]
    code, stdout, _ = run_cli("unmerge", "--release", rel, "-o", tmp_path / "back2", "--base", base)
    assert "not an exact rollback" in stdout


def test_safe_refuses_an_overflowing_merge_and_writes_nothing(tmp_path, run_cli):
    base, adapter = _fp16_fixture(tmp_path)
    cfg = json.loads(open(os.path.join(adapter, "adapter_config.json")).read())
    cfg["lora_alpha"] = 100000  # scale 1e5: 2048 + 1e5 overflows binary16 (max 65504)
    open(os.path.join(adapter, "adapter_config.json"), "w").write(json.dumps(cfg))
    code, _, stderr = run_cli("merge", "--base", base, "--adapter", adapter, "-o", tmp_path / "rel", "--safe")
    assert code == 1 and "E_MERGE_NONFINITE" in stderr
    assert not (tmp_path / "rel").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    key = "model.layers.0.self_attn.q_proj.weight"
    code, _, stderr = run_cli("merge", "--base", base, "--adapter", adapter, "-o", tmp_path / "rel", "--json")
    assert code == 0 and torch.isinf(_weights(tmp_path / "rel")[key]).any()
    assert "W_MERGE_NONFINITE" in stderr and key in stderr  # without --safe: written, and said
    warnings = json.loads((tmp_path / "rel" / "release.json").read_text())["warnings"]
    assert [(w["code"], w["tensor"], w["count"]) for w in warnings] == [("W_MERGE_NONFINITE", key, 1)]
    assert verify(str(tmp_path / "rel"))["ok"]


def test_merge_refuses_an_adapter_that_declares_another_base_unless_told(workspace, tmp_path, run_cli, manifests):
    root, base, _ = workspace
    other = factory.copy_adapter(str(root / "adapters" / "plain"), str(tmp_path / "other"))
    cfg = factory.read_config(other)
    cfg["base_model_name_or_path"] = "org/another-model"
    factory.write_config(other, cfg)
    _, [man] = manifests(other, "--base", base)
    assert [f["code"] for f in man["findings"]] == ["W_BASE_NAME_MISMATCH"]  # what validate --base says
    code, _, stderr = run_cli("merge", "--base", base, "--adapter", other, "-o", tmp_path / "rel")
    assert code == 1 and "E_MERGE_BASE_MISMATCH" in stderr and "W_BASE_NAME_MISMATCH" in stderr
    assert "org/another-model" in stderr and "--allow-base-mismatch" in stderr and not (tmp_path / "rel").exists()
    code, _, stderr = run_cli("merge", "--base", base, "--adapter", other, "-o", tmp_path / "rel",
                              "--allow-base-mismatch")
    assert code == 0 and "W_BASE_NAME_MISMATCH" in stderr
    warnings = json.loads((tmp_path / "rel" / "release.json").read_text())["warnings"]
    assert [(w["code"], w["adapter"]) for w in warnings] == [("W_BASE_NAME_MISMATCH", "other")]
    code, _, stderr = run_cli("unmerge", "--release", tmp_path / "rel", "-o", tmp_path / "back")
    assert code == 0, stderr  # the release is not the base the adapter names: unmerge expects that


def _inject_clean_base(rel, base):
    """The attack on a release: the clean base's tensors as an extra file and an index sending every
    weight there. Every file release.json lists stays byte-identical."""
    shutil.copyfile(os.path.join(base, "model.safetensors"), rel / "evil.safetensors")
    names = sorted(load_file(str(rel / "evil.safetensors")))
    (rel / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        n: "evil.safetensors" for n in names}}))


def test_files_added_to_a_release_are_tampering_and_never_loaded(workspace, tmp_path, run_cli):
    root, base, _ = workspace
    rel = tmp_path / "rel"
    assert run_cli("merge", "--base", base, "--adapter", root / "adapters" / "plain", "-o", rel)[0] == 0
    clean = run_cli("hash", "--base", base)[1].split()[0]
    merged = run_cli("hash", "--base", rel)[1].split()[0]
    assert merged != clean
    _inject_clean_base(rel, base)

    rc, stdout, stderr = run_cli("release", "verify", rel, "--json")
    assert rc == 1 and json.loads(stdout)["code"] == "E_RELEASE_TAMPERED"
    assert "evil.safetensors" in stderr and "model.safetensors.index.json" in stderr
    code, stdout, stderr = run_cli("hash", "--base", rel)
    assert code == 1 and stdout == "" and "E_BASE_INVALID" in stderr and "evil.safetensors" in stderr
    with pytest.raises(ModelError) as e:
        DecoderModel.from_pretrained(rel)
    assert e.value.code == "E_MODEL_WEIGHTS" and "evil.safetensors" in str(e.value)
    pq.write_table(pa.table({"id": ["r0"], "ids": [[1, 2, 3]], "adapter": pa.array([None], pa.string())}), tmp_path / "in.parquet")
    code, _, stderr = run_cli("batch-run", tmp_path / "in.parquet", tmp_path / "out", "--base", rel,
                              "--prompt-ids-column", "ids", "--max-new-tokens", 2, "--device", "cpu", "-q")
    assert code == 1 and "E_BASE_INVALID" in stderr and "evil.safetensors" in stderr

    for extra in ("evil.safetensors", "model.safetensors.index.json"):
        os.remove(rel / extra)
    assert run_cli("release", "verify", rel)[0] == 0 and run_cli("hash", "--base", rel)[1].split()[0] == merged


def test_a_release_places_its_tensors_as_its_record_says(tmp_path, run_cli):
    """An index listed by the release but edited is not what places the tensors: the record is
    (verify reports the edit)."""
    base = str(tmp_path / "base")
    factory.save_base(factory.tiny_model("llama", seed=0), base, max_shard_size="20KB")
    factory.make_adapters(str(tmp_path / "adapters"), base, {"a": dict(r=2, lora_alpha=4, seed=1)})
    rel = tmp_path / "rel"
    assert run_cli("merge", "--base", base, "--adapter", tmp_path / "adapters" / "a", "-o", rel)[0] == 0
    shards = json.loads((rel / "release.json").read_text())["tensors"]
    assert len({r["file"] for r in shards.values()}) > 1
    merged = run_cli("hash", "--base", rel)[1].split()[0]
    index = rel / "model.safetensors.index.json"
    os.chmod(index, 0o644)
    doc = json.loads(index.read_text())
    doc["weight_map"] = dict(list(doc["weight_map"].items())[:1])
    index.write_text(json.dumps(doc))
    assert run_cli("hash", "--base", rel)[1].split()[0] == merged
    model = DecoderModel.from_pretrained(rel, dtype="float32")
    assert torch.equal(model.layers[1].down_weight, _weights(rel)["model.layers.1.mlp.down_proj.weight"])
    assert run_cli("release", "verify", rel)[0] == 1


@pytest.mark.parametrize("damage, code", [
    ("flip", "E_RELEASE_TAMPERED"), ("truncate", "E_RELEASE_TRUNCATED"), ("remove", "E_RELEASE_MISSING"),
    ("edit", "E_RELEASE_TAMPERED"), ("config", "E_RELEASE_TAMPERED"),
])
def test_verify_catches_damage(workspace, tmp_path, run_cli, damage, code):
    root, base, _ = workspace
    rel = tmp_path / "rel"
    assert run_cli("merge", "--base", base, "--adapter", root / "adapters" / "plain", "-o", rel)[0] == 0
    assert run_cli("release", "verify", rel, "--base", base)[0] == 0
    for f in os.listdir(rel):
        os.chmod(rel / f, 0o644)
    shard = rel / "model.safetensors"
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "remove":
        shard.unlink()
    elif damage == "config":  # same size, one character changed
        text = (rel / "config.json").read_text()
        (rel / "config.json").write_text(text.replace("silu", "gelu"))
    else:
        man = json.loads((rel / "release.json").read_text())
        man["adapters"][0]["weight"] = 2.0
        (rel / "release.json").write_text(json.dumps(man))
    rc, stdout, stderr = run_cli("release", "verify", rel, "--json")
    assert rc == 1 and json.loads(stdout)["code"] == code and code in stderr


def test_merge_refuses_existing_output_and_a_wrong_parent(workspace, tmp_path, run_cli):
    root, base, _ = workspace
    (tmp_path / "taken").mkdir()
    code, _, stderr = run_cli("merge", "--base", base, "--adapter", root / "adapters" / "plain", "-o", tmp_path / "taken")
    assert code == 1 and "E_RELEASE_EXISTS" in stderr and os.listdir(tmp_path / "taken") == []
    rel = tmp_path / "rel"
    assert run_cli("merge", "--base", base, "--adapter", root / "adapters" / "plain", "-o", rel)[0] == 0
    with pytest.raises(ReleaseError) as e:
        verify(str(rel), os.path.join(DEMO, "base"))
    assert e.value.code == "E_RELEASE_PARENT"
    code, _, stderr = run_cli("merge", "--base", base, "--adapter", root / "adapters" / "plain", "--weight", 1,
                              "--weight", 2, "-o", tmp_path / "x")
    assert code == 2 and "E_USAGE" in stderr


def test_an_interrupted_merge_leaves_nothing_behind(workspace, tmp_path, monkeypatch):
    root, base, _ = workspace
    calls = {"n": 0}
    real = release_mod.StreamingSafetensors._advance

    def dying(self, name):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # as Ctrl-C would, mid-file
        return real(self, name)

    monkeypatch.setattr(release_mod.StreamingSafetensors, "_advance", dying)
    with pytest.raises(KeyboardInterrupt):
        release_mod.merge(base, [release_mod.MergeAdapter(str(root / "adapters" / "plain"))], str(tmp_path / "rel"))
    assert os.listdir(tmp_path) == []  # no release, no temporary directory


def test_unmergeable_adapters_are_refused_by_name(workspace, tmp_path, run_cli):
    root, base, _ = workspace
    dora = factory.copy_adapter(str(root / "adapters" / "plain"), str(tmp_path / "dora"))
    cfg = factory.read_config(dora)
    cfg["use_dora"] = True
    factory.write_config(dora, cfg)
    code, _, stderr = run_cli("merge", "--base", base, "--adapter", dora, "-o", tmp_path / "rel")
    assert code == 1 and "E_MERGE_UNSUPPORTED" in stderr and "DORA" in stderr.upper()
    assert not (tmp_path / "rel").exists()


def test_alora_adapters_are_refused_by_their_own_code(workspace, tmp_path, run_cli):
    """Servable, yet unmergeable: its activation depends on the prompt."""
    root, base, _ = workspace
    alora = factory.copy_adapter(str(root / "adapters" / "plain"), str(tmp_path / "alora"))
    factory.write_config(alora, {**factory.read_config(alora), "alora_invocation_tokens": [5, 6]})
    code, _, stderr = run_cli("merge", "--base", base, "--adapter", root / "adapters" / "pattern", "--adapter", alora,
                              "-o", tmp_path / "rel")
    assert code == 1 and "E_MERGE_ALORA" in stderr and "[5, 6]" in stderr and "batch-run" in stderr
    assert "E_MERGE_UNSUPPORTED" not in stderr and not (tmp_path / "rel").exists()


def test_live_and_merged_outputs_are_equal_for_a_rank_two_and_a_padded_rank_one_adapter():
    """A rank-two adapter (s = 1/2) and a logical-rank-one adapter in a physical rank-two slot
    (s = 1/4, zero second row of A and column of B) over one small W: live and merged agree."""
    W = torch.tensor([[2.0, -1.0, 0.0], [1.0, 3.0, -2.0]])
    old = (0.5, torch.tensor([[1.0, 4.0, 1.0], [-1.0, 2.0, 2.0]]), torch.eye(2))  # s B A = Delta_o
    new = (0.25, torch.tensor([[2.0, -1.0, 0.0], [0.0, 0.0, 0.0]]), torch.tensor([[1.0, 0.0], [3.0, 0.0]]))
    for (s, A, B), x, y in ((old, [1.0, 2.0, -1.0], [4.0, 9.5]), (new, [2.0, 0.0, 1.0], [5.0, 3.0])):
        x = torch.tensor(x)
        live = W @ x + s * (B @ (A @ x))
        merged = release_mod._merged(W, [(s, A, B)], torch.float32, torch.float32) @ x
        assert live.tolist() == y and merged.tolist() == y
    delta_o = release_mod._merged(torch.zeros(2, 3), [(old[0], old[1], old[2])], torch.float32, torch.float32)
    assert delta_o.tolist() == [[0.5, 2.0, 0.5], [-0.5, 1.0, 1.0]]
    delta_n = release_mod._merged(torch.zeros(2, 3), [(new[0], new[1], new[2])], torch.float32, torch.float32)
    assert delta_n.tolist() == [[0.5, -0.25, 0.0], [1.5, -0.75, 0.0]]


def test_a_killed_merges_temporary_is_removed_by_the_next_write(workspace, tmp_path, run_cli):
    """SIGKILL runs no cleanup: the hidden temporary stays, never renamed into place; the
    next write of that release removes it (its process is gone)."""
    import subprocess

    root, base, _ = workspace
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".rel.tmp-{dead.pid}-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    assert not (tmp_path / "rel").exists()
    assert run_cli("merge", "--base", base, "--adapter", root / "adapters" / "plain", "-o", tmp_path / "rel")[0] == 0
    assert sorted(os.listdir(tmp_path)) == ["rel"] and verify(str(tmp_path / "rel"))["ok"]


def test_lora_on_a_tied_lm_head_is_refused(tmp_path, run_cli):
    from transformers import AutoModelForCausalLM

    base = str(tmp_path / "tied")
    config = factory.tiny_config("llama")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    factory.save_base(AutoModelForCausalLM.from_config(config), base)

    head = tmp_path / "head"  # written by hand: PEFT saves extra tensors for tied heads (refused on their own)
    head.mkdir()
    save_file({"base_model.model.lm_head.lora_A.weight": torch.randn(2, config.hidden_size),
               "base_model.model.lm_head.lora_B.weight": torch.randn(config.vocab_size, 2)},
              str(head / "adapter_model.safetensors"))
    (head / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 2, "lora_alpha": 4, "target_modules": ["lm_head"],
        "base_model_name_or_path": "org/tied", "bias": "none"}))
    code, _, stderr = run_cli("merge", "--base", base, "--adapter", tmp_path / "head", "-o", tmp_path / "rel")
    assert code == 1 and "E_MERGE_TIED" in stderr and not (tmp_path / "rel").exists()


def test_bf16_base_merge_is_within_one_ulp_of_peft(tmp_path, run_cli):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = str(tmp_path / "base-bf16")
    factory.tiny_model("llama", seed=0).to(torch.bfloat16).save_pretrained(base, safe_serialization=True)
    factory.make_adapter(str(tmp_path / "ad"), base_model=AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                         r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], seed=3)
    assert run_cli("merge", "--base", base, "--adapter", tmp_path / "ad", "-o", tmp_path / "rel")[0] == 0
    got = _weights(tmp_path / "rel")
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), str(tmp_path / "ad"))
    want = peft.merge_and_unload().state_dict()
    assert set(got) <= set(want)
    for k, g in got.items():
        assert g.dtype == torch.bfloat16
        ulp = (release_mod._ordered_ints(g) - release_mod._ordered_ints(want[k].to(torch.bfloat16))).abs().max()
        assert int(ulp) <= 1, k


def test_unmerging_one_of_two_adapters_leaves_the_other(workspace, tmp_path, run_cli):
    root, base, _ = workspace
    both, only, back = tmp_path / "both", tmp_path / "only", tmp_path / "back"
    assert run_cli("merge", "--base", base, "--adapter", root / "adapters" / "plain", "--adapter",
                   root / "adapters" / "pattern", "-o", both)[0] == 0
    assert run_cli("merge", "--base", base, "--adapter", root / "adapters" / "pattern", "-o", only)[0] == 0
    code, _, stderr = run_cli("unmerge", "--release", both, "--adapter", "plain", "-o", back)
    assert code == 0, stderr
    man = json.loads((back / "release.json").read_text())
    assert [a["id"] for a in man["adapters"]] == ["plain"] and man["parent"]["kind"] == "release"
    got, want = _weights(back), _weights(only)
    assert max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-6
    code, _, stderr = run_cli("unmerge", "--release", both, "--adapter", "nobody", "-o", tmp_path / "x")
    assert code == 1 and "E_UNMERGE_ADAPTER" in stderr
    assert verify(str(back))["kind"] == "arithmetic-unmerge"
