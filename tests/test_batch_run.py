"""`mlora batch-run` end to end on the CPU.

The reference for every row is transformers (+ PEFT for adapter rows) run row by
row with a plain greedy loop (full forward per token, no cache): mlora's
batched, paged, chunked, mixed-adapter output must equal it token for token in
float32, whatever the batch options. Then the row outcomes, resume after kill
-9, and the demo workspace.
"""

import json
import os
import signal
import subprocess
import sys
import time

import factory
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import DEMO, REPO

MAX_NEW = 6
ADAPTERS = {
    "a1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=11),
    "a2": dict(r=8, lora_alpha=16, seed=12,
               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "a3": dict(r=2, lora_alpha=2, use_rslora=True, target_modules=["o_proj", "down_proj"], seed=13),
}
ROW_ADAPTERS = ["a1", None, "a2", "__base__", "a3", "", "a1", "a2", "a3", None, "a2", "a1", "a3", "a2"]


def _greedy(model, prompt, eos, max_new, start=None):
    """Greedy tokens of ``model`` after ``prompt``, a full forward per token; ``start``: a PEFT aLoRA
    model's first adapted position (passed as PEFT's offset from the end, as its ``generate`` does)."""
    toks = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            kw = {} if start is None else {"alora_offsets": [len(toks) - start]}
            t = int(model(input_ids=torch.tensor([toks]), **kw).logits[0, -1].argmax())
            if t in eos:
                break
            toks.append(t)
            out.append(t)
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("job")
    base = str(root / "base")
    factory.save_base(factory.tiny_model("llama", seed=0), base)
    refs = factory.make_adapters(str(root / "adapters"), base, ADAPTERS)
    base_model = AutoModelForCausalLM.from_pretrained(base).eval()
    eos = {int(base_model.generation_config.eos_token_id)}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 64, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
               for _ in ROW_ADAPTERS]
    inp = str(root / "in.parquet")
    pq.write_table(pa.table({
        "id": [f"r{i}" for i in range(len(prompts))],
        "prompt_ids": pa.array(prompts, pa.list_(pa.int64())),
        "adapter": pa.array(ROW_ADAPTERS, pa.string()),
        "note": [f"n{i}" for i in range(len(prompts))],
    }), inp)
    expected = {}
    for i, (p, a) in enumerate(zip(prompts, ROW_ADAPTERS)):
        model = refs[a] if a in refs else base_model
        expected[f"r{i}"] = _greedy(model, p, eos, MAX_NEW)
    return dict(root=root, base=base, adapters=str(root / "adapters"), input=inp, expected=expected, prompts=prompts)


def _run(env, out, **kw):
    from mlora.batch.config import JobConfig
    from mlora.batch.runner import run_job

    opts = dict(input=env["input"], output=str(out), base=env["base"], adapters_dir=env["adapters"],
                prompt_column=None, prompt_ids_column="prompt_ids", max_new_tokens=MAX_NEW, device="cpu",
                dtype="float32", keep_columns=("note",))
    opts.update(kw)
    return run_job(JobConfig(**opts))


def _input_of(env, path, keep) -> str:
    """The job's input of rows ``keep`` (indices into ``ROW_ADAPTERS``) alone, written to ``path``."""
    pq.write_table(pa.table({
        "id": [f"r{i}" for i in keep],
        "prompt_ids": pa.array([env["prompts"][i] for i in keep], pa.list_(pa.int64())),
        "adapter": pa.array([ROW_ADAPTERS[i] for i in keep], pa.string()),
        "note": [f"n{i}" for i in keep],
    }), path)
    return str(path)


def _rows(out):
    from mlora.batch.job.output import read_output

    return {r["id"]: r for r in read_output(str(out)).to_pylist()}


@pytest.mark.parametrize("seqs, budget, shard", [(64, 2048, 10000), (1, 3, 4), (3, 7, 5), (5, 16, 1)])
def test_outputs_equal_transformers_and_peft_row_by_row(env, tmp_path, seqs, budget, shard):
    summary = _run(env, tmp_path / "out", max_num_seqs=seqs, max_batch_tokens=budget, shard_rows=shard)
    rows = _rows(tmp_path / "out")
    assert len(rows) == len(ROW_ADAPTERS) == summary.rows
    for rid, want in env["expected"].items():
        r = rows[rid]
        assert r["completion_token_ids"] == want, (rid, r["adapter"])
        assert r["error_code"] is None and r["finish_reason"] in ("stop", "length")
        assert r["num_completion_tokens"] == len(want)
    assert rows["r4"]["note"] == "n4" and rows["r4"]["adapter"] == "a3" and rows["r4"]["adapter_sha256"]
    assert rows["r1"]["adapter"] is None and rows["r1"]["adapter_sha256"] is None
    assert os.path.exists(tmp_path / "out" / "_SUCCESS")
    assert list(rows) == [f"r{k}" for k in range(len(ROW_ADAPTERS))]  # shards follow input order


@pytest.mark.parametrize("ledger, lookahead", [("split", False), ("joint", True), ("split", True)])
def test_emulated_decode_graphs_job_equals_peft(env, tmp_path, monkeypatch, ledger, lookahead):
    """The whole job with its decode steps through the decode graphs, emulated on the CPU
    (MLORA_EMULATE_GRAPHS=1: static buffers, buckets, padding, staging, the Triton kernels
    interpreted, every replay's buffers checked), in both memory ledgers (the joint one with
    the graphs' spare page), with and without lookahead and so chained decode (never with
    the joint ledger: a freed KV page may become a slot while a chained iteration writes
    it): every row equals transformers + PEFT. The first eight rows (every adapter and every
    spelling of the base; more rows than the five seats): the Triton kernels run interpreted."""
    monkeypatch.setenv("MLORA_EMULATE_GRAPHS", "1")
    keep = range(8)
    summary = _run(env, tmp_path / "out", input=_input_of(env, tmp_path / "in.parquet", keep), max_num_seqs=5,
                   memory_ledger=ledger, lookahead=lookahead)
    rows = _rows(tmp_path / "out")
    assert summary.engine.get("graph_replays", 0) > 0, summary.engine
    assert (summary.engine.get("chained_iterations", 0) > 0) == (lookahead and ledger == "split"), summary.engine
    assert sorted(rows) == sorted(f"r{i}" for i in keep)
    for i in keep:
        assert rows[f"r{i}"]["completion_token_ids"] == env["expected"][f"r{i}"], (i, ROW_ADAPTERS[i])


def test_a_job_without_k_adapters_holds_no_k_slots_and_equals_peft(env, tmp_path, monkeypatch):
    """Rows naming only a1 (q/v) and a3 (o/down) and base rows: the bank holds the q and v
    slices of q/k/v, o and down, nothing else (a load copies no zeros for k), and every row
    still equals transformers + PEFT."""
    import mlora.batch.adapters.residency as residency_pkg

    keep = [i for i, a in enumerate(ROW_ADAPTERS) if a != "a2"]
    inp = _input_of(env, tmp_path / "in.parquet", keep)
    banks = []

    class Spy(residency_pkg.ResidencyBank):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            banks.append(self)

    monkeypatch.setattr("mlora.batch.job.session.ResidencyBank", Spy)
    _run(env, tmp_path / "out", input=inp)
    [bank] = banks
    assert bank.groups == ("qkv", "o", "down") and bank.slice_index["qkv"] == {0: 0, 2: 1}
    rows = _rows(tmp_path / "out")
    assert sorted(rows) == sorted(f"r{i}" for i in keep)
    for i in keep:
        assert rows[f"r{i}"]["completion_token_ids"] == env["expected"][f"r{i}"], (i, ROW_ADAPTERS[i])


def test_row_outcomes(env, tmp_path):
    inp = str(tmp_path / "bad.parquet")
    pq.write_table(pa.table({
        "id": ["ok", "unknown", "long", "empty", "null", "range"],
        "prompt_ids": pa.array([[5, 6, 7], [5, 6], list(range(3, 64)) + [5] * 10, [], None, [5, 999]], pa.list_(pa.int64())),
        "adapter": ["a1", "nope", "a1", None, None, None],
    }), inp)
    _run(env, tmp_path / "out", input=inp, keep_columns=())
    rows = _rows(tmp_path / "out")
    assert rows["ok"]["error_code"] is None
    assert {k: rows[k]["error_code"] for k in rows if k != "ok"} == {
        "unknown": "E_ADAPTER_UNKNOWN", "long": "E_PROMPT_TOO_LONG", "empty": "E_PROMPT_EMPTY",
        "null": "E_PROMPT_NULL", "range": "E_PROMPT_TOKEN_RANGE"}
    assert all(rows[k]["finish_reason"] == "error" and rows[k]["error_message"] for k in rows if k != "ok")
    # the env base has no tokenizer.json: no text, only tokens
    assert rows["ok"]["completion"] is None and rows["ok"]["completion_token_ids"]


def _typed_input(env, path, ids, files=2):
    """The env job's rows (repeated to ``len(ids)``) with ``ids`` as the id column, over ``files`` files."""
    n = len(ids)
    table = pa.table({
        "id": ids,
        "prompt_ids": pa.array([env["prompts"][i % len(ROW_ADAPTERS)] for i in range(n)], pa.list_(pa.int64())),
        "adapter": pa.array([ROW_ADAPTERS[i % len(ROW_ADAPTERS)] for i in range(n)], pa.string()),
        "note": [f"n{i}" for i in range(n)],
    })
    os.makedirs(path, exist_ok=True)
    step = -(-n // files)
    for k in range(files):
        pq.write_table(table.slice(k * step, step), os.path.join(path, f"part{k}.parquet"))
    return str(path)


@pytest.mark.parametrize("id_type", [pa.int64(), pa.int32(), pa.large_string()])
def test_ids_keep_their_arrow_type_in_the_output(env, tmp_path, id_type):
    """An int64 (int32, large_string) id column over two files comes back in its own type, so
    the output joins to the input on id; the rows are those of string ids."""
    n = len(ROW_ADAPTERS)
    ids = pa.array([1000 + i for i in range(n)]).cast(id_type)
    inp = _typed_input(env, tmp_path / "in", ids)
    _run(env, tmp_path / "out", input=inp)
    from mlora.batch.job.output import read_output

    table = read_output(str(tmp_path / "out"))
    assert table.schema.field("id").type == id_type and table.column("id").equals(pa.chunked_array([ids]))
    joined = pq.read_table(inp, columns=["id", "note"]).join(table.select(["id", "num_prompt_tokens"]), "id")
    assert sorted(joined.select(["note", "num_prompt_tokens"]).to_pylist(), key=lambda r: int(r["note"][1:])) == [
        {"note": f"n{k}", "num_prompt_tokens": len(env["prompts"][k])} for k in range(n)]  # every row matched
    assert table.column("completion_token_ids").to_pylist() == [env["expected"][f"r{k}"] for k in range(n)]


def test_duplicate_ids_are_refused_before_any_work_unless_allowed(env, tmp_path, run_cli):
    n = len(ROW_ADAPTERS)
    inp = _typed_input(env, tmp_path / "in", pa.array([100 + i for i in range(n - 1)] + [104]))
    args = ["batch-run", inp, tmp_path / "out", "--base", env["base"], "--adapters", env["adapters"],
            "--prompt-ids-column", "prompt_ids", "--device", "cpu", "--quiet"]
    code, _, err = run_cli(*args)
    err = " ".join(err.split())
    assert code == 1 and "E_INPUT_DUPLICATE_ID" in err, err
    assert "id 104 of row 13 (part1.parquet, row 6) repeats row 4 (part0.parquet, row 4)" in err, err
    assert not (tmp_path / "out").exists()
    # allowed: every row runs once, in input order, and equals the row under a unique id, with
    # the joint ledger too (rows in flight under one id keep their own KV pages)
    from mlora.batch.job.output import read_output

    n = 3 * len(ROW_ADAPTERS)
    kw = dict(memory_ledger="joint", max_num_seqs=6, max_new_tokens=24)
    _run(env, tmp_path / "unique", input=_typed_input(env, tmp_path / "u", pa.array(range(n), pa.int64())), **kw)
    same = _typed_input(env, tmp_path / "same", pa.array([7] * n, pa.int64()))  # every row has the same id
    _run(env, tmp_path / "joint", input=same, allow_duplicate_ids=True, **kw)
    rows, want = read_output(str(tmp_path / "joint")).to_pylist(), read_output(str(tmp_path / "unique")).to_pylist()
    assert [r["id"] for r in rows] == [7] * n and [r["note"] for r in rows] == [f"n{k}" for k in range(n)]
    assert [r["completion_token_ids"] for r in rows] == [r["completion_token_ids"] for r in want]


@pytest.mark.parametrize("option, code", [(["--stop", ""], "E_STOP_EMPTY"), (["--stop", "x", "--stop", ""], "E_STOP_EMPTY"),
                                          (["--commit-interval", "0"], "E_OPTION_RANGE"),
                                          (["--commit-interval", "-5"], "E_OPTION_RANGE"),
                                          (["--commit-interval", "nan"], "E_OPTION_RANGE")])
def test_empty_stop_strings_and_bad_commit_intervals_are_usage_errors(env, tmp_path, run_cli, option, code):
    rc, _, err = run_cli("batch-run", env["input"], tmp_path / "out", "--base", env["base"], "--adapters",
                         env["adapters"], "--prompt-ids-column", "prompt_ids", "--device", "cpu", "--quiet", *option)
    assert rc == 2 and code in err, err
    assert not (tmp_path / "out").exists()


def test_prompt_ids_completions_are_decoded_with_the_bases_tokenizer(tmp_path):
    """--prompt-ids-column on a base with a tokenizer.json: the completion text is the same as
    the text prompt's; a base without one (the env job's) gives a null completion."""
    from tokenizers import Tokenizer

    from mlora.batch.config import JobConfig
    from mlora.batch.job.output import read_output
    from mlora.batch.runner import run_job

    tok = Tokenizer.from_file(os.path.join(DEMO, "base", "tokenizer.json"))
    demo = pq.read_table(os.path.join(DEMO, "prompts.parquet")).slice(0, 8)
    ids = pa.array([tok.encode(p).ids for p in demo.column("prompt").to_pylist()], pa.list_(pa.int64()))
    inp = str(tmp_path / "in.parquet")
    pq.write_table(demo.append_column("prompt_ids", ids), inp)
    common = dict(input=inp, base=os.path.join(DEMO, "base"), adapters_dir=os.path.join(DEMO, "adapters"),
                  max_new_tokens=12, device="cpu")
    run_job(JobConfig(output=str(tmp_path / "text"), **common))
    run_job(JobConfig(output=str(tmp_path / "ids"), prompt_column=None, prompt_ids_column="prompt_ids", **common))
    text, by_ids = read_output(str(tmp_path / "text")), read_output(str(tmp_path / "ids"))
    assert by_ids.column("completion_token_ids").equals(text.column("completion_token_ids"))
    assert by_ids.column("completion").to_pylist() == text.column("completion").to_pylist()
    assert all(text.column("completion").to_pylist())  # non-empty text to compare


def _a1_rows_under(env, tmp_path, ids: list[str]) -> str:
    """An input of the ``a1`` rows of ``env``, once under each adapter id of ``ids``."""
    a1 = [i for i, a in enumerate(ROW_ADAPTERS) if a == "a1"]
    inp = str(tmp_path / "a1.parquet")
    pq.write_table(pa.table({
        "id": [f"{name}:r{i}" for name in ids for i in a1],
        "prompt_ids": pa.array([env["prompts"][i] for _ in ids for i in a1], pa.list_(pa.int64())),
        "adapter": [name for name in ids for _ in a1],
    }), inp)
    return inp


def test_a_bias_field_without_bias_tensors_is_served_as_the_plain_lora(env, tmp_path):
    """bias="lora_only" on a base without biases: the file is the plain LoRA a1, and so is every token."""
    adapters = tmp_path / "adapters"
    factory.copy_adapter(os.path.join(env["adapters"], "a1"), str(adapters / "a1"))
    factory.copy_adapter(os.path.join(env["adapters"], "a1"), str(adapters / "a1-bias"))
    factory.write_config(str(adapters / "a1-bias"), {**factory.read_config(str(adapters / "a1-bias")), "bias": "lora_only"})
    _run(env, tmp_path / "out", input=_a1_rows_under(env, tmp_path, ["a1", "a1-bias"]), adapters_dir=str(adapters),
         keep_columns=())
    rows = _rows(tmp_path / "out")
    for rid, r in rows.items():
        assert r["error_code"] is None, r
        assert r["completion_token_ids"] == env["expected"][rid.split(":")[1]]
    assert {r["adapter"] for r in rows.values()} == {"a1", "a1-bias"} and len(rows) == 6


def _to_pickle(path: str) -> str:
    """The adapter at ``path`` with its tensors in adapter_model.bin (torch.save) instead of safetensors."""
    torch.save(factory.load_tensors(path), os.path.join(path, "adapter_model.bin"))
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    return path


def test_a_pickle_adapter_is_served_only_with_allow_pickle(env, tmp_path, run_cli):
    """Without --allow-pickle an adapter_model.bin adapter's rows are error rows whose advice
    (--allow-pickle) batch-run takes; with it the rows equal the same adapter in safetensors,
    under the same identity. The flag is part of what the job pinned: resuming without it
    is refused."""
    adapters = tmp_path / "adapters"
    factory.copy_adapter(os.path.join(env["adapters"], "a1"), str(adapters / "a1"))
    _to_pickle(factory.copy_adapter(os.path.join(env["adapters"], "a1"), str(adapters / "a1-bin")))
    args = ["batch-run", _a1_rows_under(env, tmp_path, ["a1", "a1-bin"]), None, "--base", env["base"],
            "--adapters", adapters, "--prompt-ids-column", "prompt_ids", "--device", "cpu", "--max-new-tokens",
            MAX_NEW, "--quiet", "--json"]
    args[2] = tmp_path / "refused"
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert json.loads(out)["errors_by_code"] == {"E_PICKLE_REFUSED": 3}
    refused = _rows(tmp_path / "refused")
    for rid, r in refused.items():
        if r["adapter"] == "a1-bin":
            assert r["error_code"] == "E_PICKLE_REFUSED" and "pass --allow-pickle" in r["error_message"]
    args[2] = tmp_path / "served"
    code, out, err = run_cli(*args, "--allow-pickle")
    assert code == 0, err
    assert json.loads(out)["error_rows"] == 0
    rows = _rows(tmp_path / "served")
    for rid, r in rows.items():
        assert r["completion_token_ids"] == env["expected"][rid.split(":")[1]], r
        assert r["adapter_sha256"] == rows["a1:" + rid.split(":")[1]]["adapter_sha256"] is not None
    code, _, err = run_cli(*args, "--resume")
    assert code == 1 and "E_RESUME_MISMATCH" in err


def test_strict_fails_on_an_unknown_adapter(env, tmp_path, run_cli):
    inp = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"prompt_ids": pa.array([[5, 6]], pa.list_(pa.int64())), "adapter": ["nope"]}), inp)
    code, _, err = run_cli("batch-run", inp, tmp_path / "out", "--base", env["base"], "--adapters", env["adapters"],
                           "--prompt-ids-column", "prompt_ids", "--device", "cpu", "--strict", "--quiet")
    assert code == 1 and "E_ADAPTER_UNKNOWN" in err


def test_cli_json_summary_and_resume_mismatch(env, tmp_path, run_cli):
    args = ["batch-run", env["input"], tmp_path / "out", "--base", env["base"], "--adapters", env["adapters"],
            "--prompt-ids-column", "prompt_ids", "--device", "cpu", "--max-new-tokens", MAX_NEW, "--quiet"]
    code, out, err = run_cli(*args, "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["rows"] == len(ROW_ADAPTERS) and s["error_rows"] == 0
    code, _, err = run_cli(*args)  # exists, no --resume
    assert code == 1 and "E_OUTPUT_EXISTS" in err
    metrics = (tmp_path / "out" / "_metrics.json").read_text()
    code, _, err = run_cli(*args, "--resume")  # a finished job: nothing to do
    assert code == 0, err
    assert (tmp_path / "out" / "_metrics.json").read_text() == metrics
    code, _, err = run_cli(*args, "--resume", "--seed", "9", "--temperature", "0.5")
    assert code == 1 and "E_RESUME_MISMATCH" in err


def kill_after(cmd, envv, out, shards: int) -> subprocess.Popen:
    """Run ``cmd`` and kill -9 it once OUTPUT ``out`` exists and holds ``shards`` committed shards
    (or when it ends first); the finished process."""
    proc = subprocess.Popen(cmd, env=envv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        done = [f for f in os.listdir(out) if f.startswith("part-")] if out.exists() else []
        if len(done) >= shards and (shards or out.exists()):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    return proc


@pytest.mark.parametrize("kill_after_shards", [0, 2])
def test_kill_9_then_resume_equals_an_uninterrupted_run(env, tmp_path, kill_after_shards):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mlora", "batch-run", env["input"], str(out), "--base", env["base"],
           "--adapters", env["adapters"], "--prompt-ids-column", "prompt_ids", "--device", "cpu",
           "--max-new-tokens", str(MAX_NEW), "--shard-rows", "2", "--max-num-seqs", "2", "--quiet"]
    envv = dict(os.environ, PYTHONPATH=REPO)
    kill_after(cmd, envv, out, kill_after_shards)
    r = subprocess.run(cmd + ["--resume"], env=envv, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = _rows(out)
    assert sorted(rows) == sorted(env["expected"])
    for rid, want in env["expected"].items():
        assert rows[rid]["completion_token_ids"] == want


def test_commit_interval_keeps_the_work_of_a_killed_job_and_resume_is_exact(env, tmp_path):
    """28 rows, far below the default --shard-rows: with --commit-interval 0.05 shards are
    committed as rows finish, kill -9 keeps them, and --resume with another interval (not part
    of the fingerprint) writes the uninterrupted output. The ids are int64 over two files with
    one repeated (--allow-duplicate-ids: resume goes by row position)."""
    from mlora.batch.job.output import read_output

    n = 2 * len(ROW_ADAPTERS)
    ids = pa.array([1000 + i for i in range(n - 1)] + [1003], pa.int64())
    inp = _typed_input(env, tmp_path / "in", ids)
    _run(env, tmp_path / "ref", input=inp, max_new_tokens=40, allow_duplicate_ids=True)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mlora", "batch-run", inp, str(out), "--base", env["base"],
           "--adapters", env["adapters"], "--prompt-ids-column", "prompt_ids", "--device", "cpu",
           "--max-new-tokens", "40", "--max-num-seqs", "1", "--keep-columns", "note", "--allow-duplicate-ids",
           "--quiet"]
    envv = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen(cmd + ["--commit-interval", "0.05"], env=envv, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.loads((out / "_manifest.json").read_text())["rows_committed"]:
                proc.send_signal(signal.SIGKILL)
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err
    committed = json.loads((out / "_manifest.json").read_text())["rows_committed"]
    assert 0 < committed < n and not (out / "_SUCCESS").exists()
    r = subprocess.run(cmd + ["--resume", "--commit-interval", "60", "--json"], env=envv, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed_from_row"] == committed
    assert read_output(str(out)).equals(read_output(str(tmp_path / "ref")))


def _demo_job_gives_the_expected_rows(tmp_path, device="cpu", **options):
    """Run the demo workspace's job in float32 and assert every row equals expected.json;
    returns the job summary."""
    from mlora.batch.config import JobConfig
    from mlora.batch.runner import run_job

    with open(os.path.join(DEMO, "expected.json")) as f:
        expected = json.load(f)
    summary = run_job(JobConfig(input=os.path.join(DEMO, "prompts.parquet"), output=str(tmp_path / "out"),
                                 base=os.path.join(DEMO, "base"), adapters_dir=os.path.join(DEMO, "adapters"),
                                 max_new_tokens=expected["max_new_tokens"], device=device, dtype="float32",
                                 **options))
    rows = _rows(tmp_path / "out")
    for i, _ in enumerate(expected["prompts"]):
        for a, outs in expected["outputs"].items():
            assert rows[f"{a}-{i}"]["completion"] == outs[i], (a, i)
    return summary


@pytest.mark.parametrize("lookahead", [False, True])
def test_demo_workspace_outputs(tmp_path, lookahead):
    summary = _demo_job_gives_the_expected_rows(tmp_path, lookahead=lookahead)
    assert summary.engine.get("lookahead_iterations", 0) > 0 if lookahead else "lookahead_iterations" not in summary.engine


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU run of the joint mode needs a CUDA device (runs on the device)"))])
def test_demo_workspace_outputs_with_one_arena_for_kv_and_slots(tmp_path, device):
    """--memory-ledger joint: the KV cache and the adapter slots carved from one arena give the
    expected rows (on a GPU with CUDA graphs: the scratch block is the arena's spare page). On
    the GPU a job returns its device memory to the driver (the arena, held by reference
    cycles, collected; the allocator's cache emptied), and a second job in the same process
    gets the same arena."""
    def cached() -> int:  # device memory the allocator holds but no tensor uses (other tests' graph pools too)
        return torch.cuda.memory_reserved() - torch.cuda.memory_allocated() if device == "cuda" else 0

    if device == "cuda":
        torch.cuda.empty_cache()
    before = cached()
    summary = _demo_job_gives_the_expected_rows(tmp_path, device=device, memory_ledger="joint")
    assert summary.bank["memory_ledger"] == "joint" and summary.engine["kv_blocks"] == summary.bank["arena_pages"]
    if device == "cuda":  # the job left no cached device memory behind it (released to the driver)
        assert cached() <= before + 2**26, (cached(), before)
        again = _demo_job_gives_the_expected_rows(tmp_path / "again", device=device, memory_ledger="joint")
        assert again.bank["arena_pages"] >= 0.95 * summary.bank["arena_pages"], (again.bank, summary.bank)


def test_demo_job_reports_the_collectors_pauses(tmp_path):
    """The summary's engine stats carry the collector's pauses while the job generated
    (gcpauses.py), by generation; a job allocates, so young collections happen."""
    summary = _demo_job_gives_the_expected_rows(tmp_path)
    assert set(summary.engine["gc_collections"]) == set(summary.engine["gc_pause_seconds"]) == {"0", "1", "2"}
    assert sum(summary.engine["gc_collections"].values()) > 0 and summary.engine["gc_pause_max_ms"] > 0


def test_joint_mode_blocking_loads_wait_for_free_slot_pages(tmp_path, monkeypatch):
    """The rare blocking loads of the joint mode (start_load says "sync") in an arena of two
    slots and one longest row for the demo's four adapters: rows wait until a slot's pages
    are free, and every row is the expected one."""
    from mlora.batch.adapters.residency import ResidencyBank

    first = _demo_job_gives_the_expected_rows(tmp_path / "a", memory_ledger="joint")
    pps = first.bank["pages_per_slot"]
    monkeypatch.setattr(ResidencyBank, "start_load", lambda self, adapter_id, pinned: "sync")
    tight = _demo_job_gives_the_expected_rows(tmp_path / "b", memory_ledger="joint",
                                              kv_cache_gb=(8 + 2 * pps) * 32768 / 2**30)
    assert tight.bank["arena_pages"] == 8 + 2 * pps and tight.error_rows == 0


def test_memory_ledger_refusals(tmp_path):
    """An unknown --memory-ledger, and an arena too small for one slot beside one longest row,
    are refused before any row runs (E_MEMORY_LEDGER, exit 2)."""
    from mlora.batch.errors import JobError

    for i, (options, words) in enumerate((
            (dict(memory_ledger="shared"), "must be one of split, joint"),
            (dict(memory_ledger="joint", kv_cache_gb=8 * 32768 / 2**30), "(from --kv-cache-gb 0.000244141) cannot hold"),
            (dict(memory_ledger="joint", prefetch_gpu_adapters=0), "needs --prefetch-adapters and"))):
        with pytest.raises(JobError) as info:
            _demo_job_gives_the_expected_rows(tmp_path / str(i), **options)
        assert info.value.code == "E_MEMORY_LEDGER" and words in str(info.value), str(info.value)
        assert info.value.exit_code == 2
    assert not (tmp_path / "0" / "out").exists()  # a usage error: refused before OUTPUT is opened


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the fused gate/up SiLU product runs on a CUDA GPU (runs on the device)")
def test_demo_workspace_outputs_with_the_gate_up_deltas_fused_everywhere(tmp_path, monkeypatch):
    """The demo job on the GPU in float32 with the gate/up deltas added inside the SiLU product
    in every invocation (``FUSE_SILU_MIN_ROWS`` 1: prefill chunks and the captured decode
    graphs, slot-less rows included) gives the expected rows."""
    from mlora.batch.adapters import slots as slots_mod

    monkeypatch.setattr(slots_mod, "FUSE_SILU_MIN_ROWS", 1)
    _demo_job_gives_the_expected_rows(tmp_path, device="cuda")


def test_adapter_bytes_changed_after_pinning_are_never_served(env, tmp_path, monkeypatch):
    import shutil

    from mlora.batch.adapters import catalog as catalog_mod

    adapters = str(tmp_path / "adapters")
    shutil.copytree(env["adapters"], adapters)
    original = catalog_mod.Catalog.pin

    def pin_then_change(self, *a, **kw):
        pinned = original(self, *a, **kw)
        f = os.path.join(adapters, "a2", "adapter_model.safetensors")
        data = bytearray(open(f, "rb").read())
        data[-3] ^= 0x40  # one bit of one factor value
        open(f, "wb").write(bytes(data))
        return pinned

    monkeypatch.setattr(catalog_mod.Catalog, "pin", pin_then_change)
    _run(env, tmp_path / "out", adapters_dir=adapters)
    rows = _rows(tmp_path / "out")
    for rid, want in env["expected"].items():
        r = rows[rid]
        if r["adapter"] == "a2":
            assert r["error_code"] == "E_ADAPTER_CHANGED" and r["completion_token_ids"] == []
            assert r["adapter_sha256"] is None
        else:
            assert r["completion_token_ids"] == want


def test_empty_input_and_missing_column(env, tmp_path, run_cli):
    empty = str(tmp_path / "empty.parquet")
    pq.write_table(pa.table({"prompt_ids": pa.array([], pa.list_(pa.int64())), "adapter": pa.array([], pa.string())}), empty)
    base_args = ["--base", env["base"], "--adapters", env["adapters"], "--device", "cpu", "--quiet"]
    code, _, err = run_cli("batch-run", empty, tmp_path / "o1", "--prompt-ids-column", "prompt_ids", *base_args)
    assert code == 0, err
    assert os.path.exists(tmp_path / "o1" / "_SUCCESS") and _rows(tmp_path / "o1") == {}
    code, _, err = run_cli("batch-run", env["input"], tmp_path / "o2", "--prompt-column", "text", *base_args)
    assert code == 1 and "E_INPUT_COLUMN_MISSING" in err


def test_sampled_rows_do_not_depend_on_batch_options(env, tmp_path):
    kw = dict(temperature=0.9, top_p=0.9, top_k=20, seed=3)
    _run(env, tmp_path / "a", max_num_seqs=64, max_batch_tokens=2048, lookahead=True, **kw)
    _run(env, tmp_path / "b", max_num_seqs=2, max_batch_tokens=5, **kw)
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert {k: r["completion_token_ids"] for k, r in a.items()} == {k: r["completion_token_ids"] for k, r in b.items()}
    assert any(a[k]["completion_token_ids"] != env["expected"][k] for k in a)  # it really sampled


def test_stop_strings_and_per_row_max_new_tokens(tmp_path):
    from mlora.batch.config import JobConfig
    from mlora.batch.runner import run_job

    inp = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({
        "id": ["base", "upper", "short"],
        "prompt": ["<|bos|>hello world=", "<|bos|>hello world=", "<|bos|>hello world="],
        "adapter": [None, "upper", "reverse"],
        "limit": pa.array([None, None, 3], pa.int64()),
    }), inp)
    run_job(JobConfig(input=inp, output=str(tmp_path / "out"), base=os.path.join(DEMO, "base"),
                       adapters_dir=os.path.join(DEMO, "adapters"), max_new_tokens=40, stop=(" ",),
                       max_new_tokens_column="limit", device="cpu"))
    rows = _rows(tmp_path / "out")
    assert rows["base"]["completion"] == "hello" and rows["base"]["finish_reason"] == "stop"
    assert rows["upper"]["completion"] == "HELLO" and rows["upper"]["finish_reason"] == "stop"
    assert rows["short"]["completion"] == "dlr" and rows["short"]["finish_reason"] == "length"
    assert rows["short"]["num_completion_tokens"] == 3


def test_forty_adapters_through_three_slots_equal_forty_slots(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from mlora.batch.config import JobConfig
    from mlora.batch.job import session as session_mod
    from mlora.batch.runner import run_job

    base = str(tmp_path / "base")
    factory.save_base(factory.tiny_model("llama", seed=0, hidden=16, layers=1), base)
    for k in range(40):
        factory.make_adapter(str(tmp_path / "adapters" / f"ad{k:02d}"), base_model=AutoModelForCausalLM.from_pretrained(base),
                             seed=100 + k, r=2 + k % 3, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])
    g = torch.Generator().manual_seed(9)
    n = 120
    names = [None if i % 7 == 0 else f"ad{int(torch.randint(0, 40, (1,), generator=g)):02d}" for i in range(n)]
    prompts = [torch.randint(3, 64, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    inp = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"prompt_ids": pa.array(prompts, pa.list_(pa.int64())), "adapter": pa.array(names, pa.string())}), inp)

    def run(out, slots, prefetch=4, gpu=4, processes=0, lookahead=False, window=2048, **kw):
        return run_job(JobConfig(input=inp, output=str(tmp_path / out), base=base, adapters_dir=str(tmp_path / "adapters"),
                                  prompt_column=None, prompt_ids_column="prompt_ids", max_new_tokens=4, device="cpu",
                                  max_num_seqs=8, max_gpu_adapters=slots, prefetch_adapters=prefetch,
                                  prefetch_gpu_adapters=gpu, image_build_processes=processes, lookahead=lookahead,
                                  schedule_window=window, **kw))

    # the engine's switch interval beside the prefetch threads is SWITCH_INTERVAL_S while the job
    # runs and is restored when it ends
    switches = []
    monkeypatch.setattr(session_mod.sys, "setswitchinterval", switches.append)
    monkeypatch.setattr(session_mod.sys, "getswitchinterval", lambda: 5e-3)
    few = run("few", 3)
    assert switches == [session_mod.SWITCH_INTERVAL_S, 5e-3]
    monkeypatch.undo()
    many = run("many", None)
    # one arena for KV and slots (--memory-ledger joint): the same tokens
    joint = run("joint", 3, memory_ledger="joint")
    assert {k: r["completion_token_ids"] for k, r in _rows(tmp_path / "joint").items()} == \
        {k: r["completion_token_ids"] for k, r in _rows(tmp_path / "few").items()}
    assert joint.error_rows == 0 and joint.bank["loads_started_ahead"] > 0  # cold loads reserve pages at admission
    assert joint.bank["memory_ledger"] == "joint" and joint.engine["kv_blocks"] == joint.bank["arena_pages"]
    # a tight arena: 18 pages, three slots of 4 and one longest row's 4 beside them; eight running rows
    # need up to 8 KV pages, so KV takes idle adapters' slot pages (and cold adapters wait for pages)
    tight = run("tight", 3, memory_ledger="joint", kv_cache_gb=18 * 1024 / 2**30)
    assert {k: r["completion_token_ids"] for k, r in _rows(tmp_path / "tight").items()} == \
        {k: r["completion_token_ids"] for k, r in _rows(tmp_path / "few").items()}
    pps = tight.bank["pages_per_slot"]
    assert tight.bank["arena_pages"] == 18 and 3 * pps + 4 <= 18
    assert tight.bank["kv_pages_peak"] > 18 - 3 * pps  # KV held pages of a slot: the arena is one budget
    assert tight.bank["kv_pages_peak"] <= 8  # eight rows of one block each at most
    assert tight.error_rows == 0
    run("sync", 3, prefetch=0)
    host_only = run("host-only", 3, gpu=0)
    a, b, c = _rows(tmp_path / "few"), _rows(tmp_path / "many"), _rows(tmp_path / "sync")
    assert {k: r["completion_token_ids"] for k, r in _rows(tmp_path / "host-only").items()} == \
        {k: r["completion_token_ids"] for k, r in a.items()}
    assert host_only.bank["loads_started_ahead"] == 0
    # asynchronous loads (the GPU default; forced here on the CPU): admission starts a cold
    # adapter's load without waiting and runs its rows once it is published: same tokens
    from mlora.batch.engine import engine as engine_mod

    class AsyncEngine(engine_mod.Engine):
        idle_steps = 0

        def __init__(self, *args, **kw):
            super().__init__(*args, **{**kw, "async_loads": True})

        def step(self):  # a step that runs nothing, again and again: a deadlock (fail, do not hang)
            before = self.stats["iterations"]
            out = super().step()
            AsyncEngine.idle_steps = 0 if self.stats["iterations"] > before else AsyncEngine.idle_steps + 1
            assert AsyncEngine.idle_steps < 5000, "the engine stopped making progress"
            return out

    class CheckedEngine(engine_mod.Engine):  # the CPU default: blocking admission loads, GPU-tier prefetch on
        def schedule(self):
            # loads prefetch started are published before admission counts the slots (an
            # uncommitted one held a slot admission did not see: E_ADMISSION_CAPACITY)
            assert not self.bank.loads_in_flight()
            return super().schedule()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("mlora.batch.job.session.Engine", CheckedEngine)
        checked = run("few-checked", 3)
    assert checked.bank["loads_started_ahead"] > 0
    assert {k: r["completion_token_ids"] for k, r in _rows(tmp_path / "few-checked").items()} == \
        {k: r["completion_token_ids"] for k, r in a.items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("mlora.batch.job.session.Engine", AsyncEngine)
        started_ahead = run("async", 3)
        in_workers = run("async-workers", 3, processes=1)  # host images built in a worker process
        run("async-lookahead", 3, lookahead=True)  # and with the next decode step built ahead
        # a window of 4 rows: most rows age, strict order applies while slots hold adapters that
        # only waiting rows name (this deadlocked before: the aged row could not take their slot)
        run("async-aged", 3, window=4)
    assert started_ahead.bank["loads_started_ahead"] > 0
    assert in_workers.bank["images_built_in_workers"] > 0 and in_workers.bank["image_worker_failures"] == 0
    for out in ("async", "async-workers", "async-lookahead", "async-aged"):
        assert {k: r["completion_token_ids"] for k, r in _rows(tmp_path / out).items()} == \
            {k: r["completion_token_ids"] for k, r in a.items()}, out
    m_async = json.loads((tmp_path / "async" / "_metrics.json").read_text())["metrics"]
    assert m_async["load_amplification"] <= 1.1 and m_async["evictions"]["device"] == started_ahead.bank["evictions"]
    assert len(a) == n and all(r["error_code"] is None for r in a.values())
    tokens = {k: r["completion_token_ids"] for k, r in a.items()}
    assert tokens == {k: r["completion_token_ids"] for k, r in b.items()}
    assert tokens == {k: r["completion_token_ids"] for k, r in c.items()}  # prefetch changes timing only
    assert few.bank["evictions"] > 0 and many.bank["evictions"] == 0  # the 3-slot job really swapped adapters
    assert few.bank["load_device_ms_mean"] > 0 and few.bank["load_device_ms_p90"] > 0  # copy time per load
    m_few = json.loads((tmp_path / "few" / "_metrics.json").read_text())["metrics"]
    m_many = json.loads((tmp_path / "many" / "_metrics.json").read_text())["metrics"]
    # the whole input fits the scheduling window: adapter-aware admission loads each adapter once
    assert m_many["load_amplification"] == 1.0 and m_few["load_amplification"] <= 1.1
    assert m_few["evictions"]["device"] == few.bank["evictions"]
    assert m_few["rows_finished"] == n and m_few["rank_padding_ratio"] >= 1.0
    # cold adapters of waiting rows were built ahead in the background, and loads used them
    assert m_few["prefetch_issued"] > 0 and 0 < m_few["prefetch_used"] <= m_few["prefetch_issued"]
    m_sync = json.loads((tmp_path / "sync" / "_metrics.json").read_text())["metrics"]
    assert m_sync["prefetch_issued"] == 0
    from prometheus_client.parser import text_string_to_metric_families

    prom = (tmp_path / "few" / "_metrics.prom").read_text()
    names = {f.name for f in text_string_to_metric_families(prom)}
    assert "mlora_adapter_load_amplification_ratio" in names and "ad07" not in prom  # no adapter ids as labels


def test_preemption_by_recompute_keeps_outputs_exact(env, tmp_path):
    # a KV cache of 5 blocks (16 tokens each) for up to 8 running rows: decode growth must preempt
    from mlora.batch.model.decoder import load_config
    from mlora.batch.model.kvcache import KVCache

    cfg = load_config(env["base"])
    block_bytes = KVCache.block_bytes(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    summary = _run(env, tmp_path / "out", max_num_seqs=8, kv_cache_gb=5 * block_bytes / 2**30, max_new_tokens=12)
    assert summary.engine["preemptions"] > 0
    rows = _rows(tmp_path / "out")
    ref = _run(env, tmp_path / "ref", max_new_tokens=12)
    assert ref.engine["preemptions"] == 0
    want = _rows(tmp_path / "ref")
    assert {k: r["completion_token_ids"] for k, r in rows.items()} == {k: r["completion_token_ids"] for k, r in want.items()}


def test_a_cold_adapter_is_not_starved_by_hot_work(env):
    """The starvation bound (docs/design.md, Schedule window): one slot; a cold-adapter row arrives first, then a stream of rows of the
    resident adapter. Hot rows may overtake it only until max_wait of them were
    admitted after it arrived; then it runs."""
    from mlora.batch.adapters.catalog import load_catalog
    from mlora.batch.adapters.slots import SlotBank
    from mlora.batch.config import EngineConfig
    from mlora.batch.engine.engine import Engine, Request
    from mlora.batch.model.decoder import DecoderModel

    model = DecoderModel.from_pretrained(env["base"], dtype=torch.float32)
    pinned = load_catalog(env["adapters"], None).pin({"a1", "a2"}, env["base"])
    bank = SlotBank(model.config.num_layers, model.group_shapes(), 1, 8, torch.float32, "cpu")
    engine = Engine(model, bank, pinned, EngineConfig(max_num_seqs=2, schedule_window=3, cuda_graphs=False,
                                                      lookahead=False), num_blocks=64)
    engine.add(Request(0, "hot-0", [5, 6], "a1", 2))
    assert engine.step() == [] and bank.resident  # a1 is now resident and running
    engine.add(Request(1, "cold", [5, 6], "a2", 2))
    finished, row = [], 2
    for _ in range(40):
        while engine.num_queued < 3:  # a constant stream of hot work
            engine.add(Request(row, f"hot-{row}", [5, 7], "a1", 2))
            row += 1
        finished += [r.id for r in engine.step()]
        if "cold" in finished:
            break
    assert "cold" in finished, finished
    assert finished.index("cold") > 0  # hot rows did overtake it first


def test_default_adapter_slots_come_from_free_gpu_memory(monkeypatch):
    from mlora.batch.config import JobConfig
    from mlora.batch.job.sizing import num_slots

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert num_slots(JobConfig(input="", output="", base=""), 40, 10, cpu) == 40
    assert num_slots(JobConfig(input="", output="", base="", max_gpu_adapters=3), 40, 10, cuda) == 3
    assert num_slots(JobConfig(input="", output="", base="", max_gpu_adapters=80), 40, 10, cuda) == 40
    GiB = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GiB, 140 * GiB))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    # usable = 100 - 0.1 * 140 = 86 GiB; a quarter is 21.5 GiB: 21 slots of 1 GiB
    assert num_slots(JobConfig(input="", output="", base=""), 1000, GiB, cuda) == 21
    assert num_slots(JobConfig(input="", output="", base=""), 5, GiB, cuda) == 5
    # --kv-cache-gb fixes the KV cache: the adapters have the rest of the usable 86 GiB (56 slots
    # beside 30 GiB, 6 beside 80 GiB: not the quarter, which would not fit), at least one slot
    assert num_slots(JobConfig(input="", output="", base="", kv_cache_gb=30), 1000, GiB, cuda) == 56
    assert num_slots(JobConfig(input="", output="", base="", kv_cache_gb=80), 1000, GiB, cuda) == 6
    assert num_slots(JobConfig(input="", output="", base="", kv_cache_gb=90), 1000, GiB, cuda) == 1
    assert num_slots(JobConfig(input="", output="", base="", kv_cache_gb=30), 40, GiB, cuda) == 40


def test_batch_run_option_defaults_are_the_job_defaults():
    """Every `mlora batch-run` option that is a JobConfig field defaults to JobConfig' own
    default (both are written out: the CLI must not import torch to render --help), so a
    shell script and a Python caller get the same job. The exceptions are deliberate: the
    CLI's None for --prompt-column means "prompt unless --prompt-ids-column is given", and
    repeatable options default to None where JobConfig holds an empty tuple."""
    import dataclasses

    import typer

    from mlora.batch.config import JobConfig
    from mlora.cli.app import app

    command = typer.main.get_command(app).commands["batch-run"]
    fields = {f.name: f for f in dataclasses.fields(JobConfig)}
    compared = 0
    for param in command.params:
        f = fields.get(param.name)
        if f is None or f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            continue  # not a JobConfig field (--adapters, --json, ...) or required (INPUT, OUTPUT, --base)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if param.name == "prompt_column" or (param.default is None and default == ()):
            continue
        assert param.default == default, (param.name, param.default, default)
        compared += 1
    assert compared >= 25
