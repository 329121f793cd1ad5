"""mlora's per-module resolution equals PEFT's own LoraLayer values.

For each config, PEFT builds the adapter (the reference), saves it, and mlora
reads the saved directory. The set of adapted modules, every rank, every
scale and every factor shape must match what PEFT's layers hold.
"""

import math

import pytest
from conftest import codes
from factory import make_adapter, save_base, tiny_model

CASES = {
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "patterns": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "up_proj"],
        # dict order matters: "layers.1.self_attn.q_proj" must win over "q_proj" for layer 1
        rank_pattern={"model.layers.1.self_attn.q_proj": 6, "q_proj": 2, r"mlp\.(up|down)_proj": 8},
        alpha_pattern={"v_proj": 3, "layers.0.mlp.down_proj": 32},
    ),
    "rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "o_proj", "gate_proj"]),
    "all_linear": dict(r=2, lora_alpha=4, target_modules="all-linear"),
    "regex_target": dict(r=4, lora_alpha=4, target_modules=r".*\.layers\.1\..*(k|v)_proj"),
    "layers_to_transform": dict(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], layers_to_transform=[1]),
    "layers_pattern": dict(r=4, lora_alpha=8, target_modules=["v_proj"], layers_to_transform=0, layers_pattern="layers"),
    "exclude": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], exclude_modules=["model.layers.0.self_attn.v_proj"]),
    "float_alpha": dict(r=8, lora_alpha=12.5, target_modules=["down_proj"]),
    "dora": dict(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True),
    "lora_bias": dict(r=4, lora_alpha=8, target_modules=["q_proj"], lora_bias=True),
    "modules_to_save": dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"]),
    "embedding": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
    "alora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                  alora_invocation_tokens=[9, 10]),
}

EXPECTED_UNSERVABLE = {
    "dora": "U_DORA", "lora_bias": "U_LORA_BIAS", "modules_to_save": "U_MODULES_TO_SAVE", "embedding": "U_EMBEDDING_LORA",
}


def peft_reference(peft_model):
    """{canonical name: (rank, scale, (d_out, d_in))} from PEFT's LoraLayer objects."""
    from peft.tuners.lora import LoraLayer

    ref = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.r:
            canonical = name.removeprefix("base_model.model.")
            if "default" in module.lora_A:
                d_in, d_out = module.lora_A["default"].in_features, module.lora_B["default"].out_features
            else:  # embedding LoRA keeps raw parameters
                d_in = module.lora_embedding_A["default"].shape[1]
                d_out = module.lora_embedding_B["default"].shape[0]
            ref[canonical] = (module.r["default"], module.scaling["default"], (d_out, d_in))
    return ref


def check_parity(tmp_path, manifests, kind, case, kwargs):
    model = tiny_model(kind)
    base = save_base(model, str(tmp_path / f"{kind}-base"))
    peft_model = make_adapter(str(tmp_path / case), base_model=model, **kwargs)
    ref = peft_reference(peft_model)
    code, [m] = manifests(tmp_path / case, "--base", base)
    got = {rec["name"]: (rec["rank"], rec["scale"], (rec["d_out"], rec["d_in"])) for rec in m["modules"]}
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    for name, (r, scale, shape) in ref.items():
        assert got[name][0] == r, name
        assert math.isclose(got[name][1], scale, rel_tol=0, abs_tol=1e-12), name
        assert got[name][2] == shape, name
    errors = {f["code"] for f in m["findings"] if f["severity"] == "error"}
    assert not errors, m["findings"]
    assert "W_TARGET_SET_MISMATCH" not in codes(m), m["findings"]
    assert m["valid"]
    return code, m


@pytest.mark.parametrize("case", sorted(CASES))
def test_llama_parity(tmp_path, manifests, case):
    code, m = check_parity(tmp_path, manifests, "llama", case, CASES[case])
    if case in EXPECTED_UNSERVABLE:
        assert codes(m) == {EXPECTED_UNSERVABLE[case]}, m["findings"]
        assert not m["servable"] and code == 1
    elif case == "alora":  # servable: an info finding and the identity's policy name the invocation
        assert codes(m) == {"I_ALORA"} and m["servable"] and code == 0, m["findings"]
        assert m["activation_policy"] == {"kind": "alora", "invocation_tokens": [9, 10]}
    else:
        assert codes(m) == set() and m["servable"] and code == 0, m["findings"]


def test_patterns_resolve_in_dict_order(tmp_path, manifests):
    _, m = check_parity(tmp_path, manifests, "llama", "patterns", CASES["patterns"])
    ranks = {rec["name"]: rec["rank"] for rec in m["modules"]}
    assert ranks["model.layers.1.self_attn.q_proj"] == 6
    assert ranks["model.layers.0.self_attn.q_proj"] == 2
    assert ranks["model.layers.0.mlp.up_proj"] == 8
    assert ranks["model.layers.0.self_attn.k_proj"] == 4


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_qwen2_bias_is_unservable_and_hashed(tmp_path, manifests, bias):
    """q/k/v biases trained with bias="all" or "lora_only" are stored, explained and bound into the identity."""
    code, m = check_parity(tmp_path, manifests, "qwen2", "bias", dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"], bias=bias))
    assert codes(m) == {"U_BIAS"}, m["findings"]
    assert code == 1 and not m["servable"] and m["artifact_sha256"]


def test_llama_bias_lora_only_saves_no_bias_and_is_servable(tmp_path, manifests):
    """A base without biases leaves bias="lora_only" nothing to train: PEFT saves a plain LoRA."""
    code, m = check_parity(tmp_path, manifests, "llama", "bias", dict(r=4, lora_alpha=8, target_modules=["q_proj"], bias="lora_only"))
    assert codes(m) == {"W_BIAS_INERT"}, m["findings"]
    assert code == 0 and m["servable"]


def test_qwen2_plain_is_servable(tmp_path, manifests):
    code, m = check_parity(tmp_path, manifests, "qwen2", "plain", CASES["plain"])
    assert code == 0 and m["servable"]
