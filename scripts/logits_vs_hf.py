"""Is the bf16 logits error of one forward mlora's or bfloat16's? (step 7's logits check)

Builds a Llama model of the given shape with transformers (random init,
std 0.02), rounds every weight to bfloat16, saves it, and runs one prefill
forward of random prompts four ways: transformers in bfloat16 and in float32,
mlora's engine model (``DecoderModel.from_pretrained``, paged KV cache) in
bfloat16 and in float32, all over exactly the same weights. Prints the
relative error ||bf16 - fp32|| / ||fp32|| of the last row's logits for
transformers and for mlora, and mlora's fp32 against transformers' fp32
(which must be at float32 rounding level). When mlora's bf16 error is about
transformers', the error is bfloat16's on this model, not a defect of
mlora's kernels.

    PYTHONPATH=. python scripts/logits_vs_hf.py --layers 8 --hidden 512 --tokens 128   # CPU, a minute
    PYTHONPATH=. python scripts/logits_vs_hf.py --preset-8b --tokens 512              # GPU, the 8B shape
"""

import argparse
import sys
import tempfile

import torch

sys.path.insert(0, "scripts")
from logits_check import forward_logits  # noqa: E402

from mlora.bench.batch import PRESETS  # noqa: E402
from mlora.batch.model.decoder import DecoderModel  # noqa: E402


def cast_parameters(model, dtype, device):
    """Parameters to ``dtype`` on ``device``; buffers (the rotary ``inv_freq``) keep float32:
    ``model.to(bfloat16)`` would round the rotary frequencies too."""
    model.to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return model


def rel(a, b):
    return float((a - b).norm() / b.norm())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset-8b", action="store_true", help="Llama-3-8B's shape (needs a GPU)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--residual-scale", action="store_true",
                    help="o_proj and down_proj weights scaled by 1/sqrt(2 layers) (GPT-2's init: the residual stream "
                         "stays O(1) through depth, as in trained models)")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.preset_8b:  # the shape `mlora bench batch` and `scripts/logits_check.py` use
        p = PRESETS["llama-3-8b"]
        shape = dict(vocab_size=p["vocab_size"], hidden_size=p["hidden_size"], intermediate_size=p["intermediate_size"],
                     num_hidden_layers=p["num_layers"], num_attention_heads=p["num_heads"],
                     num_key_value_heads=p["num_kv_heads"], head_dim=p["head_dim"], rope_theta=p["rope_theta"])
    else:
        h = args.hidden
        shape = dict(vocab_size=args.vocab, hidden_size=h, intermediate_size=int(3.5 * h), num_hidden_layers=args.layers,
                     num_attention_heads=max(1, h // 128), num_key_value_heads=max(1, h // 512), head_dim=128,
                     rope_theta=500000.0)
    cfg = LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False, rms_norm_eps=1e-5)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    with torch.device(device):  # random init on the GPU when there is one (8B on the CPU takes minutes)
        hf = LlamaForCausalLM(cfg).eval()
    if args.residual_scale:
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_((2 * cfg.num_hidden_layers) ** -0.5)
    hf = cast_parameters(hf, torch.bfloat16, "cpu")  # the weights, bfloat16 values
    prompts = torch.randint(0, cfg.vocab_size, (args.seqs, args.tokens), generator=torch.Generator().manual_seed(1))
    out = {}
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        for dtype in (torch.bfloat16, torch.float32):
            m = cast_parameters(hf, dtype, device)
            with torch.no_grad():
                out[("hf", dtype)] = m(prompts.to(device)).logits[:, -1].float().cpu()
            hf = m.to("cpu")
            ours = DecoderModel.from_pretrained(d, device=device, dtype=dtype)
            out[("mlora", dtype)] = forward_logits(ours, dtype, prompts, 16, device).cpu()
            del ours
    bf, fp = torch.bfloat16, torch.float32
    e_hf, e_ml = rel(out[("hf", bf)], out[("hf", fp)]), rel(out[("mlora", bf)], out[("mlora", fp)])
    print(f"{shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, {args.seqs} x {args.tokens} tokens on "
          f"{device}{', residual-scaled init' if args.residual_scale else ''}: "
          f"bf16 vs fp32 logits relative error: transformers {e_hf:.2e}, mlora {e_ml:.2e}; "
          f"mlora fp32 vs transformers fp32 {rel(out[('mlora', fp)], out[('hf', fp)]):.2e}; "
          f"mlora bf16 vs transformers bf16 {rel(out[('mlora', bf)], out[('hf', bf)]):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
