"""``batch-run --tensor-parallel-size N``: one engine whose model is sharded over N rank processes
(gloo on the CPU, float32). The demo job at N=2 gives exactly expected.json's rows; tiny Llama
and Qwen2 (q/k/v bias) jobs with LoRA on all seven modules, mixed ranks and base rows give the
tokens of N=1; options not served under TP yet are refused up front (E_TP_UNSUPPORTED, exit 2);
a follower killed mid-job stops the job (E_TP_RANK_DIED, exit 3) and --resume completes it.
"""

import multiprocessing
import os
import random
import signal

import factory
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DEMO
from test_batch_model import random_model
from test_batch_run import _demo_job_gives_the_expected_rows, _rows
from typer.testing import CliRunner

from mlora.batch.config import JobConfig
from mlora.batch.errors import JobError
from mlora.batch.model.tpgroup import TPGroupError
from mlora.batch.runner import run_job
from mlora.cli.app import app

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_NEW = 10


def test_demo_job_at_two_ranks_gives_the_expected_rows(tmp_path):
    summary = _demo_job_gives_the_expected_rows(tmp_path, tensor_parallel_size=2)
    assert summary.bank["loads"] == 4  # the four adapters, each loaded on both ranks at once


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
    rng = random.Random(5)
    ids, prompts, adapters = [], [], []
    for i in range(6):
        prompt = [rng.randrange(64) for _ in range(rng.randrange(3, 20))]
        for adapter in ("r4", "r6", None):
            ids.append(f"{i}-{adapter}")
            prompts.append(prompt)
            adapters.append(adapter)
    pq.write_table(pa.table({"id": ids, "prompt_ids": pa.array(prompts, pa.list_(pa.int64())),
                             "adapter": pa.array(adapters, pa.string())}), str(root / "in.parquet"))
    return root


def _job(root, out, **over) -> JobConfig:
    return JobConfig(input=str(root / "in.parquet"), output=str(out), base=str(root / "base"),
                     adapters_dir=str(root / "adapters"), prompt_column=None, prompt_ids_column="prompt_ids",
                     max_new_tokens=MAX_NEW, device="cpu", dtype="float32", **over)


def test_lora_on_all_modules_at_two_ranks_equals_one_rank(workspace, tmp_path):
    run_job(_job(workspace, tmp_path / "one"))
    run_job(_job(workspace, tmp_path / "two", tensor_parallel_size=2, max_num_seqs=5))
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert set(one) == set(two) and len(one) == 18
    for rid in one:
        assert two[rid]["finish_reason"] != "error", two[rid]
        assert two[rid]["completion_token_ids"] == one[rid]["completion_token_ids"], rid
    # the adapters change the tokens (so their sharded deltas were checked, not just the base's)
    for i in range(6):
        tokens = {a: one[f"{i}-{a}"]["completion_token_ids"] for a in ("r4", "r6", None)}
        assert tokens["r4"] != tokens[None] and tokens["r6"] != tokens[None], tokens


@pytest.mark.parametrize("over, option", [
    (dict(memory_ledger="joint"), "--memory-ledger joint"),
    (dict(engine="ray"), "--engine ray"),
    (dict(gpus="0,1"), "--gpus"),
    (dict(num_workers=2), "--num-workers"),
])
def test_options_not_served_under_tensor_parallelism_are_refused(tmp_path, over, option):
    opts = JobConfig(input="in.parquet", output=str(tmp_path / "out"), base="base", tensor_parallel_size=2, **over)
    with pytest.raises(JobError) as e:
        opts.validate()
    assert e.value.code == "E_TP_UNSUPPORTED" and e.value.exit_code == 2 and option in e.value.message
    opts.tensor_parallel_size = 1
    opts.validate()  # the same job at one rank is fine


def _cli(tmp_path, *extra):
    return CliRunner().invoke(app, ["batch-run", os.path.join(DEMO, "prompts.parquet"), str(tmp_path / "out"),
                                    "--base", os.path.join(DEMO, "base"), "--adapters", os.path.join(DEMO, "adapters"),
                                    "--device", "cpu", "--max-new-tokens", "4", *extra])


@pytest.mark.parametrize("size, code", [("0", "E_OPTION_RANGE"), ("3", "E_TP_SHAPE")])
def test_a_size_the_job_cannot_take_exits_2(tmp_path, size, code):
    """0 is out of range; 3 does not divide the demo base's 4 heads (refused before any rank starts)."""
    res = _cli(tmp_path, "--tensor-parallel-size", size)
    assert res.exit_code == 2, res.output
    assert code in res.output and "tensor-parallel" in res.output
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
