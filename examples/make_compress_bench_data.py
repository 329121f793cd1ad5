"""Synthetic collection for the step-5 CPU compression benchmark (BENCHMARKS.md).

    python examples/make_compress_bench_data.py OUT [--adapters 100] [--rank 16] [--shared-rank 24] [--noise 0.05]

Writes OUT/adapter-NNN/ in PEFT layout for the demo base's shape
(examples/demo/base: hidden 128, intermediate 256, 4 layers, 4 heads, 2 KV
heads, head_dim 32), rank ``--rank`` on all seven projections. Every
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

HIDDEN, INTER, LAYERS, Q, KV = 128, 256, 4, 128, 64
MODULES = {"self_attn.q_proj": (Q, HIDDEN), "self_attn.k_proj": (KV, HIDDEN), "self_attn.v_proj": (KV, HIDDEN),
           "self_attn.o_proj": (HIDDEN, Q), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
           "mlp.down_proj": (HIDDEN, INTER)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--adapters", type=int, default=100)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--shared-rank", type=int, default=24)
    ap.add_argument("--noise", type=float, default=0.05)
    args = ap.parse_args()
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
               "target_modules": sorted(m.split(".")[-1] for m in MODULES), "base_model_name_or_path": "mlora-demo/base",
               "bias": "none", "use_rslora": False, "use_dora": False, "lora_dropout": 0.0, "inference_mode": True}
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(cfg, f, indent=1)


if __name__ == "__main__":
    main()
