"""The greedy choice over decode-sized logits on the GPU: torch.argmax against
mlora.kernels.greedy's two launches, each timed with CUDA events after a 256 MiB L2 flush
(median of 50, the kernel bench's timer), beside the byte floor (the logits read once at the
copy rate measured in the same run). Checks the two agree. Needs a CUDA GPU:

    PYTHONPATH=. python scripts/greedy_bench.py
"""
import torch

from mlora.kernels.greedy import greedy_tokens
from mlora.bench.kernels import _events_median, measure_ceilings


def main():
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    bw = measure_ceilings().copy_bytes_per_s
    print(f"copy {bw / 1e12:.2f} TB/s")
    for rows in (256, 64):
        x = torch.randn(rows, 128256, device="cuda").to(torch.bfloat16)
        assert torch.equal(greedy_tokens(x), torch.argmax(x, dim=-1))
        floor = x.numel() * x.element_size() / bw * 1e6
        t_torch = _events_median(lambda: torch.argmax(x, dim=-1), 50, flush) * 1e6
        t_mlora = _events_median(lambda: greedy_tokens(x), 50, flush) * 1e6
        print(f"{rows} rows x 128256 bf16: torch.argmax {t_torch:.1f} us, greedy_tokens {t_mlora:.1f} us, "
              f"floor {floor:.1f} us", flush=True)


if __name__ == "__main__":
    main()
