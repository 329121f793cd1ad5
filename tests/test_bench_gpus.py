"""`mlora bench gpus`: which `mlora batch-run` each run is (one GPU, --gpus replicas, --gpus at
--tensor-parallel-size N; on the CPU one process, --num-workers W, W / N workers of N gloo ranks),
the runs the options cannot make refused before anything is written, and the CPU smoke form of the
tp run: real processes on the tiny preset in float32, whose rows equal the one-process run's
(the bench's own row comparison, which a changed token makes fail)."""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mlora.bench.gpus import (
    GpusBenchOptions,
    check_options,
    output_rows,
    rows_differing,
    run_args,
    run_gpus_bench,
    selected_runs,
)

TINY = dict(preset="tiny", adapters=3, rows=12, rank=4, prompt_min=4, prompt_max=24, max_new_tokens=4, device="cpu",
            dtype="float32")


def test_each_run_is_its_batch_run_command(monkeypatch):
    """On GPUs the tp run is --gpus over every listed GPU at N ranks (two replicas of two here),
    the one-GPU run sees only the first listed GPU; on the CPU the tp run has as many processes
    as the replicas run. The tp run is made only when N > 1 or asked for."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    gpu = GpusBenchOptions(gpus="2,3,0,1", tensor_parallel_size=2)
    assert selected_runs(gpu) == ("one", "replicas", "tp")
    args, env = run_args(gpu, "one")
    assert args == ["--device", "cuda"] and env["CUDA_VISIBLE_DEVICES"] == "6"
    assert run_args(gpu, "replicas") == (["--gpus", "2,3,0,1"], None)
    assert run_args(gpu, "tp") == (["--gpus", "2,3,0,1", "--tensor-parallel-size", "2"], None)
    cpu = GpusBenchOptions(device="cpu", num_workers=4, tensor_parallel_size=2, runs=("tp", "one"))
    assert selected_runs(cpu) == ("one", "tp")
    assert run_args(cpu, "replicas") == (["--device", "cpu", "--num-workers", "4"], None)
    assert run_args(cpu, "tp") == (["--device", "cpu", "--num-workers", "2", "--tensor-parallel-size", "2"], None)
    assert selected_runs(GpusBenchOptions()) == ("one", "replicas")


@pytest.mark.parametrize("over, message", [
    (dict(gpus="0,1,2", tensor_parallel_size=2), "does not divide the 3 GPU(s) of --gpus 0,1,2"),
    (dict(device="cpu", num_workers=3, tensor_parallel_size=2), "does not divide --num-workers 3"),
    (dict(runs=("one", "tp")), "--runs tp needs --tensor-parallel-size"),
    (dict(tensor_parallel_size=2, runs=("one", "replicas")), "add tp to --runs"),
    (dict(runs=("one", "two")), "subset of one,replicas,tp"),
])
def test_runs_the_options_cannot_make_are_refused(tmp_path, over, message):
    o = GpusBenchOptions(**over)
    with pytest.raises(ValueError) as info:
        check_options(o)
    assert message in str(info.value)
    with pytest.raises(ValueError):
        run_gpus_bench(str(tmp_path / "w"), o)
    assert not (tmp_path / "w").exists()  # refused before the workspace is written


def test_tp_run_on_the_cpu_gives_the_one_process_rows(tmp_path):
    root = str(tmp_path / "w")
    r = run_gpus_bench(root, GpusBenchOptions(**TINY, num_workers=2, tensor_parallel_size=2, runs=("one", "tp")))
    one, tp = r["runs"]
    assert (one["name"], tp["name"]) == ("one", "tp")
    assert tp["args"] == ["--device", "cpu", "--num-workers", "1", "--tensor-parallel-size", "2"]
    assert tp["device"] == "cpu x1 (2 ranks each)"  # batch-run's own account: one worker of two ranks
    for run in r["runs"]:
        assert run["generated_tokens"] == TINY["rows"] * TINY["max_new_tokens"] and run["error_rows"] == 0
        assert run["tokens_per_s"] > 0 and run["wall_s"] > 0
    assert tp["compared_with"] == "one" and tp["rows_differing"] == 0 and r["outputs_equal"] is True
    [sp] = r["speedups"]
    assert (sp["run"], sp["against"]) == ("tp", "one")
    assert sp["tokens_per_s"] == pytest.approx(tp["tokens_per_s"] / one["tokens_per_s"])
    assert sp["wall"] == pytest.approx(one["wall_s"] / tp["wall_s"])

    # the comparison sees one changed token in one row
    rows = output_rows(os.path.join(root, "out-tp"))
    assert len(rows) == TINY["rows"]
    [part] = [f for f in os.listdir(os.path.join(root, "out-tp")) if f.endswith(".parquet")]
    table = pq.read_table(os.path.join(root, "out-tp", part))
    ids = table.column("completion_token_ids").to_pylist()
    ids[5] = [ids[5][0] + 1, *ids[5][1:]]
    col = table.schema.get_field_index("completion_token_ids")
    changed = table.set_column(col, table.schema.field(col), pa.array(ids, table.schema.field(col).type))
    pq.write_table(changed, os.path.join(root, "out-tp", part))
    assert rows_differing(output_rows(os.path.join(root, "out-one")), output_rows(os.path.join(root, "out-tp"))) == 1
