"""Builders for tiny base models, PEFT adapters and hand-made safetensors files.

Everything is made locally from seeds: no hub, no downloads. transformers and
peft are test-only references here: they write the artifacts mlora must read.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import torch


def tiny_config(kind: str = "llama", hidden: int = 32, layers: int = 2):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
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
