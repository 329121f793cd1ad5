"""Engine(lookahead=True): the next decode iteration's inputs built while the device runs the
current one, used only when the schedule would be exactly that iteration.

Every test compares against the same engine without lookahead: same tokens, same
iteration counts, and each taken lookahead plan equal to the plan ``schedule``
returns at that moment."""

import dataclasses
import random
from collections import Counter

import pytest
import torch

from mlora.batch.config import EngineConfig
from mlora.batch.engine.engine import Decoding, Engine, Request
from mlora.bench.batch import preset_config, random_bank, random_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
# the chained-decode tests run on real CUDA graphs where there is a GPU, emulated ones on the CPU
# (Triton kernels cannot take CPU tensors once a GPU is visible: no interpreter then)
GRAPHS_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class CheckedEngine(Engine):
    """Checks every taken lookahead against ``schedule`` (side-effect free there: no row can
    be admitted and every row already holds its next block)."""

    checked = 0

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        take = self.scheduler.take

        def checked_take(seqs, p0):
            plan = take(seqs, p0)
            if plan is not None:
                blocks = self.allocator.num_free
                want = self.schedule()
                assert self.allocator.num_free == blocks  # the lookahead already gave out the blocks
                assert [id(s) for s in want.seqs] == [id(s) for s in plan.seqs]
                assert (want.new_tokens, want.sample, want.prefill_indptr, want.doff) == \
                    (plan.new_tokens, plan.sample, plan.prefill_indptr, plan.doff)
                CheckedEngine.checked += 1
            return plan

        self.scheduler.take = checked_take


def _config(max_num_seqs, *, graphs=False, lookahead=False):
    """The engine choices these tests use: 4-token blocks, 64-token iterations."""
    return EngineConfig(block_size=4, max_num_seqs=max_num_seqs, max_batch_tokens=64, cuda_graphs=graphs,
                        lookahead=lookahead)


def _requests(n, adapters, vocab, seed, prompt_max=30, new_max=14):
    rng = random.Random(seed)
    return [Request(row=i, id=str(i), prompt_ids=[rng.randrange(vocab) for _ in range(rng.randint(2, prompt_max))],
                    adapter=rng.choice(adapters), max_new_tokens=rng.randint(1, new_max)) for i in range(n)]


def _run(model, bank, pinned, reqs, *, lookahead, num_blocks=256, max_num_seqs=6, graphs=False, cls=Engine):
    eng = cls(model, bank, pinned, _config(max_num_seqs, graphs=graphs, lookahead=lookahead), num_blocks=num_blocks)
    for r in reqs:
        assert eng.add(r) is None
    out = {r.row: (r.token_ids, r.finish_reason) for r in eng.drain()}
    return out, eng


@pytest.mark.parametrize("max_num_seqs,num_blocks", [(6, 256), (16, 256), (8, 14)])
def test_lookahead_gives_the_same_tokens_and_iterations(max_num_seqs, num_blocks):
    """Mixed adapters and base rows, rows of different lengths finishing at different
    iterations, waiting rows admitted as seats free up; (8, 14): a KV cache so small that
    decode growth preempts and the lookahead must decline for want of blocks."""
    config = preset_config("tiny", "float32")
    model = random_model(config, torch.device("cpu"), torch.float32, seed=3)
    bank, pinned = random_bank(model, 3, 4, seed=3)
    reqs = _requests(40, [None, "bench-0", "bench-1", "bench-2"], config.vocab_size, seed=4)
    plain, ref = _run(model, bank, pinned, reqs, lookahead=False, num_blocks=num_blocks, max_num_seqs=max_num_seqs)
    CheckedEngine.checked = 0
    ahead, eng = _run(model, bank, pinned, reqs, lookahead=True, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                      cls=CheckedEngine)
    assert ahead == plain and len(plain) == 40
    assert eng.stats == ref.stats  # iterations, prefill/decode tokens, preemptions
    assert eng.lookahead_used == CheckedEngine.checked > 0
    assert eng.lookahead_used < eng.stats["iterations"]  # declined where rows finished or were admitted
    assert eng.allocator.num_free == num_blocks  # every block back, looked-ahead ones included
    if num_blocks == 14:
        assert ref.stats["preemptions"] > 0


def test_a_row_that_finishes_frees_its_looked_ahead_block():
    """The lookahead gives a row crossing a block boundary its next block; the row then
    finishes (max_new_tokens) and its blocks, that one included, go back."""
    config = preset_config("tiny", "float32")
    model = random_model(config, torch.device("cpu"), torch.float32, seed=1)
    eng = Engine(model, None, {}, _config(2, lookahead=True), num_blocks=8)
    eng.add(Request(row=0, id="0", prompt_ids=[5, 6, 7], adapter=None, max_new_tokens=2))
    eng.step()  # prefill: 3 rows, token 1 sampled (4 tokens: one full block)
    assert eng.executor.ahead is None  # not a decode-only iteration
    eng.step()  # decode position 3: looks ahead to position 4 (a new block), then the row finishes
    ahead = eng.executor.ahead
    assert ahead.positions == [4] and len(ahead.tables[0]) == 2  # it did take a second block
    assert not eng.running and not ahead.seqs[0].is_running and eng.allocator.num_free == 8
    assert eng.step() == [] and eng.lookahead_used == 0  # nothing left: the stale lookahead is dropped


@cuda
def test_lookahead_with_decode_graphs_gives_the_eager_tokens():
    config = preset_config("tiny", "float32")
    model = random_model(config, torch.device("cuda"), torch.float32, seed=3)
    bank, pinned = random_bank(model, 3, 4, seed=3)
    reqs = _requests(23, [None, "bench-0", "bench-1", "bench-2"], config.vocab_size, seed=4)
    eager, _ = _run(model, bank, pinned, reqs, lookahead=False, max_num_seqs=16)
    graphed, eng = _run(model, bank, pinned, reqs, lookahead=True, max_num_seqs=16, graphs=True)
    assert eng.graphs.replays > 0 and eng.lookahead_used > 0 and eng.chained > 0
    assert graphed == eager


def test_a_row_that_arrives_with_a_free_seat_is_admitted_instead_of_the_lookahead():
    """A row added between steps (the job feeds its input that way) while a seat is free: the
    next step schedules and admits it, as the engine without lookahead would; the looked-ahead
    decode-only iteration is dropped."""
    config = preset_config("tiny", "float32")
    model = random_model(config, torch.device("cpu"), torch.float32, seed=2)
    eng = Engine(model, None, {}, _config(4, lookahead=True), num_blocks=64)
    for i in range(2):
        eng.add(Request(row=i, id=str(i), prompt_ids=[3 + i, 4, 5], adapter=None, max_new_tokens=20))
    while any(s.pending != 1 for s in eng.running) or eng.executor.ahead is None:
        eng.step()
    used = eng.lookahead_used
    eng.add(Request(row=9, id="9", prompt_ids=[7, 8, 9], adapter=None, max_new_tokens=5))
    eng.step()
    assert eng.lookahead_used == used  # dropped: the schedule had a row to admit
    late = next(s for s in eng.running if s.req.row == 9)
    assert late.num_computed == 3  # admitted and prefilled in this very step


@pytest.mark.parametrize("max_num_seqs,num_blocks,eos,adapters,rows", [(6, 256, False, True, 5),
                                                                        (16, 256, True, False, 24),
                                                                        (8, 14, False, False, 12)])
def test_chained_decode_gives_the_same_tokens(max_num_seqs, num_blocks, eos, adapters, rows):
    """Chained decode on the (emulated) decode graphs launches the looked-ahead iteration
    from the device's argmax before reading the tokens: rows that finish (length; with ``eos``
    also end-of-sequence tokens) while the chained iteration runs have their extra row dropped,
    waiting rows are admitted one iteration later, a small cache (14 blocks) preempts and the
    lookahead declines. Every row's tokens and finish reason equal the plain engine's; every
    block comes back. With ``adapters`` a slot bank (its Triton kernels interpreted on the
    CPU under graphs: few, short rows of both adapters and the base, finishing after 1 to 6
    new tokens)."""
    config = preset_config("tiny", "float32")
    model = random_model(config, GRAPHS_DEVICE, torch.float32, seed=3)
    bank, pinned = random_bank(model, 2, 4, seed=3, backend="triton") if adapters else (None, {})
    names = [None, "bench-0", "bench-1"] if adapters else [None]
    short = dict(seed=0, prompt_max=12, new_max=8) if adapters else dict(seed=4)
    reqs = _requests(rows, names, config.vocab_size, **short)
    if eos:  # the three tokens the model generates most become end-of-sequence: many rows stop early
        free, _ = _run(model, bank, pinned, reqs, lookahead=False, num_blocks=num_blocks, max_num_seqs=max_num_seqs)
        common = Counter(t for toks, _ in free.values() for t in toks).most_common(3)
        model.config = dataclasses.replace(model.config, eos_token_ids=tuple(t for t, _ in common))
    plain, ref = _run(model, bank, pinned, reqs, lookahead=False, num_blocks=num_blocks, max_num_seqs=max_num_seqs)
    chained, eng = _run(model, bank, pinned, reqs, lookahead=True, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                        graphs=True)
    assert chained == plain and len(plain) == len(reqs)
    assert eng.chained > 0 and eng.graphs.replays > 0
    assert eng.stats["generated_tokens"] == ref.stats["generated_tokens"]
    assert eng.allocator.num_free == num_blocks
    if eos:
        assert sum(reason == "stop" for _, reason in plain.values()) > 3
    if num_blocks == 14:
        assert ref.stats["preemptions"] > 0 and eng.stats["preemptions"] > 0


def test_chained_decode_drops_the_token_of_a_row_that_finished():
    """Two rows decode in a chain; one reaches max_new_tokens: the chained iteration launched
    before its last token was read still ran it, and that row's token from it is dropped
    (the row keeps exactly max_new_tokens tokens), while the other row goes on."""
    config = preset_config("tiny", "float32")
    model = random_model(config, GRAPHS_DEVICE, torch.float32, seed=5)
    reqs = [Request(row=0, id="0", prompt_ids=[3, 4, 5], adapter=None, max_new_tokens=4),
            Request(row=1, id="1", prompt_ids=[6, 7], adapter=None, max_new_tokens=9)]
    plain, _ = _run(model, None, {}, reqs, lookahead=False, max_num_seqs=2)
    eng = Engine(model, None, {}, _config(2, graphs=True, lookahead=True), num_blocks=64)
    for r in reqs:
        eng.add(r)
    done = {}
    while eng.has_work():
        for r in eng.step():
            done[r.row] = (r.token_ids, r.finish_reason)
            if r.row == 0:
                assert eng.executor.inflight is not None  # launched before row 0's last token was read
    assert done == plain and len(done[0][0]) == 4 and eng.chained > 0


def test_chained_decode_with_stop_strings_gives_the_same_rows():
    """Rows stopped by a stop string (found on the host after the next iteration was launched)
    keep the plain engine's tokens, text and finish reason; the chain still engages."""
    config = preset_config("tiny", "float32")
    model = random_model(config, GRAPHS_DEVICE, torch.float32, seed=6)
    reqs = _requests(16, [None], config.vocab_size, seed=8)

    def detok(ids):
        return "".join(chr(97 + t % 3) for t in ids)  # a three-letter alphabet: stop strings are met early

    def run(graphs=False, lookahead=False):
        eng = Engine(model, None, {}, _config(16, graphs=graphs, lookahead=lookahead), num_blocks=256,
                     decoding=Decoding(stop_strings=("ab", "ca"), detokenize=detok))
        for r in reqs:
            eng.add(r)
        return {r.row: (r.token_ids, r.text, r.finish_reason) for r in eng.drain()}, eng

    plain, _ = run(lookahead=False)
    chained, eng = run(lookahead=True, graphs=True)
    assert chained == plain and len(plain) == len(reqs)
    assert sum(reason == "stop" for _, _, reason in plain.values()) > 3 and eng.chained > 0


def test_sampled_decode_is_never_chained():
    """With temperature sampling the device's argmax is not the token: the chain declines every
    iteration (none chained, the lookahead still used) and the rows equal those of the same
    graphs without lookahead (same seeds)."""
    from mlora.batch.engine.sampling import SamplingParams

    config = preset_config("tiny", "float32")
    model = random_model(config, GRAPHS_DEVICE, torch.float32, seed=7)
    reqs = _requests(6, [None], config.vocab_size, seed=9)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    out = []
    for lookahead in (False, True):
        eng = Engine(model, None, {}, _config(8, graphs=True, lookahead=lookahead), num_blocks=256,
                     decoding=Decoding(sampling))
        for r in reqs:
            eng.add(r)
        out.append({r.row: r.token_ids for r in eng.drain()})
        assert eng.chain == lookahead and eng.chained == 0 and (eng.lookahead_used > 0) == lookahead
    assert out[0] == out[1]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chained_decode_with_cuda_graphs_gives_the_eager_tokens(dtype):
    """On a GPU: the chained launch (argmax, its copies to the host and into the token-id
    buffer, then the replay, all queued on the stream while the last iteration may still run)
    gives the tokens of the same graphs without lookahead, so without chaining (equal in
    bfloat16 too), and in float32 the eager engine's; a Triton slot bank, rows finishing at
    different iterations."""
    config = preset_config("tiny", "float32")
    model = random_model(config, torch.device("cuda"), dtype, seed=3)
    bank, pinned = random_bank(model, 3, 4, seed=3, backend="triton")
    reqs = _requests(23, [None, "bench-0", "bench-1", "bench-2"], config.vocab_size, seed=4)
    graphed, _ = _run(model, bank, pinned, reqs, lookahead=False, max_num_seqs=16, graphs=True)
    chained, eng = _run(model, bank, pinned, reqs, lookahead=True, max_num_seqs=16, graphs=True)
    assert eng.chained > 0 and eng.graphs.replays > 0
    assert chained == graphed
    if dtype == torch.float32:
        eager, _ = _run(model, bank, pinned, reqs, lookahead=False, max_num_seqs=16)
        assert chained == eager


def test_chain_needs_graphs_and_lookahead():
    config = preset_config("tiny", "float32")
    model = random_model(config, torch.device("cpu"), torch.float32, seed=1)

    def engine(graphs=True, lookahead=True):
        return Engine(model, None, {}, _config(2, graphs=graphs, lookahead=lookahead), num_blocks=8)

    assert engine().chain
    assert not engine(graphs=False).chain
    assert not engine(lookahead=False).chain
