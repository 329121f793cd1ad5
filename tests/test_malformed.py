"""The malformed-artifact corpus: every finding code, its exit code, nothing else.

Each case starts from a valid PEFT adapter (``adapter_copy``), changes one
thing, and asserts the exact finding code and the exit code of
``mlora validate``. Severity decides the exit code: error and unservable -> 1,
warning -> 0 (1 with --strict), info -> 0.
"""

import json
import os
import resource

import numpy as np
import pytest
import torch
from conftest import codes
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

from mlora.lora_tools.findings import CODES

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
ST = "adapter_model.safetensors"


def set_config(path, **changes):
    cfg = read_config(path)
    cfg.update(changes)
    write_config(path, cfg)


def mutate_tensors(path, fn):
    t = load_tensors(path)
    fn(t)
    save_tensors(path, t)


def expect(manifests, path, code, exit_code, *extra):
    """``mlora validate --json PATH *extra``: exactly the finding ``code`` (once or more, nothing else) and ``exit_code``."""
    rc, ms = manifests(path, *extra)
    assert len(ms) == 1
    assert codes(ms[0]) == {code}, ms[0]["findings"]
    assert rc == exit_code
    return ms[0]


# ---- config ----------------------------------------------------------------------


def test_not_an_adapter(tmp_path, manifests):
    (tmp_path / "empty").mkdir()
    m = expect(manifests, tmp_path / "empty", "E_NOT_AN_ADAPTER", 1)
    assert m["artifact_sha256"] is None and not m["valid"]


def test_config_missing(adapter_copy, manifests):
    os.remove(os.path.join(adapter_copy, "adapter_config.json"))
    expect(manifests, adapter_copy, "E_CONFIG_MISSING", 1)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff\xfe"])
def test_config_unparsable(adapter_copy, manifests, text):
    with open(os.path.join(adapter_copy, "adapter_config.json"), "w", encoding="latin-1") as f:
        f.write(text)
    expect(manifests, adapter_copy, "E_CONFIG_PARSE", 1)


@pytest.mark.parametrize("peft_type", ["IA3", None, "lora"])
def test_config_not_lora(adapter_copy, manifests, peft_type):
    set_config(adapter_copy, peft_type=peft_type)
    expect(manifests, adapter_copy, "E_CONFIG_TYPE", 1)


@pytest.mark.parametrize(
    "changes",
    [
        {"r": -1}, {"r": "4"}, {"r": True}, {"lora_alpha": "8"}, {"bias": "some"},
        {"rank_pattern": {"(": 2}}, {"rank_pattern": {"q_proj": 0}}, {"alpha_pattern": {"q_proj": "x"}},
        {"target_modules": 3}, {"target_modules": "(unclosed"}, {"layers_to_transform": ["0"]},
        {"use_rslora": "yes"},
    ],
)
def test_config_bad_field(adapter_copy, manifests, changes):
    set_config(adapter_copy, **changes)
    expect(manifests, adapter_copy, "E_CONFIG_FIELD", 1)


@pytest.mark.parametrize("tokens", [[], ["a"], [5, -1], [True], [5, 1.5], "5", 5, {"a": 1}])
def test_malformed_alora_invocation_tokens(adapter_copy, manifests, tokens):
    set_config(adapter_copy, alora_invocation_tokens=tokens)
    m = expect(manifests, adapter_copy, "E_ALORA_INVOCATION", 1)
    assert not m["valid"] and not m["servable"] and m["activation_policy"] is None
    assert "must be a non-empty list of non-negative integers" in m["findings"][0]["message"]


def test_alora_invocation_tokens_outside_the_base_vocabulary(adapter_copy, base_dir, manifests):
    set_config(adapter_copy, alora_invocation_tokens=[5, 64])  # factory.tiny_config: 64 token ids
    expect(manifests, adapter_copy, "I_ALORA", 0)  # no base: the vocabulary is unknown
    rc, [m] = manifests(adapter_copy, "--base", base_dir)
    [bad] = [f for f in m["findings"] if f["code"] == "E_ALORA_INVOCATION"]
    assert rc == 1 and codes(m) == {"E_ALORA_INVOCATION", "I_ALORA"} and not m["valid"]
    assert "[64]" in bad["message"] and "vocabulary of 64" in bad["message"]
    set_config(adapter_copy, alora_invocation_tokens=[5, 63])
    expect(manifests, adapter_copy, "I_ALORA", 0, "--base", base_dir)


def test_unknown_field_is_a_warning(adapter_copy, manifests):
    set_config(adapter_copy, future_knob=1)
    expect(manifests, adapter_copy, "W_CONFIG_UNKNOWN_FIELD", 0)
    expect(manifests, adapter_copy, "W_CONFIG_UNKNOWN_FIELD", 1, "--strict")


# ---- weights files -------------------------------------------------------------------


def test_weights_missing(adapter_copy, manifests):
    os.remove(os.path.join(adapter_copy, ST))
    expect(manifests, adapter_copy, "E_WEIGHTS_MISSING", 1)


def _to_pickle(path):
    tensors = load_tensors(path)
    os.remove(os.path.join(path, ST))
    torch.save(tensors, os.path.join(path, "adapter_model.bin"))


def test_pickle_refused_then_allowed_with_same_identity(adapter_copy, good_adapter, manifests):
    _, [ref] = manifests(good_adapter)
    _to_pickle(adapter_copy)
    expect(manifests, adapter_copy, "E_PICKLE_REFUSED", 1)
    rc, [m] = manifests(adapter_copy, "--allow-pickle")
    assert rc == 0 and m["format"] == "pickle"
    # the identity is of the tensors, not of the container format
    assert m["artifact_sha256"] == ref["artifact_sha256"]


def test_pickle_unreadable(adapter_copy, manifests):
    os.remove(os.path.join(adapter_copy, ST))
    with open(os.path.join(adapter_copy, "adapter_model.bin"), "wb") as f:
        f.write(b"\x80\x04garbage")
    expect(manifests, adapter_copy, "E_PICKLE_LOAD", 1, "--allow-pickle")


@pytest.mark.parametrize("cut", [10, 1000, "to-4-bytes", "into-header"])
def test_truncated(adapter_copy, manifests, cut):
    file = os.path.join(adapter_copy, ST)
    size = os.path.getsize(file)
    keep = {"to-4-bytes": 4, "into-header": 20}.get(cut, size - cut if isinstance(cut, int) else 0)
    with open(file, "r+b") as f:
        f.truncate(keep)
    expect(manifests, adapter_copy, "E_SAFETENSORS_TRUNCATED", 1)


def test_oversized_header_length_allocates_nothing(adapter_copy, manifests):
    """A header length of 2**60 must be refused before any allocation."""
    file = os.path.join(adapter_copy, ST)
    write_raw_safetensors(file, {}, b"", header_len=2**60)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    expect(manifests, adapter_copy, "E_SAFETENSORS_HEADER", 1)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 200 * 1024


def _good_arrays():
    rng = np.random.default_rng(0)
    return {
        f"{Q0}.lora_A.weight": rng.standard_normal((4, 32)).astype(np.float32),
        f"{Q0}.lora_B.weight": rng.standard_normal((32, 4)).astype(np.float32),
    }


@pytest.mark.parametrize("defect", ["not-json", "not-object", "size-mismatch", "overlap", "bad-dtype", "bad-shape", "bad-offsets"])
def test_inconsistent_header(adapter_copy, manifests, defect):
    header, data = raw_layout(_good_arrays())
    a, b = f"{Q0}.lora_A.weight", f"{Q0}.lora_B.weight"
    file = os.path.join(adapter_copy, ST)
    if defect == "not-json":
        raw = b"{nope"
        with open(file, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw + data)
    else:
        if defect == "not-object":
            header = [1, 2]
        elif defect == "size-mismatch":
            header[a]["shape"] = [4, 31]
        elif defect == "overlap":
            header[b]["data_offsets"] = [8, 8 + 512]
        elif defect == "bad-dtype":
            header[a]["dtype"] = "F17"
        elif defect == "bad-shape":
            header[a]["shape"] = [4, -32]
        elif defect == "bad-offsets":
            header[a]["data_offsets"] = [100, 50]
        write_raw_safetensors(file, header, data)
    set_config(adapter_copy, target_modules=["model.layers.0.self_attn.q_proj"])
    expect(manifests, adapter_copy, "E_SAFETENSORS_HEADER", 1)


# ---- tensors ---------------------------------------------------------------------


def _single_module(path, arrays, **config):
    header, data = raw_layout(arrays)
    write_raw_safetensors(os.path.join(path, ST), header, data)
    set_config(path, target_modules=["model.layers.0.self_attn.q_proj"], rank_pattern={}, alpha_pattern={}, **config)


def test_unsupported_dtype(adapter_copy, manifests):
    arrays = {k: v.astype(np.float64) for k, v in _good_arrays().items()}
    _single_module(adapter_copy, arrays)
    expect(manifests, adapter_copy, "E_UNSUPPORTED_DTYPE", 1)


def test_empty_tensor(adapter_copy, manifests):
    """A [r, 0]: empty, with the config's rank (a rank-0 pair would be a rank mismatch too)."""
    arrays = {f"{Q0}.lora_A.weight": np.zeros((4, 0), np.float32), f"{Q0}.lora_B.weight": np.ones((32, 4), np.float32)}
    _single_module(adapter_copy, arrays)
    expect(manifests, adapter_copy, "E_EMPTY_TENSOR", 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite(adapter_copy, manifests, dtype, value):
    def poison(t):
        for k in t:
            t[k] = t[k].to(dtype)
        t[f"{Q0}.lora_B.weight"][3, 1] = value

    mutate_tensors(adapter_copy, poison)
    m = expect(manifests, adapter_copy, "E_NON_FINITE", 1)
    assert [f["module"] for f in m["findings"] if f["code"] == "E_NON_FINITE"] == ["model.layers.0.self_attn.q_proj"]


def test_missing_partner(adapter_copy, manifests):
    mutate_tensors(adapter_copy, lambda t: t.pop(f"{Q0}.lora_B.weight"))
    expect(manifests, adapter_copy, "E_MISSING_PARTNER", 1)


def test_unexpected_key(adapter_copy, manifests):
    mutate_tensors(adapter_copy, lambda t: t.__setitem__(f"{Q0}.lora_C.weight", torch.ones(2, 2)))
    expect(manifests, adapter_copy, "E_UNEXPECTED_KEY", 1)


@pytest.mark.parametrize("shapes", [((4, 32, 1), (32, 4)), ((4, 32), (32, 3)), ((32,), (32, 4))])
def test_factor_shape(adapter_copy, manifests, shapes):
    rng = np.random.default_rng(1)
    arrays = {
        f"{Q0}.lora_A.weight": rng.standard_normal(shapes[0]).astype(np.float32),
        f"{Q0}.lora_B.weight": rng.standard_normal(shapes[1]).astype(np.float32),
    }
    _single_module(adapter_copy, arrays)
    expect(manifests, adapter_copy, "E_FACTOR_SHAPE", 1)


def test_rank_disagrees_with_config(adapter_copy, manifests):
    set_config(adapter_copy, r=8)
    expect(manifests, adapter_copy, "E_RANK_MISMATCH", 1)


def test_rank_pattern_disagrees_with_tensors(adapter_copy, manifests):
    set_config(adapter_copy, rank_pattern={"v_proj": 2})
    m = expect(manifests, adapter_copy, "E_RANK_MISMATCH", 1)
    bad = {f["module"] for f in m["findings"] if f["code"] == "E_RANK_MISMATCH"}
    assert bad == {"model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.v_proj"}


def test_dtype_mismatch(adapter_copy, manifests):
    mutate_tensors(adapter_copy, lambda t: t.__setitem__(f"{Q0}.lora_B.weight", t[f"{Q0}.lora_B.weight"].half()))
    expect(manifests, adapter_copy, "E_DTYPE_MISMATCH", 1)


def test_no_modules(adapter_copy, manifests):
    write_raw_safetensors(os.path.join(adapter_copy, ST), {}, b"")
    expect(manifests, adapter_copy, "E_NO_MODULES", 1)


def test_zero_delta_is_a_warning(adapter_copy, manifests):
    mutate_tensors(adapter_copy, lambda t: t[f"{Q0}.lora_B.weight"].zero_())
    m = expect(manifests, adapter_copy, "W_ZERO_DELTA", 0)
    assert m["valid"] and m["servable"]
    expect(manifests, adapter_copy, "W_ZERO_DELTA", 1, "--strict")


def test_pattern_key_matching_nothing(adapter_copy, manifests):
    set_config(adapter_copy, rank_pattern={"gate_proj": 4}, alpha_pattern={"xx_proj": 2})
    m = expect(manifests, adapter_copy, "W_PATTERN_UNMATCHED", 0)
    assert sum(f["code"] == "W_PATTERN_UNMATCHED" for f in m["findings"]) == 2


# ---- against a base ------------------------------------------------------------------


def test_base_invalid(adapter_copy, manifests, tmp_path, run_cli):
    (tmp_path / "nobase").mkdir()
    rc, out, err = run_cli("validate", "--json", adapter_copy, "--base", tmp_path / "nobase")
    assert rc == 1 and out == "" and "E_BASE_INVALID" in err


def test_target_not_in_base(adapter_copy, manifests, base_dir):
    """A q_proj of a layer 9 the base lacks: an error, and no target-set warning (the config
    targets every q_proj, and every q_proj of the base has its factors)."""
    def add_layer_9(t):
        for side in "AB":
            t[f"base_model.model.model.layers.9.self_attn.q_proj.lora_{side}.weight"] = t[f"{Q0}.lora_{side}.weight"].clone()

    mutate_tensors(adapter_copy, add_layer_9)
    expect(manifests, adapter_copy, "E_TARGET_NOT_IN_BASE", 1, "--base", base_dir)


def test_base_shape_mismatch(adapter_copy, manifests, tmp_path):
    other = save_base(tiny_model("llama", hidden=48), str(tmp_path / "tiny-llama"))
    expect(manifests, adapter_copy, "E_BASE_SHAPE_MISMATCH", 1, "--base", other)


def test_base_name_mismatch(adapter_copy, manifests, base_dir):
    set_config(adapter_copy, base_model_name_or_path="someone/other-model")
    expect(manifests, adapter_copy, "W_BASE_NAME_MISMATCH", 0, "--base", base_dir)
    expect(manifests, adapter_copy, "W_BASE_NAME_MISMATCH", 1, "--base", base_dir, "--strict")


def test_declared_name_matching_the_base_dir_is_quiet(good_adapter, manifests, base_dir):
    rc, [m] = manifests(good_adapter, "--base", base_dir, "--strict")
    assert rc == 0 and m["findings"] == [] and m["base"]["binding"] == "measured"


def test_target_set_mismatch(adapter_copy, manifests, base_dir):
    def drop(t):
        del t[f"{Q0}.lora_A.weight"], t[f"{Q0}.lora_B.weight"]

    mutate_tensors(adapter_copy, drop)
    expect(manifests, adapter_copy, "W_TARGET_SET_MISMATCH", 0, "--base", base_dir)


def test_literal_all_linear_config_resolves_on_the_base(tmp_path, manifests, base_dir):
    from factory import make_adapter
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / "tiny-llama-adapter")
    make_adapter(path, base_model=AutoModelForCausalLM.from_pretrained(base_dir), r=2, target_modules="all-linear")
    set_config(path, target_modules="all-linear", base_model_name_or_path="tiny-llama")
    rc, [m] = manifests(path, "--base", base_dir, "--strict")
    assert rc == 0 and m["findings"] == [], m["findings"]
    set_config(path, target_modules="all-linear", exclude_modules=["down_proj"])
    expect(manifests, path, "W_TARGET_SET_MISMATCH", 0, "--base", base_dir)


# ---- valid PEFT, not servable ------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, code",
    [
        ({"init_lora_weights": "pissa_niter_4"}, "U_INIT_CHANGES_BASE"),
        ({"init_lora_weights": "olora"}, "U_INIT_CHANGES_BASE"),
        ({"init_lora_weights": "loftq"}, "U_INIT_CHANGES_BASE"),
        ({"fan_in_fan_out": True}, "U_FAN_IN_FAN_OUT"),
        ({"use_qalora": True}, "U_FEATURE"),
        ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "U_TARGET_PARAMETERS"),
        ({"layer_replication": [[0, 2], [1, 2]]}, "U_LAYER_REPLICATION"),
        ({"trainable_token_indices": [1, 2]}, "U_TRAINABLE_TOKENS"),
    ],
)
def test_unservable_config_features(adapter_copy, manifests, changes, code):
    set_config(adapter_copy, **changes)
    m = expect(manifests, adapter_copy, code, 1)
    assert m["valid"] and not m["servable"] and m["artifact_sha256"]


def test_alora_is_servable_and_names_its_invocation_tokens(adapter_copy, base_dir, good_adapter, manifests,
                                                         run_cli):
    """An info finding, never a failure (not with --strict either); the identity keeps its policy."""
    set_config(adapter_copy, alora_invocation_tokens=[5, 6])
    m = expect(manifests, adapter_copy, "I_ALORA", 0, "--base", base_dir, "--strict")
    assert m["valid"] and m["servable"]
    assert m["activation_policy"] == {"kind": "alora", "invocation_tokens": [5, 6]}
    assert m["findings"][0]["severity"] == "info" and "[5, 6]" in m["findings"][0]["message"]
    plain = manifests(good_adapter, "--base", base_dir)[1][0]
    assert m["artifact_sha256"] == plain["artifact_sha256"] and m["semantic_sha256"] != plain["semantic_sha256"]
    rc, out, _ = run_cli("validate", adapter_copy, "--base", base_dir)
    assert rc == 0 and "I_ALORA" in out and "alora_invocation_tokens is [5, 6]" in " ".join(out.split())
    assert "1/1 adapter(s) valid and servable." in out


@pytest.mark.parametrize("bias", ["lora_only", "all"])
def test_bias_field_without_a_bias_tensor_is_a_plain_lora(adapter_copy, good_adapter, manifests, bias):
    """On a base without biases PEFT saves no bias tensor: the field is inert, the adapter
    is the plain LoRA it holds (servable, its factors' identity) and only a warning says so."""
    set_config(adapter_copy, bias=bias)
    m = expect(manifests, adapter_copy, "W_BIAS_INERT", 0)
    assert m["valid"] and m["servable"]
    assert m["modules"] == manifests(good_adapter)[1][0]["modules"]
    expect(manifests, adapter_copy, "W_BIAS_INERT", 1, "--strict")


@pytest.mark.parametrize("bias", ["lora_only", "all"])
def test_bias_field_with_a_trained_bias_tensor_is_unservable(adapter_copy, manifests, bias):
    set_config(adapter_copy, bias=bias)
    mutate_tensors(adapter_copy, lambda t: t.__setitem__(f"{Q0}.bias", torch.full((32,), 0.5)))
    m = expect(manifests, adapter_copy, "U_BIAS", 1)
    assert m["valid"] and not m["servable"] and m["artifact_sha256"]
    assert f"{Q0}.bias" in m["findings"][0]["message"]


def test_every_code_is_exercised():
    """The corpus above names every registered code (keeps the registry honest)."""
    here = open(__file__).read() + open(os.path.join(os.path.dirname(__file__), "test_peft_parity.py")).read()
    missing = [c for c in CODES if f'"{c}"' not in here]
    assert missing == []


def test_json_stdout_is_only_manifests(adapter_copy, run_cli):
    rc, out, _ = run_cli("validate", "--json", adapter_copy)
    assert rc == 0
    for line in out.splitlines():
        assert json.loads(line)["schema_version"] == 1
