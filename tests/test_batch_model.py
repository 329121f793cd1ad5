"""The batch model against transformers: packed prefill, batched decode, chunked
prefill and the LoRA seam, on tiny random checkpoints of every supported
architecture (float32, CPU); config and weight errors with their codes; the
paged KV cache and its allocator.

``Runner`` below is the smallest engine that drives the model: it owns block
tables and builds ``AttentionMetadata`` for one step of (sequence, new tokens).
"""

import json
import math
import os
import random

import factory
import pytest
import torch
from conftest import DEMO

from mlora.batch.model.attention import AttentionMetadata
from mlora.batch.model.decoder import DecoderModel, ModelConfig, ModelError, load_config
from mlora.batch.model.kvcache import BlockAllocator, KVCache, KVCacheFull
from mlora.batch.model.lora import GROUPS

TOL = 1e-4
COMMON = dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def hf_config(name: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if name == "llama":
        return LlamaConfig(**COMMON)
    if name == "llama3-rope":
        return LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE)
    if name == "llama-tied":
        return LlamaConfig(**{**COMMON, "tie_word_embeddings": True, "vocab_size": 64})
    if name == "llama-bias":
        return LlamaConfig(**COMMON, attention_bias=True)
    if name == "mistral":
        return MistralConfig(**COMMON)
    if name == "qwen2":
        return Qwen2Config(**COMMON)
    if name == "qwen3":  # head_dim 16: q_out 64 != hidden 32
        return Qwen3Config(**COMMON, head_dim=16)
    raise KeyError(name)


def random_model(config, seed: int = 0):
    """A transformers model whose every weight matters: biases and norm gains
    random too (their default init is 0 and 1)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


ARCHS = ["llama", "llama3-rope", "llama-tied", "llama-bias", "mistral", "qwen2", "qwen3", "llama-sharded"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, transformers model), built once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            hf = random_model(hf_config("llama" if name == "llama-sharded" else name))
            path = str(tmp_path_factory.mktemp("ckpt") / name)
            factory.save_base(hf, path, max_shard_size="20KB" if name == "llama-sharded" else None)
            cache[name] = (path, hf)
        return cache[name]

    return get


def load(path: str) -> DecoderModel:
    return DecoderModel.from_pretrained(path, dtype=torch.float32)


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


class Runner:
    """Block tables and metadata for a few sequences over one KV cache. Free
    blocks come out in a shuffled order, so block tables are not contiguous."""

    def __init__(self, model: DecoderModel, num_blocks: int = 48, block_size: int = 4, seed: int = 0,
                 attention: str = "auto", device: str | None = None):
        # the Triton kernel runs under the interpreter on a CPU-only machine, compiled on a GPU
        on_gpu = attention == "triton" and torch.cuda.is_available()
        self.device = torch.device(device or ("cuda" if on_gpu else "cpu"))
        self.model = model.to(self.device)
        self.attention = attention
        self.kv = model.new_kv_cache(num_blocks, block_size)
        self.alloc = BlockAllocator(num_blocks)
        everything = self.alloc.allocate(num_blocks)
        random.Random(seed).shuffle(everything)
        self.alloc.free(everything)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, items: list[tuple[str, list[int]]], lora=None, sample: str = "last") -> list[torch.Tensor]:
        """Run one invocation over ``(sequence, new tokens)`` items; per item, the
        logits of its last row (``sample="last"``) or of all its rows."""
        bs = self.kv.block_size
        ids, positions, slots, starts, ctx_lens, tables, sample_rows = [], [], [], [0], [], [], []
        for seq, new in items:
            past = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            ctx = past + len(new)
            table += self.alloc.allocate(math.ceil(ctx / bs) - len(table))
            for p, tok in enumerate(new, start=past):
                ids.append(tok)
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            rows = list(range(starts[-1], starts[-1] + len(new)))
            sample_rows += rows if sample == "all" else rows[-1:]
            starts.append(starts[-1] + len(new))
            ctx_lens.append(ctx)
            tables.append(list(table))
            self.lens[seq] = ctx
        dev = self.device
        meta = AttentionMetadata(query_starts=starts, context_lens=ctx_lens, block_tables=tables,
                                 slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), backend=self.attention)
        logits = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta, self.kv, lora,
                            torch.tensor(sample_rows, device=dev)).cpu()
        # logits in the model's dtype (no float32 copy of the vocab-wide rows); compared in float32 here
        assert logits.dtype == self.model.dtype and logits.shape == (len(sample_rows), self.model.config.vocab_size)
        logits = logits.float()
        out, i = [], 0
        for _, new in items:
            k = len(new) if sample == "all" else 1
            out.append(logits[i:i + k])
            i += k
        return out


def tokens(n: int, seed: int, vocab: int = 64) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("name", ARCHS)
def test_packed_prefill_matches_transformers_at_every_position(checkpoints, name):
    path, hf = checkpoints(name)
    model = load(path)
    a, b = tokens(7, 1), tokens(11, 2)
    got_a, got_b = Runner(model).step([("a", a), ("b", b)], sample="all")
    assert (got_a - hf_logits(hf, a)).abs().max() <= TOL
    assert (got_b - hf_logits(hf, b)).abs().max() <= TOL


@pytest.mark.parametrize("name, attention", [(n, "torch") for n in ARCHS] + [("llama", "triton"), ("qwen3", "triton")])
def test_batched_decode_matches_transformers_step_by_step(checkpoints, name, attention):
    path, hf = checkpoints(name)
    runner = Runner(load(path), seed=3, attention=attention)
    seqs = {"a": tokens(5, 3), "b": tokens(3, 4), "c": tokens(9, 5)}
    first = runner.step(list(seqs.items()))
    nxt = {s: int(l.argmax()) for s, l in zip(seqs, first)}
    orders = [["c", "a", "b"], ["b", "c", "a"], ["a", "b", "c"], ["b", "a", "c"], ["c", "b", "a"]]
    for order in orders:
        for s in order:
            seqs[s].append(nxt[s])
        got = runner.step([(s, [nxt[s]]) for s in order])
        for s, logits in zip(order, got):
            assert (logits[0] - hf_logits(hf, seqs[s])[-1]).abs().max() <= TOL, (s, len(seqs[s]))
            nxt[s] = int(logits.argmax())


@pytest.mark.parametrize("name, attention", [("llama", "torch"), ("qwen3", "torch"), ("llama", "triton")])
def test_chunked_prefill_gives_the_same_logits(checkpoints, name, attention):
    path, hf = checkpoints(name)
    model = load(path)
    prompt, other = tokens(10, 6), tokens(4, 7)
    whole = Runner(model, attention=attention).step([("p", prompt)])[0]
    runner = Runner(model, seed=9, attention=attention)
    runner.step([("q", other), ("p", prompt[:6])])
    # second chunk of p packed behind a decode row of q
    _, chunked = runner.step([("q", [5]), ("p", prompt[6:])])
    assert (chunked - whole).abs().max() <= 1e-5
    assert (chunked[0] - hf_logits(hf, prompt)[-1]).abs().max() <= TOL


# ---------------------------------------------------------------- the LoRA seam


class RecordingLora:
    def __init__(self):
        self.calls = []

    def apply(self, layer, group, x, y):
        self.calls.append((layer, group, tuple(x.shape), tuple(y.shape)))


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_lora_hook_is_called_once_per_group_and_layer_with_the_group_widths(checkpoints, name):
    path, _ = checkpoints(name)
    model = load(path)
    rec = RecordingLora()
    Runner(model).step([("a", tokens(3, 1)), ("b", tokens(4, 2))], lora=rec)
    shapes = model.group_shapes()
    expected = [(layer, g, (7, shapes[g][0]), (7, sum(shapes[g][1])))
                for layer in range(model.config.num_layers) for g in ("qkv", "o", "gate_up", "down")]
    assert rec.calls == expected


class PeftStateLora:
    """Single-adapter LoraContext from a PEFT state dict: every row gets
    y[:, slice] += scale * (x @ A.T) @ B.T for every adapted slice."""

    def __init__(self, state: dict[str, torch.Tensor], scale: float, shapes):
        self.factors, self.scale, self.shapes = {}, scale, shapes
        for key, t in state.items():
            if ".lora_A." in key:
                layer = int(key.split(".layers.")[1].split(".")[0])
                role = key.split(".lora_A.")[0].rsplit(".", 1)[1]
                self.factors[(layer, role)] = (t, state[key.replace(".lora_A.", ".lora_B.")])

    def apply(self, layer, group, x, y):
        start = 0
        for role, width in zip(GROUPS[group], self.shapes[group][1]):
            if (layer, role) in self.factors:
                a, b = self.factors[(layer, role)]
                y[:, start:start + width] += self.scale * (x @ a.T) @ b.T
            start += width


def test_lora_context_gives_peft_logits(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    path, _ = checkpoints("llama")
    roles = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = factory.make_adapter(str(tmp_path / "adapter"), base_model=AutoModelForCausalLM.from_pretrained(path),
                                      target_modules=roles, r=4, lora_alpha=8).eval()
    state = {k: v.detach().clone() for k, v in peft_model.state_dict().items() if "lora_" in k}
    model = load(path)
    lora = PeftStateLora(state, 8 / 4, model.group_shapes())
    assert len(lora.factors) == 7 * model.config.num_layers
    a, b = tokens(6, 11), tokens(9, 12)
    got_a, got_b = Runner(model).step([("a", a), ("b", b)], lora=lora, sample="all")
    assert (got_a - hf_logits(peft_model, a)).abs().max() <= TOL
    assert (got_b - hf_logits(peft_model, b)).abs().max() <= TOL
    # the adapter changes the answer, so the test could fail
    assert (got_a - Runner(model).step([("a", a)], sample="all")[0]).abs().max() > 1e-2


# ---------------------------------------------------------------- config


def base_config(**over) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 80, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "eos_token_id": 2,
           "bos_token_id": 1, "torch_dtype": "bfloat16"}
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


def test_config_reads_transformers_4_and_5_layouts_alike():
    v4 = ModelConfig.from_hf(base_config(rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}))
    v5 = ModelConfig.from_hf(base_config(rope_theta=None, torch_dtype=None, dtype="bfloat16",
                                         rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0}))
    assert v4 == v5
    assert v4.rope_theta == 500000.0 and v4.rope_scaling["factor"] == 8.0 and v4.dtype == "bfloat16"
    assert (v4.head_dim, v4.qkv_bias, v4.qk_norm, v4.eos_token_ids, v4.bos_token_id) == (8, False, False, (2,), 1)
    assert ModelConfig.from_hf(base_config(rope_scaling={"type": "default"})).rope_scaling is None


def test_generation_config_eos_wins_and_may_be_a_list():
    cfg = ModelConfig.from_hf(base_config(), {"eos_token_id": [2, 7]})
    assert cfg.eos_token_ids == (2, 7)
    assert ModelConfig.from_hf(base_config(eos_token_id=None)).eos_token_ids == ()


def test_qwen_flags():
    qwen2 = ModelConfig.from_hf(base_config(architectures=["Qwen2ForCausalLM"], sliding_window=16, use_sliding_window=False))
    assert qwen2.qkv_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_hf(base_config(architectures=["Qwen3ForCausalLM"], head_dim=16))
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 16


@pytest.mark.parametrize("over, needle", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type 'yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "low_freq_factor"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 16}, "sliding_window"),
    ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 16, "use_sliding_window": True}, "sliding_window"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"vocab_size": "80"}, "vocab_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_config_errors(over, needle):
    with pytest.raises(ModelError) as e:
        ModelConfig.from_hf(base_config(**over))
    assert e.value.code == "E_MODEL_CONFIG" and needle in str(e.value)


def test_mistral_window_as_long_as_the_context_is_fine():
    assert ModelConfig.from_hf(base_config(architectures=["MistralForCausalLM"], sliding_window=64)).arch == "mistral"


# ---------------------------------------------------------------- checkpoint errors


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(base_config(architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ModelError) as e:
        load_config(str(tmp_path))
    assert e.value.code == "E_MODEL_ARCH" and "GPT2LMHeadModel" in str(e.value) and "LlamaForCausalLM" in str(e.value)


def copy_checkpoint(src: str, dst) -> str:
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def rewrite_weights(path: str, edit) -> None:
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_tensor_is_named(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints("llama")[0], tmp_path / "m")
    rewrite_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelError) as e:
        load(path)
    assert e.value.code == "E_MODEL_WEIGHTS" and "model.layers.1.mlp.up_proj.weight" in str(e.value)


def test_misshaped_tensor_is_named(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints("llama")[0], tmp_path / "m")
    rewrite_weights(path, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32)}))
    with pytest.raises(ModelError) as e:
        load(path)
    assert e.value.code == "E_MODEL_WEIGHTS" and "k_proj" in str(e.value) and "(16, 32)" in str(e.value)


def test_untied_checkpoint_without_lm_head(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints("llama")[0], tmp_path / "m")
    rewrite_weights(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelError) as e:
        load(path)
    assert e.value.code == "E_MODEL_WEIGHTS" and "lm_head.weight" in str(e.value)


def test_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(base_config()))
    with pytest.raises(ModelError) as e:
        DecoderModel.from_pretrained(str(tmp_path))
    assert e.value.code == "E_MODEL_WEIGHTS"


def test_unsupported_rope_type_in_a_checkpoint(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints("llama")[0], tmp_path / "m")
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    open(os.path.join(path, "config.json"), "w").write(json.dumps(cfg))
    with pytest.raises(ModelError) as e:
        load(path)
    assert e.value.code == "E_MODEL_CONFIG"


# ---------------------------------------------------------------- loading


def test_sharded_checkpoint_really_is_sharded(checkpoints):
    path, _ = checkpoints("llama-sharded")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1


def test_tied_head_is_the_embedding_and_dtype_follows_the_request(checkpoints):
    model = DecoderModel.from_pretrained(checkpoints("llama-tied")[0], dtype="bfloat16")
    assert model.lm_head_weight is model.embed_weight and model.dtype == torch.bfloat16
    assert model.layers[0].qkv_weight.shape == (32 + 2 * 16, 32) and model.layers[0].gate_up_weight.shape == (96, 32)
    logits = Runner(model).step([("a", tokens(5, 1))])[0]  # Runner.step checks they came in bfloat16
    assert torch.isfinite(logits).all()


def test_from_state_dict_equals_from_pretrained(checkpoints):
    path, hf = checkpoints("qwen2")
    state = {k: v for k, v in hf.state_dict().items()}
    a = DecoderModel.from_state_dict(load_config(path), state, dtype=torch.float32)
    b = load(path)
    buffers_a, buffers_b = dict(a.named_buffers()), dict(b.named_buffers())
    assert buffers_a.keys() == buffers_b.keys() and "layers.1.qkv_bias" in buffers_a
    assert all(torch.equal(buffers_a[k], buffers_b[k]) for k in buffers_a)


def test_demo_base_decodes_the_expected_greedy_answers():
    from tokenizers import Tokenizer

    base = os.path.join(DEMO, "base")
    expected = json.load(open(os.path.join(DEMO, "expected.json")))
    tok = Tokenizer.from_file(os.path.join(base, "tokenizer.json"))
    model = DecoderModel.from_pretrained(base)
    assert model.config.eos_token_ids == (257,) and model.config.bos_token_id == 256
    runner = Runner(model, num_blocks=64, block_size=8)
    prompts = expected["prompts"][:3]
    seqs = {i: tok.encode(expected["format"].format(prompt=p), add_special_tokens=False).ids for i, p in enumerate(prompts)}
    logits = runner.step(list(seqs.items()))
    assert all(torch.isfinite(lg).all() for lg in logits)
    answers = {i: [] for i in seqs}
    live = dict(zip(seqs, (int(lg.argmax()) for lg in logits)))
    for _ in range(expected["max_new_tokens"]):
        live = {i: t for i, t in live.items() if t not in model.config.eos_token_ids}
        if not live:
            break
        for i, t in live.items():
            answers[i].append(t)
        got = runner.step([(i, [t]) for i, t in live.items()])
        live = {i: int(lg.argmax()) for i, lg in zip(live, got)}
    assert [tok.decode(answers[i]) for i in seqs] == expected["outputs"]["__base__"][:3]


# ---------------------------------------------------------------- KV cache and allocator


def test_allocator_is_all_or_nothing():
    alloc = BlockAllocator(4)
    got = alloc.allocate(3)
    assert sorted(got) == [0, 1, 2] and alloc.num_free == 1
    with pytest.raises(KVCacheFull) as e:
        alloc.allocate(2)
    assert (e.value.needed, e.value.free) == (2, 1) and alloc.num_free == 1
    alloc.free(got[:2])
    assert alloc.num_free == 3 and alloc.allocate(0) == []


@pytest.mark.parametrize("blocks", [[0], [7], [1, 1]], ids=["double-free", "foreign", "twice-in-one-call"])
def test_allocator_refuses_double_and_foreign_frees(blocks):
    alloc = BlockAllocator(8)
    alloc.allocate(2)  # 0, 1
    alloc.free([0])
    with pytest.raises(ValueError):
        alloc.free(blocks)
    assert alloc.num_free == 7


@pytest.mark.parametrize("layout", ["layer-major", "page-major"])
def test_kv_cache_write_addresses_slots_and_sizes(layout):
    kv = KVCache(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16, device="cpu",
                 layout=layout)
    assert kv.k[1].shape == (3, 4, 2, 8)
    rows = torch.randn(2, 2, 8)
    kv.write(1, rows, -rows, torch.tensor([9, 2]))  # block 2 offset 1, block 0 offset 2
    assert torch.equal(kv.k[1][2, 1], rows[0].half()) and torch.equal(kv.v[1][0, 2], -rows[1].half())
    assert kv.k[0].abs().sum() == 0
    assert kv.bytes_per_block() == 2 * 2 * 4 * 2 * 8 * 2
    assert KVCache.blocks_for_budget(10 * kv.bytes_per_block() + 5, 2, 4, 2, 8, torch.float16) == 10


def test_page_major_kv_cache_holds_what_layer_major_holds():
    """The page-major layout (one page per block id: every layer's K and V) stores and reads back
    exactly what the per-layer tensors do, through the same views and slot addressing; a block's
    page is contiguous; an unknown layout is refused."""
    g = torch.Generator().manual_seed(3)
    caches = [KVCache(3, 5, 4, 2, 8, torch.float32, "cpu", layout=lay) for lay in ("layer-major", "page-major")]
    for c in caches:  # poison: a write must land in exactly its slots
        for t in c.k + c.v:
            t.fill_(float("nan"))
    for _ in range(4):
        slots = torch.randperm(20, generator=g)[:6]
        for layer in range(3):
            k, v = torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
            for c in caches:
                c.write(layer, k, v, slots)
    a, b = caches
    for layer in range(3):
        assert torch.equal(a.k[layer].nan_to_num(7.0), b.k[layer].nan_to_num(7.0))
        assert torch.equal(a.v[layer].nan_to_num(7.0), b.v[layer].nan_to_num(7.0))
        want = torch.tensor([0, 5, 19])
        assert all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(a.read(layer, want), b.read(layer, want)))
    assert b.pages[2].is_contiguous() and b.pages[2].numel() * 4 == b.bytes_per_block()
    assert b.k[1].stride(0) == b.pages.stride(0)  # a layer's view steps a whole page per block
    with pytest.raises(ValueError, match="layout"):
        KVCache(1, 1, 1, 1, 1, layout="block-major")


def test_page_major_writes_follow_a_slot_buffer_updated_in_place():
    """The engine's CUDA graphs reuse one slot_mapping tensor and copy each step's slots into it:
    every invocation (begin() then a write per layer, as the model does, or writes alone) must
    land at the buffer's current contents, never at a split cached from an earlier call (a
    cache keyed on identity alone would make graph replays write at the warm-up's slots)."""
    g = torch.Generator().manual_seed(5)
    caches = [KVCache(2, 6, 4, 2, 8, torch.float32, "cpu", layout=lay) for lay in ("layer-major", "page-major")]
    for c in caches:
        for t in c.k + c.v:
            t.fill_(float("nan"))
    static = torch.empty(5, dtype=torch.long)
    for step in range(6):
        static.copy_(torch.randperm(24, generator=g)[:5])
        for c in caches:
            if step % 2 == 0:
                c.begin(static)
        for layer in range(2):
            k, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
            for c in caches:
                c.write(layer, k, v, static)
                got_k, got_v = c.read(layer, static)
                assert torch.equal(got_k, k) and torch.equal(got_v, v), (c.layout, step, layer)
    a, b = caches
    for layer in range(2):
        assert torch.equal(a.k[layer].nan_to_num(7.0), b.k[layer].nan_to_num(7.0))
        assert torch.equal(a.v[layer].nan_to_num(7.0), b.v[layer].nan_to_num(7.0))


def test_metadata_with_too_few_blocks_is_refused(checkpoints):
    model = load(checkpoints("llama")[0])
    kv = model.new_kv_cache(4, 4)
    meta = AttentionMetadata([0, 6], [6], [[0]], torch.arange(6))
    with pytest.raises(ValueError, match="needs 6 slots"):
        model(torch.zeros(6, dtype=torch.long), torch.arange(6), meta, kv, None, torch.tensor([5]))


def test_a_step_may_sample_no_row(checkpoints):
    """A non-final prefill chunk samples nothing; its K/V still land in the cache."""
    model = load(checkpoints("llama")[0])
    kv = model.new_kv_cache(4, 4)
    meta = AttentionMetadata([0, 8], [8], [[3, 1]], torch.tensor([12, 13, 14, 15, 4, 5, 6, 7]))
    logits = model(torch.tensor(tokens(8, 4)), torch.arange(8), meta, kv, None, torch.tensor([], dtype=torch.long))
    assert logits.shape == (0, model.config.vocab_size)
    written = kv.k[0].flatten(1).abs().sum(-1) > 0
    assert written.tolist() == [False, True, False, True]


# ---------------------------------------------------------------- the BLAS preference (mlora.batch.model.gemms)


def test_blas_preference_by_rows():
    """cuBLASLt for CUDA forwards of 1..128 rows, the process's preference above, never on the CPU."""
    from mlora.batch.model.gemms import blas_for

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [blas_for(r, cuda) for r in (1, 64, 128, 129, 256)] == ["cublaslt"] * 3 + [None, None]
    assert blas_for(0, cuda) is None
    assert blas_for(8, cpu) is None


def test_blas_switch_keeps_the_notice_off_stderr_and_restores_it(monkeypatch, capfd):
    """The first switch to cuBLASLt runs with fd 2 on /dev/null (torch's C++ notice), then the
    preference is restored and fd 2 writes reach stderr again, also when the setter raises."""
    import mlora.batch.model.gemms as gemms

    calls = []

    def setter(choice=None):
        if choice is None:
            return "saved"
        os.write(2, b"NOTICE from C++\n")
        calls.append(choice)
        if choice == "boom":
            raise RuntimeError("no cuBLASLt in this build")
        return choice

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", setter)
    monkeypatch.setattr(gemms, "_notice_done", False)
    with pytest.raises(RuntimeError, match="no cuBLASLt"):
        gemms._set_quietly("boom")
    os.write(2, b"after a failed switch\n")
    with gemms.blas_library(8, torch.device("cuda")):
        os.write(2, b"inside\n")
    err = capfd.readouterr().err
    assert "NOTICE" not in err.split("after a failed switch")[0]
    assert "after a failed switch" in err and "inside" in err
    assert calls == ["boom", "cublaslt", "saved"]


def test_forward_runs_its_gemms_under_the_rows_preference(checkpoints, monkeypatch):
    """DecoderModel.forward enters mlora.batch.model.gemms.blas_library with its own row count and
    device, around every GEMM (the lm_head included), once per forward."""
    import contextlib

    import mlora.batch.model.decoder as model_mod

    path, _ = checkpoints("llama")
    seen, inside = [], []

    @contextlib.contextmanager
    def spy(rows, device):
        seen.append((rows, device.type))
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    real_linear = model_mod.F.linear

    def linear(*a, **k):
        assert inside, "a GEMM ran outside blas_library"
        return real_linear(*a, **k)

    monkeypatch.setattr(model_mod, "blas_library", spy)
    monkeypatch.setattr(model_mod.F, "linear", linear)
    runner = Runner(load(path), seed=2)
    runner.step([("a", tokens(5, 1)), ("b", tokens(2, 2))])
    runner.step([("a", [3]), ("b", [4])])
    assert seen == [(7, "cpu"), (2, "cpu")]
