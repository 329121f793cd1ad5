"""Tensor parallelism at the model level, on the CPU: two rank processes (gloo, float32) each run
their part of a tiny Llama / Qwen2 / Qwen3 through a packed prefill and greedy decode steps with
their own KV cache; rank 0's logits equal the unsharded model's (and rank 1's are the same
tensors), greedy tokens exactly, with and without LoRA on all seven modules (mixed ranks, base
rows). Also: a rank loads only its slices from the files, and a dead or hung rank stops the group
with a clear error instead of a hang (mlora.batch.model.tpgroup).
"""

import importlib
import os
import time

import factory
import pytest
import safetensors
import torch
import tp_ranks
from safetensors.torch import load_file
from test_batch_model import Runner, hf_config, random_model, tokens

from mlora.batch.errors import ModelError
from mlora.batch.model.decoder import DecoderModel, load_config
from mlora.batch.model.lora import GROUPS, config_role_shapes, group_shapes
from mlora.batch.model.tp import ROW_PARALLEL, TPLayout, lora_cuts, shard_config, shard_lora, weight_cuts
from mlora.batch.model.tpgroup import LeadGroup, TPGroupError, run_ranks

ATOL = 1e-5
DECODE_STEPS = 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> checkpoint directory, every weight random (biases and norm gains included)."""
    configs = {
        "llama": factory.tiny_config("llama"),
        "qwen2": factory.tiny_config("qwen2"),  # q/k/v biases
        "llama-kv1-bias": factory.tiny_config("llama", num_key_value_heads=1, attention_bias=True),  # o bias too
        "qwen3": hf_config("qwen3"),  # q/k norms, head_dim 16 with hidden 32
    }
    root = tmp_path_factory.mktemp("tp")
    return {name: factory.save_base(random_model(cfg, seed=i), str(root / name)) for i, (name, cfg) in
            enumerate(configs.items())}


class RowLora:
    """A reference LoraContext over per-row adapters (``rows``: each packed row's adapter name, or
    None for a base row): every adapter adds ``scale * (x A^T) B^T`` at each module it targets.
    On a tensor-parallel rank (``layout``, ``collective``) it holds the rank's factors
    (``tp.shard_lora``) and adds the rank's delta columns; a row-parallel module's rank-width
    partial shrink is summed over the group before its expand (docs/scaleout.md)."""

    def __init__(self, adapters: dict, config, layout: TPLayout | None = None, collective=None):
        self.collective, self.rows = collective, []
        c = config if layout is None else shard_config(config, layout)
        self.widths = {g: w for g, (_, w) in group_shapes(c.hidden_size, c.intermediate_size, c.num_heads,
                                                           c.num_kv_heads, c.head_dim).items()}
        self.out_start = {role: 0 if layout is None else cut.out_start
                          for role, cut in lora_cuts(config, layout or TPLayout(0, 1)).items()}
        self.adapters = {name: (scale, {key: (a, b) if layout is None else shard_lora(key[1], a, b, config, layout)
                                        for key, (a, b) in factors.items()})
                         for name, (scale, factors) in adapters.items()}

    def apply(self, layer, group, x, y):
        start = 0
        for role, width in zip(GROUPS[group], self.widths[group]):
            out = start + self.out_start[role]
            for name, (scale, factors) in self.adapters.items():  # the same order on every rank
                rows = torch.tensor([r == name for r in self.rows])
                if (layer, role) not in factors or not bool(rows.any()):
                    continue
                a, b = factors[(layer, role)]
                z = x[rows] @ a.T
                if self.collective is not None and role in ROW_PARALLEL:
                    self.collective.all_reduce(z)
                d = scale * z @ b.T
                y[rows, out:out + d.shape[1]] += d
            start += width


def random_adapters(config, seed: int) -> dict:
    """Two adapters on all seven modules of every layer, ranks 4 and 6: name -> (scale, factors)."""
    g = torch.Generator().manual_seed(seed)
    adapters = {}
    for name, rank, scale in (("r4", 4, 2.0), ("r6", 6, 0.5)):
        factors = {}
        for layer in range(config.num_layers):
            for role, (d_out, d_in) in config_role_shapes(config).items():
                factors[(layer, role)] = (0.2 * torch.randn(rank, d_in, generator=g),
                                          0.2 * torch.randn(d_out, rank, generator=g))
        adapters[name] = (scale, factors)
    return adapters


SEQ_ADAPTER = {"a": "r4", "b": "r6", "c": None}  # mixed ranks and a base row in every step


def drive(model: DecoderModel, lora: RowLora | None = None) -> dict:
    """Three sequences prefilled in one packed step, then DECODE_STEPS greedy decode steps of all
    three (in changing orders): every step's logits and the tokens chosen."""
    runner = Runner(model, seed=5, attention="torch")
    items = [("a", tokens(6, 1)), ("b", tokens(9, 2)), ("c", tokens(4, 3))]
    logits, chosen = [], []
    for step in range(1 + DECODE_STEPS):
        if lora is not None:
            lora.rows = [SEQ_ADAPTER[s] for s, new in items for _ in new]
        out = runner.step(items, lora=lora, sample="all" if step == 0 else "last")
        logits.append(torch.cat(out))
        nxt = {s: int(o[-1].argmax()) for (s, _), o in zip(items, out)}
        chosen.append(nxt)
        order = ["c", "a", "b"] if step % 2 == 0 else ["b", "c", "a"]
        items = [(s, [nxt[s]]) for s in order]
    return {"logits": logits, "tokens": chosen, "heads": model.config.num_heads}


def rank_drive(collective, paths: dict, adapters: dict) -> dict:
    """One rank: its part of every checkpoint, driven as ``drive`` drives the unsharded model,
    then again with the rank's part of the checkpoint's adapters where ``adapters`` has some."""
    torch.set_num_threads(1)
    out = {"rank": collective.layout.rank}
    for name, path in paths.items():
        model = DecoderModel.from_pretrained(path, dtype=torch.float32, tp=collective.layout, collective=collective)
        out[name] = drive(model)
        if name in adapters:
            lora = RowLora(adapters[name], load_config(path), collective.layout, collective)
            out[name + "+lora"] = drive(model, lora)
    return out


def test_two_ranks_give_the_unsharded_logits_and_tokens_with_and_without_sharded_adapters(checkpoints):
    adapters = {name: random_adapters(load_config(checkpoints[name]), seed=7) for name in ("llama", "llama-kv1-bias")}
    ranks = run_ranks(rank_drive, 2, (checkpoints, adapters), timeout_s=120)
    torch.set_num_threads(1)
    assert [r["rank"] for r in ranks] == [0, 1]
    reference = {}
    for name, path in checkpoints.items():
        model = DecoderModel.from_pretrained(path, dtype=torch.float32)
        reference[name] = drive(model)
        if name in adapters:
            reference[name + "+lora"] = drive(model, RowLora(adapters[name], model.config))
            # the adapters change the answer, so the comparison could fail
            assert (reference[name + "+lora"]["logits"][0] - reference[name]["logits"][0]).abs().max() > 1e-2
    assert set(ranks[0]) == set(reference) | {"rank"}
    for name, ref in reference.items():
        got = ranks[0][name]
        assert got["heads"] == ref["heads"] // 2, name  # the ranks really held half the heads each
        for step, (g, r) in enumerate(zip(got["logits"], ref["logits"])):
            assert (g - r).abs().max() <= ATOL, (name, step, float((g - r).abs().max()))
        assert got["tokens"] == ref["tokens"], name
        # every rank computes the same logits (replicated lm_head over the same all-reduced stream)
        assert all(torch.equal(a, b) for a, b in zip(ranks[1][name]["logits"], got["logits"])), name


# ---------------------------------------------------------------- loading one rank's part


class RecordingFile:
    """A safetensors handle that records which tensors are read whole."""

    def __init__(self, handle, whole: list):
        self.handle, self.whole = handle, whole

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def get_tensor(self, name):
        self.whole.append(name)
        return self.handle.get_tensor(name)

    def __getattr__(self, name):  # keys, get_slice, ...
        return getattr(self.handle, name)


class NoGroup:
    def all_reduce(self, tensor):
        raise AssertionError("loading calls no collective")


def test_a_rank_reads_only_its_slices_of_the_cut_tensors(checkpoints, monkeypatch):
    path = checkpoints["llama-kv1-bias"]
    full = DecoderModel.from_pretrained(path, dtype=torch.float32)
    whole: list[str] = []
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: RecordingFile(real(*a, **k), whole))
    layout = TPLayout(1, 2)
    part = DecoderModel.from_pretrained(path, dtype=torch.float32, tp=layout, collective=NoGroup())
    cut_roles = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert whole and not [n for n in whole if any(r in n for r in cut_roles) and not n.endswith("o_proj.bias")]
    c, cuts = full.config, weight_cuts(full.config, layout)
    assert (part.config.num_heads, part.config.num_kv_heads, part.tp) == (2, 1, layout)
    for i, (f, p) in enumerate(zip(full.layers, part.layers)):
        q, kv = cuts["q_proj"], cuts["k_proj"]
        rows = [*range(q.start, q.stop), *range(c.q_out + kv.start, c.q_out + kv.stop),
                *range(c.q_out + c.kv_out + kv.start, c.q_out + c.kv_out + kv.stop)]
        assert torch.equal(p.qkv_weight, f.qkv_weight[rows]) and torch.equal(p.qkv_bias, f.qkv_bias[rows])
        assert torch.equal(p.o_weight, cuts["o_proj"].take(f.o_weight)) and torch.equal(p.o_bias, f.o_bias)
        inter = cuts["gate_proj"]
        gate_up = [*range(inter.start, inter.stop), *range(c.intermediate_size + inter.start,
                                                           c.intermediate_size + inter.stop)]
        assert torch.equal(p.gate_up_weight, f.gate_up_weight[gate_up])
        assert torch.equal(p.down_weight, cuts["down_proj"].take(f.down_weight))
        assert torch.equal(p.input_norm_weight, f.input_norm_weight) and p.collective is not None
    assert torch.equal(part.lm_head_weight, full.lm_head_weight)
    # the same part from a state dict
    state = load_file(os.path.join(path, "model.safetensors"))
    again = DecoderModel.from_state_dict(load_config(path), state, tp=layout, collective=NoGroup())
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), part.state_dict().values()))


def test_a_rank_without_a_group_or_a_size_that_does_not_divide_is_refused(checkpoints):
    path = checkpoints["llama"]
    with pytest.raises(ModelError) as e:
        DecoderModel.from_pretrained(path, tp=TPLayout(0, 2))
    assert e.value.code == "E_TP_LAYOUT" and "collective" in e.value.message
    with pytest.raises(ModelError) as e:
        DecoderModel.from_pretrained(path, tp=TPLayout(0, 3), collective=NoGroup())
    assert e.value.code == "E_TP_SHAPE" and "(1, 2, 4)" in e.value.message


# ---------------------------------------------------------------- a rank that fails


def test_a_dead_rank_stops_the_group_with_a_clear_error_at_once():
    start = time.monotonic()
    with pytest.raises(TPGroupError) as e:
        run_ranks(tp_ranks.die_or_fail_or_sum, 3, (1, 2), timeout_s=60)
    assert e.value.code == "E_TP_RANK_DIED"
    assert "rank 1 died (exit code 3)" in e.value.message
    assert "rank 2: E_TP_RANK_FAILED: ValueError: this rank's own failure" in e.value.message
    assert "rank 0: E_TP_PEER_LOST" in e.value.message
    assert "ValueError" in e.value.details
    assert time.monotonic() - start < 30  # gloo sees the dead peer: nobody waits for the 60 s timeout


def test_a_hung_rank_fails_its_peers_within_the_group_timeout_and_is_stopped():
    start = time.monotonic()
    with pytest.raises(TPGroupError) as e:
        run_ranks(tp_ranks.sleep_or_sum, 2, (1,), timeout_s=1)
    assert e.value.code == "E_TP_RANK_HUNG"
    assert "rank 1 did not finish within the group's timeout (1 s) and was stopped" in e.value.message
    assert "rank 0: E_TP_PEER_LOST" in e.value.message
    assert time.monotonic() - start < 30


def test_a_follower_that_dies_before_it_joins_fails_the_start_at_once():
    """Rank 0 is this process: a follower that dies on its way in (here: as it imports its
    function's module) fails the start with its exit code, not after the group's timeout."""
    # imported here, not at the top: the other tests' ranks import this module, and this one ends them
    tp_dies_early = importlib.import_module("tp_dies_early")
    t0 = time.monotonic()
    with pytest.raises(TPGroupError) as failed:
        LeadGroup(tp_dies_early.never_runs, 2, timeout_s=60)
    assert failed.value.code == "E_TP_RANK_DIED" and "7" in failed.value.message
    assert time.monotonic() - t0 < 30
