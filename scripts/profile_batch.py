"""Where a steady-state decode iteration of the engine spends its time (GPU).

Builds the ``mlora bench batch`` model (random weights, a shape preset), fills
the engine with ``--rows`` rows, runs until every row is decoding, then
profiles ``--iters`` decode iterations with torch.profiler and prints: wall
time per iteration split into host stages (schedule, input build, forward
launch, sampling sync), and the GPU kernels by total time. With ``--graphs``
also the GPU time of the decode step alone: the batch's graph replayed back to
back with the greedy argmax after each (no host work in between; CUDA events),
against the engine's wall time per iteration: the difference is the time the
GPU waits for the host between iterations.

    PYTHONPATH=. python scripts/profile_batch.py --rows 256 --adapters 8
"""

import argparse
import time

import torch

from mlora.batch.engine import engine as engine_mod
from mlora.bench.batch import BatchBenchOptions, _num_blocks, _requests, preset_config, random_bank, random_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--adapters", type=int, default=0)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--phase", choices=["decode", "prefill"], default="decode",
                    help="profile steady decode iterations, or the first (prefill-chunk) iterations")
    ap.add_argument("--graphs", action="store_true", help="decode steps from CUDA graphs (as batch-run on a GPU)")
    ap.add_argument("--lookahead", action=argparse.BooleanOptionalAction, default=True,
                    help="batch-run's lookahead (its default; --no-lookahead: serial steps)")
    args = ap.parse_args()
    o = BatchBenchOptions(preset=args.preset, rows=args.rows, max_num_seqs=args.rows, prompt_max=args.prompt_max,
                          prompt_min=min(128, args.prompt_max))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    config = preset_config(o.preset, o.dtype)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = random_model(config, dev, dtype, 0)
    bank, pinned = random_bank(model, args.adapters, o.rank, 0) if args.adapters else (None, {})
    eng = engine_mod.Engine(model, bank, pinned, num_blocks=_num_blocks(o), block_size=o.block_size,
                            max_num_seqs=o.max_num_seqs, max_batch_tokens=o.max_batch_tokens, device=dev,
                            dtype=dtype, cuda_graphs=args.graphs, lookahead=args.lookahead)
    for r in _requests(o, config, args.adapters, args.rows, 100, 0):
        eng.add(r)
    if args.phase == "decode":
        while eng.waiting or any(s.pending != 1 for s in eng.running):
            eng.step()
        for _ in range(3):
            eng.step()
    else:
        eng.step()  # compile
    sync()

    stages = {"schedule": 0.0, "forward (launch)": 0.0, "advance (sync + sample)": 0.0}
    sched, fwd, adv = eng.schedule, eng._forward, eng._advance

    def timed(name, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            stages[name] += time.perf_counter() - t0
            return out
        return run

    eng.schedule, eng._forward, eng._advance = (timed("schedule", sched), timed("forward (launch)", fwd),
                                                 timed("advance (sync + sample)", adv))
    # parts of the forward stage (each inside "forward (launch)"): the graph path's input copies,
    # LoRA plan and replay; the replay call alone; the bank's per-invocation context
    if eng.graphs is not None:
        stages["  of which graphs.run"] = 0.0
        stages["    of which graph.replay"] = 0.0
        eng.graphs.run = timed("  of which graphs.run", eng.graphs.run)
        replay = torch.cuda.CUDAGraph.replay
        torch.cuda.CUDAGraph.replay = lambda self: timed("    of which graph.replay", replay)(self)
    if bank is not None:
        stages["  of which bank.context"] = 0.0
        bank.context = timed("  of which bank.context", bank.context)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        eng.step()
    sync()
    wall = (time.perf_counter() - t0) / args.iters
    print(f"{len(eng.running)} running rows, {args.adapters} adapters: {wall * 1e3:.2f} ms per {args.phase} iteration")
    for k, v in stages.items():
        print(f"  {k:28s} {v / args.iters * 1e3:8.2f} ms")

    if eng.graphs is not None and args.phase == "decode":  # the device alone: replays back to back
        graph, logits = eng.graphs.graphs[eng.graphs.bucket(len(eng.running))]

        def device_step():
            graph.replay()
            torch.argmax(logits, dim=-1)

        device_step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            device_step()
        end.record()
        end.synchronize()
        gpu = start.elapsed_time(end) / 1e3 / args.iters
        print(f"  device alone (replay + argmax)  {gpu * 1e3:8.2f} ms; the GPU waits for the host "
              f"{(wall - gpu) * 1e3:.2f} ms an iteration ({(wall - gpu) / wall:.1%})")

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(args.iters):
            eng.step()
        sync()
    print(prof.key_averages().table(sort_by="cuda_time_total" if dev.type == "cuda" else "cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
