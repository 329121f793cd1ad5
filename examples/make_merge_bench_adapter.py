"""One PEFT adapter for the `mlora merge` benchmark (BENCHMARKS.md), matching the base
that examples/make_hash_bench_data.py writes (Llama-3-8B projection shapes, 4 layers).

    python examples/make_merge_bench_adapter.py BASE_DIR OUT_DIR [--rank 16]

Rank ``--rank`` on q/k/v/o/gate/up/down of every layer the base has, bf16,
random values (fixed seed), alpha = 2 * rank.
"""

import argparse
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("out")
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    shapes = {}
    for f in sorted(os.listdir(args.base)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(args.base, f), "pt") as st:
                for k in st.keys():
                    if k.endswith("_proj.weight"):
                        shapes[k[: -len(".weight")]] = st.get_slice(k).get_shape()
    g = torch.Generator().manual_seed(0)
    r = args.rank
    tensors = {}
    for module, (d_out, d_in) in sorted(shapes.items()):
        tensors[f"base_model.model.{module}.lora_A.weight"] = (torch.randn(r, d_in, generator=g) / d_in ** 0.5).to(torch.bfloat16)
        tensors[f"base_model.model.{module}.lora_B.weight"] = (torch.randn(d_out, r, generator=g) * 0.01).to(torch.bfloat16)
    os.makedirs(args.out, exist_ok=True)
    save_file(tensors, os.path.join(args.out, "adapter_model.safetensors"))
    with open(os.path.join(args.out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r,
                   "target_modules": sorted({m.rsplit(".", 1)[-1] for m in shapes}),
                   "base_model_name_or_path": "bench/base", "bias": "none"}, f, indent=1)


if __name__ == "__main__":
    main()
