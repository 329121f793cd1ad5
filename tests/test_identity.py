"""Identity stability and sensitivity (docs/identity.md), and the canonical form.

Stable: copying, renaming, aliasing, re-serialising or re-sharding keeps a
digest. Sensitive: one factor byte, a rank, an alpha, a target, a dtype, the
base or the activation policy changes it.
"""

import hashlib
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from factory import (
    load_tensors,
    raw_layout,
    read_config,
    save_base,
    save_tensors,
    tiny_model,
    write_config,
    write_raw_safetensors,
)

from mlora.lora_tools.base import BaseCheckpoint
from mlora.lora_tools.canonical import CanonicalError, canonical_json, canonical_real, digest
from mlora.lora_tools.safetensors_io import read_header, scan_many, scan_tensor

ST = "adapter_model.safetensors"


def ident(manifests, path, *extra):
    rc, [m] = manifests(path, *extra)
    assert m["valid"], m["findings"]
    return m["artifact_sha256"], m["semantic_sha256"]


# ---- canonical form ---------------------------------------------------------------


def test_canonical_json_is_sorted_compact_utf8():
    assert canonical_json({"b": 1, "a": [True, None, "é"]}) == '{"a":[true,null,"é"],"b":1}'.encode()


@pytest.mark.parametrize("bad", [{"x": 1.0}, [0.5], {1: "a"}, {"x": object()}])
def test_canonical_json_refuses_values_without_a_canonical_form(bad):
    with pytest.raises(CanonicalError):
        canonical_json(bad)


def test_canonical_real():
    assert canonical_real(16) == canonical_real(16.0) == "16.0"
    assert canonical_real(1e-5) == "1e-05"
    assert canonical_real(0.1) == "0.1"
    assert canonical_real(float("inf")) == "inf"
    with pytest.raises(CanonicalError):
        canonical_real(True)


# ---- tensor digests against an independent reference -------------------------------


def reference_tensor_sha256(file: str, name: str) -> str:
    """Slow reference: load with the safetensors library, hash header + bytes."""
    from safetensors import safe_open

    with safe_open(file, "pt") as f:
        t = f.get_tensor(name)
    dtype = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[t.dtype]
    prefix = json.dumps({"dtype": dtype, "shape": list(t.shape)}, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(prefix + b"\n" + t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tensor_digest_matches_reference(tmp_path, dtype, monkeypatch):
    from safetensors.torch import save_file

    import mlora.lora_tools.safetensors_io as sio

    monkeypatch.setattr(sio, "CHUNK_BYTES", 4096)  # force many chunks
    gen = torch.Generator().manual_seed(7)
    tensors = {f"t{i}": torch.randn(37 + i, 129, generator=gen).to(dtype) for i in range(6)}
    file = str(tmp_path / "x.safetensors")
    save_file(tensors, file)
    infos = read_header(file).tensors
    names = sorted(infos)
    parallel = scan_many([(infos[n], True) for n in names], workers=2)
    for n, res in zip(names, parallel):
        assert res.sha256 == reference_tensor_sha256(file, n) == scan_tensor(infos[n]).sha256
        assert res.non_finite == 0 and res.all_zero is False


def test_all_zero_ignores_sign_bit(tmp_path):
    from safetensors.torch import save_file

    file = str(tmp_path / "z.safetensors")
    save_file({"z": torch.tensor([0.0, -0.0, 0.0]), "nz": torch.tensor([0.0, 1e-30, 0.0])}, file)
    infos = read_header(file).tensors
    assert scan_tensor(infos["z"], True).all_zero is True
    assert scan_tensor(infos["nz"], True).all_zero is False


# ---- adapter identity: stable ------------------------------------------------------------


def test_copy_rename_and_alias_keep_digests(good_adapter, tmp_path, manifests):
    ref = ident(manifests, good_adapter)
    copy = shutil.copytree(good_adapter, tmp_path / "elsewhere" / "customer-blue")
    assert ident(manifests, copy) == ref
    os.symlink(copy, tmp_path / "alias")
    assert ident(manifests, tmp_path / "alias") == ref


def test_reserialising_in_another_key_order_keeps_digests(adapter_copy, good_adapter, manifests):
    ref = ident(manifests, good_adapter)
    t = load_tensors(adapter_copy)
    arrays = {k: t[k].numpy() for k in sorted(t, reverse=True)}
    header, data = raw_layout(arrays)
    write_raw_safetensors(os.path.join(adapter_copy, ST), {**header, "__metadata__": {"note": "x"}}, data)
    cfg = read_config(adapter_copy)
    cfg["lora_dropout"] = 0.3  # training-only field
    cfg["inference_mode"] = False
    write_config(adapter_copy, dict(reversed(list(cfg.items()))))
    assert ident(manifests, adapter_copy) == ref


def test_float_and_int_alpha_hash_the_same(adapter_copy, good_adapter, manifests):
    ref = ident(manifests, good_adapter)
    cfg = read_config(adapter_copy)
    cfg["lora_alpha"] = float(cfg["lora_alpha"])
    write_config(adapter_copy, cfg)
    assert ident(manifests, adapter_copy) == ref


# ---- adapter identity: sensitive -------------------------------------------------


def _flip_one_byte(path):
    file = os.path.join(path, ST)
    header_len = int.from_bytes(open(file, "rb").read(8), "little")
    with open(file, "r+b") as f:
        f.seek(8 + header_len + 5)
        b = f.read(1)
        f.seek(8 + header_len + 5)
        f.write(bytes([b[0] ^ 0x01]))


def _change_alpha(path):
    cfg = read_config(path)
    cfg["lora_alpha"] = cfg["lora_alpha"] + 1
    write_config(path, cfg)


def _alpha_pattern(path):
    cfg = read_config(path)
    cfg["alpha_pattern"] = {"v_proj": 3}
    write_config(path, cfg)


def _to_bf16(path):
    t = load_tensors(path)
    save_tensors(path, {k: v.to(torch.bfloat16) for k, v in t.items()})


def _retarget_q_to_k(path):
    t = load_tensors(path)
    save_tensors(path, {k.replace("q_proj", "k_proj"): v for k, v in t.items()})
    cfg = read_config(path)
    cfg["target_modules"] = ["k_proj", "v_proj"]
    write_config(path, cfg)


def _rank_4_to_2(path):
    t = load_tensors(path)
    out = {}
    for k, v in t.items():
        out[k] = v[:2].contiguous() if ".lora_A." in k else v[:, :2].contiguous()
    save_tensors(path, out)
    cfg = read_config(path)
    cfg["r"] = 2
    write_config(path, cfg)


def _rslora(path):
    cfg = read_config(path)
    cfg["use_rslora"] = True
    write_config(path, cfg)


def _swap_factors_between_modules(path):
    t = load_tensors(path)
    q = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    v = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
    if t[q].shape == t[v].shape:
        t[q], t[v] = t[v].clone(), t[q].clone()
    else:  # GQA: v_proj is narrower; swap A factors instead
        qa, va = q.replace("lora_B", "lora_A"), v.replace("lora_B", "lora_A")
        t[qa], t[va] = t[va].clone(), t[qa].clone()
    save_tensors(path, t)


MUTATIONS = {
    "one factor byte": _flip_one_byte,
    "alpha": _change_alpha,
    "alpha_pattern": _alpha_pattern,
    "dtype": _to_bf16,
    "target": _retarget_q_to_k,
    "rank": _rank_4_to_2,
    "scaling rule": _rslora,
    "factors swapped between modules": _swap_factors_between_modules,
}


@pytest.mark.parametrize("what", sorted(MUTATIONS))
def test_one_change_changes_both_digests(adapter_copy, good_adapter, manifests, what):
    ref_art, ref_sem = ident(manifests, good_adapter)
    MUTATIONS[what](adapter_copy)
    art, sem = ident(manifests, adapter_copy)
    assert art != ref_art and sem != ref_sem


def test_activation_policy_changes_semantic_only_through_policy(adapter_copy, good_adapter, manifests):
    ref_art, ref_sem = ident(manifests, good_adapter)
    cfg = read_config(adapter_copy)
    cfg["alora_invocation_tokens"] = [3, 4]
    write_config(adapter_copy, cfg)
    rc, [m] = manifests(adapter_copy)
    assert m["activation_policy"] == {"kind": "alora", "invocation_tokens": [3, 4]}
    assert m["semantic_sha256"] != ref_sem


def test_semantic_binds_the_base(good_adapter, base_dir, tmp_path, manifests):
    art0, sem_declared = ident(manifests, good_adapter)
    art1, sem_base = ident(manifests, good_adapter, "--base", base_dir)
    # same shapes, different weights: a different base for the same artifact
    other = save_base(tiny_model("llama", seed=5), str(tmp_path / "tiny-llama"))
    art2, sem_other = ident(manifests, good_adapter, "--base", other)
    assert art0 == art1 == art2
    assert len({sem_declared, sem_base, sem_other}) == 3


# ---- base identity -----------------------------------------------------------------


def test_base_identity_ignores_sharding_and_provenance(tmp_path):
    model = tiny_model("llama", seed=3)
    single = BaseCheckpoint(save_base(model, str(tmp_path / "single"))).identity()
    sharded_dir = save_base(model, str(tmp_path / "sharded"), max_shard_size="20KB")
    assert os.path.exists(os.path.join(sharded_dir, "model.safetensors.index.json"))
    cfg_file = os.path.join(sharded_dir, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["_name_or_path"] = "/somewhere/else"
    cfg["transformers_version"] = "0.0.1"
    json.dump(cfg, open(cfg_file, "w"))
    assert BaseCheckpoint(sharded_dir).identity(workers=2) == single


def test_base_identity_sensitive_to_weights_and_config(tmp_path):
    model = tiny_model("llama", seed=3)
    d = save_base(model, str(tmp_path / "b"))
    ref = BaseCheckpoint(d).identity()
    cfg_file = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["rms_norm_eps"] = cfg["rms_norm_eps"] * 2
    json.dump(cfg, open(cfg_file, "w"))
    changed_cfg = BaseCheckpoint(d).identity()
    assert changed_cfg.model_config_sha256 != ref.model_config_sha256
    assert changed_cfg.model_weights_sha256 == ref.model_weights_sha256
    assert changed_cfg.base_sha256 != ref.base_sha256
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] += 1
    d2 = save_base(model, str(tmp_path / "b2"))
    assert BaseCheckpoint(d2).identity().model_weights_sha256 != ref.model_weights_sha256


def test_base_identity_formula(tmp_path):
    """base_sha256 is the digest of the four component digests (docs/identity.md, Base identity)."""
    d = save_base(tiny_model("llama"), str(tmp_path / "b"))
    i = BaseCheckpoint(d).identity()
    assert i.base_sha256 == digest(
        {
            "model_weights_sha256": i.model_weights_sha256,
            "model_config_sha256": i.model_config_sha256,
            "weight_transform_sha256": i.weight_transform_sha256,
            "target_module_map_sha256": i.target_module_map_sha256,
        }
    )


# ---- a worked rank-and-shard identity trace ---------------------------------------------


def _spec_adapter(path, v_rank=4, v_target="v_proj", flip=False):
    """q_proj rank 2 alpha 4 and v_proj rank 4 alpha 8 over [8, 8] projections, 2-byte scalars."""
    rng = np.random.default_rng(17)
    prefix = "base_model.model.model.layers.0.self_attn."
    arrays = {
        f"{prefix}q_proj.lora_A.weight": rng.standard_normal((2, 8)).astype(np.float16),
        f"{prefix}q_proj.lora_B.weight": rng.standard_normal((8, 2)).astype(np.float16),
        f"{prefix}{v_target}.lora_A.weight": rng.standard_normal((4, 8)).astype(np.float16)[:v_rank],
        f"{prefix}{v_target}.lora_B.weight": rng.standard_normal((8, 4)).astype(np.float16)[:, :v_rank],
    }
    if flip:
        arrays[f"{prefix}q_proj.lora_A.weight"].view(np.uint16)[0, 0] ^= 1
    os.makedirs(path)
    header = {}
    off, chunks = 0, []
    for k, v in arrays.items():
        b = np.ascontiguousarray(v).tobytes()
        header[k] = {"dtype": "F16", "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        chunks.append(b)
        off += len(b)
    write_raw_safetensors(os.path.join(path, ST), header, b"".join(chunks))
    write_config(path, {
        "peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", v_target],
        "rank_pattern": {v_target: v_rank}, "alpha_pattern": {v_target: 8}, "base_model_name_or_path": "synthetic/base",
    })
    return path


def test_spec_worked_identity_trace(tmp_path, manifests):
    rc, [m] = manifests(_spec_adapter(str(tmp_path / "customer-blue")))
    assert rc == 0, m["findings"]
    assert m["stats"]["parameters"] == 96 and m["stats"]["bytes"] == 192
    by = {r["role"]: r for r in m["modules"]}
    assert (by["q_proj"]["rank"], by["q_proj"]["alpha"], by["q_proj"]["scale"]) == (2, 4, 2.0)
    assert (by["v_proj"]["rank"], by["v_proj"]["alpha"], by["v_proj"]["scale"]) == (4, 8, 2.0)
    # a reload of identical bytes (another path, same alias) keeps the identity
    _, [same] = manifests(_spec_adapter(str(tmp_path / "reload" / "customer-blue")))
    assert (same["artifact_sha256"], same["semantic_sha256"]) == (m["artifact_sha256"], m["semantic_sha256"])
    # v_proj rank 4 -> 2, one factor byte, retarget v_proj -> k_proj: each changes H_artifact
    variants = [
        _spec_adapter(str(tmp_path / "r2" / "customer-blue"), v_rank=2),
        _spec_adapter(str(tmp_path / "flip" / "customer-blue"), flip=True),
        _spec_adapter(str(tmp_path / "k" / "customer-blue"), v_target="k_proj"),
    ]
    seen = {m["artifact_sha256"]}
    for v in variants:
        _, [mv] = manifests(v)
        assert mv["valid"]
        seen.add(mv["artifact_sha256"])
    assert len(seen) == 4


# ---- mlora hash --------------------------------------------------------------------


def test_hash_lines_and_exit_codes(good_adapter, tmp_path, run_cli, manifests):
    rc, out, _ = run_cli("hash", good_adapter)
    assert rc == 0
    art, sem = ident(manifests, good_adapter)
    assert out == f"{art}  {sem}  {good_adapter}\n"
    assert re.fullmatch(r"[0-9a-f]{64}  [0-9a-f]{64}  .+\n", out)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{")
    rc, out, err = run_cli("hash", good_adapter, tmp_path / "broken")
    assert rc == 1 and out.count("\n") == 1 and "E_CONFIG_PARSE" in err


def test_hash_json_matches_validate_json(good_adapter, run_cli, manifests):
    rc, out, _ = run_cli("hash", "--json", good_adapter)
    _, [m] = manifests(good_adapter)
    assert rc == 0 and json.loads(out) == m


def test_directory_of_adapters(good_adapter, tmp_path, run_cli):
    coll = tmp_path / "collection"
    coll.mkdir()
    for name in ("b", "a"):
        shutil.copytree(good_adapter, coll / name)
    (coll / "notes").mkdir()  # not an adapter: ignored
    rc, out, _ = run_cli("hash", coll)
    lines = out.splitlines()
    assert rc == 0 and [line.split("  ")[2] for line in lines] == [str(coll / "a"), str(coll / "b")]
    assert lines[0].split("  ")[:2] == lines[1].split("  ")[:2]


def test_hash_base_alone(base_dir, run_cli, tmp_path):
    rc, out, _ = run_cli("hash", "--base", base_dir)
    assert rc == 0 and out == f"{BaseCheckpoint(base_dir).identity().base_sha256}  {base_dir}\n"
    rc, out, _ = run_cli("hash", "--json", "--base", base_dir)
    doc = json.loads(out)
    assert doc["kind"] == "mlora.base_identity" and doc["base_sha256"] == BaseCheckpoint(base_dir).identity().base_sha256
    rc, out, err = run_cli("hash")
    assert rc == 2 and out == "" and "PATH" in err
    (tmp_path / "cfg-only").mkdir()
    (tmp_path / "cfg-only" / "config.json").write_text("{}")
    rc, out, err = run_cli("hash", "--base", tmp_path / "cfg-only")
    assert rc == 1 and "E_BASE_INVALID" in err


def test_base_shard_index_lies(tmp_path, run_cli):
    d = save_base(tiny_model("llama"), str(tmp_path / "b"), max_shard_size="20KB")
    idx_file = os.path.join(d, "model.safetensors.index.json")
    idx = json.load(open(idx_file))
    first = sorted(idx["weight_map"])[0]
    idx["weight_map"]["model.not_there.weight"] = idx["weight_map"][first]
    json.dump(idx, open(idx_file, "w"))
    rc, _, err = run_cli("hash", "--base", d)
    assert rc == 1 and "E_BASE_INVALID" in err and "not_there" in err
