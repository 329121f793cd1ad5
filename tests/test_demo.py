"""The embedded demo workspace (examples/demo) is valid, servable and consistent.

Later steps test the engine against examples/demo/expected.json; here we check
that the files themselves hold what the README promises.
"""

import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DEMO, REPO

ADAPTERS = os.path.join(DEMO, "adapters")
BASE = os.path.join(DEMO, "base")
NAMES = ["reverse", "rot13", "spell", "upper"]


@pytest.fixture(scope="module")
def expected():
    with open(os.path.join(DEMO, "expected.json")) as f:
        return json.load(f)


def test_demo_adapters_are_valid_and_servable_against_the_demo_base(manifests):
    rc, ms = manifests(ADAPTERS, "--base", BASE, "--strict")
    assert rc == 0, [m["findings"] for m in ms]
    assert sorted(m["name"] for m in ms) == NAMES
    assert all(m["valid"] and m["servable"] and m["findings"] == [] for m in ms)
    assert len({m["artifact_sha256"] for m in ms}) == 4
    assert all(m["base"]["binding"] == "measured" for m in ms)


def test_demo_adapters_cover_the_config_variety(manifests):
    _, ms = manifests(ADAPTERS)
    by = {m["name"]: m for m in ms}
    cfg = {n: json.load(open(os.path.join(ADAPTERS, n, "adapter_config.json"))) for n in NAMES}
    # different ranks and target sets
    assert len({frozenset(r["role"] for r in m["modules"]) for m in ms}) >= 3
    assert len({tuple(m["stats"]["rank_histogram"]) for m in ms}) >= 3
    # one with rank_pattern and alpha_pattern, resolved to more than one rank
    patterned = [n for n in NAMES if cfg[n].get("rank_pattern") and cfg[n].get("alpha_pattern")]
    assert patterned and len(by[patterned[0]]["stats"]["rank_histogram"]) > 1
    # one rslora
    assert any(cfg[n].get("use_rslora") for n in NAMES)
    rs = [n for n in NAMES if cfg[n].get("use_rslora")][0]
    assert {r["scale_rule"] for r in by[rs]["modules"]} == {"alpha/sqrt(r)"}
    # one all-linear: every linear projection of every layer is adapted
    roles = {n: {r["role"] for r in by[n]["modules"]} for n in NAMES}
    assert any(rl >= {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} for rl in roles.values())
    assert all(c["base_model_name_or_path"] == "mlora-demo/base" for c in cfg.values())


def test_demo_tokenizer_round_trips_ascii():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(BASE, "tokenizer.json"))
    text = "hello world 42 ~!"
    assert tok.decode(tok.encode(text).ids) == text


def test_expected_outputs_are_visibly_different(expected):
    """The base copies; every adapter changes most prompts, and a prompt with
    letters and digits gets five different answers."""
    outs = expected["outputs"]
    assert set(outs) == {"__base__", *NAMES}
    prompts = expected["prompts"]
    assert len(prompts) >= 4
    assert outs["__base__"] == prompts
    for name in NAMES:
        changed = sum(a != p for a, p in zip(outs[name], prompts))
        assert changed >= len(prompts) // 2, name
    mixed = [i for i, p in enumerate(prompts) if any(c.isdigit() for c in p) and any(c.isalpha() for c in p)]
    assert mixed
    for i in mixed:
        answers = [outs[k][i] for k in outs]
        assert len(set(answers)) == len(answers), (prompts[i], answers)


def test_expected_json_reproduces_with_transformers_and_peft(expected):
    """Greedy decoding with the reference stack gives the recorded answers."""
    import torch
    from peft import PeftModel
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(os.path.join(BASE, "tokenizer.json"))
    eos = tok.token_to_id("<|eos|>")
    fmt, max_new = expected["format"], expected["max_new_tokens"]

    def greedy(model, prompt):
        ids = torch.tensor([tok.encode(fmt.format(prompt=prompt), add_special_tokens=False).ids])
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        new = [t for t in out[0, ids.shape[1]:].tolist() if t != eos]
        return tok.decode(new)

    for name in ["__base__", *NAMES]:
        model = AutoModelForCausalLM.from_pretrained(BASE)
        if name != "__base__":
            model = PeftModel.from_pretrained(model, os.path.join(ADAPTERS, name))
        model.eval()
        for i in (0, 1):
            assert greedy(model, expected["prompts"][i]) == expected["outputs"][name][i], (name, i)


def test_demo_is_small():
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(DEMO) for f in fs)
    assert total < 10 * 1024 * 1024


def test_check_demo_outputs_finds_a_changed_row(single_process_output, tmp_path):
    """scripts/check_demo_outputs.py: the CPU float32 demo output equals expected.json and itself;
    one row with a changed token and text fails both comparisons (exit 1) and is named."""
    def check(*outs):
        return subprocess.run([sys.executable, os.path.join(REPO, "scripts", "check_demo_outputs.py"), *map(str, outs)],
                              capture_output=True, text=True)

    assert check(single_process_output).returncode == 0
    assert check(single_process_output, single_process_output).returncode == 0
    changed = tmp_path / "changed"
    shutil.copytree(single_process_output, changed)
    part = sorted(p for p in os.listdir(changed) if p.endswith(".parquet"))[0]
    table = pq.read_table(changed / part)
    rows = table.to_pylist()
    rows[0]["completion_token_ids"][0] += 1
    rows[0]["completion"] = "x" + rows[0]["completion"]
    pq.write_table(pa.Table.from_pylist(rows, table.schema), changed / part)
    for result in (check(changed, single_process_output), check(changed)):
        assert result.returncode == 1 and rows[0]["id"] in result.stdout
