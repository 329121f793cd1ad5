"""Prefix identity (mlora.batch.model.prefix): aLoRA activation as PEFT derives it, and the
content keys of KV blocks, on the specification's fixtures and against PEFT on random prompts."""

import random
from types import SimpleNamespace

import pytest
import torch

from mlora.batch.model.prefix import Execution, alora_activation_start, block_keys, extend_block_keys, shared_blocks

BASE, A, B = "b" * 64, "a" * 64, "c" * 64


def _mask(tokens, invocation):
    start = alora_activation_start(tokens, invocation)
    return [start is not None and t >= start for t in range(len(tokens))]


def test_the_last_exact_occurrence_starts_the_adapter():
    assert _mask([11, 12, 99, 100], [99, 100]) == [False, False, True, True]
    assert _mask([99, 100, 11, 99, 100, 12], [99, 100]) == [False, False, False, True, True, True]
    assert alora_activation_start([99, 100, 5], [99, 100]) == 0  # at the start
    assert alora_activation_start([5, 99, 99, 100], [99, 100]) == 2  # a partial match before it does not count
    assert alora_activation_start([5, 99], [99, 100]) is None  # cut off at the end: absent
    assert alora_activation_start([], [99]) is None
    with pytest.raises(ValueError):
        alora_activation_start([1, 2], [])


def test_activation_equals_peft_on_random_prompts():
    variants = pytest.importorskip("peft.tuners.lora.variants")
    rng = random.Random(7)
    for _ in range(300):
        invocation = [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        config = {"x": SimpleNamespace(alora_invocation_tokens=invocation)}
        [offset] = variants.calculate_alora_offsets(config, "x", torch.tensor([tokens]))
        start = alora_activation_start(tokens, invocation)
        assert (None if start is None else len(tokens) - start) == offset, (tokens, invocation)


def test_alora_blocks_before_the_invocation_are_the_bases():
    tokens = list(range(100, 116))  # four blocks of four
    base = block_keys(tokens, 4, Execution(BASE))
    alora_a = block_keys(tokens, 4, Execution(BASE, A, activation_start=8))
    alora_b = block_keys(tokens, 4, Execution(BASE, B, activation_start=8))
    assert shared_blocks(base, alora_a) == 2 and shared_blocks(alora_a, alora_b) == 2
    # the block holding the invocation start is the adapter's, even if it starts mid-block
    mid = block_keys(tokens, 4, Execution(BASE, A, activation_start=9))
    assert shared_blocks(base, mid) == 2 and shared_blocks(alora_a, mid) == 2
    assert len(base) == len(alora_a) == 4


def test_an_ordinary_lora_shares_no_block_with_the_base_or_another_adapter():
    tokens = list(range(12))
    base = block_keys(tokens, 4, Execution(BASE))
    assert shared_blocks(base, block_keys(tokens, 4, Execution(BASE, A))) == 0
    assert shared_blocks(block_keys(tokens, 4, Execution(BASE, A)), block_keys(tokens, 4, Execution(BASE, B))) == 0
    # the same adapter (semantic identity) on another row shares everything: nothing per row or slot enters
    assert block_keys(tokens, 4, Execution(BASE, A)) == block_keys(list(tokens), 4, Execution(BASE, A))


def test_the_specifications_four_token_switch_cases():
    """Block size 1 over [11, 12, 99, 100]: the reusable rows of each switch."""
    tokens = [11, 12, 99, 100]
    start = alora_activation_start(tokens, [99, 100])

    def keys(adapter=None, activation=None):
        return block_keys(tokens, 1, Execution(BASE, adapter, activation))

    assert shared_blocks(keys(A), keys(B)) == 0  # ordinary LoRA A -> B
    assert shared_blocks(keys(), keys(A, start)) == 2  # base -> aLoRA A at position 2
    assert shared_blocks(keys(A, start), keys(B, start)) == 2  # aLoRA A -> B, same boundary
    assert shared_blocks(keys(A, start), keys(A, 1)) == 1  # same artifact, another boundary
    assert shared_blocks(keys(A), keys(A)) == 4  # same semantic adapter in another slot


def test_a_block_differing_in_its_last_token_is_not_shared_nor_anything_after_it():
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    b = a[:7] + [99] + a[8:]  # differs at position 7, the last of the second block
    ka, kb = block_keys(a, 4, Execution(BASE)), block_keys(b, 4, Execution(BASE))
    assert shared_blocks(ka, kb) == 1
    assert ka[2] != kb[2]  # equal tokens, different prefix: a key names the whole prefix


def test_partial_blocks_have_no_key_and_keys_have_a_known_form():
    assert block_keys([1, 2, 3], 4, Execution(BASE)) == []
    assert len(block_keys(list(range(9)), 4, Execution(BASE))) == 2
    # pinned: a change of the key's byte form must change KEY_SCHEMA (cached keys would otherwise lie)
    assert block_keys([1, 2], 2, Execution(BASE, A, 0)) == [
        "56f5a5788dd7db4a8e69a3c6c4880a547afacc76b8de6a44256bcd936eb32805"]


def test_keys_extended_block_by_block_equal_keys_computed_at_once():
    rng = random.Random(5)
    for _ in range(50):
        tokens = [rng.randrange(50) for _ in range(rng.randint(0, 40))]
        ex = Execution(BASE, A, rng.choice([None, rng.randint(0, 40)]))
        keys: list[str] = []
        for end in sorted(rng.sample(range(len(tokens) + 1), min(4, len(tokens) + 1))) + [len(tokens)]:
            extend_block_keys(keys, tokens[:end], 4, ex)
        assert keys == block_keys(tokens, 4, ex)


def test_bad_executions_are_refused():
    with pytest.raises(ValueError):
        Execution(BASE, None, 3)
    with pytest.raises(ValueError):
        Execution(BASE, A, -1)
    with pytest.raises(ValueError):
        block_keys([1], 0, Execution(BASE))
