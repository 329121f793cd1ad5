"""The greedy choice over decode-sized logits on the GPU: torch.argmax against
mlora.batch.greedy's two launches, each timed with CUDA events after a 256 MiB L2 flush
(median of 50), beside the byte floor (the logits read once at the measured copy rate).
Checks the two agree. Needs a CUDA GPU:

    PYTHONPATH=. python scripts/greedy_bench.py
"""
import statistics

import torch

from mlora.batch.greedy import greedy_tokens


def _median_us(fn, flush, reps=50):
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main():
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = _median_us(lambda: dst.copy_(src), flush, 10) / 1e6
    bw = 2 * src.numel() / copy_s
    print(f"copy {bw / 1e12:.2f} TB/s")
    for rows in (256, 64):
        x = torch.randn(rows, 128256, device="cuda").to(torch.bfloat16)
        assert torch.equal(greedy_tokens(x), torch.argmax(x, dim=-1))
        floor = x.numel() * x.element_size() / bw * 1e6
        t_torch = _median_us(lambda: torch.argmax(x, dim=-1), flush)
        t_mlora = _median_us(lambda: greedy_tokens(x), flush)
        print(f"{rows} rows x 128256 bf16: torch.argmax {t_torch:.1f} us, greedy_tokens {t_mlora:.1f} us, "
              f"floor {floor:.1f} us", flush=True)


if __name__ == "__main__":
    main()
