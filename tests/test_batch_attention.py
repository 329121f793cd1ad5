"""The Triton paged attention kernel against the torch reference.

On the CPU the kernel runs under TRITON_INTERPRET=1 (conftest), so shapes stay
small. Every case builds a paged cache whose blocks are handed out in a
shuffled order, fills every cache slot that no sequence owns (and every slot
past a sequence's context) with NaN, poisons the output with NaN, and packs
prefill chunks, whole prompts and decode rows into one invocation.
"""

import dataclasses
import random

import pytest
import torch

from mlora.batch.model.attention import AttentionMetadata, attention
from mlora.batch.model.kvcache import KVCache
from mlora.kernels.paged_attention import PagedLayout, paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def paged_case(seed: int, seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
               dtype=torch.float32):
    """``seqs`` = (new rows, context length) per sequence, in packing order.
    Returns (q, kv cache, metadata); cache slots outside every context are NaN."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-c // block_size) for _, c in seqs)
    num_blocks = need + 3
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    kv = KVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    kv.k[0].fill_(float("nan"))
    kv.v[0].fill_(float("nan"))
    starts, ctx_lens, tables, slots = [0], [], [], []
    for n, c in seqs:
        assert 1 <= n <= c
        table = [order.pop() for _ in range(-(-c // block_size))]
        for p in range(c):  # every position of the context holds a finite key and value
            b, i = table[p // block_size], p % block_size
            kv.k[0][b, i] = torch.randn(kv_heads, head_dim, generator=g).to(dtype)
            kv.v[0][b, i] = torch.randn(kv_heads, head_dim, generator=g).to(dtype)
        starts.append(starts[-1] + n)
        ctx_lens.append(c)
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c - n, c)]
    q = torch.randn(starts[-1], heads, head_dim, generator=g).to(dtype).to(DEVICE)
    meta = AttentionMetadata(query_starts=starts, context_lens=ctx_lens, block_tables=tables,
                             slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE))
    return q, kv, meta


def run_kernel(q, kv, meta):
    meta.backend = "triton"
    layout = meta.paged_layout(kv.block_size, q.shape[1] // kv.num_kv_heads, q.device)
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, kv.k[0], kv.v[0], layout, q.shape[-1] ** -0.5, out=out)
    assert got is out
    return got


def reference(q, kv, meta):
    meta.backend = "torch"
    return attention(q, 0, kv, meta, q.shape[-1] ** -0.5)


@pytest.mark.parametrize(
    "seed, seqs, heads, kv_heads, head_dim, block_size, dtype",
    [
        # decode rows, a chunk in the middle of a prompt, a whole prompt; GQA 4
        (0, [(1, 9), (5, 12), (1, 1), (17, 17), (1, 70)], 8, 2, 16, 4, torch.float32),
        (1, [(3, 3), (1, 33), (20, 40)], 4, 4, 32, 16, torch.float32),  # MHA, block 16
        (2, [(1, 5), (1, 6), (7, 30)], 6, 2, 24, 8, torch.float32),  # group 3 (padded to 4), head_dim 24
        (3, [(1, 65), (66, 66), (2, 2)], 8, 1, 16, 4, torch.bfloat16),  # MQA, keys past one key block
        (4, [(1, 20), (9, 21)], 4, 2, 16, 4, torch.float16),
    ],
)
def test_kernel_equals_the_reference(seed, seqs, heads, kv_heads, head_dim, block_size, dtype):
    q, kv, meta = paged_case(seed, seqs, heads, kv_heads, head_dim, block_size, dtype)
    want = reference(q, kv, meta).float()
    got = run_kernel(q, kv, meta).float()
    assert torch.isfinite(got).all()  # every row written, no NaN slot ever read
    err = (got - want).abs().max() / want.abs().max()
    assert err <= TOL[dtype], float(err)


@pytest.mark.parametrize("warps", [4, 8])
def test_kernel_equals_the_reference_at_each_warp_count(warps, monkeypatch):
    """Decode and prefill launches at 4 and 8 warps (the defaults differ: decode 4, prefill 8):
    the same results on a decode + prefill mix in bfloat16 (compiled on a GPU; the interpreter
    ignores warps, so on the CPU this is the kernel's plain check)."""
    from mlora.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "DECODE_WARPS", warps)
    monkeypatch.setattr(pa, "PREFILL_WARPS", warps)
    q, kv, meta = paged_case(6, [(1, 40), (9, 9), (1, 130), (33, 70)], 8, 2, 32, 16, torch.bfloat16)
    want = reference(q, kv, meta).float()
    got = run_kernel(q, kv, meta).float()
    assert torch.isfinite(got).all()
    err = (got - want).abs().max() / want.abs().max()
    assert err <= TOL[torch.bfloat16], float(err)


def test_kernel_rows_do_not_depend_on_the_other_sequences():
    q, kv, meta = paged_case(5, [(1, 9), (6, 14), (1, 3)], 4, 2, 16, 4)
    alone_q, alone_kv, alone_meta = q[1:7], kv, AttentionMetadata(
        query_starts=[0, 6], context_lens=[14], block_tables=[meta.block_tables[1]],
        slot_mapping=meta.slot_mapping[1:7])
    together = run_kernel(q, kv, meta)[1:7]
    alone = run_kernel(alone_q.contiguous(), alone_kv, alone_meta)
    torch.testing.assert_close(together, alone, rtol=1e-6, atol=1e-6)


def test_layout_splits_decode_and_prefill_launches(monkeypatch):
    from mlora.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "PREFILL_ROWS", 64)  # 16 new rows x 4 heads: the 20-row prompt takes two tiles
    layout = PagedLayout.build([0, 1, 21, 22], [8, 20, 30], [[0, 1], [2, 3, 4], [5, 6, 7, 8]], group=4,
                               device=torch.device("cpu"))
    by_q = {t.block_q: (t.tile_seq.tolist(), t.tile_q0.tolist()) for t in layout.launches}
    assert by_q == {16: ([1, 1], [0, 16]), 4: ([2, 0], [0, 0])}  # decode tiles longest context first
    pad = [0] * 12  # the tables' row stride is a multiple of 16 whatever the longest table
    assert layout.block_tables.tolist() == [[0, 1, 0, 0] + pad, [2, 3, 4, 0] + pad, [5, 6, 7, 8] + pad]
    assert layout.context_lens.tolist() == [8, 20, 30] and layout.query_starts.tolist() == [0, 1, 21, 22]


def test_layout_metadata_is_aligned_whatever_the_batch():
    """Triton specialises each launch on every pointer's 16-byte alignment and every integer's
    divisibility by 16: the layout's arrays start at 64-byte offsets into one buffer and the
    tables' row stride is a multiple of 16 for any batch, so one compiled variant serves all."""
    import random

    rng = random.Random(7)
    for _ in range(20):
        B = rng.randint(1, 9)
        news = [rng.choice([1, 1, rng.randint(2, 40)]) for _ in range(B)]
        ctx = [n + rng.randint(0, 50) for n in news]
        tables = [list(range(-(-c // 16))) for c in ctx]
        starts = [0]
        for n in news:
            starts.append(starts[-1] + n)
        layout = PagedLayout.build(starts, ctx, tables, group=4, device=torch.device("cpu"))
        arrays = [layout.block_tables, layout.context_lens, layout.query_starts]
        arrays += [t for tl_ in layout.launches for t in (tl_.tile_seq, tl_.tile_q0)]
        # offsets into the one buffer (on a GPU its allocation is 512-byte aligned; numpy's on the CPU need not be)
        assert all((a.data_ptr() - a.untyped_storage().data_ptr()) % 64 == 0 for a in arrays)
        assert layout.block_tables.stride(0) % 16 == 0
        assert layout.context_lens.tolist() == ctx and layout.query_starts.tolist() == starts
        assert [row[: len(t)] for row, t in zip(layout.block_tables.tolist(), tables)] == tables


def test_kernel_refuses_mismatched_shapes():
    q, kv, meta = paged_case(6, [(1, 4)], 4, 2, 16, 4)
    layout = meta.paged_layout(kv.block_size, 2, q.device)
    with pytest.raises(ValueError, match="paged_attention"):
        paged_attention(q[..., :8].contiguous(), kv.k[0], kv.v[0], layout, 1.0)
    with pytest.raises(ValueError, match="cache is"):
        paged_attention(q.double(), kv.k[0], kv.v[0], layout, 1.0)


def test_pad_tables():
    from mlora.kernels.paged_attention import pad_tables

    got = pad_tables([[5, 6], [], [7, 8, 9]])
    assert got.dtype.name == "int32" and got.tolist() == [[5, 6, 0], [0, 0, 0], [7, 8, 9]]
    assert pad_tables([[1]], width=4).tolist() == [[1, 0, 0, 0]]
    assert pad_tables([]).shape == (0, 1)


@pytest.mark.parametrize("splits", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_keys_of_decode_rows_equal_the_reference(splits, dtype):
    """Decode rows whose keys are split over several programs and merged (flash-decoding):
    contexts shorter than one chunk (empty chunks), exactly one BLOCK_N, several, and a
    prefill sequence in the same invocation (never split) all equal the reference."""
    from mlora.kernels.paged_attention import DECODE_BLOCK_N as BLOCK_N

    seqs = [(1, 3), (1, BLOCK_N), (1, 3 * BLOCK_N + 5), (9, 20), (1, 130), (1, 1)]
    q, kv, meta = paged_case(7 + splits, seqs, 8, 2, 16, 4, dtype)
    meta.backend = "triton"
    layout = meta.paged_layout(kv.block_size, q.shape[1] // kv.num_kv_heads, q.device)
    assert [t.decode for t in layout.launches].count(True) == 1
    want = reference(q, kv, meta).float()
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, kv.k[0], kv.v[0], layout, q.shape[-1] ** -0.5, out=out, splits_override=splits).float()
    assert torch.isfinite(got).all()
    err = (got - want).abs().max() / want.abs().max()
    assert err <= TOL[dtype], float(err)
    one = paged_attention(q, kv.k[0], kv.v[0], layout, q.shape[-1] ** -0.5, splits_override=1).float()
    if dtype == torch.float32:  # the same numbers up to the merge's float32 reassociation
        torch.testing.assert_close(got, one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_dispatch_order_does_not_change_results(splits):
    """The decode launch lists its tiles longest context first (ties in batch order) on a
    heads-first grid; the prefill launch keeps batch order on a tiles-first grid. Every row
    gets the reference's numbers, and the same numbers as the decode tiles in batch order on a
    tiles-first grid."""
    from mlora.kernels import paged_attention as pa

    seqs = [(1, 3), (1, 3 * pa.DECODE_BLOCK_N + 5), (9, 20), (1, 130), (1, 70), (1, 130)]
    q, kv, meta = paged_case(31 + splits, seqs, 8, 2, 16, 4, torch.float32)
    group = q.shape[1] // kv.num_kv_heads
    layout = pa.PagedLayout.build(meta.query_starts, meta.context_lens, meta.block_tables, group, q.device)
    decode = next(t for t in layout.launches if t.decode)
    prefill = next(t for t in layout.launches if not t.decode)
    assert decode.heads_first and not prefill.heads_first
    assert decode.tile_seq.tolist() == [1, 3, 5, 4, 0]
    assert prefill.tile_seq.tolist() == [2]
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, kv.k[0], kv.v[0], layout, q.shape[-1] ** -0.5, out=out, splits_override=splits)
    torch.testing.assert_close(got, reference(q, kv, meta), rtol=1e-4, atol=1e-4)
    batch_order = torch.tensor([0, 1, 3, 4, 5], dtype=torch.int32, device=q.device)
    in_batch_order = dataclasses.replace(decode, tile_seq=batch_order, heads_first=False)
    plain = dataclasses.replace(layout, launches=[in_batch_order if t is decode else t for t in layout.launches])
    want = paged_attention(q, kv.k[0], kv.v[0], plain, q.shape[-1] ** -0.5, splits_override=splits)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_graph_tile_order_is_a_permutation_of_the_bucket():
    """DecodeGraphs' decode tile order: real rows longest context first (ties in batch order),
    then the bucket's padding rows, so every replay reads a whole permutation."""
    from mlora.batch.engine.graphs import DecodeGraphs

    assert DecodeGraphs._tile_order([5, 9, 5, 12], 8).tolist() == [3, 1, 0, 2, 4, 5, 6, 7]
    assert DecodeGraphs._tile_order([7], 1).tolist() == [0]


def test_decode_splits_rule():
    """Few programs per SM split (powers of two, capped); enough do not."""
    from mlora.kernels import paged_attention as pa

    cpu = torch.device("cpu")  # 4 "SMs"
    assert pa.decode_splits(pa.SPLIT_BELOW_PROGRAMS_PER_SM * 4, cpu) == 1
    assert pa.decode_splits(10_000, cpu) == 1
    assert pa.decode_splits(pa.SPLIT_BELOW_PROGRAMS_PER_SM * 4 // 2, cpu) == 2
    assert pa.decode_splits(1, cpu) == pa.MAX_DECODE_SPLITS


def test_kv_layout_is_a_parameter():
    """Layer-major unless the caller names page-major or passes pages; an unknown layout is
    refused by name."""
    from mlora.batch.model.kvcache import KVCache

    assert KVCache(2, 4, 16, 2, 8).layout == "layer-major"
    assert KVCache(2, 4, 16, 2, 8, layout="page-major").layout == "page-major"
    pages = torch.zeros(4, 2, 2, 16, 2, 8)
    assert KVCache(2, 4, 16, 2, 8, pages=pages).layout == "page-major"
    with pytest.raises(ValueError, match="KV cache layout 'sideways'"):
        KVCache(2, 4, 16, 2, 8, layout="sideways")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_page_major_views(dtype):
    """The page-major KV layout's per-layer views (block stride = a whole page of every layer)
    through the kernel and the reference: the same output as the contiguous layer tensors."""
    q, kv, meta = paged_case(12, [(1, 40), (5, 21), (1, 3)], 8, 2, 16, 4, dtype)
    paged = KVCache(3, kv.num_blocks, kv.block_size, kv.num_kv_heads, kv.head_dim, dtype=dtype, device=DEVICE,
                    layout="page-major")
    paged.pages.fill_(float("nan"))
    paged.k[1].copy_(kv.k[0])
    paged.v[1].copy_(kv.v[0])
    want = run_kernel(q, kv, meta)
    layout = meta.paged_layout(kv.block_size, q.shape[1] // kv.num_kv_heads, q.device)
    got = paged_attention(q, paged.k[1], paged.v[1], layout, q.shape[-1] ** -0.5)
    assert torch.equal(got, want)
    meta.backend = "torch"
    ref = attention(q, 1, paged, meta, q.shape[-1] ** -0.5)
    assert (ref.float() - want.float()).abs().max() <= TOL[dtype] * want.float().abs().max()
