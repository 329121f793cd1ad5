"""Loading adapter directories as a compressible collection (the input of `mlora compress`).

Each member's factored delta must equal PEFT's own delta weight for that
module; bad members, duplicate ids, changed bytes and mixed bases fail closed
with a named error.
"""

import factory
import pytest
import torch

from mlora.compress import jd_full, relative_errors
from mlora.compress.collection import load_collection
from mlora.compress.solvers import CompressError

MEMBERS = {
    "m1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=21),
    "m2": dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "down_proj"], seed=22),
    "m3": dict(r=6, lora_alpha=6, rank_pattern={"v_proj": 3}, alpha_pattern={"v_proj": 9},
               target_modules=["q_proj", "v_proj"], seed=23),
}


@pytest.fixture(scope="module")
def coll(tmp_path_factory):
    root = tmp_path_factory.mktemp("coll")
    base = str(root / "base")
    factory.save_base(factory.tiny_model("llama", seed=0), base)
    refs = factory.make_adapters(str(root / "adapters"), base, MEMBERS)
    return root, base, refs


def _peft_delta(peft_model, module):
    mod = peft_model.base_model.model.get_submodule(module)
    return mod.get_delta_weight("default").double()


def test_members_equal_peft_deltas(coll):
    root, base, refs = coll
    col = load_collection([str(root / "adapters")], base)
    assert [m.id for m in col.members] == ["m1", "m2", "m3"]
    assert all(m.semantic_sha256 and m.artifact_sha256 for m in col.members)
    n = 0
    for module, per in col.modules.items():
        for member, delta in per.items():
            want = _peft_delta(refs[member], module)
            torch.testing.assert_close(delta.dense(), want, rtol=1e-6, atol=1e-7)
            n += 1
    assert n == 2 * (2 + 2 + 2)  # 2 layers x 2 targets per member
    ids, factors = col.factors("model.layers.0.self_attn.q_proj")
    assert ids == ["m1", "m2", "m3"] and [f.rank for f in factors] == [4, 2, 6]
    # the loaded collection feeds the solvers: R = sum of ranks reconstructs exactly
    res = jd_full(factors, R=12, iters=5, seed=0)
    assert max(relative_errors(factors, res)) < 1e-20


def test_a_bad_member_stops_the_load(coll, tmp_path):
    root, base, _ = coll
    bad = factory.copy_adapter(str(root / "adapters" / "m1"), str(tmp_path / "bad"))
    t = factory.load_tensors(bad)
    key = next(k for k in t if "lora_A" in k)
    t[key][0, 0] = float("nan")
    factory.save_tensors(bad, t)
    with pytest.raises(CompressError) as exc:
        load_collection([str(root / "adapters" / "m2"), bad], base)
    assert exc.value.code == "E_COMPRESS_MEMBER_INVALID" and "bad" in str(exc.value)


def test_an_alora_member_is_refused(coll, tmp_path, run_cli):
    """A bundle core carries no activation rule: an aLoRA member stops the load, by its own code."""
    root, base, _ = coll
    alora = str(tmp_path / "act")
    factory.make_adapter(alora, seed=5, r=2, task_type="CAUSAL_LM", alora_invocation_tokens=[5, 6])
    with pytest.raises(CompressError) as exc:
        load_collection([str(root / "adapters" / "m1"), alora], base)
    assert exc.value.code == "E_COMPRESS_ALORA" and "'act'" in str(exc.value) and "[5, 6]" in str(exc.value)
    code, _, stderr = run_cli("compress", "fit", str(root / "adapters" / "m1"), alora, "--rank", "2", "-o",
                              str(tmp_path / "bundle"), "--quiet")
    assert code == 1 and "Error: E_COMPRESS_ALORA" in stderr and not (tmp_path / "bundle").exists()


def test_duplicate_ids_and_mixed_bases_are_refused(coll, tmp_path):
    root, base, _ = coll
    twin = factory.copy_adapter(str(root / "adapters" / "m1"), str(tmp_path / "x" / "m1"))
    with pytest.raises(CompressError) as exc:
        load_collection([str(root / "adapters" / "m1"), twin])
    assert exc.value.code == "E_COMPRESS_DUPLICATE_ID"
    other = factory.copy_adapter(str(root / "adapters" / "m2"), str(tmp_path / "other"))
    cfg = factory.read_config(other)
    cfg["base_model_name_or_path"] = "org/another-base"
    factory.write_config(other, cfg)
    with pytest.raises(CompressError) as exc:  # declared bases differ (no --base given)
        load_collection([str(root / "adapters" / "m1"), other])
    assert exc.value.code == "E_COMPRESS_BASE_MISMATCH"


def test_bytes_changed_after_validation_are_refused(coll, tmp_path, monkeypatch):
    root, base, _ = coll
    member = factory.copy_adapter(str(root / "adapters" / "m1"), str(tmp_path / "m1"))
    from mlora.compress import collection as mod

    original = mod.scan_adapters

    def scan_then_change(arts, workers=None):
        original(arts, workers)
        t = factory.load_tensors(member)
        key = next(k for k in t if "lora_B" in k)
        t[key][0, 0] += 1.0
        factory.save_tensors(member, t)

    monkeypatch.setattr(mod, "scan_adapters", scan_then_change)
    col = load_collection([member], base)  # factors are read when their module is fitted
    with pytest.raises(CompressError) as exc:
        for module in col.modules:
            col.factors(module)
    assert exc.value.code == "E_COMPRESS_MEMBER_CHANGED"
