"""Rank 0 of a tensor-parallel group serves adapters through the residency engine
(``ResidencyBank.for_rank``; docs/design.md, "The data path of a tensor-parallel job").

In one process (rank 0's bank beside a follower's ``SlotBank.for_rank``, the mirror writing
into it as ``tpfollow.follow`` does on a "load"): rank 0's slots hold exactly the cut its own
``SlotBank.for_rank`` would, also from an image built elsewhere (the pickled layout); every
copy into a slot is mirrored, so the follower holds rank 0's published adapter in every slot
across evictions, and after a rollback that restores a victim rank 0 already told the
follower to overwrite; a follower's failure rolls the load back (retried, or the adapter
fails after the retry budget, the bank unchanged). As jobs at N=2 (gloo, float32): four
adapters in two slots give the tokens of N=1 with loads, evictions and loads started at
admission in the metrics; a follower that cannot load one adapter fails that adapter's rows
(or, once, is retried) and rank 0's validation failing after the followers loaded fails only
that adapter's rows, every other row as at N=1. The follower's host cache of its cuts: with
adapters evicted and loaded again it reads each adapter's files once (every mirrored load reads
them with --host-cache-gb 0), and a hinted build that fails fails only that adapter's rows.
With --memory-ledger joint a follower's slots lie at rank 0's pages of an arena of rank 0's
shape, and a job whose KV growth evicts idle adapters gives the rows of one rank.
"""

import dataclasses
import functools
import pickle

import factory
import pytest
import torch
import tp_faulty_follower
from test_batch_model import random_model
from test_batch_run import _rows

import mlora.batch.job.session as session_mod
from mlora.batch.adapters.catalog import load_catalog
from mlora.batch.adapters.residency import AdapterLoadError, FaultInjector, MirrorError, ResidencyBank
from mlora.batch.adapters.slots import SlotBank, TPShard
from mlora.batch.config import JobConfig
from mlora.batch.engine.engine import Engine
from mlora.batch.engine.tpfollow import Leader, Setup, follower_memory
from mlora.batch.model.arena import ArenaShape, PageArena
from mlora.batch.model.decoder import load_config
from mlora.batch.model.kvcache import KVCache
from mlora.batch.model.lora import GROUPS
from mlora.batch.model.tp import TPLayout
from mlora.batch.runner import run_job

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAMES = ("a", "b", "c", "d")
MAX_NEW = 8


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A random tiny Llama base, four adapters (ranks 4, 6, 2 and 5; d on four modules only) and
    rows naming each adapter and the base on the same prompts."""
    root = tmp_path_factory.mktemp("tp-residency")
    base = factory.save_base(random_model(factory.tiny_config("llama"), seed=3), str(root / "base"))
    factory.make_adapters(str(root / "adapters"), base, {
        "a": dict(r=4, lora_alpha=8, target_modules=ALL_SEVEN, seed=11),
        "b": dict(r=6, lora_alpha=6, target_modules=ALL_SEVEN, seed=12),
        "c": dict(r=2, lora_alpha=4, target_modules=ALL_SEVEN, seed=13),
        "d": dict(r=5, lora_alpha=5, target_modules=["q_proj", "o_proj", "up_proj", "down_proj"], seed=14),
    })
    factory.write_shared_prompt_rows(str(root / "in.parquet"), NAMES + (None,), prompts=4, seed=5, max_len=16)
    return root


@pytest.fixture(scope="module")
def pinned(workspace):
    return load_catalog(str(workspace / "adapters"), None).pin(set(NAMES), str(workspace / "base"), workers=1)


class Ranks:
    """Rank 0's residency bank and rank 1's slot bank of a two-rank group, in one process:
    ``mirror`` does what a follower does on "load" (``SlotBank.load_into``) unless ``fail``
    says otherwise; ``calls`` records (slot, adapter id) of each mirrored copy."""

    def __init__(self, workspace, slots: int = 2, fail=None):
        config = load_config(str(workspace / "base"))
        self.config, self.calls, self.fail = config, [], fail
        self.follower = SlotBank.for_rank(TPShard(config, TPLayout(1, 2), None), slots, 8, torch.float32, "cpu")
        self.leader = ResidencyBank.for_rank(TPShard(config, TPLayout(0, 2), None), slots, 8, torch.float32, "cpu",
                                             self.mirror, faults=FaultInjector(), prefetch_workers=0, trace=True)

    def mirror(self, slot, p):
        self.calls.append((slot, p.id))
        if self.fail is not None and self.fail(slot, p):
            raise MirrorError(f"rank 1 of 2: E_ADAPTER_CHANGED: adapter {p.id!r} cannot be read")
        self.follower.load_into(slot, p)

    def check(self, pinned):
        """Every slot rank 0 publishes holds the same adapter on rank 1, and rank 0's slot holds
        exactly what rank 0's own SlotBank.for_rank writes for it (the cut of tp.shard_lora)."""
        leader = self.leader
        ref = SlotBank.for_rank(TPShard(self.config, TPLayout(0, 2), None), leader.num_slots, 8, torch.float32, "cpu")
        by_key = {p.semantic_sha256: p for p in pinned.values()}
        assert leader.resident, "nothing published"
        for key, slot in leader.resident.items():
            assert self.follower.resident.get(key) == slot, (by_key[key].id, slot, self.follower.resident)
            ref.load_into(slot, by_key[key])
            for name in ("A", "B", "ranks", "scales"):
                for g in GROUPS:
                    assert torch.equal(getattr(leader, name)[g][slot], getattr(ref, name)[g][slot]), (name, g, slot)
        leader.residency.audit()


def test_every_copy_is_mirrored_and_every_rank_holds_the_published_adapter(workspace, pinned):
    ranks = Ranks(workspace)
    leader = ranks.leader
    for ids in (["a", "b"], ["c"], ["a", "d"], ["b"], ["c", "d"], ["a"]):
        leader.ensure(ids, pinned)
        ranks.check(pinned)
    assert leader.stats.evictions >= 4 and leader.stats.loads == len(ranks.calls) == leader.stats.load_attempts
    assert leader.tp is not None and leader.tp.layout == TPLayout(0, 2)  # o and down: reduce_z (BankContext.apply)


def test_images_built_from_the_pickled_layout_hold_the_ranks_cut(workspace, pinned):
    """A worker process builds images from the pickled ``SlotLayout`` (residency/build.py): it
    keeps the cut, so its image is rank 0's (not the whole adapter, not rank 1's cut)."""
    layout = Ranks(workspace).leader.layout
    there = pickle.loads(pickle.dumps(layout)).artifact(pinned["b"])
    here = layout.artifact(pinned["b"])
    assert [(p.view, p.index) for p in there.pieces] == [(p.view, p.index) for p in here.pieces]
    assert all(torch.equal(p.src, q.src) for p, q in zip(there.pieces, here.pieces))
    assert there.checks == here.checks and there.digest == here.digest


def test_a_rollback_after_the_mirror_restores_the_victim_on_every_rank(workspace, pinned):
    """Rank 0's validation of c fails on every attempt after rank 1 wrote c over the victim's
    slot: each rollback restores the victim on rank 0 and mirrors it, so rank 1 holds it too."""
    ranks = Ranks(workspace)
    leader = ranks.leader
    leader.ensure(["a", "b"], pinned)
    leader.ensure(["a"], pinned)  # b is the least recently used: c's victim
    before, slot = leader.resident, leader.resident[pinned["b"].semantic_sha256]
    ranks.calls.clear()
    leader.residency.faults.fail("validate", adapter="c", times=None)
    with pytest.raises(AdapterLoadError) as e:
        leader.ensure(["c"], pinned)
    assert e.value.code == "E_ADAPTER_LOAD" and len(e.value.attempts) == 3
    assert ranks.calls == [(slot, "c"), (slot, "b")] * 3  # each attempt's copy, then its victim's restoration
    assert leader.resident == before and leader.stats.restores == 3
    ranks.check(pinned)


def test_a_followers_failure_rolls_the_load_back_and_is_retried(workspace, pinned):
    failures = []

    def once(slot, p):
        if p.id == "c" and not failures:
            failures.append(slot)
            return True
        return False

    ranks = Ranks(workspace, fail=once)
    ranks.leader.ensure(["a", "b"], pinned)
    ranks.leader.ensure(["a", "c"], pinned)
    assert failures and ranks.leader.stats.rollbacks == 1 and ranks.leader.stats.load_failures == 1
    assert pinned["c"].semantic_sha256 in ranks.leader.resident
    ranks.check(pinned)


def test_a_follower_that_always_fails_fails_the_adapter_and_leaves_the_bank_unchanged(workspace, pinned):
    ranks = Ranks(workspace, fail=lambda slot, p: p.id == "c")
    leader = ranks.leader
    leader.ensure(["a", "b"], pinned)
    before = leader.resident
    with pytest.raises(AdapterLoadError) as e:
        leader.ensure(["c"], pinned)
    assert e.value.code == "E_ADAPTER_LOAD" and "E_RESIDENCY_MIRROR" in e.value.message
    assert "rank 1 of 2: E_ADAPTER_CHANGED" in e.value.message
    assert leader.resident == before
    ranks.check(pinned)
    leader.ensure(["d"], pinned)  # the next adapter loads as usual
    ranks.check(pinned)


# ---- jobs at two ranks -----------------------------------------------------------------------------


def _job(root, out, rows=None, **over) -> JobConfig:
    """The workspace's job (its rows, or those of the file ``rows``) in two slots."""
    return JobConfig(**{**dict(input=str(rows or root / "in.parquet"), output=str(out), base=str(root / "base"),
                               adapters_dir=str(root / "adapters"), prompt_column=None, prompt_ids_column="prompt_ids",
                               max_new_tokens=MAX_NEW, dtype="float32", device="cpu", max_gpu_adapters=2,
                               max_num_seqs=3), **over})


@pytest.fixture(scope="module")
def one_rank(workspace, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "out"
    run_job(_job(workspace, out))
    return _rows(out)


def _same_rows(one, two, failing=()):
    assert set(two) <= set(one) and len(two) >= 4 * 4
    for rid, got in two.items():
        want = one[rid]
        if want["adapter"] in failing:
            assert got["finish_reason"] == "error" and got["error_code"] == "E_ADAPTER_LOAD", got
        else:
            assert got["finish_reason"] != "error", got
            assert got["completion_token_ids"] == want["completion_token_ids"], rid


@pytest.fixture
def follower_reports(monkeypatch) -> list:
    """The followers' reports (``tpfollow.follow``'s returns) of the jobs run in a test, one list per job."""
    seen = []

    class Recording(Leader):
        def stop(self):
            super().stop()
            seen.append(self.reports)

    monkeypatch.setattr(session_mod, "Leader", Recording)
    return seen


def _counting_reads(monkeypatch, fail=None):
    monkeypatch.setattr(session_mod, "follow", functools.partial(tp_faulty_follower.follow_counting_reads, fail=fail))


def test_four_adapters_in_two_slots_at_two_ranks_give_the_tokens_of_one_rank(workspace, one_rank, tmp_path,
                                                                             monkeypatch):
    """With admission's asynchronous loads (on by default on a GPU only): the loads it starts
    between iterations are mirrored like the others."""
    monkeypatch.setattr(session_mod, "Engine", functools.partial(Engine, async_loads=True))
    summary = run_job(_job(workspace, tmp_path / "two", tensor_parallel_size=2))
    _same_rows(one_rank, _rows(tmp_path / "two"))
    for i in range(4):  # the adapters change the tokens (their sharded deltas were checked)
        assert all(one_rank[f"{i}-{a}"]["completion_token_ids"] != one_rank[f"{i}-None"]["completion_token_ids"]
                   for a in NAMES)
    bank = summary.bank
    # each adapter loaded (or prefetched onto the GPU) once at least, two of them evicted; of the
    # loads started ahead of the forward that needs them, some by admission (the others: prefetches)
    assert bank["loads"] + bank["prefetches"] >= 4 and bank["evictions"] >= 2, bank
    assert bank["loads_started_ahead"] > bank["prefetches"], bank
    assert bank["load_failures"] == 0 and bank["rollbacks"] == 0


@pytest.mark.parametrize("cache_gb", [None, 0])
def test_a_follower_reads_each_adapter_once_from_its_host_cache(workspace, one_rank, tmp_path, monkeypatch,
                                                                follower_reports, cache_gb):
    """Rows in file order through two slots (``schedule_window=1``): rank 0 evicts adapters and
    loads them again. The follower reads each adapter's files once at most (the later loads copy
    from its host cache, or wait for the build rank 0's prefetch hinted); with --host-cache-gb 0
    every mirrored load reads them. Tokens as at one rank either way."""
    _counting_reads(monkeypatch)
    summary = run_job(_job(workspace, tmp_path / "two", tensor_parallel_size=2, schedule_window=1,
                           host_cache_gb=cache_gb))
    _same_rows(one_rank, _rows(tmp_path / "two"))
    [[report]] = follower_reports
    reads, loads = report["reads"], report["mirrored_loads"]
    assert loads > 2 * len(NAMES) and set(reads) == set(NAMES), report  # adapters evicted and loaded again
    if cache_gb is None:
        assert max(reads.values()) == 1 and report["hinted_builds"] > 0, report
        assert report["host_cache_hits"] >= loads - len(NAMES), report
    else:
        assert sum(reads.values()) == loads == report["host_cache_misses"], report
        assert report["host_cache_hits"] == report["hinted_builds"] == 0, report
    for key in ("host_cache_hits", "host_cache_misses", "hinted_builds", "hinted_build_failures"):
        assert summary.engine[f"follower_{key}"] == [report[key]], key


def test_a_follower_whose_hinted_build_fails_fails_only_that_adapters_rows(workspace, one_rank, tmp_path,
                                                                          monkeypatch, follower_reports):
    """Every read of c on the follower fails: its hinted build fails on the background thread
    (counted, not raised), each mirrored load of c reads again and fails as without a cache,
    so c's rows fail with E_ADAPTER_LOAD and every other row gives the tokens of one rank."""
    _counting_reads(monkeypatch, fail="c")
    summary = run_job(_job(workspace, tmp_path / "two", tensor_parallel_size=2))
    _same_rows(one_rank, _rows(tmp_path / "two"), failing=("c",))
    [[report]] = follower_reports
    assert report["hinted_build_failures"] >= 1 and summary.bank["load_failures"] >= 3, (report, summary.bank)
    assert report["reads"]["c"] == report["hinted_build_failures"] + summary.bank["load_failures"], report


@pytest.mark.parametrize("times", [1, None])
def test_a_follower_that_cannot_load_an_adapter_fails_only_its_rows(workspace, one_rank, tmp_path, monkeypatch, times):
    """Rank 1's writes of c fail once (retried: every row as at one rank) or always (c's rows
    fail with E_ADAPTER_LOAD, every other row as at one rank)."""
    monkeypatch.setattr(session_mod, "follow", functools.partial(tp_faulty_follower.follow_failing_loads,
                                                                 adapter="c", times=times))
    summary = run_job(_job(workspace, tmp_path / "two", tensor_parallel_size=2))
    _same_rows(one_rank, _rows(tmp_path / "two"), failing=("c",) if times is None else ())
    assert summary.bank["load_failures"] >= (1 if times else 3), summary.bank


def test_rank_0_failing_validation_after_the_followers_loaded_fails_only_that_adapters_rows(
        workspace, one_rank, tmp_path, monkeypatch):
    """Rank 0's copies of c fail validation after the followers wrote c: every rollback restores
    its victim on every rank, and the victims' later rows give the tokens of one rank."""
    faults = FaultInjector()
    faults.fail("validate", adapter="c", times=None)
    for_rank = ResidencyBank.for_rank.__func__
    monkeypatch.setattr(ResidencyBank, "for_rank", classmethod(lambda cls, *a, **kw: for_rank(cls, *a, faults=faults,
                                                                                              **kw)))
    factory.write_shared_prompt_rows(str(tmp_path / "abc.parquet"), ("a", "b", "c", None), prompts=4, seed=5,
                                     max_len=16)  # the prompts of in.parquet (same seed), without d
    summary = run_job(_job(workspace, tmp_path / "two", rows=tmp_path / "abc.parquet", tensor_parallel_size=2,
                           schedule_window=1))
    _same_rows(one_rank, _rows(tmp_path / "two"), failing=("c",))
    assert summary.bank["restores"] > 0, summary.bank


# ---- the joint memory ledger at two ranks ------------------------------------------------------------


def test_a_followers_slots_and_kv_blocks_are_rank_0s_pages_of_the_same_arena(workspace, pinned):
    """Rank 0's bank carved from an arena (``ResidencyBank.for_rank(arena=...)``) and a follower's
    KV cache and ``SlotBank.for_rank`` over an arena of the ``ArenaShape`` rank 0 sends
    (``tpfollow.follower_memory``): the KV cache is every page of that arena, the scratch block its
    spare page; every slot tensor of slot s starts at the same byte of the same page on both
    ranks, past every KV block, and a follower's load writes only its slot's pages."""
    config = load_config(str(workspace / "base"))
    cut = dataclasses.replace(config, num_kv_heads=config.num_kv_heads // 2)  # rank 1's part of the model
    page = KVCache.block_bytes(cut.num_layers, 16, cut.num_kv_heads, cut.head_dim, torch.float32)
    arena = PageArena(40, page, "cpu", spare_pages=1)
    leader = ResidencyBank.for_rank(TPShard(config, TPLayout(0, 2), None), 2, 8, torch.float32, "cpu",
                                    lambda slot, p: None, prefetch_workers=0, arena=arena)
    try:
        pps = leader.residency.storage.pages_per_slot
        setup = Setup(40, 16, 2, 8, pinned, graph_seqs=4,
                      arena=ArenaShape(arena.num_pages, arena.page_bytes, arena.spare_pages, 2, pps))
        kv, carver = follower_memory(setup, cut, torch.float32, "cpu")
        theirs = carver.arena
        assert theirs.nbytes == arena.nbytes and pps > 1
        assert kv.pages.data_ptr() == theirs.data.data_ptr() and kv.pages.numel() * 4 == theirs.nbytes
        follower = SlotBank.for_rank(TPShard(config, TPLayout(1, 2), None), 2, 8, torch.float32, "cpu", alloc=carver)
        for name in ("A", "B", "ranks", "scales"):
            for g in GROUPS:
                mine, its = getattr(leader, name)[g], getattr(follower, name)[g]
                for s in range(2):
                    at = mine[s].data_ptr() - arena.data.data_ptr()
                    assert its[s].data_ptr() - theirs.data.data_ptr() == at, (name, g, s)
                    assert (40 - 2 * pps + s * pps) * page <= at < (40 - 2 * pps + (s + 1) * pps) * page
        follower.load_into(1, pinned["b"])
        written = theirs.data.view(40 + 1, page).ne(0).any(1).nonzero().flatten().tolist()
        assert written and set(written) <= set(range(40 - pps, 40)), written
    finally:
        leader.close()


@pytest.fixture(scope="module")
def one_rank_joint(workspace, tmp_path_factory):
    out = tmp_path_factory.mktemp("one-joint") / "out"
    run_job(_job(workspace, out, memory_ledger="joint", preload_adapters=True))
    return _rows(out)


def test_joint_ledger_at_two_ranks_gives_the_tokens_of_one_rank(workspace, one_rank, one_rank_joint, tmp_path,
                                                                follower_reports):
    """--memory-ledger joint at two ranks, four adapters in an arena of 24 pages: two slots of
    10 pages (preloaded) above 4 KV pages, so the rows' KV growth evicts idle adapters (the KV
    cache holds pages that were a slot's) and they are loaded again. Every row gives the tokens
    of one rank, in the joint ledger and in the split one; rank 0's summary names the joint
    ledger and its arena, and the follower built an arena of the same pages."""
    page = 2 * 2 * 16 * 1 * 8 * 4  # a KV block of rank 0's cut: 2 layers, K and V, 16 tokens, 1 kv head, float32
    summary = run_job(_job(workspace, tmp_path / "two", tensor_parallel_size=2, memory_ledger="joint",
                           preload_adapters=True, kv_cache_gb=24 * page / 2**30))
    two = _rows(tmp_path / "two")
    _same_rows(one_rank_joint, two)
    _same_rows(one_rank, two)
    bank = summary.bank
    assert bank["memory_ledger"] == "joint" and bank["arena_pages"] == summary.engine["kv_blocks"] == 24, bank
    assert bank["pages_per_slot"] == 10 and bank["kv_pages_peak"] > 24 - 2 * 10, bank  # KV in a slot's pages
    assert bank["loads"] > len(NAMES) and bank["evictions"] > 2, bank  # an evicted adapter loaded again
    [[report]] = follower_reports
    assert report["arena_pages"] == bank["arena_pages"] and report["mirrored_loads"] == bank["loads"], report
