"""Token sampling with per-row random streams independent of batch composition.

Owns the choice of the next token from a row's logits (the model's dtype: the
LM head's output as it is rounded; nothing is gained by widening it). Greedy
(the default, temperature 0) is the argmax over them, lowest index on ties,
which is the argmax of their float32 values (``mlora.kernels.greedy``). Otherwise, in float32:
temperature scaling, then top-k, then top-p (nucleus: the smallest prefix of
the probability-sorted tokens whose mass reaches p), then one draw by inverse
CDF with a uniform number that depends only on (job seed, row id, token
index): the same row gets the same tokens whatever else is in its batch, on
any device, in any order, and after a resume.

The uniform comes from SplitMix64 over a 64-bit key (blake2b of the seed and
the row id) and the token index, so no generator state is carried between
iterations.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from mlora.kernels.greedy import greedy_tokens  # torch.argmax's choice, in two launches on CUDA

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("--temperature must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError("--top-p must lie in (0, 1]")
        if self.top_k < 0:
            raise ValueError("--top-k must be >= 0 (0 = no limit)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def row_key(seed: int, row_id: str) -> int:
    """64-bit key of a row's random stream."""
    h = hashlib.blake2b(f"{seed}\x00{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(key: int, index: int) -> float:
    """The uniform in [0, 1) for token ``index`` of the row with ``key`` (53 bits)."""
    return (_splitmix64((key + _splitmix64(index)) & _MASK) >> 11) / float(1 << 53)


def sample(logits: torch.Tensor, params: SamplingParams, keys: list[int], indices: list[int]) -> list[int]:
    """Next token of each row of ``logits`` [B, V] (any float dtype); ``keys`` and
    ``indices`` give each row's stream and token index."""
    if logits.shape[0] == 0:
        return []
    if params.greedy:
        return greedy_tokens(logits).tolist()
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    if params.top_p < 1:
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the tokens ranked above
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
    cdf = torch.cumsum(sorted_p.double(), dim=-1)
    u = torch.tensor([uniform(k, i) for k, i in zip(keys, indices)], dtype=torch.float64, device=cdf.device)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=cdf.shape[-1] - 1)
    return order.gather(1, pick).flatten().tolist()
