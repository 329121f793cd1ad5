"""``batch-run --tensor-parallel-size N``: one engine whose model is sharded over N rank processes
(gloo on the CPU, float32). The demo job at N=2 gives exactly expected.json's rows; tiny Llama
and Qwen2 (q/k/v bias) jobs with LoRA on all seven modules, mixed ranks and base rows give the
tokens of N=1 (with --memory-ledger joint: test_tp_residency.py, and the demo job on a GPU);
a follower killed mid-job stops the job (E_TP_RANK_DIED, exit 3) and --resume completes it.
Replicas: --num-workers 2 at N=2 (two workers, each rank 0 of two gloo ranks) gives the demo's
expected rows; --gpus cuts its GPUs into groups of N and --engine ray sizes one actor per N GPUs
of a node (placement arithmetic, no GPU or Ray needed; the Ray job itself: test_batch_ray.py).
On a GPU, the demo and the tiny-model jobs also run with both ranks on one GPU over gloo
(MLORA_TP_ONE_GPU=1): the sharded model and kernels on CUDA, still equal to N=1 in float32.
"""

import multiprocessing
import os
import signal

import factory
import pytest
import torch
from conftest import DEMO
from test_batch_model import random_model
from test_batch_run import _demo_job_gives_the_expected_rows, _rows
from typer.testing import CliRunner

from mlora.batch.config import JobConfig
from mlora.batch.errors import JobError
from mlora.batch.job.sizing import rank_usable
from mlora.batch.model.tpgroup import TPGroupError
from mlora.batch.runner import run_job
from mlora.batch.scaleout.placement import RayActors, gpu_places, plan_workers, ray_actors
from mlora.cli.app import app

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_NEW = 10
# on a GPU both ranks share it (MLORA_TP_ONE_GPU=1, gloo): the sharded model and kernels on CUDA
ONE_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: two ranks sharing one GPU over gloo")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ONE_GPU)])
def test_demo_job_at_two_ranks_gives_the_expected_rows(tmp_path, monkeypatch, device):
    monkeypatch.setenv("MLORA_TP_ONE_GPU", "1")  # on a GPU: both ranks on cuda:0 (the CPU ignores it)
    summary = _demo_job_gives_the_expected_rows(tmp_path, device, tensor_parallel_size=2)
    # the four adapters, each published once on both ranks (on a GPU admission loads them ahead: prefetches)
    assert summary.bank["loads"] + summary.bank["prefetches"] == 4
    assert summary.device.endswith(" (2 ranks)")  # the summary line and _metrics.json name the group


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def workspace(request, tmp_path_factory):
    """A random tiny base (Qwen2: q/k/v biases), two adapters on all seven modules at ranks 4 and
    6, and rows naming each adapter and the base, several on the same prompt."""
    root = tmp_path_factory.mktemp(f"tp-{request.param}")
    base = factory.save_base(random_model(factory.tiny_config(request.param), seed=3), str(root / "base"))
    factory.make_adapters(str(root / "adapters"), base, {
        "r4": dict(r=4, lora_alpha=8, target_modules=ALL_SEVEN, seed=11),
        "r6": dict(r=6, lora_alpha=6, target_modules=ALL_SEVEN, seed=12),
    })
    factory.write_shared_prompt_rows(str(root / "in.parquet"), ("r4", "r6", None), prompts=6, seed=5, max_len=20)
    return root


def _job(root, out, **over) -> JobConfig:
    over = {"device": "cpu", **over}
    return JobConfig(input=str(root / "in.parquet"), output=str(out), base=str(root / "base"),
                     adapters_dir=str(root / "adapters"), prompt_column=None, prompt_ids_column="prompt_ids",
                     max_new_tokens=MAX_NEW, dtype="float32", **over)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ONE_GPU)])
def test_lora_on_all_modules_at_two_ranks_equals_one_rank(workspace, tmp_path, monkeypatch, device):
    monkeypatch.setenv("MLORA_TP_ONE_GPU", "1")
    run_job(_job(workspace, tmp_path / "one", device=device))
    run_job(_job(workspace, tmp_path / "two", device=device, tensor_parallel_size=2, max_num_seqs=5))
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert set(one) == set(two) and len(one) == 18
    for rid in one:
        assert two[rid]["finish_reason"] != "error", two[rid]
        assert two[rid]["completion_token_ids"] == one[rid]["completion_token_ids"], rid
    # the adapters change the tokens (so their sharded deltas were checked, not just the base's)
    for i in range(6):
        tokens = {a: one[f"{i}-{a}"]["completion_token_ids"] for a in ("r4", "r6", None)}
        assert tokens["r4"] != tokens[None] and tokens["r6"] != tokens[None], tokens


@ONE_GPU
def test_demo_job_at_two_ranks_in_one_arena_gives_the_expected_rows(tmp_path, monkeypatch):
    """--memory-ledger joint at two ranks sharing one GPU: every rank's KV cache and slots carved
    from one arena of the same pages, sized from the ranks' GPU memory (rank 0's shape,
    ``Setup.arena``), give the demo's expected rows. (On the CPU: test_tp_residency.py's joint job.)"""
    monkeypatch.setenv("MLORA_TP_ONE_GPU", "1")
    summary = _demo_job_gives_the_expected_rows(tmp_path, "cuda", tensor_parallel_size=2, memory_ledger="joint")
    assert summary.bank["memory_ledger"] == "joint" and summary.engine["kv_blocks"] == summary.bank["arena_pages"]


def test_replicas_of_two_ranks_on_cpu_workers_give_the_expected_rows(tmp_path):
    """--num-workers 2 --tensor-parallel-size 2: two worker processes, each rank 0 of its own
    two-rank gloo group (two rendezvous stores at once), share the rows of the demo job."""
    summary = _demo_job_gives_the_expected_rows(tmp_path, num_workers=2, tensor_parallel_size=2)
    assert summary.device == "cpu x2 (2 ranks each)"
    assert [w["status"] for w in summary.workers] == ["ok", "ok"]
    assert sum(w["rows"] for w in summary.workers) == summary.rows and all(w["rows"] for w in summary.workers)
    assert not multiprocessing.active_children()


def _cuda_host(monkeypatch, count: int, visible: str | None = None):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def test_gpus_split_into_groups_of_the_tensor_parallel_size(monkeypatch):
    """One worker per N GPUs in --gpus order; it sees its group's GPUs (as CUDA_VISIBLE_DEVICES
    names them) in rank order, so rank j of a group is its cuda:j."""
    _cuda_host(monkeypatch, 4, "4,5,6,7")

    def placed(gpus, size):
        return [(p.index, p.cuda_visible, p.label) for p in gpu_places(gpus, "auto", size)]

    two_groups = [(0, "4,5", "cuda:0+1"), (1, "6,7", "cuda:2+3")]
    assert placed("0,1,2,3", 2) == placed("all", 2) == two_groups
    assert placed("3,1,2,0", 2) == [(0, "7,5", "cuda:3+1"), (1, "6,4", "cuda:2+0")]
    assert placed("all", 4) == [(0, "4,5,6,7", "cuda:0+1+2+3")]
    assert placed("all", 1) == [(i, str(4 + i), f"cuda:{i}") for i in range(4)]
    plan = plan_workers(JobConfig(input="", output="", base="", gpus="all", tensor_parallel_size=2))
    assert [p.cuda_visible for p in plan.places] == ["4,5", "6,7"] and plan.device.type == "cuda"
    _cuda_host(monkeypatch, 2)
    assert placed("all", 2) == [(0, "0,1", "cuda:0+1")]


@pytest.mark.parametrize("count, gpus, size, hint", [
    (3, "all", 2, "give --gpus 0,1 (1 replica(s) of 2 ranks)"),
    (4, "0,1,3", 2, "give --gpus 0,1 (1 replica(s) of 2 ranks)"),
    (8, "2,0,5,1,7", 4, "give --gpus 2,0,5,1 (1 replica(s) of 4 ranks)"),
    (4, "2", 2, "--tensor-parallel-size 1"),
])
def test_a_gpu_count_that_does_not_split_into_groups_is_refused(monkeypatch, tmp_path, count, gpus, size, hint):
    _cuda_host(monkeypatch, count)
    opts = JobConfig(input=os.path.join(DEMO, "prompts.parquet"), output=str(tmp_path / "out"),
                     base=os.path.join(DEMO, "base"), gpus=gpus, tensor_parallel_size=size)
    with pytest.raises(JobError) as e:
        run_job(opts)
    assert e.value.code == "E_SCALEOUT_USAGE" and e.value.exit_code == 2, e.value
    assert f"groups of --tensor-parallel-size {size}" in e.value.message and hint in e.value.message
    assert not (tmp_path / "out").exists()  # refused before any work


def test_cpu_workers_share_the_cores_with_their_ranks(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    plan = plan_workers(JobConfig(input="", output="", base="", num_workers=2, device="cpu",
                                  tensor_parallel_size=4))
    assert [(p.device, p.cuda_visible, p.threads) for p in plan.places] == [("cpu", None, 2)] * 2


def test_ray_actors_own_a_replica_of_n_ranks():
    """--engine ray: one actor per N GPUs of one node (a node's odd GPU left over), each asking
    Ray for its N GPUs; on the CPU each actor's share of the cores divided among its N ranks;
    at N = 1 the pool of every GPU, or one CPU actor with every core, as without TP."""
    assert ray_actors(True, [8, 4], 96, None, 2) == RayActors(6, 2, 1, None)
    assert ray_actors(True, [8, 3], 96, None, 4) == RayActors(2, 4, 1, None)
    assert ray_actors(True, [8], 96, 3, 2) == RayActors(3, 2, 1, None)  # --num-workers is taken as given
    assert ray_actors(True, [1, 1], 8, None, 1) == RayActors(2, 1, 1, None)
    assert ray_actors(False, [], 16, None, 2) == RayActors(1, 0, 16, 8)
    assert ray_actors(False, [], 16, 2, 4) == RayActors(2, 0, 8, 2)
    assert ray_actors(False, [], 16, 2, 1) == RayActors(2, 0, 8, 8)
    assert ray_actors(False, [], 2, 2, 2) == RayActors(2, 0, 1, 1)  # fewer cores than ranks: one thread each
    with pytest.raises(JobError) as e:  # two GPUs, but no node holds a replica of two
        ray_actors(True, [1, 1], 8, None, 2)
    assert e.value.code == "E_SCALEOUT_USAGE" and e.value.exit_code == 2
    assert "GPUs per node: 1, 1" in e.value.message and "--tensor-parallel-size 1 or less" in e.value.message
    JobConfig(input="in", output="out", base="base", engine="ray", tensor_parallel_size=2).validate()


def _cli(tmp_path, *extra):
    return CliRunner().invoke(app, ["batch-run", os.path.join(DEMO, "prompts.parquet"), str(tmp_path / "out"),
                                    "--base", os.path.join(DEMO, "base"), "--adapters", os.path.join(DEMO, "adapters"),
                                    "--device", "cpu", "--max-new-tokens", "4", *extra])


@pytest.mark.parametrize("size, code, workers", [("0", "E_OPTION_RANGE", ()), ("3", "E_TP_SHAPE", ()),
                                                  ("3", "E_TP_SHAPE", ("--num-workers", "2"))])
def test_a_size_the_job_cannot_take_exits_2(tmp_path, size, code, workers):
    """0 is out of range; 3 does not divide the demo base's 4 heads (refused before any rank,
    or any worker of replicas, starts, and before OUTPUT is opened: a rerun needs no --resume)."""
    res = _cli(tmp_path, "--tensor-parallel-size", size, *workers)
    assert res.exit_code == 2, res.output
    assert not (tmp_path / "out").exists()
    assert code in res.output and "tensor-parallel" in res.output
    assert "E_TP_SHAPE: worker" not in res.output  # the coordinator's refusal, not a started worker's error
    assert not multiprocessing.active_children()


def test_a_killed_rank_stops_the_job_and_resume_completes_it(tmp_path):
    """Rank 1 is killed once some rows are committed: the job fails with E_TP_RANK_DIED, leaves
    no _SUCCESS, and --resume gives exactly expected.json's rows (at one rank: the size is not
    part of the job fingerprint, and a fresh two-rank start is what the tests above run)."""
    killed = []

    def kill_rank_1(summary, progress):
        if progress.rows_committed >= 2 and not killed:
            (rank,) = [p for p in multiprocessing.active_children() if p.name == "mlora-tp-rank-1"]
            os.kill(rank.pid, signal.SIGKILL)
            killed.append(progress.rows_committed)

    opts = JobConfig(input=os.path.join(DEMO, "prompts.parquet"), output=str(tmp_path / "out"),
                     base=os.path.join(DEMO, "base"), adapters_dir=os.path.join(DEMO, "adapters"), max_new_tokens=40,
                     device="cpu", dtype="float32", tensor_parallel_size=2, shard_rows=2, max_num_seqs=8)
    with pytest.raises(TPGroupError) as e:
        run_job(opts, progress=kill_rank_1)
    assert e.value.code == "E_TP_RANK_DIED" and "rank 1 died" in e.value.message
    assert not os.path.exists(tmp_path / "out" / "_SUCCESS")
    assert not multiprocessing.active_children()
    summary = _demo_job_gives_the_expected_rows(tmp_path, resume=True, shard_rows=2, max_num_seqs=8)
    assert 0 < summary.resumed_from_row < summary.rows  # the rows committed before the kill were kept


def test_each_rank_takes_its_share_of_the_tightest_gpu():
    """Every rank allocates the same KV blocks and slots: the budget is the least usable memory over
    the group's GPUs, split among the ranks sharing a GPU; the CPU has none."""
    gib = 2**30
    # two GPUs of 80 GiB at utilization 0.9 (8 GiB kept free): 30 and 20 GiB free -> 22 and 12 usable
    assert rank_usable([(0, 30 * gib, 80 * gib), (1, 20 * gib, 80 * gib)], 0.9) == pytest.approx(12 * gib)
    # two ranks on GPU 0 (its 22 usable GiB halved) beside one rank on GPU 1 with 20 usable
    assert rank_usable([(0, 30 * gib, 80 * gib), (0, 30 * gib, 80 * gib), (1, 28 * gib, 80 * gib)],
                       0.9) == pytest.approx(11 * gib)
    assert rank_usable([(0, 4 * gib, 80 * gib)], 0.9) == 0.0  # less free than the kept share: nothing
    assert rank_usable([None, None], 0.9) is None
