"""Sampling: greedy, filters, and per-row random streams independent of batch composition."""

import math

import pytest
import torch

from mlora.batch.engine.sampling import SamplingParams, row_key, sample, uniform


def _logits(seed, rows=6, vocab=50):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_lowest_index_on_ties():
    x = _logits(0)
    x[2, 7] = x[2, 3] = x[2].max() + 1  # tie: index 3 wins
    got = sample(x, SamplingParams(), [0] * 6, [0] * 6)
    expect = x.argmax(-1).tolist()
    assert got == expect and got[2] == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_sample_as_their_float32_values(dtype):
    """The model hands over logits in its own dtype: greedy and drawn tokens equal those of the
    same values widened to float32, ties (frequent at 16 bits) included."""
    x = (_logits(5, rows=8, vocab=300) * 4).to(dtype)
    x[3, 10] = x[3, 200] = x[3].max() + 1  # a tie at the top: the lower index wins
    keys, idx = [row_key(4, str(i)) for i in range(8)], list(range(8))
    greedy = sample(x, SamplingParams(), keys, idx)
    assert greedy == sample(x.float(), SamplingParams(), keys, idx) and greedy[3] == 10
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=4)
    assert sample(x, p, keys, idx) == sample(x.float(), p, keys, idx)


def test_row_stream_does_not_depend_on_the_batch():
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=20, seed=7)
    x = _logits(1)
    keys = [row_key(7, f"row-{i}") for i in range(6)]
    idx = [i * 3 for i in range(6)]
    together = sample(x, p, keys, idx)
    perm = [4, 1, 5, 0, 3, 2]
    shuffled = sample(x[perm], p, [keys[i] for i in perm], [idx[i] for i in perm])
    assert [shuffled[perm.index(i)] for i in range(6)] == together
    alone = [sample(x[i : i + 1], p, [keys[i]], [idx[i]])[0] for i in range(6)]
    assert alone == together


def test_filters_that_leave_one_token_are_greedy():
    x = _logits(2)
    keys, idx = list(range(6)), [0] * 6
    greedy = sample(x, SamplingParams(), keys, idx)
    assert sample(x, SamplingParams(temperature=1.5, top_k=1), keys, idx) == greedy
    assert sample(x, SamplingParams(temperature=1.5, top_p=1e-6), keys, idx) == greedy


def test_draws_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = SamplingParams(temperature=1.0, seed=3)
    n = 4000
    counts = [0] * 4
    for i in range(n):
        counts[sample(logits, p, [row_key(3, str(i))], [0])[0]] += 1
    probs = torch.softmax(logits[0], -1).tolist()
    for c, q in zip(counts, probs):  # deterministic keys: a fixed outcome, 5 sigma bounds
        assert abs(c / n - q) < 5 * math.sqrt(q * (1 - q) / n), (counts, probs)


def test_top_k_and_top_p_never_pick_filtered_tokens():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    for i in range(300):
        t = sample(logits, SamplingParams(temperature=2.0, top_k=2, seed=1), [row_key(1, str(i))], [i])[0]
        assert t in (0, 1)
        # softmax(x/2): the top two hold ~0.61 of the mass, so top_p 0.5 keeps exactly two
        t = sample(logits, SamplingParams(temperature=2.0, top_p=0.5, seed=1), [row_key(1, str(i))], [i])[0]
        assert t in (0, 1)


def test_uniform_is_in_range_and_varies():
    us = [uniform(row_key(0, "a"), i) for i in range(1000)]
    assert all(0 <= u < 1 for u in us) and len(set(us)) == 1000


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2)])
def test_bad_params_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)
