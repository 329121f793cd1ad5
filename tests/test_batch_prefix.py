"""Prefix sharing and activated LoRA end to end on the CPU, in float32.

The reference for every row is transformers + PEFT run row by row with a plain
greedy loop (a full forward per token, no cache); an aLoRA row's reference
passes PEFT the offset PEFT's own ``calculate_alora_offsets`` derives from the
prompt, as PEFT's ``generate`` does. Rows share long prefixes over two LoRA
adapters, the base and an aLoRA adapter whose invocation is at the end of the
prompt, at its start, twice, or absent; two contexts differ only in the last
token before a block boundary. Then: the cache on and off and under eviction
give the same tokens, a published block is never written, and rows that share a
context compute it once. On a GPU the job runs there (float32, CUDA graphs and
chained decode included).
"""

import os
import random
import signal
import subprocess
import sys

import factory
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO
from test_batch_run import _greedy, kill_after
from test_batch_run import _rows as _out

from mlora.batch.model.kvcache import KVCache
from mlora.batch.model.prefixcache import PrefixCache

MAX_NEW = 6
BLOCK = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # float32 either way
INVOCATION = [5, 6]
ADAPTERS = {
    "a1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=21),
    "a2": dict(r=4, lora_alpha=8, seed=22,
               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "al": dict(r=4, lora_alpha=8, seed=23, alora_invocation_tokens=INVOCATION, task_type="CAUSAL_LM",
               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def _rows():
    """(id, prompt ids, adapter, kind) of the job: shared contexts, unique suffixes."""
    rng = random.Random(3)

    def tokens(n):
        return [rng.randrange(7, 64) for _ in range(n)]  # never the invocation's ids

    c1 = tokens(22)
    c2 = list(c1)
    c2[4 * 5 - 1] = 7 if c1[19] != 7 else 8  # differs only at the last position of block 5
    contexts = [c1, c2, tokens(29)]
    rows = []
    for ci, ctx in enumerate(contexts):
        for adapter in ("a1", "a2", None, "al"):
            for k in range(2):
                suffix = tokens(rng.randint(1, 5))
                prompt = ctx + suffix + (INVOCATION if adapter == "al" else [])
                rows.append((f"c{ci}-{adapter}-{k}", prompt, adapter, "end" if adapter == "al" else "plain"))
        rows.append((f"c{ci}-al-start", INVOCATION + ctx + tokens(2), "al", "start"))
        rows.append((f"c{ci}-al-twice", ctx[:9] + INVOCATION + ctx[9:] + tokens(2) + INVOCATION, "al", "twice"))
        rows.append((f"c{ci}-al-absent", ctx + tokens(3), "al", "absent"))
    rng.shuffle(rows)
    return rows


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from peft.tuners.lora.variants import calculate_alora_offsets
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("prefix")
    base = str(root / "base")
    factory.save_base(factory.tiny_model("llama", seed=0), base)
    refs = factory.make_adapters(str(root / "adapters"), base, ADAPTERS)
    base_model = AutoModelForCausalLM.from_pretrained(base).eval()
    eos = {int(base_model.generation_config.eos_token_id)}
    rows = _rows()
    inp = str(root / "in.parquet")
    pq.write_table(pa.table({
        "id": [r[0] for r in rows],
        "prompt_ids": pa.array([r[1] for r in rows], pa.list_(pa.int64())),
        "adapter": pa.array([r[2] for r in rows], pa.string()),
    }), inp)
    expected, on_base = {}, {}
    al = refs["al"]
    for rid, prompt, adapter, kind in rows:
        if adapter == "al":
            (offset,) = calculate_alora_offsets(al.peft_config, al.active_adapter, torch.tensor([prompt]))
            if offset is None:
                assert kind == "absent"
                expected[rid] = None  # an error row by default
                on_base[rid] = _greedy(base_model, prompt, eos, MAX_NEW)
                continue
            start = len(prompt) - offset
            assert start == {"end": len(prompt) - 2, "start": 0, "twice": len(prompt) - 2}[kind]
            expected[rid] = _greedy(al, prompt, eos, MAX_NEW, start)
        else:
            expected[rid] = _greedy(refs[adapter] if adapter else base_model, prompt, eos, MAX_NEW)
    return dict(base=base, adapters=str(root / "adapters"), input=inp, rows=rows, expected=expected,
                on_base=on_base, prompt_tokens=sum(len(r[1]) for r in rows))


def _run(env, out, **kw):
    from mlora.batch.config import JobConfig
    from mlora.batch.runner import run_job

    opts = dict(input=env["input"], output=str(out), base=env["base"], adapters_dir=env["adapters"],
                prompt_column=None, prompt_ids_column="prompt_ids", max_new_tokens=MAX_NEW, device=DEVICE,
                dtype="float32", block_size=BLOCK)
    opts.update(kw)
    return run_job(JobConfig(**opts))


def _caches(monkeypatch) -> list[PrefixCache]:
    """Every PrefixCache the job makes, recorded."""
    made = []
    init = PrefixCache.__init__

    def record(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(PrefixCache, "__init__", record)
    return made


@pytest.mark.parametrize("seqs, budget", [(64, 2048), (3, 9)])
def test_shared_prefixes_over_lora_base_and_alora_equal_peft(env, tmp_path, monkeypatch, seqs, budget):
    caches = _caches(monkeypatch)
    summary = _run(env, tmp_path / "out", max_num_seqs=seqs, max_batch_tokens=budget)
    got = _out(tmp_path / "out")
    for rid, want in env["expected"].items():
        row = got[rid]
        if want is None:
            assert row["finish_reason"] == "error" and row["error_code"] == "E_ALORA_NO_INVOCATION", rid
            assert "--alora-without-invocation base" in row["error_message"]
        else:
            assert row["error_code"] is None and row["completion_token_ids"] == want, rid
    engine = summary.engine
    admitted = sum(len(p) for rid, p, _, _ in env["rows"] if env["expected"][rid] is not None)
    assert engine["prefill_tokens_computed"] + engine["prefill_tokens_reused"] == admitted
    assert engine["prefill_tokens_reused"] > admitted // 3  # the contexts are most of every prompt
    (cache,) = caches
    assert cache.stats.hit_blocks > 0 and cache.stats.published > 0


def test_alora_rows_without_their_invocation_run_on_the_base_with_the_flag(env, tmp_path):
    _run(env, tmp_path / "out", alora_without_invocation="base")
    got = _out(tmp_path / "out")
    assert env["on_base"]
    for rid, want in env["on_base"].items():
        assert got[rid]["error_code"] is None and got[rid]["completion_token_ids"] == want, rid
        assert got[rid]["adapter"] == "al"
    for rid, want in env["expected"].items():
        if want is not None:
            assert got[rid]["completion_token_ids"] == want, rid


def test_cache_on_off_and_under_eviction_give_the_same_tokens(env, tmp_path, monkeypatch):
    _run(env, tmp_path / "off", prefix_cache=False)
    off = _out(tmp_path / "off")
    caches = _caches(monkeypatch)
    # 24 blocks of 4 tokens: fewer than the contexts' blocks over every execution: eviction and preemption
    block_bytes = KVCache.block_bytes(2, BLOCK, 2, 8, torch.float32)
    summary = _run(env, tmp_path / "small", kv_cache_gb=24 * block_bytes / 2**30, max_num_seqs=8)
    small = _out(tmp_path / "small")
    assert {r: off[r]["completion_token_ids"] for r in off} == {r: small[r]["completion_token_ids"] for r in small}
    assert {r: off[r]["error_code"] for r in off} == {r: small[r]["error_code"] for r in small}
    (cache,) = caches
    assert cache.stats.evictions > 0 and summary.engine["prefill_tokens_reused"] > 0
    assert summary.engine["preemptions"] > 0
    assert summary.engine["kv_blocks"] == 24


def test_a_published_block_is_never_written(env, tmp_path, monkeypatch):
    """Every slot an iteration writes (its inputs, and those built ahead for the next decode
    iteration) lies in a block that is not published, whatever path then writes it."""
    from mlora.batch.engine.executor import Executor

    caches = _caches(monkeypatch)
    written = []

    def check(slots):
        cache = caches[0]
        blocks = {s // BLOCK for s in slots if s // BLOCK < cache.allocator.num_blocks}  # not the graphs' scratch
        assert not [b for b in blocks if cache.is_published(b)]
        written.append(len(blocks))

    launch, ahead = Executor._launch, Executor.build_ahead

    def checked_launch(self, plan, x, staged=False):
        check(x.slots)
        return launch(self, plan, x, staged)

    def checked_ahead(self, plan, p0):
        ahead(self, plan, p0)
        check(self.ahead.slots_map)

    monkeypatch.setattr(Executor, "_launch", checked_launch)
    monkeypatch.setattr(Executor, "build_ahead", checked_ahead)
    _run(env, tmp_path / "out", max_num_seqs=4, max_batch_tokens=11)
    assert written and caches[0].stats.hit_blocks > 0


def test_rows_that_share_a_context_compute_it_once(env, tmp_path):
    """Eight base rows: a 32-token context (eight full blocks) and a 3-token question each,
    admitted together: one row computes the context, the others wait for it and share it."""
    rng = random.Random(9)
    ctx = [rng.randrange(7, 64) for _ in range(32)]
    prompts = [ctx + [rng.randrange(7, 64) for _ in range(3)] for _ in range(8)]
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"q{i}" for i in range(8)],
                             "prompt_ids": pa.array(prompts, pa.list_(pa.int64())),
                             "adapter": pa.array([None] * 8, pa.string())}), str(inp))
    summary = _run(dict(env, input=str(inp)), tmp_path / "out")
    assert summary.engine["prefill_tokens_computed"] == 32 + 8 * 3
    assert summary.engine["prefill_tokens_reused"] == 7 * 32
    _run(dict(env, input=str(inp)), tmp_path / "off", prefix_cache=False)
    got, off = _out(tmp_path / "out"), _out(tmp_path / "off")
    assert {r: got[r]["completion_token_ids"] for r in got} == {r: off[r]["completion_token_ids"] for r in off}


def test_kill_9_then_resume_with_the_cache_equals_peft(env, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mlora", "batch-run", env["input"], str(out), "--base", env["base"],
           "--adapters", env["adapters"], "--prompt-ids-column", "prompt_ids", "--device", "cpu",
           "--max-new-tokens", str(MAX_NEW), "--shard-rows", "3", "--max-num-seqs", "3", "--quiet"]
    envv = dict(os.environ, PYTHONPATH=REPO)
    proc = kill_after(cmd, envv, out, 2)
    assert proc.returncode == -signal.SIGKILL  # killed mid-job, not finished
    r = subprocess.run(cmd + ["--resume"], env=envv, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = _out(out)
    assert sorted(got) == sorted(env["expected"])
    for rid, want in env["expected"].items():
        assert got[rid]["completion_token_ids"] == (want or []), rid
