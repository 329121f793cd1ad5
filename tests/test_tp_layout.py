"""The tensor-parallel layout contract (mlora.batch.model.tp), pure: the specification's exact
two-rank trace through the real factor cuts, its failure lab, sharded against unsharded LoRA on
random shapes, the rank's local config and weight cuts, shape errors, the adapter residency ledger."""

import random

import pytest
import torch

from mlora.batch.model.decoder import ModelConfig, ModelError
from mlora.batch.model.lora import config_role_shapes
from mlora.batch.model.tp import (
    COLUMN_PARALLEL,
    ROW_PARALLEL,
    TPLayout,
    column_parallel_delta,
    kv_heads,
    lora_cuts,
    lora_elements,
    reduce_sum,
    row_parallel_output,
    shard_config,
    shard_lora,
    tp_sizes,
    weight_cuts,
)


def config(hidden=32, inter=48, heads=4, kv=2, head_dim=None, layers=2) -> ModelConfig:
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 80, "hidden_size": hidden, "intermediate_size": inter,
          "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
          "max_position_embeddings": 64}
    if head_dim is not None:
        hf["head_dim"] = head_dim
    return ModelConfig.from_hf(hf)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# ---------------------------------------------------------------- the specification's trace

# B = 3 token rows, h = d = 4, r = N = 2: the MLP pair gate (column-parallel) then down (row-parallel).
# Inputs chosen to give the trace's intermediates; factors in S-LoRA's orientation as the trace prints them
# (A [d_in, r], B [r, d_out]), transposed into the checkpoint orientation before any cut.
X = t([[0, 1, 0, 1], [4, 2, 0, 0], [2, 0, 2, 0]])
A1 = t([[1, 0], [0, 1], [1, 1], [0, 2]])
B1 = t([[1, 0, 2, -1], [2, 1, 0, 3]])
H = t([[3, 2, -4, 19], [-1, -1, -1, 6], [2, 0, 2, -7]])
A2 = t([[1, 0], [1, 1], [1, 2], [0, 1]])
B2 = t([[1, 2, 0, -1], [0, 1, 3, 2]])
Y_BASE = t([[1, 1, 2, 2], [2, 1, 1, 2], [0, 1, 3, 1]])
Y_BASE_0 = t([[1, 0, 2, 1], [0, 1, 1, 2], [0, 0, 1, 1]])  # any split of Y_BASE into two rank partials
Y_BASE_PARTS = [Y_BASE_0, Y_BASE - Y_BASE_0]

Z1_0, Z1_1 = t([[0], [4], [4]]), t([[3], [2], [2]])
Z1 = t([[0, 3], [4, 2], [4, 2]])
D1 = t([[6, 3, 0, 9], [8, 2, 8, 2], [8, 2, 8, 2]])
P2_0, P2_1 = t([[5, 2], [-2, -1], [2, 0]]), t([[-4, 11], [-1, 4], [2, -3]])
Z2 = t([[1, 13], [-3, 3], [4, -3]])
D2 = t([[1, 15, 39, 25], [-3, -3, 9, 9], [4, 5, -9, -10]])
Y = t([[2, 16, 41, 27], [-1, -2, 10, 11], [4, 6, -6, -9]])

TRACE = config(hidden=4, inter=4, heads=2, kv=2, layers=1)
RANKS = [TPLayout(0, 2), TPLayout(1, 2)]


def trace_first():
    """The first projection on two ranks, paper schedule: A cut on the rank axis, B by mlora's cut."""
    a_std, b_std = A1.T, B1.T
    b_parts = [shard_lora("gate_proj", a_std, b_std, TRACE, r)[1] for r in RANKS]
    return list(a_std.tensor_split(2, dim=0)), b_parts


def trace_second():
    """The second projection's per-rank inputs, every factor cut by mlora's ``shard_lora``."""
    shards = [shard_lora("down_proj", A2.T, B2.T, TRACE, r) for r in RANKS]
    cuts = [lora_cuts(TRACE, r)["down_proj"] for r in RANKS]
    return [c.a.take(H) for c in cuts], [a for a, _ in shards], [b for _, b in shards]


def test_two_rank_trace_first_projection_gathers_the_bottleneck():
    a_parts, b_parts = trace_first()
    first = column_parallel_delta(X, a_parts, b_parts)
    assert torch.equal(first.bottlenecks[0], Z1_0) and torch.equal(first.bottlenecks[1], Z1_1)
    assert torch.equal(first.z, Z1)
    assert torch.equal(torch.cat(first.deltas, dim=1), D1)
    assert torch.equal(D1, X @ A1 @ B1)
    # mlora's schedule: A whole on both ranks, no gather; the same output shards
    whole = column_parallel_delta(X, [A1.T], b_parts)
    assert all(torch.equal(w, f) for w, f in zip(whole.deltas, first.deltas))


def test_two_rank_trace_second_projection_reduces_then_places_slices_in_the_base_reduction():
    h_parts, a_parts, b_parts = trace_second()
    second = row_parallel_output(h_parts, a_parts, b_parts, Y_BASE_PARTS)
    assert torch.equal(second.partials[0], P2_0) and torch.equal(second.partials[1], P2_1)
    assert torch.equal(second.z, Z2)
    assert torch.equal(torch.cat(second.deltas, dim=1), D2)
    assert torch.equal(second.y, Y)
    assert torch.equal(Y, Y_BASE + H @ A2 @ B2)


def test_two_rank_trace_residency_in_fp16_bytes():
    # the paper's schedule: A_1j [h, r/N], B_1j [r, d/N], A_2j [d/N, r], B_2j [r, h/N] -> 32 bytes per rank
    a_parts, b_parts = trace_first()
    h_parts, a2_parts, b2_parts = trace_second()
    paper = [a_parts[j].numel() + b_parts[j].numel() + a2_parts[j].numel() + b2_parts[j].numel() for j in range(2)]
    assert [2 * n for n in paper] == [32, 32]
    # mlora's: the first A whole (8 more bytes per rank); every factor on every rank would be 64 bytes
    roles = ("gate_proj", "down_proj")
    assert [2 * lora_elements(TRACE, r, 2, roles) for r in RANKS] == [40, 40]
    assert 2 * lora_elements(TRACE, TPLayout(0, 1), 2, roles) == 64


# ---------------------------------------------------------------- the failure lab


def test_failure_lab_every_misplacement_changes_the_answer():
    a_parts, b_parts = trace_first()
    h_parts, a2_parts, b2_parts = trace_second()
    # omitting the rank-axis gather: each rank keeps its own bottleneck column and B's matching rank block
    no_gather = [(X @ a.T) @ b[:, j:j + 1].T for j, (a, b) in enumerate(zip(a_parts, b_parts))]
    assert not torch.equal(torch.cat(no_gather, dim=1), D1)
    # concatenating the partial sums as if they were rank-axis shards of the bottleneck
    concat = row_parallel_output(h_parts, a2_parts, b2_parts, Y_BASE_PARTS, reduce=lambda parts: torch.cat(
        [p.tensor_split(len(parts), dim=-1)[j] for j, p in enumerate(parts)], dim=-1))
    assert concat.z.shape == Z2.shape and not torch.equal(concat.y, Y)
    # averaging instead of summing
    mean = row_parallel_output(h_parts, a2_parts, b2_parts, Y_BASE_PARTS, reduce=lambda p: reduce_sum(p) / len(p))
    assert not torch.equal(mean.y, Y)
    # the o bias added on every rank before the sum instead of once after it
    bias = t([1, 2, 3, 4])
    assert not torch.equal(reduce_sum([y + bias for y in Y_BASE_PARTS]), Y_BASE + bias)
    # the placement itself is right: the same call with the sum gives Y
    assert torch.equal(row_parallel_output(h_parts, a2_parts, b2_parts, Y_BASE_PARTS).y, Y)


# ---------------------------------------------------------------- sharded equals unsharded


def random_config(rnd: random.Random, size: int) -> ModelConfig:
    kv = rnd.choice([k for k in (1, 2, 4, 8) if size % k == 0 or k % size == 0])
    heads = kv * rnd.choice([g for g in (1, 2, 4) if (kv * g) % size == 0] or [size])
    return config(hidden=size * rnd.randint(1, 4) * 2, inter=size * rnd.randint(1, 5), heads=heads, kv=kv,
                  head_dim=rnd.choice([2, 4, 6]), layers=1)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_sharded_lora_equals_unsharded_on_random_shapes_and_mixed_ranks(size, seed):
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    c = random_config(rnd, size)
    layouts = [TPLayout(j, size) for j in range(size)]
    rows = rnd.randint(1, 5)
    for role, (d_out, d_in) in config_role_shapes(c).items():
        r = rnd.choice([1, 3, 5, 8, 16])  # mixed ranks across modules, some no multiple of N
        a = torch.randn(r, d_in, generator=g, dtype=torch.float64)
        b = torch.randn(d_out, r, generator=g, dtype=torch.float64)
        x = torch.randn(rows, d_in, generator=g, dtype=torch.float64)
        full = x @ a.T @ b.T
        shards = [shard_lora(role, a, b, c, lay) for lay in layouts]
        cuts = [lora_cuts(c, lay)[role] for lay in layouts]
        if role in COLUMN_PARALLEL:
            whole = column_parallel_delta(x, [shards[0][0]], [b_j for _, b_j in shards])
            covered = torch.zeros(d_out, dtype=torch.bool)
            for cut, (a_j, _), d_j in zip(cuts, shards, whole.deltas):
                assert a_j is a and cut.out_start == 0
                torch.testing.assert_close(d_j, full[:, cut.b.start:cut.b.stop], rtol=0, atol=1e-10)
                covered[cut.b.start:cut.b.stop] = True
            assert bool(covered.all())
            # the paper's schedule (A cut on the rank axis, unevenly where N does not divide r) agrees
            gathered = column_parallel_delta(x, list(a.tensor_split(size, dim=0)), [b_j for _, b_j in shards])
            for d_w, d_g in zip(whole.deltas, gathered.deltas):
                torch.testing.assert_close(d_g, d_w, rtol=0, atol=1e-10)
        else:
            w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
            h_parts = [cut.a.take(x) for cut in cuts]
            base = [h_j @ cut.a.take(w).T for h_j, cut in zip(h_parts, cuts)]
            got = row_parallel_output(h_parts, [a_j for a_j, _ in shards], [b_j for _, b_j in shards], base)
            torch.testing.assert_close(got.y, x @ w.T + full, rtol=0, atol=1e-10)
            assert [cut.out_start for cut in cuts] == [cut.b.start for cut in cuts] == [j * d_out // size
                                                                                      for j in range(size)]


# ---------------------------------------------------------------- config and weight cuts


@pytest.mark.parametrize("heads, kv, size", [(4, 2, 2), (4, 2, 4), (4, 1, 2), (8, 2, 8), (8, 8, 2), (4, 4, 1)])
def test_rank_config_and_cuts_hold_the_heads_their_queries_read(heads, kv, size):
    c = config(heads=heads, kv=kv, head_dim=4, hidden=16, inter=24 if size != 8 else 32)
    per_kv = heads // kv  # q heads per kv head
    rows = {role: torch.zeros(n, dtype=torch.int64) for role, n in
            (("q_proj", c.q_out), ("k_proj", c.kv_out), ("gate_proj", c.intermediate_size))}
    for j in range(size):
        lay = TPLayout(j, size)
        local = shard_config(c, lay)
        assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (
            heads // size, max(1, kv // size), c.intermediate_size // size)
        assert (local.hidden_size, local.vocab_size, local.head_dim) == (c.hidden_size, c.vocab_size, c.head_dim)
        cuts = weight_cuts(c, lay)
        first_kv, count = kv_heads(c, lay)
        q_first = cuts["q_proj"].start // c.head_dim
        for i in range(local.num_heads):  # local GQA mapping = global mapping
            assert first_kv + i // (local.num_heads // local.num_kv_heads) == (q_first + i) // per_kv
        assert cuts["k_proj"] == cuts["v_proj"] and cuts["k_proj"].length == local.kv_out
        assert cuts["o_proj"].axis == 1 and (cuts["o_proj"].start, cuts["o_proj"].stop) == (
            cuts["q_proj"].start, cuts["q_proj"].stop)
        assert cuts["down_proj"].axis == 1 and cuts["gate_proj"] == cuts["up_proj"]
        for role in rows:
            rows[role][cuts[role].start:cuts[role].stop] += 1
    assert bool((rows["q_proj"] == 1).all()) and bool((rows["gate_proj"] == 1).all())
    assert bool((rows["k_proj"] == max(1, size // kv)).all())  # each kv head on N / H_kv ranks when replicated


@pytest.mark.parametrize("over, size, needle, sizes", [
    ({}, 3, "num_attention_heads 4", "1, 2, 4"),
    ({"heads": 8, "kv": 4, "inter": 48}, 8, "", "1, 2, 4, 8"),
    ({"inter": 6}, 4, "intermediate_size 6", "1, 2"),
    ({"heads": 6, "kv": 3, "head_dim": 4, "inter": 12, "hidden": 24}, 2, "num_key_value_heads 3", "1, 3, 6"),
])
def test_sizes_that_do_not_divide_are_refused_naming_those_that_do(over, size, needle, sizes):
    c = config(**over)
    assert ", ".join(map(str, tp_sizes(c))) == sizes
    if str(size) in sizes.split(", "):
        shard_config(c, TPLayout(0, size))
        return
    with pytest.raises(ModelError) as e:
        shard_config(c, TPLayout(0, size))
    assert e.value.code == "E_TP_SHAPE" and needle in e.value.message and f"({sizes})" in e.value.message


@pytest.mark.parametrize("rank, size", [(2, 2), (-1, 2), (0, 0), (True, 2), (0, 2.0)])
def test_layout_is_validated(rank, size):
    with pytest.raises(ModelError) as e:
        TPLayout(rank, size)
    assert e.value.code == "E_TP_LAYOUT"


# ---------------------------------------------------------------- the ledger of docs/scaleout.md


def test_llama3_8b_rank16_adapter_residency_per_rank():
    c = config(hidden=4096, inter=14336, heads=32, kv=8, layers=32)
    mib = 2 / 2**20  # bf16 bytes per element, in MiB
    assert lora_elements(c, TPLayout(0, 1), 16) == 41_943_040 and lora_elements(c, TPLayout(0, 1), 16) * mib == 80
    assert 16 * 4096 * len(COLUMN_PARALLEL) * 32 * mib == 20  # the column-parallel A factors
    for size, per_rank in ((2, 50), (8, 27.5)):
        assert {lora_elements(c, TPLayout(j, size), 16) * mib for j in range(size)} == {per_rank}
    assert set(ROW_PARALLEL) | set(COLUMN_PARALLEL) == set(config_role_shapes(c))
