"""Builders for tiny base models, PEFT adapters and hand-made safetensors files.

Everything is made locally from seeds: no hub, no downloads. transformers and
peft are test-only references here: they write the artifacts mlora must read.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch


def tiny_config(kind: str = "llama", hidden: int = 32, layers: int = 2, **over):
    """A tiny transformers config; ``over`` replaces or adds fields (``num_key_value_heads=1``,
    ``attention_bias=True``, ...)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    common.update(over)
    if kind == "qwen2":  # q/k/v projections carry a bias
        return Qwen2Config(**common)
    return LlamaConfig(**common)


def tiny_model(kind: str = "llama", seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(kind, **kw))


def save_base(model, path: str, max_shard_size: str | None = None) -> str:
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    return path


def make_adapter(path: str, kind: str = "llama", seed: int = 1, base_model=None, **lora_kwargs):
    """Wrap a tiny model with PEFT, give every LoRA factor random values
    (so no delta is zero) and save it. Returns the PeftModel (the reference)."""
    from peft import LoraConfig, get_peft_model

    model = base_model if base_model is not None else tiny_model(kind)
    lora_kwargs.setdefault("target_modules", ["q_proj", "v_proj"])
    config = LoraConfig(**lora_kwargs)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(path)
    return peft_model


def make_adapters(root: str, base_dir: str, specs: dict[str, dict]) -> dict:
    """One adapter per ``specs`` entry (name -> make_adapter kwargs, ``seed`` included)
    under ``root/name``, each over a fresh load of the saved base ``base_dir``.
    Returns name -> PeftModel in eval mode (the references)."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for name, kw in specs.items():
        model = AutoModelForCausalLM.from_pretrained(base_dir)
        refs[name] = make_adapter(os.path.join(root, name), base_model=model, **kw).eval()
    return refs


def copy_adapter(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    for root, _, files in os.walk(dst):
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    return dst


def read_config(path: str) -> dict:
    with open(os.path.join(path, "adapter_config.json")) as f:
        return json.load(f)


def write_config(path: str, cfg: dict) -> None:
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)


def load_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def save_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "adapter_model.safetensors"))


def write_raw_safetensors(file: str, header: dict, data: bytes, header_len: int | None = None) -> None:
    """Write a safetensors file byte by byte, with any header we like (malformed ones too)."""
    raw = json.dumps(header).encode()
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if header_len is None else header_len))
        f.write(raw)
        f.write(data)


def raw_layout(tensors: dict[str, np.ndarray]) -> tuple[dict, bytes]:
    """Header and data for numpy arrays laid out back to back."""
    header, chunks, off = {}, [], 0
    names = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("float64"): "F64", np.dtype("int8"): "I8"}
    for k, v in tensors.items():
        b = np.ascontiguousarray(v).tobytes()
        header[k] = {"dtype": names[v.dtype], "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        chunks.append(b)
        off += len(b)
    return header, b"".join(chunks)


# Llama-3 and ChatML control tokens of the chat tokenizer, after its 256 byte tokens and 7 merges
CHAT_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>",
               "<|im_end|>", "<|pad|>")


def save_chat_tokenizer(path: str, chat_template=None, template_file: str | None = None) -> str:
    """A byte-level BPE tokenizer with a few merges and the :data:`CHAT_TOKENS` as special tokens,
    whose post-processor prepends ``<|begin_of_text|>`` (so encoding rendered chat text with special
    tokens would double it), saved as ``tokenizer.json`` plus ``tokenizer_config.json`` (bos as a
    string, eos as an AddedToken object). ``chat_template`` goes into the config (a string or a list
    of named templates); ``template_file`` is written to ``chat_template.jinja`` beside it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("u", "s"), ("e", "r"), ("us", "er"), ("Ġ", "t")]
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_TOKENS])
    bos = tok.token_to_id(CHAT_TOKENS[0])
    tok.post_processor = processors.TemplateProcessing(single=f"{CHAT_TOKENS[0]} $A", pair=f"{CHAT_TOKENS[0]} $A $B",
                                                       special_tokens=[(CHAT_TOKENS[0], bos)])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in CHAT_TOKENS}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": CHAT_TOKENS[0],
              "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": True},
              "pad_token": "<|pad|>", "added_tokens_decoder": added, "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if template_file is not None:
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(template_file)
    return path


def write_shared_prompt_rows(path: str, adapters, prompts: int, seed: int, max_len: int) -> None:
    """An input Parquet file (``id``, ``prompt_ids``, ``adapter``) of ``prompts`` random prompts
    (3 to ``max_len - 1`` token ids below 64), each asked of every adapter in ``adapters`` (None:
    the base model); row ids ``"{prompt}-{adapter}"``."""
    rng = random.Random(seed)
    ids, rows, names = [], [], []
    for i in range(prompts):
        prompt = [rng.randrange(64) for _ in range(rng.randrange(3, max_len))]
        for adapter in adapters:
            ids.append(f"{i}-{adapter}")
            rows.append(prompt)
            names.append(adapter)
    pq.write_table(pa.table({"id": ids, "prompt_ids": pa.array(rows, pa.list_(pa.int64())),
                             "adapter": pa.array(names, pa.string())}), path)
