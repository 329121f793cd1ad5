"""`mlora bench batch` on the CPU with the tiny preset: the job runs through the
real engine, every row generates its tokens, and the floor accounting is
consistent with the bank it measures (no timings are asserted)."""

import json
import socket

import pytest
import torch

from mlora.bench.batch import (
    BatchBenchOptions,
    Ceilings,
    adapter_bytes,
    decode_floor,
    preset_config,
    random_bank,
    random_model,
    run_batch_bench,
)

OPTS = dict(preset="tiny", rows=10, adapters=(0, 3), rank=4, prompt_min=3, prompt_max=17, max_new_tokens=6,
            max_num_seqs=4, max_batch_tokens=32, device="cpu", dtype="float32")


def test_bench_runs_every_row_to_max_new_tokens():
    r = run_batch_bench(BatchBenchOptions(**OPTS))
    # base first among several counts: run again last, ratios against the faster base run
    assert [(s["adapters"], s.get("repeat", False)) for s in r["scenarios"]] == [(0, False), (3, False), (0, True)]
    for s in r["scenarios"]:
        assert s["generated_tokens"] == 10 * 6  # EOS removed: every row runs to max_new_tokens
        d = s["decode"]
        assert d["iterations"] > 0 and d["median_floor_s"] > 0 and d["median_s"] > 0
        # no decode graphs on the CPU: looked-ahead iterations, none chained
        assert s["lookahead_iterations"] > 0 and s["chained_iterations"] == 0
    first, again = r["scenarios"][0], r["scenarios"][2]
    fastest = max(first["tokens_per_s"], again["tokens_per_s"])
    assert max(first["tokens_per_s_vs_base"], again["tokens_per_s_vs_base"]) == 1.0
    assert r["scenarios"][1]["tokens_per_s_vs_base"] == r["scenarios"][1]["tokens_per_s"] / fastest
    once = run_batch_bench(BatchBenchOptions(**OPTS, repeat_base=False))
    assert [s["adapters"] for s in once["scenarios"]] == [0, 3]
    json.dumps(r)  # the --json / --out payload serialises
    assert r["machine"]["host"] and "gpu_uuid" not in r["machine"]  # which machine measured (no GPU here)
    assert r["machine"]["clocks_before"] is None and r["machine"]["clocks_after"] is None  # no NVML on the CPU
    assert all(s["clocks_full_batch"] is None for s in r["scenarios"])  # no samples off CUDA
    for s in r["scenarios"]:  # the collector's pauses over each timed job
        assert set(s["gc"]["gc_collections"]) == set(s["gc"]["gc_pause_seconds"]) == {"0", "1", "2"}


def test_bench_batch_on_the_command_line(run_cli):
    """The table (with the machine that measured) on stdout, or the results as JSON."""
    args = ("bench", "batch", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--rows", 6,
            "--adapters", 2, "--prompt-min", 3, "--prompt-max", 9, "--max-new-tokens", 3, "--max-num-seqs", 4,
            "--max-batch-tokens", 32)
    code, stdout, stderr = run_cli(*args)
    assert code == 0, stderr
    assert "tiny float32, 6 rows" in stdout and f"on {socket.gethostname()}" in stdout
    code, stdout, stderr = run_cli(*args, "--json")
    assert code == 0, stderr
    r = json.loads(stdout)
    assert [s["adapters"] for s in r["scenarios"]] == [2] and r["scenarios"][0]["generated_tokens"] == 6 * 3


def test_adapter_bytes_equal_the_true_rank_bytes_in_the_bank():
    config = preset_config("tiny", "float32")
    model = random_model(config, torch.device("cpu"), torch.float32, seed=0)
    bank, pinned = random_bank(model, 2, 4, seed=0)
    assert sorted(pinned) == ["bench-0", "bench-1"]
    per_slot = sum(bank.A[g][0].numel() + bank.B[g][0].numel() for g in bank.A) * 4  # R = true rank here
    assert adapter_bytes(config, 4, 4) == per_slot
    assert all(torch.isfinite(bank.A[g]).all() and bank.A[g].abs().sum() > 0 for g in bank.A)


def test_decode_floor_counts_each_term_once():
    c = preset_config("tiny", "float32")
    ceil = Ceilings(copy_bytes_per_s=1e12, matmul_flops_per_s=1e18)  # memory-bound
    base = decode_floor(c, torch.float32, rows=4, context_tokens=100, distinct=0, rank=4, ceil=ceil)
    two = decode_floor(c, torch.float32, rows=4, context_tokens=100, distinct=2, rank=4, ceil=ceil)
    more_ctx = decode_floor(c, torch.float32, rows=4, context_tokens=150, distinct=0, rank=4, ceil=ceil)
    assert two["bytes"] - base["bytes"] == 2 * adapter_bytes(c, 4, 4)
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    assert more_ctx["bytes"] - base["bytes"] == 50 * kv_per_token
    assert base["bound"] == "memory" and base["floor_s"] == base["bytes"] / 1e12
    # all stages bandwidth-bound here: the staged floor is the same bytes, counted once each
    assert two["staged_floor_s"] == pytest.approx(two["bytes"] / 1e12, rel=1e-12)


def test_staged_floor_sums_a_compute_bound_gemm_and_a_bandwidth_bound_attention():
    """A GEMM stage bound by flops and an attention stage bound by bytes: the floor is the
    larger whole-iteration term, the staged floor the sum of the two stages' own limits."""
    from mlora.bench.batch import layer_params

    c = preset_config("tiny", "float32")
    rows, ctx = 64, 5000
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * ctx
    gemm_flops = 2 * rows * c.num_layers * layer_params(c) + 2 * rows * c.vocab_size * c.hidden_size
    attn_flops = 4 * ctx * c.num_heads * c.head_dim * c.num_layers
    bw = 1e12
    rate = gemm_flops / (kv / bw)  # the GEMMs' flops take exactly as long as reading the K/V
    f = decode_floor(c, torch.float32, rows=rows, context_tokens=ctx, distinct=0, rank=4,
                     ceil=Ceilings(copy_bytes_per_s=bw, matmul_flops_per_s=rate))
    gemm_bytes = f["bytes"] - kv
    want = max(gemm_bytes / bw, gemm_flops / rate) + max(kv / bw, attn_flops / rate)
    assert f["staged_floor_s"] == pytest.approx(want, rel=1e-12)
    assert f["floor_s"] == pytest.approx(f["bytes"] / bw, rel=1e-12)  # overlapped: bytes and flops tie
    assert f["staged_floor_s"] > 1.4 * f["floor_s"]  # in sequence: the K/V time counted twice, nearly


def test_residency_bench_runs_the_real_job_twice_with_the_same_outputs(tmp_path):
    import pyarrow.parquet as pq

    from mlora.bench.residency import ResidencyBenchOptions, run_residency_bench

    o = ResidencyBenchOptions(preset="tiny", adapters=6, rows=24, prompt_min=3, prompt_max=9, max_new_tokens=3, slots=2,
                              max_num_seqs=6, max_batch_tokens=48, device="cpu", dtype="float32", warmup_rows=5,
                              warmup_new_tokens=2)
    said = []
    r = run_residency_bench(str(tmp_path), o, progress=said.append)
    limited, full = r["runs"]
    # each run's line; the all-resident run loads nothing in the job: its load figures are the preload's
    lines = [m for m in said if m.startswith(("limited:", "all-resident:"))]
    assert len(lines) == 2 and "(copy stream" in lines[0] and "(preload: copy stream" in lines[1], lines
    assert (limited["slots"], full["slots"]) == (2, 6)
    assert limited["error_rows"] == full["error_rows"] == 0
    assert sum(limited["metrics"]["evictions"].values()) > 0  # 6 adapters really went through 2 slots
    assert full["loads"] == 0  # preloaded before the metrics clock
    # per load: the copies alone are part of the copies + validation (CPU: synchronous wall time)
    assert 0 < limited["load_copy_ms_mean"] <= limited["load_device_ms_mean"]
    assert limited["load_device_ms_p50"] <= limited["load_device_ms_p90"]
    assert 0 < limited["load_issue_ms_p50"] <= limited["load_issue_ms_p90"]  # the host's time to issue a load
    assert 0 <= limited["load_issue_cpu_ms_p50"] <= limited["load_issue_cpu_ms_p90"]  # its CPU time
    # the collector's pauses: inside load issues (in at most every load) and over the whole run
    assert 0 <= limited["load_issues_with_gc"] <= limited["loads"] and limited["load_issue_gc_ms_mean"] >= 0
    assert set(limited["gc"]["gc_collections"]) == {"0", "1", "2"}
    assert full["metrics"]["prefetch_issued"] == 0  # the preload's background builds are not the job's prefetches
    # q/v adapters in slots of q and v only: a load copies the factors and the rank/scale tables (28,704
    # bytes here), about the adapter file's size (factors plus a header); k's zeros would make it 1.38x
    assert 0.9 <= limited["copied_bytes_per_load"] / r["adapter_bytes"] <= 1.05, (
        limited["copied_bytes_per_load"], r["adapter_bytes"])
    assert r["workspace"]["distinct_adapters_used"] >= 3

    def tokens(name):
        t = pq.read_table(str(tmp_path / f"out-{name}")).to_pydict()
        return dict(zip(t["id"], t["completion_token_ids"]))

    got = tokens("limited")
    assert len(got) == 24 and all(len(v) == 3 for v in got.values())  # no EOS: every row to max_new_tokens
    assert got == tokens("all-resident")
    for run in ("limited", "all-resident"):  # each run was preceded by its untimed warm-up job: the first 5 rows
        warm = tokens(f"warmup-{run}")
        assert sorted(warm, key=int) == [str(i) for i in range(5)]  # the input's first rows
        assert all(v == got[k][:2] for k, v in warm.items())  # greedy: the same first two tokens
    again = run_residency_bench(str(tmp_path), o)  # the workspace is reused, outputs replaced
    assert again["runs"][0]["error_rows"] == 0
    # the limited run with KV and slots in one arena (--memory-ledger joint): the same tokens
    import dataclasses

    joint = run_residency_bench(str(tmp_path), dataclasses.replace(o, memory_ledger="joint", runs=("limited",)))
    assert joint["runs"][0]["error_rows"] == 0 and tokens("limited") == got
    ledger = joint["runs"][0]["ledger"]
    assert ledger["memory_ledger"] == "joint" and ledger["arena_pages"] == joint["runs"][0]["kv_blocks"]
    assert 0 < ledger["kv_pages_peak"] <= ledger["arena_pages"] and ledger["pages_per_slot"] >= 1
    assert limited["ledger"] == {}  # the split ledger: no arena


def test_cold_load_against_its_floor():
    """The copy stream's time per job load over the cold-load floor; nothing for a run with no
    job load (its figures are a preload's) or without a floor (no CUDA)."""
    from mlora.bench.residency import cold_load_vs_floor

    run = dict(loads=859, load_device_ms_mean=0.88, load_device_ms_p50=0.42, load_device_ms_p90=2.2)
    got = cold_load_vs_floor(run, 0.28e-3)
    assert got == pytest.approx(dict(mean=0.88 / 0.28, p50=1.5, p90=2.2 / 0.28))
    assert cold_load_vs_floor(dict(run, loads=0), 0.28e-3) is None
    assert cold_load_vs_floor(run, None) is None


def test_residency_runs_of_two_calls_combine_into_one_ratio(tmp_path, run_cli):
    """--compare: the all-resident run of one call and the limited run of an earlier call of
    the same job give the ratio; a different job is refused before running (exit 2)."""
    common = ("--preset", "tiny", "--adapters", 4, "--rows", 10, "--prompt-min", 3, "--prompt-max", 6,
              "--max-new-tokens", 2, "--slots", 2, "--max-num-seqs", 4, "--max-batch-tokens", 32, "--device", "cpu",
              "--dtype", "float32", "--warmup-rows", 0, "--json")
    code, _, err = run_cli("bench", "residency", tmp_path / "w", *common, "--runs", "limited", "--out", tmp_path / "a.json")
    assert code == 0, err
    code, out, err = run_cli("bench", "residency", tmp_path / "w", *common, "--runs", "all-resident",
                             "--compare", tmp_path / "a.json")
    assert code == 0, err
    r = json.loads(out)
    runs = {x["name"]: x for x in r["runs"]}
    assert set(runs) == {"limited", "all-resident"} and runs["limited"]["from_earlier_call"]
    assert r["throughput_ratio"] == runs["limited"]["tokens_per_s"] / runs["all-resident"]["tokens_per_s"]
    code, _, err = run_cli("bench", "residency", tmp_path / "w", *common[:-1], "--rows", 11, "--json",
                           "--runs", "all-resident", "--compare", tmp_path / "a.json")
    assert code == 2 and "E_BENCH_COMPARE" in err and "rows 10" in err


def test_mixed_floor_counts_causal_pairs_and_the_sampled_head():
    from mlora.bench.batch import layer_params, mixed_floor

    c = preset_config("tiny", "float32")
    ceil = Ceilings(copy_bytes_per_s=1e30, matmul_flops_per_s=1.0)  # compute-bound: floor_s = flops
    one = mixed_floor(c, torch.float32, [(4, 4)], sampled=1, lora_rows=0, distinct=0, rank=4, ceil=ceil)
    # a 4-token prompt: 4 * 5 / 2 = 10 query-key pairs
    want = 2 * 4 * c.num_layers * layer_params(c) + 4 * 10 * c.num_heads * c.head_dim * c.num_layers \
        + 2 * c.vocab_size * c.hidden_size
    assert one["flops"] == want and one["bound"] == "compute" and one["rows"] == 4
    chunk = mixed_floor(c, torch.float32, [(2, 6)], sampled=0, lora_rows=2, distinct=1, rank=4, ceil=ceil)
    # the second chunk of a 6-token prompt: rows at positions 4 and 5 see 5 + 6 keys
    want = 2 * 2 * c.num_layers * layer_params(c) + 4 * 11 * c.num_heads * c.head_dim * c.num_layers \
        + 2 * 2 * adapter_bytes(c, 4, 1)
    assert chunk["flops"] == want


def test_peft_baseline_runs_the_same_job(run_cli):
    code, stdout, stderr = run_cli("bench", "peft", "--preset", "tiny", "--device", "cpu", "--dtype", "float32",
                                   "--rows", 5, "--adapters", 2, "--batch-size", 2, "--prompt-min", 3, "--prompt-max", 9,
                                   "--max-new-tokens", 4, "--json")
    assert code == 0, stderr
    r = json.loads(stdout.strip().splitlines()[-1])
    assert r["rows"] == 5 and r["generated_tokens"] == 5 * 4 and r["tokens_per_s"] > 0


def test_peft_baseline_finds_the_largest_batch_that_fits(monkeypatch):
    """--batch-size 0: batches that run out of memory are retried at half the size, the size
    that worked is kept, every row is generated once, and the failed attempts' time is
    reported apart from the baseline's."""
    from mlora.bench import peft as bench_peft
    from mlora.bench.batch import BatchBenchOptions

    real, sizes = bench_peft.add_adapters, []

    def limited(model, n, rank, seed=0):
        peft = real(model, n, rank, seed)
        generate = peft.generate

        def capped(**kw):
            sizes.append(len(kw["input_ids"]))
            if len(kw["input_ids"]) > 3:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return generate(**kw)

        peft.generate = capped
        return peft

    monkeypatch.setattr(bench_peft, "add_adapters", limited)
    o = BatchBenchOptions(preset="tiny", rows=7, rank=4, prompt_min=3, prompt_max=9, max_new_tokens=2, device="cpu",
                          dtype="float32")
    r = bench_peft.run_peft_baseline(o, 2, 0)
    assert sizes == [7, 3, 3, 1] and r["batch_size"] == 3 and r["generated_tokens"] == 7 * 2
    assert r["out_of_memory_s"] >= 0 and r["tokens_per_s"] > 0
    sizes.clear()
    import pytest

    with pytest.raises(torch.OutOfMemoryError):  # a fixed batch size that does not fit raises
        bench_peft.run_peft_baseline(o, 2, 5)


def test_peft_baseline_reports_progress_inside_a_generate_call():
    """Progress inside a batch (a 64-adapter batch on the 8B shape outlasts a device call):
    tokens so far = finished batches + steps x running rows, rising, the last report after
    the last batch with the job's total and nothing running."""
    from mlora.bench import peft as bench_peft
    from mlora.bench.batch import BatchBenchOptions

    o = BatchBenchOptions(preset="tiny", rows=5, rank=4, prompt_min=3, prompt_max=9, max_new_tokens=4, device="cpu",
                          dtype="float32")
    calls = []
    r = bench_peft.run_peft_baseline(o, 2, 3, progress=lambda *a: calls.append(a), progress_every=0.0)
    assert calls[0][:3] == (0, 5, 0)  # set-up done, nothing generated yet
    inside = [c for c in calls if c[5]]
    assert inside and {c[5] for c in inside} == {3, 2}  # both batches reported while generating
    assert all(c[2] % c[5] == 0 or c[0] for c in inside)
    tokens = [c[2] for c in calls]
    assert tokens == sorted(tokens) and tokens[-1] == r["generated_tokens"] == 5 * 4
    assert calls[-1][0] == 5 and calls[-1][5] == 0


def test_peft_baseline_adapters_change_the_output():
    from mlora.bench.peft import add_adapters, hf_model

    model = add_adapters(hf_model("tiny", torch.float32, "cpu"), 2, 4)
    ids = torch.tensor([[5, 6, 7, 8]])
    outs = {}
    for name in ("__base__", "bench-0", "bench-1"):
        with torch.no_grad():
            outs[name] = model(input_ids=ids, adapter_names=[name]).logits
    assert not torch.allclose(outs["__base__"], outs["bench-0"]) and not torch.allclose(outs["bench-0"], outs["bench-1"])


def test_few_slots_keep_the_batch_as_full_as_all_resident(tmp_path):
    """Adapter-aware admission (0x09): under Zipf popularity with far fewer slots than
    adapters, the limited run needs about as many iterations as the all-resident one
    (rare adapters run beside the popular ones, not in a low-occupancy tail), and every
    adapter is loaded about once."""
    from mlora.bench.residency import ResidencyBenchOptions, run_residency_bench

    o = ResidencyBenchOptions(preset="tiny", adapters=60, rows=240, prompt_min=3, prompt_max=9, max_new_tokens=8,
                              slots=8, max_num_seqs=32, max_batch_tokens=256, device="cpu", dtype="float32",
                              warmup_rows=0)
    limited, full = run_residency_bench(str(tmp_path), o)["runs"]
    assert limited["error_rows"] == full["error_rows"] == 0
    assert sum(limited["metrics"]["evictions"].values()) > 0
    it_limited, it_full = limited["metrics"]["iterations"], full["metrics"]["iterations"]
    assert it_limited <= 1.1 * it_full, (it_limited, it_full)
    assert limited["metrics"]["load_amplification"] <= 1.1


def test_bench_startup_on_a_tiny_checkpoint(tmp_path):
    """`mlora bench startup`: writes a random checkpoint, measures a cold read and a load to the
    device plus one first token; the figures are consistent with each other."""
    from typer.testing import CliRunner

    from mlora.cli.app import app

    res = CliRunner().invoke(app, ["bench", "startup", str(tmp_path), "--preset", "tiny", "--device", "cpu",
                                   "--dtype", "float32", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    size = sum(p.stat().st_size for p in (tmp_path / "base").glob("*.safetensors"))
    assert r["checkpoint_bytes"] == size > 0
    assert 0 < r["load_s"] <= r["first_token_s"] and r["read_s"] > 0
    assert r["target_s"] == 1.5 * r["floor_s"] + 10.0 and r["met"] == (r["first_token_s"] <= r["target_s"])


def test_bundle_bench_serves_the_same_collection_three_ways(tmp_path):
    """bench_bundle: the bundle of an exactly shared collection (no noise, shared rank <= R)
    serves the same greedy tokens as its uncompressed adapters through the matched number
    of slots; the base run names no adapter; the compression record is kept and reused."""
    import pyarrow.parquet as pq

    from mlora.bench.bundle import BundleBenchOptions, matched_slots, run_bundle_bench

    o = BundleBenchOptions(preset="tiny", adapters=8, rank=4, shared_rank=4, noise=0.0, bundle_rank=8, clusters=1,
                           rows=24, prompt_min=3, prompt_max=9, max_new_tokens=3, max_num_seqs=6, max_batch_tokens=48,
                           device="cpu", dtype="float32", warmup_rows=5, warmup_new_tokens=2)
    said = []
    r = run_bundle_bench(str(tmp_path), o, progress=said.append)
    assert [x["name"] for x in r["runs"]] == ["bundle", "base", "adapters"]  # the slowest last
    # an untimed warm-up job of the same kind before each timed run, over the first rows of its input
    assert [line.split(":")[0].split(" (")[0] for line in said if line.startswith(("warm-up", "running"))] == [
        "warm-up for bundle", "running bundle", "warm-up for base", "running base", "warm-up for adapters",
        "running adapters"]
    for name in ("bundle", "base", "adapters"):
        warm = pq.read_table(str(tmp_path / f"out-warmup-{name}")).to_pydict()
        assert sorted(warm["id"]) == sorted(pq.read_table(str(tmp_path / "input.parquet")).column("id")
                                            .to_pylist()[:5])
        assert all(len(v) == 2 for v in warm["completion_token_ids"])
    assert all(x["error_rows"] == 0 for x in r["runs"])
    assert r["workspace"]["compress"]["worst_error"] < 1e-6
    slots, need, slot = matched_slots(str(tmp_path), o)
    assert r["slots"] == slots == max(1, need // slot) and need == r["bundle_device_bytes"] > 0
    bundle, base, adapters = r["runs"]
    assert bundle["loads"] == 0 and adapters["loads"] >= r["workspace"]["distinct_adapters_used"] >= 3
    assert pq.read_table(str(tmp_path / "input-base.parquet")).column("adapter").null_count == 24

    def tokens(name):
        t = pq.read_table(str(tmp_path / f"out-{name}")).to_pydict()
        return dict(zip(t["id"], t["completion_token_ids"]))

    got = tokens("bundle")
    assert len(got) == 24 and got == tokens("adapters")
    first = r["workspace"]["compress"]["seconds"]
    again = run_bundle_bench(str(tmp_path), BundleBenchOptions(**{**o.__dict__, "runs": ("base",)}))
    assert again["workspace"]["compress"]["seconds"] == first and len(again["runs"]) == 1  # bundle reused


def test_bundle_bench_refuses_an_unknown_run(tmp_path, run_cli):
    """A misspelt --runs name fails at once (exit 2, the names to choose from) instead of
    silently running nothing; nothing is written."""
    code, _, stderr = run_cli("bench", "bundle", tmp_path / "w", "--preset", "tiny", "--device", "cpu",
                              "--runs", "bundle,bundel")
    assert code == 2 and "bundel" in stderr and "bundle-triton" in stderr, stderr
    assert not (tmp_path / "w").exists()


def test_recording_engine_records_chained_iterations_too():
    """bench batch times every step against its plan's floor: a chained step (launched by the
    step before) has a plan recorded like any other, so every decode iteration is timed (real
    decode graphs on a GPU, emulated on the CPU)."""
    from mlora.batch.config import EngineConfig
    from mlora.batch.engine.engine import Request
    from mlora.bench.batch import _RecordingEngine, random_model

    config = preset_config("tiny", "float32")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # real graphs on a GPU
    model = random_model(config, device, torch.float32, seed=2)
    config = EngineConfig(block_size=4, max_num_seqs=4, max_batch_tokens=64, cuda_graphs=True, lookahead=True)
    eng = _RecordingEngine(model, None, {}, config, num_blocks=64)
    for i in range(3):
        eng.add(Request(row=i, id=str(i), prompt_ids=[3 + i, 4, 5], adapter=None, max_new_tokens=12))
    steps = recorded = 0
    while eng.has_work():
        eng.last_plan = None
        eng.step()
        steps += 1
        recorded += eng.last_plan is not None
    assert eng.chained > 0 and recorded == steps
    # the last chained launch ran rows that had all finished: counted, never stepped
    assert eng.executor.inflight is not None and eng.stats["iterations"] == steps + 1
