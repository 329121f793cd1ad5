"""Host work of one decode iteration of the engine, with the model replaced by a stub.

The model's forward returns zero logits at once, so what is timed is the
engine's own Python: scheduling, building the invocation's inputs and the
bank's LoRA plan, sampling and bookkeeping. 512 rows of the tiny preset
(prompts 100-400 tokens), 256 running, CPU:

    PYTHONPATH=. python scripts/engine_host_overhead.py

On a GPU this time adds to every iteration unless it overlaps the device
work (step 7).
"""

import time

import torch

from mlora.bench.batch import BatchBenchOptions, _requests, preset_config, random_bank, random_model
from mlora.batch.engine.engine import Engine


def main() -> None:
    o = BatchBenchOptions(preset="tiny", rows=512, max_num_seqs=256, prompt_min=100, prompt_max=400,
                          max_new_tokens=64, device="cpu", dtype="float32")
    cfg = preset_config("tiny", "float32")
    model = random_model(cfg, torch.device("cpu"), torch.float32, 0)
    model.forward = lambda ids, pos, meta, kv, lora, sample_rows: torch.zeros(sample_rows.numel(), cfg.vocab_size)
    for n_ad in (0, 8):
        bank, pinned = random_bank(model, n_ad, 16, 0) if n_ad else (None, {})
        eng = Engine(model, bank, pinned, num_blocks=256 * 30, block_size=16, max_num_seqs=256, max_batch_tokens=8192,
                     device="cpu", dtype=torch.float32)
        for r in _requests(o, cfg, n_ad, o.rows, o.max_new_tokens, 0):
            eng.add(r)
        while not eng.running or any(s.pending != 1 for s in eng.running):
            eng.step()
        t = {"schedule": 0.0, "_forward": 0.0, "_advance": 0.0}
        for name in t:
            f = getattr(eng, name)

            def timed(*a, f=f, name=name):
                t0 = time.perf_counter()
                out = f(*a)
                t[name] += time.perf_counter() - t0
                return out

            setattr(eng, name, timed)
        n = 20
        t0 = time.perf_counter()
        for _ in range(n):
            eng.step()
        step = (time.perf_counter() - t0) / n
        parts = ", ".join(f"{k.strip('_')} {v / n * 1e3:.2f} ms" for k, v in t.items())
        print(f"{n_ad} adapters, {len(eng.running)} running: {step * 1e3:.2f} ms per decode step ({parts})")


if __name__ == "__main__":
    main()
