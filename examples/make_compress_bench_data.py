"""Synthetic collection for the compression benchmarks of BENCHMARKS.md (CPU and GPU).

    python examples/make_compress_bench_data.py OUT [--adapters 100] [--rank 16] [--shared-rank 24] [--noise 0.05]
        [--shape demo|mistral-7b]

Writes OUT/adapter-NNN/ in PEFT layout, rank ``--rank``: ``demo`` is the demo
base's shape (examples/demo/base: hidden 128, intermediate 256, 4 layers,
4 heads, 2 KV heads, head_dim 32) on all seven projections; ``mistral-7b``
is Mistral-7B's q/k/v (32 layers; 1,000 adapters are about 19 GB). Every
adapter's update at a module lies mostly in a per-module subspace of rank
``--shared-rank`` shared by the collection (B = U0 S_i, A = V0^T mixed per
adapter), plus independent noise of relative size ``--noise``: a collection
with the structure joint compression exploits. Deterministic (fixed seed).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

SHAPES = {  # hidden, intermediate, layers, q_out, kv_out, modules
    "demo": (128, 256, 4, 128, 64, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "mistral-7b": (4096, 14336, 32, 4096, 1024, ("q_proj", "k_proj", "v_proj")),  # the GPU compression benchmark's shape
}


def modules_of(shape: str) -> dict[str, tuple[int, int]]:
    hidden, inter, _, q, kv, mods = SHAPES[shape]
    every = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
             "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
             "mlp.down_proj": (hidden, inter)}
    return {k: v for k, v in every.items() if k.split(".")[-1] in mods}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--adapters", type=int, default=100)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--shared-rank", type=int, default=24)
    ap.add_argument("--noise", type=float, default=0.05)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    args = ap.parse_args()
    LAYERS, MODULES = SHAPES[args.shape][2], modules_of(args.shape)
    g = torch.Generator().manual_seed(0)
    r, k = args.rank, args.shared_rank
    bases = {(layer, m): (torch.randn(o, k, generator=g), torch.randn(i, k, generator=g))
             for layer in range(LAYERS) for m, (o, i) in MODULES.items()}
    for n in range(args.adapters):
        tensors = {}
        for layer in range(LAYERS):
            for m, (o, i) in MODULES.items():
                U0, V0 = bases[(layer, m)]
                b = U0 @ torch.randn(k, r, generator=g) / k ** 0.5
                a = torch.randn(r, k, generator=g) @ V0.T / k ** 0.5
                b += args.noise * b.std() * torch.randn(o, r, generator=g)
                a += args.noise * a.std() * torch.randn(r, i, generator=g)
                pre = f"base_model.model.model.layers.{layer}.{m}"
                tensors[pre + ".lora_A.weight"] = (a * 0.01).to(torch.bfloat16)
                tensors[pre + ".lora_B.weight"] = (b * 0.01).to(torch.bfloat16)
        path = os.path.join(args.out, f"adapter-{n:03d}")
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r,
               "target_modules": sorted(m.split(".")[-1] for m in MODULES), "base_model_name_or_path": f"mlora-bench/{args.shape}",
               "bias": "none", "use_rslora": False, "use_dora": False, "lora_dropout": 0.0, "inference_mode": True}
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(cfg, f, indent=1)


if __name__ == "__main__":
    main()
