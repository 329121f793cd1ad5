"""`mlora batch-run --num-workers` / `--gpus`: a coordinator and one engine per worker process.

First the assignment policy alone (mlora.batch.scaleout.assign, pure), then the real
coordinator with CPU worker processes on the demo job: the output equals the
single-process output byte for byte, a worker killed with SIGKILL loses and
duplicates no row (its rows are reassigned; with no worker left the job stops
with exit 3 and --resume completes it), and nonsense scale-out options are
usage errors with stable codes.
"""

import json
import os
import random

import pytest
import torch
from conftest import DEMO, DEMO_MAX_NEW_TOKENS
from conftest import demo_job_options as _opts
from conftest import shard_digests as _shards

from mlora.batch.config import JobConfig
from mlora.batch.errors import JobError
from mlora.batch.job.output import read_output
from mlora.batch.runner import run_job
from mlora.batch.scaleout.assign import Dispatcher
from mlora.batch.scaleout.placement import gpu_places, plan_workers

# -- assignment (pure) ---------------------------------------------------------


def _simulate(groups: dict, workers: int, speed: list[float], chunk: int = 8):
    """Pull-based run: a worker with room takes chunks; time advances by cost / speed.
    Returns (adapter -> set of workers, busy time per worker)."""
    d = Dispatcher()
    for a, rows in groups.items():
        for r, cost in rows:
            d.add(r, a, cost)
    cost_of = {r: c for rows in groups.values() for r, c in rows}
    clock = [0.0] * workers
    ran: dict = {}
    while d.pending_rows:
        w = min(range(workers), key=lambda i: clock[i])  # the first worker with room
        adapter, rows = d.take(w, chunk)
        ran.setdefault(adapter, set()).add(w)
        clock[w] += sum(cost_of[r] for r in rows) / speed[w]
    return ran, clock


def test_each_adapter_stays_on_one_worker_while_tokens_balance():
    rng = random.Random(0)
    groups, row = {}, 0
    for k in range(64):  # 64 adapters, Zipf-like sizes
        n = max(1, int(400 / (k + 1)))
        groups[f"a{k}"] = [(row + i, rng.randint(128, 1024) + 128) for i in range(n)]
        row += n
    ran, clock = _simulate(groups, 2, [1.0, 1.0])
    split = [a for a, ws in ran.items() if len(ws) > 1]
    assert len(split) <= 2, split  # only the largest groups are ever split
    assert all(len(groups[a]) >= 20 for a in split)
    assert max(clock) / min(clock) < 1.03  # no worker idles at the end
    ran, clock = _simulate(groups, 2, [1.0, 3.0])  # a faster worker takes more
    assert max(clock) - min(clock) < 0.03 * max(clock)


def test_dispatcher_choice_order():
    d = Dispatcher()
    for r in range(6):
        d.add(r, "big", 100)
    for r in range(6, 8):
        d.add(r, "small", 10)
    d.add(8, None, 50)
    assert d.take(0, 2) == ("big", [0, 1])  # rule 3: the largest group no worker owns
    assert d.take(1, 2) == (None, [8])  # rule 3 again: "big" is owned, the base group (50) beats "small" (20)
    assert d.take(1, 2) == ("small", [6, 7])  # its last group is empty: the remaining free group
    assert d.take(1, 2) == ("big", [4, 5])  # rule 4: steal from the tail of another worker's group
    assert d.take(0, 1) == ("big", [2])  # rule 1: the owner goes on from the head
    assert d.owners["big"] == {0, 1}
    d.requeue([(1, "big", 100), (0, "big", 100)])  # a dead worker's rows go back to the head
    d.forget(0)
    assert d.owners["big"] == {1}
    assert d.take(1, 8) == ("big", [0, 1, 3])  # rule 1: its last group, requeued rows first
    assert d.take(1, 8) is None and d.pending_rows == 0


# -- the coordinator on CPU workers --------------------------------------------


def _same_output(out, single_process_output, same_shards: bool = True) -> None:
    assert read_output(str(out)).equals(read_output(str(single_process_output)))
    if same_shards:  # (an interrupted job commits its contiguous prefix as a shorter shard)
        assert _shards(out) == _shards(single_process_output)  # the same shard files, byte for byte
    assert os.path.exists(os.path.join(out, "_SUCCESS"))


def test_two_cpu_workers_write_exactly_the_single_process_output(tmp_path, single_process_output):
    seen = []
    summary = run_job(_opts(tmp_path / "out", num_workers=2), progress=lambda s, p: seen.append(p))
    _same_output(tmp_path / "out", single_process_output)
    assert [w["status"] for w in summary.workers] == ["ok", "ok"]
    assert sum(w["rows"] for w in summary.workers) == 40 and summary.device == "cpu x2"
    assert seen and seen[-1].workers == 2 and seen[-1].rows_done == 40
    metrics = json.loads((tmp_path / "out" / "_metrics.json").read_text())
    m = metrics["metrics"]
    assert m["rows_finished"] == 40 and m["iterations"] == summary.engine["iterations"] > 0
    assert m["completion_tokens"] == summary.generated_tokens
    assert 1.0 <= m["load_amplification"] <= 2.0  # each adapter loaded by at most the two workers
    assert len([f for f in os.listdir(tmp_path / "out") if f == "_manifest.json"]) == 1


def test_pickle_adapters_with_allow_pickle_on_two_workers_write_the_single_process_output(tmp_path,
                                                                                          single_process_output):
    """The demo adapters as adapter_model.bin: the workers read them as the job pinned them
    (torch.load(weights_only=True), bytes re-hashed), to the same rows and identities."""
    import shutil

    from factory import load_tensors

    adapters = tmp_path / "adapters"
    shutil.copytree(os.path.join(DEMO, "adapters"), adapters)
    for name in os.listdir(adapters):
        torch.save(load_tensors(str(adapters / name)), adapters / name / "adapter_model.bin")
        os.remove(adapters / name / "adapter_model.safetensors")
    run_job(_opts(tmp_path / "out", adapters_dir=str(adapters), num_workers=2, allow_pickle=True))
    _same_output(tmp_path / "out", single_process_output)


def test_a_killed_worker_loses_and_duplicates_no_row(tmp_path, single_process_output, monkeypatch):
    """Worker 0 kills itself (SIGKILL) after sending 2 rows; its unfinished rows go to
    worker 1. Small chunks (max_num_seqs 2) and segments (schedule_window 8) so it holds some."""
    monkeypatch.setenv("MLORA_TEST_KILL_WORKER", "0:2")
    notes = []
    summary = run_job(_opts(tmp_path / "out", num_workers=2, max_num_seqs=2, schedule_window=8), note=notes.append)
    _same_output(tmp_path / "out", single_process_output)
    assert [w["status"] for w in summary.workers] == ["died", "ok"]
    assert summary.workers[0]["rows"] >= 2 and sum(w["rows"] for w in summary.workers) == 40
    assert summary.rows_this_run == 40 and any("worker 0 (cpu) died" in n for n in notes)


def test_no_worker_left_stops_with_exit_3_and_resume_completes(tmp_path, single_process_output, monkeypatch, run_cli):
    args = ["batch-run", os.path.join(DEMO, "prompts.parquet"), tmp_path / "out", "--base", os.path.join(DEMO, "base"),
            "--adapters", os.path.join(DEMO, "adapters"), "--max-new-tokens", DEMO_MAX_NEW_TOKENS, "--device", "cpu",
            "--shard-rows", 7, "--keep-columns", "prompt", "--max-num-seqs", 4, "--quiet"]
    monkeypatch.setenv("MLORA_TEST_KILL_WORKER", "0:9")
    code, _, err = run_cli(*args, "--num-workers", 1)
    assert code == 3 and "E_WORKER_DIED" in err and "--resume" in err, err
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert 0 < manifest["rows_committed"] < 40 and not (tmp_path / "out" / "_SUCCESS").exists()
    monkeypatch.delenv("MLORA_TEST_KILL_WORKER")
    code, out, err = run_cli(*args, "--num-workers", 2, "--resume", "--json")
    assert code == 0, err
    assert json.loads(out)["resumed_from_row"] == manifest["rows_committed"]
    _same_output(tmp_path / "out", single_process_output, same_shards=False)


def test_workers_keep_integer_ids_and_commit_by_interval(tmp_path):
    """int64 ids over two files, shards committed by a tiny --commit-interval far below
    --shard-rows: two workers write the one-process rows, every shard with the int64 id."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    demo = pq.read_table(os.path.join(DEMO, "prompts.parquet")).slice(0, 16)
    demo = demo.set_column(0, "id", pa.array(range(900, 916), pa.int64()))
    os.makedirs(tmp_path / "in")
    pq.write_table(demo.slice(0, 9), tmp_path / "in" / "a.parquet")
    pq.write_table(demo.slice(9), tmp_path / "in" / "b.parquet")
    kw = dict(input=str(tmp_path / "in"), max_new_tokens=8, shard_rows=10000, commit_interval=1e-6, max_num_seqs=2)
    run_job(_opts(tmp_path / "one", **kw))
    run_job(_opts(tmp_path / "two", num_workers=2, **kw))
    table = read_output(str(tmp_path / "two"))
    assert table.schema.field("id").type == pa.int64() and table.column("id").to_pylist() == list(range(900, 916))
    assert table.equals(read_output(str(tmp_path / "one")))
    shards = json.loads((tmp_path / "two" / "_manifest.json").read_text())["shards"]
    assert len(shards) > 1  # committed by time, not by --shard-rows
    assert {pq.read_schema(tmp_path / "two" / s["file"]).field("id").type for s in shards} == {pa.int64()}


@pytest.mark.parametrize("extra, code", [
    (["--gpus", "7"], "E_GPUS_NO_CUDA"),  # the CI host has no CUDA at all
    (["--gpus", "0,x"], "E_GPUS_INVALID"),
    (["--gpus", "1,1"], "E_GPUS_INVALID"),
    (["--gpus", "0", "--num-workers", "2"], "E_SCALEOUT_USAGE"),
    (["--num-workers", "2", "--device", "cuda"], "E_WORKERS_DEVICE"),
    (["--ray-address", "auto"], "E_SCALEOUT_USAGE"),
    (["--engine", "spark"], "E_SCALEOUT_USAGE"),
    (["--engine", "ray", "--gpus", "0"], "E_SCALEOUT_USAGE"),
])
def test_nonsense_scale_out_options_are_usage_errors(tmp_path, run_cli, extra, code):
    if torch.cuda.is_available() and code == "E_GPUS_NO_CUDA":
        extra, code = ["--gpus", "99"], "E_GPUS_UNAVAILABLE"
    rc, _, err = run_cli("batch-run", os.path.join(DEMO, "prompts.parquet"), tmp_path / "out", "--base",
                         os.path.join(DEMO, "base"), "--adapters", os.path.join(DEMO, "adapters"), "--quiet", *extra)
    assert rc == 2 and f"Error: {code}:" in err, err
    assert not (tmp_path / "out").exists()  # refused before any work


def test_gpus_are_checked_against_the_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    places = gpu_places("all", "auto")
    assert [(p.index, p.cuda_visible, p.label) for p in places] == [(0, "3", "cuda:0"), (1, "5", "cuda:1")]
    assert [p.cuda_visible for p in gpu_places("1", "cuda")] == ["5"]  # each worker sees exactly its GPU
    with pytest.raises(JobError) as e:
        gpu_places("0,2", "auto")
    assert e.value.code == "E_GPUS_UNAVAILABLE" and e.value.exit_code == 2 and "it has 2" in str(e.value)
    with pytest.raises(JobError) as e:
        gpu_places("0", "cpu")
    assert e.value.code == "E_GPUS_DEVICE"
    # --num-workers on a CUDA host runs on the CPU only when asked to
    with pytest.raises(JobError) as e:
        plan_workers(JobConfig(input="", output="", base="", num_workers=2))
    assert e.value.code == "E_WORKERS_DEVICE"
    plan = plan_workers(JobConfig(input="", output="", base="", num_workers=2, device="cpu"))
    assert [p.device for p in plan.places] == ["cpu", "cpu"] and plan.places[0].threads >= 1


@pytest.mark.parametrize("size, visible, label", [(1, "0", "cuda:0"), (2, "0,1", "cuda:0+1")])
def test_a_gpu_worker_pins_its_device_and_a_failing_worker_stops_the_job(tmp_path, size, visible, label):
    """The GPU path up to CUDA: a worker placed on GPU "0" (or, rank 0 of a tensor-parallel
    group, on GPUs "0,1") sets CUDA_VISIBLE_DEVICES before torch starts CUDA and refuses to run
    unless it then sees exactly its devices. On this CPU-only host it sees none: the worker's
    error stops the job with its code (exit 3)."""
    from mlora.batch.job.prepare import prepare_job
    from mlora.batch.scaleout.coordinator import run_workers
    from mlora.batch.scaleout.placement import WorkerPlace

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the worker would find its GPU")
    prep = prepare_job(_opts(tmp_path / "out", dtype="float32", tensor_parallel_size=size), torch.device("cuda"))
    try:
        with pytest.raises(JobError) as e:
            run_workers(prep, [WorkerPlace(0, "cuda", visible, label)])
    finally:
        prep.sink.close(final=False)
    assert e.value.exit_code == 3 and e.value.code == "E_RUNTIME"
    assert f"worker 0 ({label})" in str(e.value) and f"sees 0 CUDA devices, not its {size}" in str(e.value)
    assert f"CUDA_VISIBLE_DEVICES='{visible}'" in str(e.value) and "--resume" in str(e.value)
