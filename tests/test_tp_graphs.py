"""Decode graphs under tensor parallelism (docs/scaleout.md, docs/design.md "Decode graphs"): rank 0
decides each replay and its bucket, every follower captures the same buckets at the same time and
replays its own graphs over its part of the model, KV cache and adapter cuts. On the CPU the
graphs are emulated on every rank (MLORA_EMULATE_GRAPHS=1, gloo, the Triton kernels interpreted):
a TP=2 job gives the tokens of TP=1 eager, and the followers replay as often as rank 0.
"""


import factory
import pytest
from test_batch_model import random_model
from test_batch_run import _rows
from test_tp_residency import follower_reports  # noqa: F401 - a fixture

from mlora.batch.config import JobConfig
from mlora.batch.engine.executor import Inputs
from mlora.batch.engine.graphs import buckets_for
from mlora.batch.engine.tpfollow import _replay, tp_graphs
from mlora.batch.errors import CodedError
from mlora.batch.runner import run_job

MAX_NEW, SEQS = 4, 4


def _workspace(root):
    """A tiny random Llama, adapters of ranks 2 and 4 (one on all seven modules, one on o and
    down only: the row-parallel deltas), rows naming each and the base on the same prompts."""
    base = factory.save_base(random_model(factory.tiny_config("llama"), seed=7), str(root / "base"))
    factory.make_adapters(str(root / "adapters"), base, {
        "all": dict(r=4, lora_alpha=8, seed=21, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"]),
        "od": dict(r=2, lora_alpha=16, seed=22, target_modules=["o_proj", "down_proj"]),
    })
    factory.write_shared_prompt_rows(str(root / "in.parquet"), ("all", "od", None), prompts=2, seed=3, max_len=9)


def _job(root, out, **over) -> JobConfig:
    return JobConfig(input=str(root / "in.parquet"), output=str(out), base=str(root / "base"),
                     adapters_dir=str(root / "adapters"), prompt_column=None, prompt_ids_column="prompt_ids",
                     max_new_tokens=MAX_NEW, max_num_seqs=SEQS, device="cpu", dtype="float32", **over)


@pytest.mark.parametrize("ledger", ["split", "joint"])
def test_emulated_graphs_at_two_ranks_give_the_eager_tokens_of_one_rank(tmp_path, monkeypatch, ledger,
                                                                        follower_reports):
    """Also with --memory-ledger joint: every rank's KV cache, slots and the graphs' scratch block
    (the arena's spare page) carved from one arena of rank 0's shape."""
    _workspace(tmp_path)
    run_job(_job(tmp_path, tmp_path / "one"))  # eager: no MLORA_EMULATE_GRAPHS yet
    monkeypatch.setenv("MLORA_EMULATE_GRAPHS", "1")  # the followers' processes inherit it
    summary = run_job(_job(tmp_path, tmp_path / "two", tensor_parallel_size=2, memory_ledger=ledger))
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert set(one) == set(two) and len(one) == 6
    for rid in one:
        assert two[rid]["finish_reason"] != "error", two[rid]
        assert two[rid]["completion_token_ids"] == one[rid]["completion_token_ids"], rid
    for i in range(2):  # the adapters change the tokens: their cuts ran in the replays
        tokens = {a: one[f"{i}-{a}"]["completion_token_ids"] for a in ("all", "od", None)}
        assert tokens["all"] != tokens[None] and tokens["od"] != tokens[None], tokens
    engine = summary.engine
    assert engine.get("graph_replays", 0) > 0, engine
    assert engine["graph_buckets"] == len(buckets_for(SEQS))  # every bucket captured up front, on every rank
    assert engine["follower_graph_replays"] == [engine["graph_replays"]]  # rank 1 replayed each one too
    assert "lookahead_iterations" not in engine and "chained_iterations" not in engine
    if ledger == "joint":  # rank 0's arena pages are its KV blocks; the follower built an arena of as many
        assert summary.bank["memory_ledger"] == "joint" and summary.bank["arena_pages"] == engine["kv_blocks"]
        [[report]] = follower_reports
        assert report["arena_pages"] == summary.bank["arena_pages"], report


def test_graphs_run_under_tensor_parallelism_over_nccl_or_on_the_cpu():
    assert tp_graphs("nccl", "cuda") and tp_graphs("gloo", "cpu")
    assert not tp_graphs("gloo", "cuda")  # gloo's collectives on a GPU cannot be captured


def test_a_replay_the_follower_holds_no_graph_for_fails_closed():
    x = Inputs([1, 2], [3, 4], [3, 4], [0, 1, 2], [4, 5], [[0], [1]], [0, 1], [None, None])
    with pytest.raises(CodedError) as e:
        _replay(None, x, None, 2)  # graphs off on this rank: rank 0 and it disagree
    assert e.value.code == "E_TP_PROTOCOL" and "--no-cuda-graphs" in e.value.message
