"""`mlora bench batch --tensor-parallel-size N` on the CPU (two gloo ranks, the tiny preset): the
job runs end to end with a follower that generates its own part of the random model, whose
greedy tokens are the one-device model's; each rank's generated weights are the slices of the
whole tensors; the per-rank floor adds the measured all-reduces, layer by layer; and a model
that cannot fit a GPU is refused with the sizes that would (no timings asserted)."""

import json
import os

import pytest
import torch

from mlora.batch.model.tp import TPLayout, lora_elements, shard_config, weight_cuts
from mlora.bench.batch import (
    AllReduceTimes,
    BatchBenchOptions,
    BenchError,
    Ceilings,
    GeneratedModel,
    TPFloor,
    check_fits,
    check_options,
    decode_floor,
    preset_config,
    random_model,
    run_batch_bench,
)

OPTS = dict(preset="tiny", rows=10, rank=4, prompt_min=3, prompt_max=17, max_new_tokens=6, max_num_seqs=4,
            max_batch_tokens=32, device="cpu", dtype="float32", repeat_base=False)


def test_two_ranks_run_the_bench_and_generate_the_one_device_tokens(tmp_path, run_cli):
    one = run_batch_bench(BatchBenchOptions(**OPTS, adapters=(0,)))
    adapters, out = tmp_path / "adapters", tmp_path / "tp.json"
    code, stdout, stderr = run_cli(
        "bench", "batch", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--rows", 10, "--rank", 4,
        "--prompt-min", 3, "--prompt-max", 17, "--max-new-tokens", 6, "--max-num-seqs", 4, "--max-batch-tokens", 32,
        "--adapters", "0,2", "--no-repeat-base", "--tensor-parallel-size", 2, "--adapters-dir", adapters, "--out", out)
    assert code == 0, stderr
    assert "tensor-parallel size 2 (floors per rank, all-reduces included)" in stdout
    assert "2 adapters written" in stderr and "all-reduces" in stderr and "2 ranks built their weights" in stderr
    two = json.loads(out.read_text())
    base, lora = two["scenarios"]
    assert (base["adapters"], lora["adapters"]) == (0, 2)
    for s in (base, lora):
        assert s["generated_tokens"] == 10 * 6 and s["tokens_per_s"] > 0 and s["tensor_parallel_size"] == 2
        assert s["lookahead_iterations"] == 0  # no lookahead under tensor parallelism
        d = s["decode"]
        assert d["iterations"] > 0 and d["median_all_reduce_s"] > 0
        assert d["median_floor_s"] > d["median_all_reduce_s"]  # the rank's bytes, plus the all-reduces
        assert s["all_reduce"]["rows"] == [1, 4, 32] and set(s["all_reduce"]["seconds"]) == {"hidden", "rank"}
    # the follower generated its own slices: together the one-device model of the same seed
    assert base["tokens_sha256"] == one["scenarios"][0]["tokens_sha256"]
    assert lora["tokens_sha256"] != base["tokens_sha256"]  # the adapters (loaded on both ranks) changed the tokens
    assert lora["adapter_bytes"] == lora_elements(preset_config("tiny", "float32"), TPLayout(0, 2), 4) * 4
    assert two["tensor_parallel"]["size"] == 2 and two["tensor_parallel"]["backend"] == "gloo"
    assert sorted(os.listdir(adapters)) == [".complete", "bench-0", "bench-1"]  # PEFT files, kept for a rerun


def test_each_rank_generates_the_slices_of_the_whole_tensors():
    config = preset_config("tiny", "float32")
    whole = random_model(config, "cpu", torch.float32, seed=5)
    other = random_model(config, "cpu", torch.float32, seed=6)
    assert not torch.equal(whole.layers[0].o_weight, other.layers[0].o_weight)
    c = config
    for rank in range(2):
        layout = TPLayout(rank, 2)
        part = GeneratedModel(config, 5).model("cpu", torch.float32, layout, collective=object())
        cuts = weight_cuts(config, layout)
        for i, (w, p) in enumerate(zip(whole.layers, part.layers)):
            q, k, v = w.qkv_weight.split([c.q_out, c.kv_out, c.kv_out])
            gate, up = w.gate_up_weight.split([c.intermediate_size] * 2)
            expected = {
                "qkv_weight": torch.cat([cuts["q_proj"].take(q), cuts["k_proj"].take(k), cuts["v_proj"].take(v)]),
                "o_weight": cuts["o_proj"].take(w.o_weight),
                "gate_up_weight": torch.cat([cuts["gate_proj"].take(gate), cuts["up_proj"].take(up)]),
                "down_weight": cuts["down_proj"].take(w.down_weight),
            }
            for name, t in expected.items():
                assert torch.equal(getattr(p, name), t), (rank, i, name)
        assert torch.equal(part.embed_weight, whole.embed_weight)
        assert torch.equal(part.lm_head_weight, whole.lm_head_weight)
        assert part.config == shard_config(config, layout)


def test_the_rank_floor_adds_two_all_reduces_per_layer_and_two_more_with_adapters():
    config = preset_config("tiny", "float32")
    local = shard_config(config, TPLayout(0, 2))
    times = AllReduceTimes(2, (1, 4, 32), {"hidden": (1e-5, 4e-5, 9e-5), "rank": (5e-6, 8e-6, 2e-5)})
    tp = TPFloor(config, times)
    ceil = Ceilings(1e11, 1e12)
    base = decode_floor(local, torch.float32, rows=4, context_tokens=40, distinct=0, rank=4, ceil=ceil, tp=tp)
    lora = decode_floor(local, torch.float32, rows=4, context_tokens=40, distinct=1, rank=4, ceil=ceil, tp=tp)
    assert base["all_reduce_s"] == pytest.approx(config.num_layers * 2 * 4e-5)
    assert lora["all_reduce_s"] == pytest.approx(config.num_layers * (2 * 4e-5 + 2 * 8e-6))
    for f in (base, lora):
        assert f["floor_s"] == pytest.approx(max(f["bytes"] / 1e11, f["flops"] / 1e12) + f["all_reduce_s"])
        assert f["staged_floor_s"] >= f["floor_s"]
    # one adapter's bytes on the rank: its cut (A whole on q/k/v/gate/up, B by the rank's rows)
    assert lora["bytes"] - base["bytes"] == lora_elements(config, TPLayout(0, 2), 4) * 4
    # between the measured row counts, linear in rows
    assert times.at("hidden", 2) == pytest.approx(1e-5 + 3e-5 / 3)
    assert times.at("hidden", 18) == pytest.approx(4e-5 + 5e-5 / 2)
    # the rank's weights are its cut: fewer bytes than the whole model's on one device
    whole = decode_floor(config, torch.float32, rows=4, context_tokens=40, distinct=0, rank=4, ceil=ceil)
    assert base["bytes"] < whole["bytes"] and "all_reduce_s" not in whole


def test_a_model_larger_than_a_gpu_is_refused_with_the_sizes_that_fit(run_cli):
    config = preset_config("llama-3-70b", "bfloat16")
    h200 = 150_000_000_000  # what an H200 reports (about 139.7 GiB)
    o = BatchBenchOptions(preset="llama-3-70b", adapters=(0, 8), tensor_parallel_size=1)
    with pytest.raises(BenchError) as e:
        check_fits(config, o, h200)
    assert e.value.code == "E_BENCH_MEMORY" and "--tensor-parallel-size >= 2" in e.value.message
    check_fits(config, BatchBenchOptions(preset="llama-3-70b", adapters=(0, 8), tensor_parallel_size=2), h200)
    check_fits(preset_config("llama-3-8b", "bfloat16"), BatchBenchOptions(), h200)  # 8B on one GPU, 64 adapters
    with pytest.raises(BenchError) as e:  # 64 heads do not cut into 3
        check_options(BatchBenchOptions(preset="llama-3-70b", device="cpu", tensor_parallel_size=3))
    assert e.value.code == "E_TP_SHAPE"
    code, _, stderr = run_cli("bench", "batch", "--preset", "llama-3-70b", "--device", "cpu",
                              "--tensor-parallel-size", 3)
    assert code == 2 and "E_TP_SHAPE" in stderr and "use a size that divides this model" in stderr
