"""`mlora bench prefix` on the CPU with the tiny preset: every job runs with the prefix cache on
and off through the real engine, and the report's arithmetic holds against the rows the bench
generated (no timings are asserted)."""

import json

import pytest
import torch

from mlora.batch.model.prefix import alora_activation_start
from mlora.bench.batch import as_alora, preset_config, random_bank, random_model
from mlora.bench.prefix import (
    PrefixBenchOptions,
    invocation_tokens,
    job_requests,
    run_prefix_bench,
)

# 2 contexts of 3 blocks, 3 adapters + the base: 8 (context, identity) pairs over 24 rows
OPTS = dict(preset="tiny", rows=24, contexts=2, context_tokens=48, question_tokens=8, max_new_tokens=3, adapters=3,
            rank=4, max_num_seqs=4, max_batch_tokens=64, device="cpu", dtype="float32")


def _rows(o, job):
    return job_requests(o, job, preset_config(o.preset, o.dtype).vocab_size, seed=o.seed, rows=o.rows,
                        max_new_tokens=o.max_new_tokens)


def test_rows_share_contexts_and_alora_rows_invoke_after_them():
    """lora: every (context, identity) pair used, rows shuffled; alora: the same prompts with the
    invocation opening the question (PEFT's activation start = the context's length);
    unshared: no two prompts share their first block."""
    o = PrefixBenchOptions(**OPTS)
    C = o.context_tokens
    lora, alora, unshared = (_rows(o, job) for job in ("lora", "alora", "unshared"))
    assert {(tuple(r.prompt_ids[:C]), r.adapter) for r in lora} == {
        (c, a) for c in {tuple(r.prompt_ids[:C]) for r in lora} for a in ("bench-0", "bench-1", "bench-2", None)}
    assert len({tuple(r.prompt_ids[:C]) for r in lora}) == o.contexts
    assert [r.adapter for r in lora] != [r.adapter for r in sorted(lora, key=lambda r: (r.adapter or "~"))]
    inv = list(invocation_tokens(preset_config("tiny", "float32").vocab_size, o.seed))
    for a, b in zip(lora, alora):
        assert len(a.prompt_ids) == len(b.prompt_ids) == C + o.question_tokens and a.adapter == b.adapter
        assert b.prompt_ids[:C] == a.prompt_ids[:C] and b.prompt_ids[C + 2:] == a.prompt_ids[C + 2:]
        assert b.prompt_ids[C:C + 2] == inv and alora_activation_start(b.prompt_ids, inv) == C
    assert len({tuple(r.prompt_ids[:16]) for r in unshared}) == o.rows
    assert all(len(r.prompt_ids) == C + o.question_tokens for r in unshared)


def test_alora_records_carry_their_invocation():
    model = random_model(preset_config("tiny", "float32"), "cpu", torch.float32, seed=0)
    _, pinned = random_bank(model, 2, 4, seed=0)
    got = as_alora(pinned, [7, 9])
    assert [p.invocation_tokens for p in got.values()] == [(7, 9), (7, 9)]
    assert all(p.invocation_tokens is None for p in pinned.values())  # the records given are left alone
    assert {p.semantic_sha256 for p in got.values()}.isdisjoint(p.semantic_sha256 for p in pinned.values())
    with pytest.raises(ValueError):
        as_alora(pinned, [])


def test_every_job_on_and_off_with_its_arithmetic():
    o = PrefixBenchOptions(**OPTS)
    r = run_prefix_bench(o)
    json.dumps(r)  # the --json / --out payload serialises
    C, Q, bs = o.context_tokens, o.question_tokens, o.block_size
    kv = r["kv_cache"]
    assert kv["num_blocks"] == o.contexts * (o.adapters + 1) * (C // bs) + o.max_num_seqs * -(-(C + Q + 3) // bs)
    assert [j["job"] for j in r["jobs"]] == ["lora", "alora", "unshared"]
    for job in r["jobs"]:
        rows = _rows(o, job["job"])
        prompt = sum(len(x.prompt_ids) for x in rows)
        # the ideal from the rows: each context once per identity computing its KV (alora: the
        # base's for every row), each row's question once; unshared: everything
        if job["job"] == "lora":
            ideal = len({(tuple(x.prompt_ids[:C]), x.adapter) for x in rows}) * C + len(rows) * Q
        elif job["job"] == "alora":
            ideal = len({tuple(x.prompt_ids[:C]) for x in rows}) * C + len(rows) * Q
        else:
            ideal = prompt
        assert job["ideal_computed"] == ideal and job["prompt_tokens"] == prompt
        on, off = job["runs"]
        assert (on["prefix_cache"], off["prefix_cache"]) == (True, False)
        for s in (on, off):
            assert s["ideal_computed"] == ideal and s["prompt_tokens"] == prompt
            assert s["generated_tokens"] == o.rows * o.max_new_tokens  # EOS removed: every row to max_new_tokens
            assert s["prefill_tokens_computed"] + s["prefill_tokens_reused"] == prompt
            assert s["computed_vs_ideal"] == s["prefill_tokens_computed"] / ideal
            p = s["prefix"]
            assert 0 <= p["hit_blocks"] <= p["looked_up_blocks"]
            assert p["hit_rate"] == (p["hit_blocks"] / p["looked_up_blocks"] if p["looked_up_blocks"] else None)
        # off: nothing reused, nothing cached
        assert off["prefill_tokens_computed"] == prompt and off["prefill_tokens_reused"] == 0
        assert all(off["prefix"][k] == 0 for k in ("hit_blocks", "looked_up_blocks", "published", "shared_blocks_peak"))
        # on: never below the ideal (a context's KV is computed at least once per identity)
        assert ideal <= on["prefill_tokens_computed"]
        if job["job"] == "unshared":
            assert on["prefill_tokens_reused"] == 0
        else:
            assert on["prefill_tokens_reused"] > 0 and on["prefix"]["hit_blocks"] > 0
            assert on["prefix"]["published"] > 0
        # float32: the cache changes which rows compute a block, never the tokens
        assert on["tokens_sha256"] == off["tokens_sha256"] and job["rows_with_other_tokens"] == 0
        assert job["tokens_per_s_ratio"] == on["tokens_per_s"] / off["tokens_per_s"]
        names = [t["name"] for t in job["targets"]]
        assert names == {"lora": ["prompt tokens computed / ideal (cache on)", "tokens/s on / off"],
                         "alora": ["prompt tokens computed / ideal (cache on)"],
                         "unshared": ["tokens/s on / off"]}[job["job"]]
        for t in job["targets"]:
            assert t["met"] == (t["value"] <= t["limit"] if t["at_most"] else t["value"] >= t["limit"])


def test_bench_prefix_on_the_command_line(run_cli, tmp_path):
    args = ("bench", "prefix", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--rows", 6,
            "--contexts", 1, "--context-tokens", 32, "--question-tokens", 4, "--max-new-tokens", 2, "--adapters", 2,
            "--rank", 4, "--max-num-seqs", 4, "--max-batch-tokens", 32)
    code, stdout, stderr = run_cli(*args, "--jobs", "lora", "--out", tmp_path / "r.json")
    assert code == 0, stderr
    assert "tiny float32, 6 rows" in stdout and "lora: ideal " in stdout and "tokens/s on / off" in stdout
    r = json.loads((tmp_path / "r.json").read_text())
    assert [j["job"] for j in r["jobs"]] == ["lora"] and r["options"]["jobs"] == ["lora"]
    # usage errors: exit 2, nothing measured
    for bad, word in ((("--jobs", "lora,lorra"), "lorra"), (("--jobs", "alora", "--question-tokens", 2), "--question-tokens must be >= 3"),
                      (("--context-tokens", 600), "512")):
        code, stdout, stderr = run_cli(*args, *bad)
        assert code == 2 and "E_USAGE" in stderr and word in stderr, (bad, stderr)
