"""A collection bundle's members served with the three-stage operator under tensor parallelism:
the shared bases cut as a LoRA's A and B are (docs/scaleout.md, "Tensor parallelism: how adapters
are placed"), the cores whole. Two ranks of one module (threads sharing a summing collective)
give the unsharded operator's output for every kind of module; a bundle job at two gloo ranks
gives the tokens of one rank on a tiny Llama and a tiny Qwen2 (q/k/v bias), with every core
resident and with fewer core slots than members (loads published by rank 0 only once both
ranks hold them); the Triton operator's ranks (interpreted) equal the unsharded operator too."""

import json
import threading
from types import SimpleNamespace

import factory
import pytest
import torch
from test_batch_model import random_model
from test_batch_run import _rows
from typer.testing import CliRunner

from mlora.batch.adapters.bundle_bank import BundleBank
from mlora.batch.adapters.slots import TPShard
from mlora.batch.config import JobConfig
from mlora.batch.model.decoder import ModelConfig
from mlora.batch.model.lora import GROUPS, group_shapes
from mlora.batch.model.tp import TPLayout, weight_cuts
from mlora.batch.runner import run_job
from mlora.cli.app import app

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class ThreadGroup:
    """``size`` ranks as threads of this process: ``collective(j)`` is rank j's ``all_reduce``,
    which sums every rank's tensor in rank order (as the group's all-reduce does) into each."""

    def __init__(self, size: int):
        self.size, self.barrier, self.parts = size, threading.Barrier(size, timeout=10), {}

    def collective(self, rank: int):
        def all_reduce(t: torch.Tensor) -> None:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.parts[j] for j in range(1, self.size)) + self.parts[0]
            self.barrier.wait()
            t.copy_(total)
        return SimpleNamespace(all_reduce=all_reduce)

    def run(self, fn) -> list:
        """``fn(rank)`` on every rank at once; their results in rank order."""
        out, errors = [None] * self.size, []

        def one(j):
            try:
                out[j] = fn(j)
            except BaseException as e:  # noqa: BLE001 - re-raised below, on the test's thread
                errors.append(e)
                self.barrier.abort()
        threads = [threading.Thread(target=one, args=(j,)) for j in range(self.size)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return out


def synthetic_bundle(config: ModelConfig, method: str, R: int = 3):
    """A bundle over every module of ``config`` in float64 (values a float32 file could hold),
    1 to 3 clusters per module, member m3 adapting no MLP module."""
    g = torch.Generator().manual_seed(7)
    members = ["m0", "m1", "m2", "m3"]
    shapes = {role: (w, d_in) for grp, (d_in, ws) in group_shapes(
        config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads, config.head_dim).items()
        for role, w in zip(GROUPS[grp], ws)}
    modules, bases, cores = {}, {}, {}
    for layer in range(config.num_layers):
        for k, role in enumerate(ALL_SEVEN):
            name = f"model.layers.{layer}.{BLOCK[role]}.{role}"
            K = 1 + (k + layer) % 3
            users = members if BLOCK[role] == "self_attn" else members[:3]
            d_out, d_in = shapes[role]
            modules[name] = {"d_out": d_out, "d_in": d_in, "clusters": K,
                             "assignments": {m: (i + layer) % K for i, m in enumerate(users)}}
            for c in range(K):
                bases[f"{name}/cluster{c}/U"] = torch.randn(d_out, R, generator=g).double()
                bases[f"{name}/cluster{c}/V"] = torch.randn(d_in, R, generator=g).double()
            for m in users:
                cores[f"{name}/{m}"] = torch.randn((R,) if method == "jd-diag" else (R, R), generator=g).double()
    return SimpleNamespace(manifest={"bundle_sha256": "e" * 64, "options": {"rank": R}, "modules": modules,
                                     "members": [{"id": m} for m in members]},
                           bases=bases, cores=cores, method=method, member_ids=lambda: members)


def _only_own_columns_changed(got: list, partials: list, h: int, base: torch.Tensor) -> None:
    """Row-parallel rank j changed only its columns ``[j h, (j+1) h)`` of its partial, and no base row."""
    for j, y in enumerate(got):
        outside = torch.ones(y.shape[1], dtype=torch.bool)
        outside[j * h:(j + 1) * h] = False
        assert torch.equal(y[:, outside], partials[j][:, outside])
        assert torch.equal(y[base], partials[j][base])


def _unsharded(method: str, layers: int, kv: int):
    """(config, bundle, group shapes, the unsharded float64 torch bank) of a tiny Llama with
    ``kv`` kv heads and a synthetic bundle over every module."""
    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
                                  "intermediate_size": 24, "num_hidden_layers": layers, "num_attention_heads": 4,
                                  "num_key_value_heads": kv, "max_position_embeddings": 64})
    bundle = synthetic_bundle(config, method)
    shapes = group_shapes(config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
                          config.head_dim)
    return config, bundle, shapes, BundleBank(bundle, config.num_layers, shapes, torch.float64, "cpu")


@pytest.mark.parametrize("method", ["jd-full", "jd-diag"])
@pytest.mark.parametrize("kv", [2, 1])  # kv 1: the one k/v head replicated on both ranks
def test_two_ranks_of_the_three_stage_operator_equal_one(method, kv):
    """Column-parallel groups: each rank's output columns are the unsharded operator's columns
    its base weight rows give. Row-parallel groups (o, down): each rank adds, at its h/N columns,
    the expansion of the projections summed over the ranks, so the ranks' partials sum to the
    unsharded output; every other column and every base row keep their bits."""
    config, bundle, shapes, full = _unsharded(method, layers=2, kv=kv)
    group = ThreadGroup(2)
    layouts = [TPLayout(j, 2) for j in range(2)]
    ranks = [BundleBank.for_rank(bundle, TPShard(config, layouts[j], group.collective(j)), torch.float64, "cpu")
             for j in range(2)]
    rows = torch.tensor([1, -1, 0, 3, 2, 1, -1, 0], dtype=torch.int32)
    base = (rows < 0).nonzero().flatten()
    full_ctx, rank_ctx = full.context(rows), [bank.context(rows) for bank in ranks]
    g = torch.Generator().manual_seed(8)
    changed = 0
    for layer in range(config.num_layers):
        for grp in GROUPS:
            d_in, widths = shapes[grp]
            x = torch.randn(len(rows), d_in, generator=g, dtype=torch.float64)
            cuts = [weight_cuts(config, lay) for lay in layouts]
            if grp in ("o", "down"):  # row-parallel: the rank's input columns, a partial of the whole output
                partials = [torch.randn(len(rows), widths[0], generator=g, dtype=torch.float64) for _ in ranks]
                want = partials[0] + partials[1]
                full_ctx.apply(layer, grp, x, want)

                def rank_apply(j, grp=grp, x=x, partials=partials, layer=layer):
                    y = partials[j].clone()
                    rank_ctx[j].apply(layer, grp, cuts[j][GROUPS[grp][0]].take(x), y)
                    return y
                got = group.run(rank_apply)
                assert torch.allclose(got[0] + got[1], want, rtol=1e-12, atol=1e-12), (layer, grp)
                _only_own_columns_changed(got, partials, config.hidden_size // 2, base)
                changed += not torch.equal(want, partials[0] + partials[1])
            else:  # column-parallel: x whole, the rank's output rows of each slice
                y0 = torch.randn(len(rows), sum(widths), generator=g, dtype=torch.float64)
                want = y0.clone()
                full_ctx.apply(layer, grp, x, want)
                offs = [sum(widths[:k]) for k in range(len(widths))]
                cols = [torch.cat([torch.arange(off + cuts[j][role].start, off + cuts[j][role].stop)
                                   for off, role in zip(offs, GROUPS[grp])]) for j in range(2)]

                def rank_apply(j, grp=grp, x=x, y0=y0, layer=layer, cols=cols):
                    y = y0[:, cols[j]].clone()
                    rank_ctx[j].apply(layer, grp, x, y)
                    return y
                for j, y in enumerate(group.run(rank_apply)):
                    assert torch.allclose(y, want[:, cols[j]], rtol=1e-12, atol=1e-12), (layer, grp, j)
                    assert torch.equal(y[base], y0[base][:, cols[j]])
                changed += not torch.equal(want, y0)
    assert changed == config.num_layers * len(GROUPS)  # every module's deltas really checked
    # the rank holds its cut of the bases: what split_bytes sizes the core slots against
    for j, bank in enumerate(ranks):
        bases, per_slot = BundleBank.split_bytes(bundle, torch.float64, "torch", bank.tp)
        assert bank.nbytes() == bases + (bank.num_slots + 1) * per_slot
        assert bases < BundleBank.split_bytes(bundle, torch.float64)[0]


class TwoPassGroup:
    """``size`` ranks run one after the other, twice, without threads (the Triton interpreter is
    not shared between threads): in the first pass each rank's ``all_reduce`` records its tensor,
    in the second each call sets its tensor to the sum of the ranks' first-pass tensors of that
    call (what one pass of the group's all-reduce gives)."""

    def __init__(self, size: int):
        self.size, self.summing, self.seen, self.calls = size, False, [[] for _ in range(size)], [0] * size

    def collective(self, rank: int):
        def all_reduce(t: torch.Tensor) -> None:
            if not self.summing:
                self.seen[rank].append(t.clone())
                return
            i, self.calls[rank] = self.calls[rank], self.calls[rank] + 1
            t.copy_(sum(self.seen[j][i] for j in range(1, self.size)) + self.seen[0][i])
        return SimpleNamespace(all_reduce=all_reduce)

    def run(self, fn) -> list:
        """``fn(rank)`` for every rank, recording, then again, summing: the second pass's results."""
        self.summing, self.seen, self.calls = False, [[] for _ in range(self.size)], [0] * self.size
        for j in range(self.size):
            fn(j)
        self.summing = True
        return [fn(j) for j in range(self.size)]


@pytest.mark.parametrize("method", ["jd-full", "jd-diag"])
def test_two_ranks_of_the_triton_operator_equal_one(method):
    """The Triton operator (interpreted, float32) on two ranks: column-parallel groups give the
    unsharded operator's columns of their base rows; on o and down the projections are summed
    between the kernels' launches and each rank adds its h/N columns, so the partials sum to
    the unsharded output; other columns and base rows keep their bits."""
    config, bundle, shapes, full = _unsharded(method, layers=1, kv=2)
    group = TwoPassGroup(2)
    layouts = [TPLayout(j, 2) for j in range(2)]
    ranks = [BundleBank.for_rank(bundle, TPShard(config, layouts[j], group.collective(j)), torch.float32, "cpu",
                                 operator="triton") for j in range(2)]
    rows = torch.tensor([1, -1, 0, 3, 2, 1, -1, 0], dtype=torch.int32)
    base = (rows < 0).nonzero().flatten()
    full_ctx, rank_ctx = full.context(rows), [bank.context(rows) for bank in ranks]
    cuts = [weight_cuts(config, lay) for lay in layouts]
    g = torch.Generator().manual_seed(9)
    for grp in GROUPS:
        d_in, widths = shapes[grp]
        x = torch.randn(len(rows), d_in, generator=g)
        if grp in ("o", "down"):
            partials = [torch.randn(len(rows), widths[0], generator=g) for _ in ranks]
            want = (partials[0] + partials[1]).double()
            full_ctx.apply(0, grp, x.double(), want)

            def rank_apply(j, grp=grp, x=x, partials=partials):
                y = partials[j].clone()
                rank_ctx[j].apply(0, grp, cuts[j][GROUPS[grp][0]].take(x), y)
                return y
            got = group.run(rank_apply)
            assert torch.allclose((got[0] + got[1]).double(), want, rtol=1e-4, atol=1e-4), grp
            assert not torch.allclose(want, (partials[0] + partials[1]).double())  # the deltas were checked
            _only_own_columns_changed(got, partials, config.hidden_size // 2, base)
        else:
            y0 = torch.randn(len(rows), sum(widths), generator=g)
            want = y0.double()
            full_ctx.apply(0, grp, x.double(), want)
            offs = [sum(widths[:k]) for k in range(len(widths))]
            for j in range(2):
                cols = torch.cat([torch.arange(off + cuts[j][role].start, off + cuts[j][role].stop)
                                  for off, role in zip(offs, GROUPS[grp])])
                y = y0[:, cols].clone()
                rank_ctx[j].apply(0, grp, x, y)
                assert torch.allclose(y.double(), want[:, cols], rtol=1e-4, atol=1e-4), (grp, j)
                assert torch.equal(y[base], y0[base][:, cols])


# ---------------------------------------------------------------- jobs


MAX_NEW = 8


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def bundle_job(request, tmp_path_factory):
    """A random tiny base (Qwen2: q/k/v biases), three adapters on all seven modules fitted into
    one bundle of two clusters (``mlora compress fit``), rows naming each member and the base,
    several on the same prompt, and the job's rows at one rank (the reference)."""
    root = tmp_path_factory.mktemp(f"tp-bundle-{request.param}")
    base = factory.save_base(random_model(factory.tiny_config(request.param), seed=4), str(root / "base"))
    factory.make_adapters(str(root / "adapters"), base, {
        name: dict(r=4, lora_alpha=8, target_modules=ALL_SEVEN, seed=20 + k) for k, name in enumerate("abc")})
    res = CliRunner().invoke(app, ["compress", "fit", str(root / "adapters"), "-o", str(root / "bundle"),
                                   "--rank", "4", "--clusters", "2", "--max-error", "1.0"])
    assert res.exit_code == 0, res.output
    members = json.loads((root / "bundle" / "bundle.json").read_text())["members"]
    assert len(members) == 3
    factory.write_shared_prompt_rows(str(root / "in.parquet"), ("a", "b", "c", None), prompts=4, seed=6, max_len=16)
    one = run_job(_job(root, root / "one"))
    assert one.bank["loads"] == 0  # every core resident from the start
    reference = _rows(root / "one")
    assert len(reference) == 16 and all(r["finish_reason"] != "error" for r in reference.values())
    # the members change the tokens (so their sharded deltas are checked, not just the base's)
    for i in range(4):
        tokens = {a: reference[f"{i}-{a}"]["completion_token_ids"] for a in ("a", "b", "c", None)}
        assert all(tokens[a] != tokens[None] for a in "abc"), tokens
    return root, reference


def _job(root, out, **over) -> JobConfig:
    over = {"bundle_operator": "three-stage", "device": "cpu", **over}  # a fallback to another operator fails
    return JobConfig(input=str(root / "in.parquet"), output=str(out), base=str(root / "base"),
                     adapters_dir=str(root / "bundle"), prompt_column=None, prompt_ids_column="prompt_ids",
                     max_new_tokens=MAX_NEW, dtype="float32", **over)


def _same_tokens(rows: dict, reference: dict) -> None:
    assert set(rows) == set(reference)
    for rid, want in reference.items():
        assert rows[rid]["finish_reason"] != "error", rows[rid]
        assert rows[rid]["completion_token_ids"] == want["completion_token_ids"], rid


def test_a_bundle_job_at_two_ranks_equals_one_rank(bundle_job, tmp_path):
    root, reference = bundle_job
    two = run_job(_job(root, tmp_path / "two", tensor_parallel_size=2, max_num_seqs=5))
    _same_tokens(_rows(tmp_path / "two"), reference)
    assert two.bank["loads"] == 0  # every core resident on every rank from the start


@pytest.mark.parametrize("bundle_job", ["llama"], indirect=True)
def test_fewer_core_slots_than_members_at_two_ranks(bundle_job, tmp_path):
    """Two core slots for three members: rank 0 loads and evicts cores as rows need them, each
    load published once both ranks hold the member's cores in the slot rank 0 chose."""
    root, reference = bundle_job
    few = run_job(_job(root, tmp_path / "few", tensor_parallel_size=2, max_num_seqs=2, max_gpu_adapters=2))
    _same_tokens(_rows(tmp_path / "few"), reference)
    assert few.bank["loads"] >= 3 and few.bank["evictions"] >= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: two ranks sharing one GPU over gloo")
@pytest.mark.parametrize("bundle_job", ["llama"], indirect=True)
@pytest.mark.parametrize("operator", ["three-stage", "three-stage-triton"])
def test_a_bundle_job_at_two_ranks_sharing_one_gpu_equals_one_rank(bundle_job, tmp_path, monkeypatch, operator):
    """Both ranks on one GPU (MLORA_TP_ONE_GPU=1): the sharded operators on CUDA give the tokens
    of one rank on the GPU with the same operator."""
    monkeypatch.setenv("MLORA_TP_ONE_GPU", "1")
    root = bundle_job[0]
    run_job(_job(root, tmp_path / "one", device="cuda", bundle_operator=operator))
    run_job(_job(root, tmp_path / "two", device="cuda", bundle_operator=operator, tensor_parallel_size=2,
                 max_num_seqs=5))
    _same_tokens(_rows(tmp_path / "two"), _rows(tmp_path / "one"))
