"""Synthetic data for `mlora bench hash` (BENCHMARKS.md): a directory of PEFT-layout
LoRA adapters and a sharded Llama-shaped base checkpoint, bf16, random finite values.

    python examples/make_hash_bench_data.py OUT [--adapters-gb 1.1] [--base-gb 2.2]

Writes OUT/adapters/adapter-NNN/ and OUT/base/. Deterministic (fixed seed).
Nothing here is committed: the files are large; regenerate them.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

HIDDEN, INTER, KV = 4096, 14336, 1024  # Llama-3-8B projection shapes
MODULES = {
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV, HIDDEN), "self_attn.v_proj": (KV, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}


def bf16(rng: np.random.Generator, shape) -> np.ndarray:
    """Random normal values rounded to bfloat16, returned as raw uint16 bits."""
    x = (rng.standard_normal(shape, dtype=np.float32) * 0.02).view(np.uint32)
    return (x >> 16).astype(np.uint16)


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    header, off = {}, 0
    for k, v in tensors.items():
        header[k] = {"dtype": "BF16", "shape": list(v.shape), "data_offsets": [off, off + v.nbytes]}
        off += v.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for v in tensors.values():
            f.write(v.tobytes())


def make_adapters(out: str, total_gb: float, rng) -> None:
    rank, layers = 64, 8
    per = sum(rank * (i + o) * 2 for o, i in MODULES.values()) * layers
    n = max(1, int(total_gb * 1e9 // per) + 1)
    for a in range(n):
        d = os.path.join(out, "adapters", f"adapter-{a:03d}")
        os.makedirs(d, exist_ok=True)
        tensors = {}
        for layer in range(layers):
            for mod, (o, i) in MODULES.items():
                key = f"base_model.model.model.layers.{layer}.{mod}"
                tensors[f"{key}.lora_A.weight"] = bf16(rng, (rank, i))
                tensors[f"{key}.lora_B.weight"] = bf16(rng, (o, rank))
        write_safetensors(os.path.join(d, "adapter_model.safetensors"), tensors)
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [m.split(".")[1] for m in MODULES],
                       "base_model_name_or_path": "bench/base", "layers_to_transform": list(range(layers))}, f)


def make_base(out: str, total_gb: float, rng) -> None:
    d = os.path.join(out, "base")
    os.makedirs(d, exist_ok=True)
    vocab = 32000
    per_layer = sum(o * i * 2 for o, i in MODULES.values())
    layers = max(1, int((total_gb * 1e9 - 2 * vocab * HIDDEN * 2) // per_layer) + 1)
    weight_map, shard, tensors, size = {}, 0, {}, 0

    def flush():
        nonlocal shard, tensors, size
        name = f"model-{shard:05d}.safetensors"
        write_safetensors(os.path.join(d, name), tensors)
        weight_map.update({k: name for k in tensors})
        shard, tensors, size = shard + 1, {}, 0

    def add(key, arr):
        nonlocal size
        tensors[key] = arr
        size += arr.nbytes
        if size > 1_000_000_000:
            flush()

    add("model.embed_tokens.weight", bf16(rng, (vocab, HIDDEN)))
    for layer in range(layers):
        for mod, (o, i) in MODULES.items():
            add(f"model.layers.{layer}.{mod}.weight", bf16(rng, (o, i)))
        add(f"model.layers.{layer}.input_layernorm.weight", bf16(rng, (HIDDEN,)))
        add(f"model.layers.{layer}.post_attention_layernorm.weight", bf16(rng, (HIDDEN,)))
    add("model.norm.weight", bf16(rng, (HIDDEN,)))
    add("lm_head.weight", bf16(rng, (vocab, HIDDEN)))
    if tensors:
        flush()
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
                   "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "vocab_size": vocab, "torch_dtype": "bfloat16"}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--adapters-gb", type=float, default=1.1)
    ap.add_argument("--base-gb", type=float, default=2.2)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    make_adapters(args.out, args.adapters_gb, rng)
    make_base(args.out, args.base_gb, rng)


if __name__ == "__main__":
    main()
