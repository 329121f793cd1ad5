"""CUDA graphs of the decode step against the eager forward.

Tests marked ``cuda`` need a CUDA device; they run on the GPU machine
(BENCHMARKS.md records the runs). The others run everywhere: on the CPU the
graphs are emulated (``mlora.batch.engine.graphs``: the same static buffers, padding,
staging and tile lists, the forward re-run at each replay with the Triton
kernels interpreted, the buffers' invariants checked before every replay).
"""

import random

import pytest
import torch

from mlora.batch.adapters.residency import ResidencyBank
from mlora.batch.config import EngineConfig
from mlora.batch.engine.engine import Engine, Request
from mlora.batch.engine.graphs import GraphBufferError, buckets_for
from mlora.batch.model.arena import PageArena
from mlora.batch.model.kvcache import KVCache
from mlora.bench.batch import preset_config, random_bank, random_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_buckets_cover_every_batch_size_once():
    for max_seqs in (1, 3, 16, 64, 100, 256):
        b = buckets_for(max_seqs)
        assert b == sorted(set(b)) and b[-1] == max_seqs and b[0] == 1
        assert all(any(x >= n for x in b) for n in range(1, max_seqs + 1))
    assert buckets_for(256) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256]


def _requests(n, adapters, vocab, seed):
    rng = random.Random(seed)
    return [Request(row=i, id=str(i), prompt_ids=[rng.randrange(vocab) for _ in range(rng.randint(3, 40))],
                    adapter=rng.choice(adapters), max_new_tokens=rng.randint(4, 12)) for i in range(n)]


def _config(max_num_seqs, graphs, lookahead=False):
    """The engine choices these tests use: 4-token blocks, 64-token iterations."""
    return EngineConfig(block_size=4, max_num_seqs=max_num_seqs, max_batch_tokens=64, cuda_graphs=graphs,
                        lookahead=lookahead)


def _run(model, bank, pinned, reqs, graphs, max_num_seqs, lookahead=False):
    eng = Engine(model, bank, pinned, _config(max_num_seqs, graphs, lookahead), num_blocks=256)
    for r in reqs:
        assert eng.add(r) is None
    out = {r.row: r.token_ids for r in eng.drain()}
    return out, eng


def _graphed_engine(seed, num_blocks, max_num_seqs, adapters=2):
    """A tiny float32 model on DEVICE, a Triton slot bank of ``adapters`` rank-4 adapters (none
    for 0) and an engine with decode graphs (emulated on the CPU): (engine, model, bank)."""
    model = random_model(preset_config("tiny", "float32"), DEVICE, torch.float32, seed=seed)
    bank, pinned = random_bank(model, adapters, 4, seed=seed, backend="triton") if adapters else (None, {})
    eng = Engine(model, bank, pinned, _config(max_num_seqs, True), num_blocks=num_blocks)
    return eng, model, bank


@cuda
@pytest.mark.parametrize("max_num_seqs", [5, 16])
def test_graph_decode_gives_the_eager_tokens(max_num_seqs):
    config = preset_config("tiny", "float32")
    model = random_model(config, torch.device("cuda"), torch.float32, seed=3)
    bank, pinned = random_bank(model, 3, 4, seed=3)
    reqs = _requests(23, [None, "bench-0", "bench-1", "bench-2"], config.vocab_size, seed=4)
    eager, _ = _run(model, bank, pinned, reqs, False, max_num_seqs)
    graphed, eng = _run(model, bank, pinned, reqs, True, max_num_seqs)
    assert eng.graphs.replays > 0 and len(eng.graphs.graphs) > 1  # several buckets, padding exercised
    assert graphed == eager


@cuda
def test_graphs_captured_up_front_give_the_eager_tokens():
    """``capture_all`` (what ``bench batch`` runs before its clock) captures every bucket; the
    job then replays them, captures nothing more, and gives the eager tokens."""
    config = preset_config("tiny", "float32")
    model = random_model(config, torch.device("cuda"), torch.float32, seed=7)
    bank, pinned = random_bank(model, 3, 4, seed=7)
    reqs = _requests(19, [None, "bench-0", "bench-1", "bench-2"], config.vocab_size, seed=8)
    eager, _ = _run(model, bank, pinned, reqs, False, 16)
    eng = Engine(model, bank, pinned, _config(16, True), num_blocks=256)
    eng.graphs.capture_all()
    captured = dict(eng.graphs.graphs)
    assert sorted(captured) == eng.graphs.buckets
    for r in reqs:
        assert eng.add(r) is None
    assert {r.row: r.token_ids for r in eng.drain()} == eager
    assert eng.graphs.replays > 0 and sorted(eng.graphs.graphs) == sorted(captured)
    assert all(eng.graphs.graphs[b] is captured[b] for b in captured)  # the same graphs: none recaptured


@cuda
def test_graph_logits_equal_eager_logits_with_padding():
    config = preset_config("tiny", "float32")
    model = random_model(config, torch.device("cuda"), torch.float32, seed=5)
    bank, pinned = random_bank(model, 2, 4, seed=5)
    eng = Engine(model, bank, pinned, _config(8, True), num_blocks=64)
    for r in _requests(5, [None, "bench-0", "bench-1"], config.vocab_size, seed=6):
        eng.add(r)
    while eng.waiting or any(s.pending != 1 for s in eng.running):
        eng.step()
    plan = eng.schedule()
    assert plan.doff == 0 and len(plan.seqs) == 5  # decode-only: the graph path, bucket 8 (3 padded rows)
    graphs, eng.executor.graphs = eng.graphs, None
    eager = eng.executor.forward(plan).clone()
    kv_after_eager = [k.clone() for k in eng.kv.k]
    eng.executor.graphs = graphs
    got = eng.executor.forward(plan)
    assert graphs.replays == 1
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(kv_after_eager, eng.kv.k):  # same K/V rewritten; padding went to the scratch block only
        torch.testing.assert_close(a[:-1], b[:-1], rtol=0, atol=1e-6)


def test_a_new_bucket_is_captured_over_its_own_rows(monkeypatch):
    """Decode tiles longest context first: after a 9-row iteration (bucket 16, tiles in that
    batch's order) a first 3-row iteration captures bucket 4; its eager warm-up run must see a
    permutation of rows 0-3, not the 16-row order's first four entries (rows 8, 7, 6, 5: on a
    GPU an illegal memory access, the larger bucket's order naming rows past the smaller
    bucket's tensors). Emulated on the CPU (every forward, replays too, seen)."""
    eng, model, _ = _graphed_engine(11, num_blocks=64, max_num_seqs=16)
    graphs = eng.graphs
    seen = []
    forward = model.forward

    def spy(ids, *args, **kwargs):
        if DEVICE.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            seen.append((ids.shape[0], graphs.tile_seq[: ids.shape[0]].tolist()))
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    scratch = graphs.scratch_slot

    def step(n):  # n decode rows, contexts 1..n (longest last in batch order), one block each
        ctx = list(range(1, n + 1))
        return graphs.run(list(range(n)), [c - 1 for c in ctx], [scratch] * n, [[0]] * n, ctx, [0, 1, -1] * (n // 3))

    step(9)
    logits = step(3).clone()
    assert [b for b, _ in seen if b == 16][:1] == [16] and 4 in [b for b, _ in seen], seen
    assert all(sorted(order) == list(range(b)) for b, order in seen), seen
    assert graphs.tile_seq[:4].tolist() == [2, 1, 0, 3]  # then the 3-row batch's own order
    assert logits.shape[0] == 3 and torch.isfinite(logits).all()


@pytest.fixture(scope="module")
def eager_mixed():
    """(model, requests, the eager engine's tokens) of nine mixed rows over a tiny model and a
    Triton bank of two adapters (``random_bank(model, 2, 4, seed=13)``), computed once for the
    tests that compare the decode graphs with it (they only read it; each builds its own bank)."""
    config = preset_config("tiny", "float32")
    model = random_model(config, DEVICE, torch.float32, seed=13)
    bank, pinned = random_bank(model, 2, 4, seed=13, backend="triton")
    reqs = _mixed_requests(config, [None, "bench-0", "bench-1"], seed=14)
    eager, _ = _run(model, bank, pinned, reqs, False, 6)
    return model, reqs, eager


@pytest.mark.parametrize("lookahead", [False, True])
def test_emulated_graphs_give_the_eager_tokens(lookahead, eager_mixed):
    """The engine with decode graphs (emulated on the CPU: static buffers, buckets, padding,
    staged inputs, the decode tiles longest first, the LoRA tile lists refilled in place) gives
    the eager engine's tokens, over batch sizes that grow and shrink across buckets, and with
    lookahead (the next iteration's inputs staged into the buffers ahead of its replay, the
    iteration after launched from the device's argmax)."""
    model, reqs, eager = eager_mixed
    bank, pinned = random_bank(model, 2, 4, seed=13, backend="triton")
    graphed, eng = _run(model, bank, pinned, reqs, True, 6, lookahead=lookahead)
    assert eng.graphs.replays > 0 and len(eng.graphs.graphs) > 1
    assert (eng.lookahead_used > 0) == lookahead  # staged iterations replayed
    assert graphed == eager


def test_emulated_graphs_over_the_joint_ledgers_page_major_kv_give_the_eager_tokens():
    """The joint memory ledger's KV cache is page-major (one arena page is one block of every
    layer), its scratch block the arena's spare page: under the decode graphs (emulated on the
    CPU) the rows write their K/V at the staged slots of that layout and give the tokens of the
    eager engine over its own layer-major cache."""
    config = preset_config("tiny", "float32")
    model = random_model(config, DEVICE, torch.float32, seed=13)
    c = model.config
    page = KVCache.block_bytes(c.num_layers, 4, c.num_kv_heads, c.head_dim, torch.float32)
    arena = PageArena(128, page, DEVICE, spare_pages=1)
    bank = ResidencyBank(c.num_layers, model.group_shapes(), 1, 4, torch.float32, DEVICE, backend="triton",
                         prefetch_workers=0, expected_adapters=0, arena=arena)
    try:
        reqs = _mixed_requests(config, [None], seed=14)
        eager, plain = _run(model, None, {}, reqs, False, 6)
        eng = Engine(model, bank, {}, _config(6, True), num_blocks=arena.num_pages, arena=arena)
        for r in reqs:
            assert eng.add(r) is None
        graphed = {r.row: r.token_ids for r in eng.drain()}
    finally:
        bank.close()
    assert eng.kv.layout == "page-major" and plain.kv.layout == "layer-major"
    assert eng.graphs.replays > 0 and len(eng.graphs.graphs) > 1
    assert graphed == eager


def _mixed_requests(config, adapters, seed):
    """Nine rows of 3-12 prompt tokens and 2-7 new ones: batch sizes grow and shrink across buckets."""
    rng = random.Random(seed)
    return [Request(row=i, id=str(i), prompt_ids=[rng.randrange(config.vocab_size) for _ in range(rng.randint(3, 12))],
                    adapter=rng.choice(adapters), max_new_tokens=rng.randint(2, 7)) for i in range(9)]


def test_graph_buffer_check_names_the_broken_invariant():
    """``DecodeGraphs.check_buffers`` (run before every emulated replay): a decode tile order
    that is not a permutation of the bucket's rows, a padding row that is not padding, and a
    block table naming a block outside the cache are each refused by name."""
    eng, _, _ = _graphed_engine(15, num_blocks=16, max_num_seqs=8, adapters=0)
    g = eng.graphs
    g.context_lens[:3] = torch.tensor([5, 1, 8], dtype=torch.int32)
    g.block_tables[:3, :2] = torch.tensor([[0, 1], [2, 0], [3, 4]], dtype=torch.int32)
    g.check_buffers(4, 3)  # the good state
    g.tile_seq[:4] = torch.tensor([8, 7, 6, 5], dtype=torch.int32)
    with pytest.raises(GraphBufferError, match="not a permutation"):
        g.check_buffers(4, 3)
    g.tile_seq[:4] = torch.tensor([2, 0, 1, 3], dtype=torch.int32)
    g.check_buffers(4, 3)
    g.positions[3] = 7
    with pytest.raises(GraphBufferError, match="padding rows 3..3"):
        g.check_buffers(4, 3)
    g.positions[3] = 0
    g.block_tables[2, 1] = 16  # the scratch block is 16; 17 blocks in all
    g.check_buffers(4, 3)
    g.block_tables[2, 1] = 17
    with pytest.raises(GraphBufferError, match="outside the cache"):
        g.check_buffers(4, 3)


def test_graph_buffer_check_covers_the_lora_tile_list():
    """The check's LoRA part: a bucket's static tile list filled from its rows passes; a tile
    naming a row past the bucket, or a tile count past the list's capacity, is refused."""
    eng, _, bank = _graphed_engine(17, num_blocks=16, max_num_seqs=8)
    g = eng.graphs
    g.context_lens[:3] = torch.tensor([5, 1, 8], dtype=torch.int32)
    lp = g.lora[4].static
    bank.context(torch.tensor([1, -1, 0, -1], dtype=torch.int32), static=lp)
    g.check_buffers(4, 3)
    live = int(lp.num_tiles)
    assert live == 2
    lp.sorted_rows[int(lp.tile_start[0])] = 5  # a row of a larger bucket
    with pytest.raises(GraphBufferError, match="names a row outside"):
        g.check_buffers(4, 3)
    lp.sorted_rows[int(lp.tile_start[0])] = 0
    lp.num_tiles.fill_(lp.tile_capacity + 1)
    with pytest.raises(GraphBufferError, match="LoRA tiles in a list"):
        g.check_buffers(4, 3)
