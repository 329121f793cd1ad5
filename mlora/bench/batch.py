"""The engine benchmark behind ``mlora bench batch`` (its targets: BENCHMARKS.md).

Owns the measurement method; the figures go into BENCHMARKS.md.

* Model: a named shape preset (``llama-3-8b``, ``llama-3-70b``; ``tiny`` for CPU
  tests) with random weights generated on the device (no files), EOS ids removed
  so every row generates exactly ``max_new_tokens``. Each tensor comes from a
  generator seeded by (``seed``, its checkpoint name) (:class:`GeneratedModel`), so a
  tensor-parallel rank generates the whole tensors it cuts and keeps its slices:
  the ranks together hold exactly the one-device model of the same seed.
* Adapters: ``n`` random adapters of rank ``rank`` on every linear module
  (q, k, v, o, gate, up, down of every layer), written straight into a
  :class:`~mlora.batch.adapters.slots.SlotBank` with ``n`` slots (all resident: this
  measures execution, not loading). Rows pick their adapter uniformly at
  random; ``n = 0`` is the base-only run.
* Job: ``rows`` prompts of random token ids, lengths uniform in
  ``[prompt_min, prompt_max]``, all queued at the start, run through the real
  :class:`~mlora.batch.engine.engine.Engine` (continuous batching, chunked prefill,
  paged KV cache, segmented LoRA kernels, greedy sampling). A short warm-up
  job first compiles the kernels; the timed engine then captures the decode
  graphs of every batch-size bucket before the clock starts (``graph_capture_s``;
  batch-run captures each bucket when first met, inside the job).
* Per iteration: wall time of ``Engine.step`` (it ends in a host sync when the
  sampled tokens are read, so wall time is the iteration's time, host work
  included). For decode-only iterations the floor is computed from what that
  iteration had to move and compute:

  bytes = base weights read (all layers, final norm, LM head)
        + the distinct adapters' factors at true rank
        + K/V read (every sequence's context, all layers)
        + activations (each GEMM's input and output rows, the logits)
  flops = 2 * rows * (layer weights + LM head) + attention (4 * context * heads * head_dim per row and layer)
        + LoRA (2 * rows * rank * (d_in + d_out) per module)
  floor = max(bytes / copy bandwidth, flops / bf16 matmul rate), both measured in the same run.

  Also the *staged floor*: the same terms split by the kernels that do them,
  each stage's own max(bytes, flops) time, summed: GEMMs (weights, activations
  and logits against the GEMM and LM-head flops), attention (K/V bytes against
  the attention flops) and LoRA (adapter bytes against the LoRA flops). Stages
  that run one after the other cannot overlap a compute-bound GEMM with a
  bandwidth-bound attention, so the staged floor (>= the floor) is what
  kernels in sequence can reach; at 256 decode rows of an 8B model, the GEMMs
  are compute-bound and attention bandwidth-bound.
* Under tensor parallelism (``tensor_parallel_size`` N > 1, :mod:`mlora.bench.tpbatch`)
  the floor is rank 0's: the terms above for the part of the model the rank
  holds (its cut of every layer's q/k/v/o/gate/up/down, its kv heads' K/V, its cut
  of each adapter, ``tp.lora_elements``; embeddings, LM head and norms whole),
  plus the group's all-reduces, which no stage overlaps:

  floor = max(bytes / copy bandwidth, flops / matmul rate)
        + layers * (2 * t_ar(rows, hidden) + [adapters in the batch] 2 * t_ar(rows, rank))

  (one all-reduce after o and one after down, and with adapters one of the o and
  down LoRA bottlenecks each). ``t_ar(rows, width)`` is the measured time of one
  all-reduce of a [rows, width] tensor over the group: timed at the start of each
  scenario at 1, ``max_num_seqs`` and ``max_batch_tokens`` rows (a run of
  back-to-back all-reduces, the best of three), interpolated linearly in rows.
  The staged floor adds the same term. The adapters there are PEFT files, which
  every rank loads its cut of.
* Reported per scenario: generated tokens per second over the whole job (wall
  clock, prefill included), and for decode-only iterations the median time,
  the median floor and the median of time / floor, overall and at full batch
  (at least 90 % of ``max_num_seqs`` running). Iterations with prefill chunks
  are summed: their time against the sum of their floors (:func:`mixed_floor`:
  causal attention counted per query-key pair), usually compute-bound.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import socket
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mlora.batch.adapters.catalog import PinnedAdapter
from mlora.batch.adapters.slots import SlotBank
from mlora.batch.config import EngineConfig
from mlora.batch.engine.engine import Engine, Request, Result
from mlora.batch.errors import CodedError
from mlora.batch.gcpauses import RunPauses
from mlora.batch.model.decoder import DTYPES, DecoderModel, ModelConfig
from mlora.batch.model.kvcache import KVCache
from mlora.batch.model.lora import config_role_shapes, module_name
from mlora.batch.model.tp import TPLayout, check_size, shard_config, tp_sizes
from mlora.batch.model.tp import lora_elements as tp_lora_elements
from mlora.bench.gpuclocks import ClockSampler, gpu_clocks

PRESETS: dict[str, dict] = {
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192),
    "llama-3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                        num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192),
    "mistral-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, rope_theta=1000000.0, max_position_embeddings=32768),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, rope_theta=10000.0, max_position_embeddings=512),
}


@dataclass
class BatchBenchOptions:
    preset: str = "llama-3-8b"
    rows: int = 512
    adapters: tuple[int, ...] = (0, 1, 8, 64)
    rank: int = 16
    prompt_min: int = 128
    prompt_max: int = 1024
    max_new_tokens: int = 128
    max_num_seqs: int = 256
    max_batch_tokens: int = 8192
    block_size: int = 16
    device: str = "cuda"
    dtype: str = "bfloat16"
    seed: int = 0
    cuda_graphs: bool = True  # decode steps from CUDA graphs (on a GPU), as batch-run does
    # with base first among several scenarios: run it again last, ratios against the faster run
    repeat_base: bool = True
    lookahead: bool = True  # batch-run's --lookahead (the next decode iteration's inputs built during this one)
    # one model over this many rank processes, one GPU each (mlora.bench.tpbatch); no lookahead there
    tensor_parallel_size: int = 1
    # tensor parallelism: where the adapters are written as PEFT files (reused when complete);
    # None: a temporary directory, removed at the end
    adapters_dir: str | None = None


def preset_config(name: str, dtype: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    p = PRESETS[name]
    return ModelConfig(arch="llama", rms_norm_eps=1e-5, rope_scaling=None, tie_word_embeddings=False,
                       qkv_bias=False, o_bias=False, qk_norm=False, eos_token_ids=(), bos_token_id=None,
                       dtype=dtype, **p)


def checkpoint_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor of a Llama checkpoint of ``c`` (norms: 1-D)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        for role, shape in config_role_shapes(c).items():
            shapes[f"{module_name(i, role)}.weight"] = shape
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[f"model.layers.{i}.{norm}.weight"] = (c.hidden_size,)
    shapes["model.norm.weight"] = (c.hidden_size,)
    shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name``: the same in every process (no salted ``hash``), and
    its low 32 bits depend on both (the CPU generator seeds from those alone)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") % 2**63


class _GeneratedTensors(Mapping):
    """The checkpoint of :class:`GeneratedModel` as a mapping generated on demand: each tensor
    whole on ``device`` (std 0.02; norm gains 1), the last one kept, as the model's loader asks
    for a tensor's shape and then for its data (or slice)."""

    def __init__(self, config: ModelConfig, seed: int, device: torch.device, dtype: torch.dtype):
        self.shapes, self.seed, self.device, self.dtype = checkpoint_shapes(config), seed, device, dtype
        self._last: tuple[str | None, torch.Tensor | None] = (None, None)

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._last[0] != name:
            self._last = (None, None)  # the previous tensor freed before the next is generated
            shape = self.shapes[name]
            if len(shape) == 1:
                t = torch.ones(shape, device=self.device, dtype=self.dtype)
            else:
                gen = torch.Generator(device=self.device).manual_seed(tensor_seed(self.seed, name))
                t = torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32).mul_(0.02)
                t = t.to(self.dtype)
            self._last = (name, t)
        return self._last[1]

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


class GeneratedModel:
    """A random model of ``config`` as a tensor-parallel model source
    (``mlora.batch.engine.tpfollow.ModelSource``): every rank generates each whole tensor from
    its seed on its own device and keeps its slice (seconds on a GPU, nothing on disk), so the
    ranks' parts are the cuts of the one-device model of the same seed. ``probe_rows``: after
    building, every rank times the group's all-reduces of [rows, width] tensors for those row
    counts, widths ``hidden_size`` and ``rank`` (the floor's collective term, module docstring);
    rank 0 reads them in ``probed``. Travels to the followers by pickle."""

    def __init__(self, config: ModelConfig, seed: int, probe_rows: tuple[int, ...] = (), rank: int = 16):
        self.config, self.seed, self.probe_rows, self.rank = config, seed, tuple(probe_rows), rank
        self.probed: AllReduceTimes | None = None

    def model(self, device, dtype: torch.dtype, layout: TPLayout | None = None, collective=None) -> DecoderModel:
        """The rank's part (the whole model without ``layout``)."""
        device = torch.device(device)
        return DecoderModel.from_state_dict(self.config, _GeneratedTensors(self.config, self.seed, device, dtype),
                                            device=device, dtype=dtype, tp=layout, collective=collective)

    def build(self, device, dtype: torch.dtype, layout: TPLayout, collective) -> DecoderModel:
        model = self.model(device, dtype, layout, collective)
        if self.probe_rows and layout.size > 1:
            widths = {"hidden": self.config.hidden_size, "rank": self.rank}
            self.probed = time_all_reduces(collective, torch.device(device), dtype, widths, self.probe_rows)
        return model


def random_model(config: ModelConfig, device, dtype: torch.dtype, seed: int) -> DecoderModel:
    """Random weights generated on ``device`` (std 0.02, unit norm gains; :class:`GeneratedModel`)."""
    return GeneratedModel(config, seed).model(device, dtype)


@dataclass(frozen=True)
class AllReduceTimes:
    """Seconds of one all-reduce over a group, per tensor width and row count (measured)."""

    size: int  # ranks in the group
    rows: tuple[int, ...]
    seconds: dict[str, tuple[float, ...]]  # width name -> seconds at each of ``rows``

    def at(self, width: str, rows: int) -> float:
        """Linear in rows between the measured counts (beyond them: the nearest segment's line)."""
        xs, ys = self.rows, self.seconds[width]
        if len(xs) == 1:
            return ys[0]
        j = next((k for k in range(1, len(xs) - 1) if rows <= xs[k]), len(xs) - 1)
        x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
        return max(0.0, y0 + (y1 - y0) * (rows - x0) / (x1 - x0))

    def record(self) -> dict:
        return dict(size=self.size, rows=list(self.rows), seconds={k: list(v) for k, v in self.seconds.items()})


def time_all_reduces(collective, device: torch.device, dtype: torch.dtype, widths: dict[str, int],
                     rows: tuple[int, ...], count: int = 20, repeats: int = 3) -> AllReduceTimes:
    """Every rank of ``collective``'s group at once: ``count`` back-to-back all-reduces of a
    [r, width] tensor per width and row count ``r``, the best of ``repeats`` runs, each run
    started after an all-reduce has completed on this rank (the ranks lined up)."""
    rows = tuple(sorted(set(rows)))
    seconds: dict[str, tuple[float, ...]] = {}
    for name, width in widths.items():
        per_row = []
        for r in rows:
            t = torch.zeros(r, width, dtype=dtype, device=device)
            for _ in range(3):
                collective.all_reduce(t)
            best = float("inf")
            for _ in range(repeats):
                collective.all_reduce(t)
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(count):
                    collective.all_reduce(t)
                _sync(device)
                best = min(best, (time.perf_counter() - t0) / count)
            per_row.append(best)
        seconds[name] = tuple(per_row)
    return AllReduceTimes(collective.layout.size, rows, seconds)


@dataclass(frozen=True)
class TPFloor:
    """What a tensor-parallel rank's floor needs beyond its own config (module docstring): the
    whole model's config (its adapter cut: ``tp.lora_elements``) and the group's all-reduce times."""

    config: ModelConfig  # the whole model's
    all_reduce: AllReduceTimes

    @property
    def layout(self) -> TPLayout:
        return TPLayout(0, self.all_reduce.size)

    def collectives_s(self, rows: int, lora: bool) -> float:
        """The all-reduces of one invocation of ``rows`` packed rows (``lora``: some row has an adapter)."""
        per_layer = 2 * self.all_reduce.at("hidden", rows) + (2 * self.all_reduce.at("rank", rows) if lora else 0.0)
        return self.config.num_layers * per_layer


def random_bank(model: DecoderModel, n: int, rank: int, seed: int, backend: str = "auto"
                ) -> tuple[SlotBank, dict[str, PinnedAdapter]]:
    """A bank whose ``n`` slots hold random rank-``rank`` adapters on every module, and their
    pinned records (``backend``: the bank's kernels, as ``SlotBank``'s)."""
    c = model.config
    bank = SlotBank(c.num_layers, model.group_shapes(), n, rank, model.dtype, model.device, backend=backend)
    gen = torch.Generator(device=model.device).manual_seed(seed + 1)
    pinned = {}
    for g in bank.A:
        d_in = bank.d_in[g]
        bank.A[g].copy_(torch.randn(bank.A[g].shape, generator=gen, device=model.device) / d_in ** 0.5)
        bank.B[g].copy_(torch.randn(bank.B[g].shape, generator=gen, device=model.device) * 0.02)
        bank.ranks[g].fill_(rank)
        bank.scales[g].fill_(2.0)
    every = frozenset((layer, g) for layer in range(c.num_layers) for g in bank.A)
    for s in range(n):
        key = f"bench-{s}"
        pinned[key] = PinnedAdapter(id=key, path=None, ok=True, semantic_sha256=key, max_rank=rank)
        bank._lru[key] = s
        bank._targets[s] = every
    return bank, pinned


def as_alora(pinned: dict[str, PinnedAdapter], invocation_tokens) -> dict[str, PinnedAdapter]:
    """``pinned``'s adapters as activated LoRA (aLoRA) adapters invoked by ``invocation_tokens``
    (the same factors; a new semantic identity, as the invocation is part of what an aLoRA adapter is)."""
    inv = tuple(int(t) for t in invocation_tokens)
    if not inv:
        raise ValueError("an aLoRA adapter needs at least one invocation token id")
    return {k: dataclasses.replace(p, invocation_tokens=inv, semantic_sha256=f"{p.semantic_sha256}+alora{list(inv)}")
            for k, p in pinned.items()}


def adapter_bytes(config: ModelConfig, rank: int, itemsize: int) -> int:
    """Bytes of one adapter's factors at true rank on every linear module."""
    per_layer = sum(rank * (d_out + d_in) for d_out, d_in in config_role_shapes(config).values())
    return per_layer * config.num_layers * itemsize


def layer_params(c: ModelConfig) -> int:
    """Weights of one layer's seven projections."""
    return sum(d_out * d_in for d_out, d_in in config_role_shapes(c).values())


@dataclass
class Ceilings:
    copy_bytes_per_s: float
    matmul_flops_per_s: float
    # what the GPU holds over seconds of matmuls (power-capped); recorded beside the burst
    # rate the floors use (mlora.bench.kernels.sustained_matmul_rate); None off CUDA
    sustained_matmul_flops_per_s: float | None = None


def measure_ceilings(device: torch.device) -> Ceilings:
    """Copy bandwidth and matmul rate of ``device`` (the kernel benchmark's method on CUDA;
    a small wall-clock measurement on the CPU, good enough for floors there)."""
    if device.type == "cuda":
        from mlora.bench.kernels import measure_ceilings as cuda_ceilings
        from mlora.bench.kernels import sustained_matmul_rate

        c = cuda_ceilings()
        return Ceilings(c.copy_bytes_per_s, c.bf16_flops_per_s, sustained_matmul_rate())
    src = torch.empty(1 << 24, dtype=torch.float32)
    dst = torch.empty_like(src)
    a = torch.randn(512, 512)
    times_copy, times_mm = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times_copy.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        a @ a
        times_mm.append(time.perf_counter() - t0)
    return Ceilings(2 * src.numel() * 4 / min(times_copy), 2 * 512**3 / min(times_mm))


class _RecordingEngine(Engine):
    """The engine, remembering each iteration's plan for the floor computation."""

    last_plan = None

    def _advance(self, plan, logits):  # every iteration's plan: scheduled, looked ahead or chained
        self.last_plan = plan
        return super()._advance(plan, logits)


def iteration_floor(config: ModelConfig, dtype: torch.dtype, rows: int, pairs: int, kv_tokens: int, sampled: int,
                    lora_rows: int, distinct: int, rank: int, ceil: Ceilings, tp: TPFloor | None = None) -> dict:
    """Floor of one iteration of ``rows`` packed rows (module docstring): ``pairs`` causal
    query-key pairs attended, ``kv_tokens`` cached tokens read, ``sampled`` rows through the
    LM head, ``lora_rows`` rows through the LoRA branches of ``distinct`` adapters.
    flops = 2 * rows * layer weights + 4 * heads * head_dim * layers per pair + LM head + LoRA;
    bytes = weights (norms included) + distinct adapters at true rank + K/V read + each GEMM's
    input and output rows + the logits of the sampled rows. ``config``: the model the rank
    runs; with ``tp``, a tensor-parallel rank's (its ``shard_config``), its adapter cut and
    the group's all-reduces added (``all_reduce_s``)."""
    c = config
    itemsize = torch.empty((), dtype=dtype).element_size()
    # one adapter's factor elements on this device at true rank
    lora_elements = adapter_bytes(c, rank, 1) if tp is None else tp_lora_elements(tp.config, tp.layout, rank)
    collectives = tp.collectives_s(rows, lora_rows > 0) if tp is not None else 0.0
    weights = (c.num_layers * layer_params(c) + c.vocab_size * c.hidden_size) * itemsize \
        + (2 * c.num_layers + 1) * c.hidden_size * itemsize
    kv_per_token = KVCache.block_bytes(c.num_layers, 1, c.num_kv_heads, c.head_dim, dtype)
    per_row_act = c.num_layers * (4 * c.hidden_size + 2 * c.q_out + 2 * c.kv_out + 3 * c.intermediate_size) * itemsize
    act = rows * per_row_act + sampled * c.vocab_size * itemsize  # logits written once, in the model's dtype
    total = weights + distinct * lora_elements * itemsize + kv_tokens * kv_per_token + act
    flops = 2 * rows * c.num_layers * layer_params(c) + 4 * pairs * c.num_heads * c.head_dim * c.num_layers \
        + 2 * sampled * c.vocab_size * c.hidden_size + 2 * lora_rows * lora_elements
    t_bytes, t_flops = total / ceil.copy_bytes_per_s, flops / ceil.matmul_flops_per_s
    bw, rate = ceil.copy_bytes_per_s, ceil.matmul_flops_per_s
    stages = (  # (bytes, flops) of the GEMMs, attention and LoRA: the terms above, each counted once
        (weights + act, 2 * rows * c.num_layers * layer_params(c) + 2 * sampled * c.vocab_size * c.hidden_size),
        (kv_tokens * kv_per_token, 4 * pairs * c.num_heads * c.head_dim * c.num_layers),
        (distinct * lora_elements * itemsize, 2 * lora_rows * lora_elements),
    )
    staged = sum(max(b / bw, f / rate) for b, f in stages) + collectives
    out = dict(rows=rows, bytes=total, flops=flops, floor_s=max(t_bytes, t_flops) + collectives, staged_floor_s=staged,
               bound="memory" if t_bytes >= t_flops else "compute")
    if tp is not None:
        out["all_reduce_s"] = collectives
    return out


def decode_floor(config: ModelConfig, dtype: torch.dtype, rows: int, context_tokens: int, distinct: int, rank: int,
                 ceil: Ceilings, tp: TPFloor | None = None) -> dict:
    """Floor of one decode iteration: every row one new token (attending to its whole
    context) and sampled; LoRA on every row when any adapter is in the batch."""
    return iteration_floor(config, dtype, rows, context_tokens, context_tokens, rows, rows if distinct else 0,
                           distinct, rank, ceil, tp)


def mixed_floor(config: ModelConfig, dtype: torch.dtype, seqs: list[tuple[int, int]], sampled: int, lora_rows: int,
                distinct: int, rank: int, ceil: Ceilings, tp: TPFloor | None = None) -> dict:
    """Floor of an iteration with prefill chunks: ``seqs`` = (new rows n, context after it c)
    per sequence; row i of a chunk attends to the c - n + i + 1 keys up to its position."""
    rows = sum(n for n, _ in seqs)
    pairs = sum(n * (ctx - n) + n * (n + 1) // 2 for n, ctx in seqs)
    return iteration_floor(config, dtype, rows, pairs, sum(ctx for _, ctx in seqs), sampled, lora_rows, distinct,
                           rank, ceil, tp)


def _requests(o: BatchBenchOptions, config: ModelConfig, n_adapters: int, rows: int, max_new: int, seed: int):
    rng = random.Random(seed)  # prompts: the same for every adapter count
    pick = random.Random(seed + 1)  # adapters
    out = []
    for i in range(rows):
        length = rng.randint(o.prompt_min, o.prompt_max)
        prompt = [rng.randrange(config.vocab_size) for _ in range(length)]
        adapter = f"bench-{pick.randrange(n_adapters)}" if n_adapters else None
        out.append(Request(row=i, id=str(i), prompt_ids=prompt, adapter=adapter, max_new_tokens=max_new))
    return out


def _short_requests(o, config: ModelConfig, n_adapters: int, seed: int, length: int = 16):
    """Up to 96 prompts of ``length`` tokens (as many as one chunk and the seats hold: ``o``'s
    ``max_batch_tokens`` and ``max_num_seqs``), the adapters taken in turn, one new token each:
    a bench's second warm-up."""
    rng = random.Random(seed)
    count = max(1, min(96, o.max_num_seqs, o.max_batch_tokens // length))
    return [Request(row=i, id=f"short-{i}", prompt_ids=[rng.randrange(config.vocab_size) for _ in range(length)],
                    adapter=f"bench-{i % n_adapters}" if n_adapters else None, max_new_tokens=1)
            for i in range(count)]


def _num_blocks(o: BatchBenchOptions) -> int:
    """Enough KV blocks that ``max_num_seqs`` full-length rows never preempt each other."""
    per_seq = -(-(o.prompt_max + o.max_new_tokens) // o.block_size)
    return o.max_num_seqs * per_seq + 8


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def drain(eng: Engine, requests) -> list[Result]:
    """Queue ``requests`` on ``eng`` and step until every row is done (untimed: the warm-ups)."""
    for r in requests:
        eng.add(r)
    done: list[Result] = []
    while eng.has_work():
        done += eng.step()
    return done


def queue(eng: Engine, requests, hint: str) -> None:
    """Queue ``requests`` on ``eng``; a refused row is a bench set-up error (``hint``: which options to lower)."""
    for r in requests:
        if eng.add(r) is not None:
            raise RuntimeError(f"bench row {r.row} was refused; {hint}")


@dataclass
class TimedRun:
    """What :func:`timed_run` measured over one job."""

    wall_s: float
    graph_capture_s: float  # the decode graphs of every bucket, captured before the clock
    decode: list[dict]  # per decode-only iteration: its time, floor, rows and context
    mixed: list[dict]  # per iteration with prefill chunks: its time and floor
    results: list[Result]  # the finished rows, in completion order
    gc: dict  # the collector's pauses over the timed job (RunPauses.stats)
    clocks: ClockSampler  # the SM clock and power over the timed job (mlora.bench.gpuclocks)


def timed_run(eng: _RecordingEngine, rank: int, ceil: Ceilings, tp: TPFloor | None = None) -> TimedRun:
    """Run the rows queued on ``eng`` to the end against the clock, every iteration timed
    beside its floor (module docstring; ``rank``: the adapters' true rank; ``tp``: the floor
    terms of a tensor-parallel rank 0, whose engine's graphs every rank captures at once).
    The whole timed span of a bench job is this function."""
    model = eng.model
    dev, dtype = model.device, model.dtype
    decode, mixed, results = [], [], []
    # the decode graphs of every bucket, before the clock: a fresh engine would otherwise capture
    # each bucket inside the timed job the first time the running rows shrink to it (batch-run
    # pays that once per job; reported as graph_capture_s)
    _sync(dev)
    t_capture = time.perf_counter()
    if eng.graphs is not None:
        leader = eng.executor.tp  # a capture holds the layers' all-reduces: every rank captures at once
        leader.capture(eng.graphs.capture_all) if leader is not None else eng.graphs.capture_all()
    _sync(dev)
    capture_s = time.perf_counter() - t_capture
    pauses = RunPauses()
    pauses.start()
    clocks = ClockSampler(dev).start()
    try:
        t_start = time.perf_counter()
        while eng.has_work():
            eng.last_plan = None
            t0 = time.perf_counter()
            results += eng.step()
            seconds = time.perf_counter() - t0
            plan = eng.last_plan
            if plan is None:
                continue
            if plan.doff:  # prefill chunks (and maybe decode rows): the compute-heavy iterations
                seqs = [(n, s.num_computed) for s, n in zip(plan.seqs, plan.new_tokens)]
                lora_rows = sum(n for s, n in zip(plan.seqs, plan.new_tokens) if s.adapter is not None)
                distinct = len({s.adapter for s in plan.seqs if s.adapter is not None})
                f = mixed_floor(model.config, dtype, seqs, sum(plan.sample), lora_rows, distinct, rank, ceil, tp)
                mixed.append(dict(seconds=seconds, **f))
                continue
            ctx = sum(s.num_computed for s in plan.seqs)  # after the step: the context each row attended to
            distinct = len({s.adapter for s in plan.seqs if s.adapter is not None})
            f = decode_floor(model.config, dtype, len(plan.seqs), ctx, distinct, rank, ceil, tp)
            decode.append(dict(context=ctx, distinct=distinct, seconds=seconds, t0=t0, **f))  # f['rows']: running rows
        _sync(dev)
        wall = time.perf_counter() - t_start
    finally:
        clocks.stop()
        pauses.close()
    return TimedRun(wall, capture_s, decode, mixed, results, pauses.stats(), clocks)


def iteration_summary(items: list[dict]) -> dict | None:
    """Medians of decode iterations' times against their floors (None for no iterations)."""
    if not items:
        return None
    return dict(iterations=len(items), median_rows=statistics.median(d["rows"] for d in items),
                median_s=statistics.median(d["seconds"] for d in items),
                total_s=sum(d["seconds"] for d in items), max_s=max(d["seconds"] for d in items),
                median_floor_s=statistics.median(d["floor_s"] for d in items),
                median_ratio=statistics.median(d["seconds"] / d["floor_s"] for d in items),
                median_staged_floor_s=statistics.median(d["staged_floor_s"] for d in items),
                median_staged_ratio=statistics.median(d["seconds"] / d["staged_floor_s"] for d in items),
                bound=statistics.mode(d["bound"] for d in items),
                # tensor parallelism: the floor's all-reduce term (module docstring)
                median_all_reduce_s=statistics.median(d["all_reduce_s"] for d in items) if "all_reduce_s" in items[0]
                else None)


def prefill_summary(mixed: list[dict]) -> dict:
    """The iterations with prefill chunks, summed: their time against the sum of their floors."""
    seconds, floor = sum(m["seconds"] for m in mixed), sum(m["floor_s"] for m in mixed)
    return dict(iterations=len(mixed), seconds=seconds, floor_s=floor, rows=sum(m["rows"] for m in mixed),
                ratio=seconds / floor if mixed else None)


def engine_config(o: BatchBenchOptions, device: torch.device) -> EngineConfig:
    """The engine's choices for ``o``: a scheduling window of 256 rows (the setting of the
    figures BENCHMARKS.md records), decode graphs on a GPU."""
    return EngineConfig(block_size=o.block_size, max_num_seqs=o.max_num_seqs, max_batch_tokens=o.max_batch_tokens,
                        schedule_window=256, cuda_graphs=o.cuda_graphs and device.type == "cuda", lookahead=o.lookahead)


def warm_up(engine: Engine, o: BatchBenchOptions, config: ModelConfig, n_adapters: int) -> None:
    """Compile the kernels outside the timed job: enough rows for full prefill chunks and
    most of the integer specialisations Triton compiles lazily, then one chunk of short
    prompts over 1,024 rows when the limits allow: with many adapters its segments average
    under 32 rows, so it compiles the 16-row-tile variants of the fused SiLU launch
    (invocations of >= 1,024 rows) that the job's mixed iterations need and full chunks never do."""
    for batch in (_requests(o, config, n_adapters, min(o.rows, 256), 2, o.seed + 99),
                  _short_requests(o, config, n_adapters, o.seed + 98)):
        drain(engine, batch)


def run_scenario(model: DecoderModel, o: BatchBenchOptions, n_adapters: int, ceil: Ceilings, progress=None) -> dict:
    """One scenario from warm-up to its record (the timed span: :func:`timed_run`)."""
    bank, pinned = random_bank(model, n_adapters, o.rank, o.seed) if n_adapters else (None, {})
    config = engine_config(o, model.device)

    def engine():
        return _RecordingEngine(model, bank, pinned, config, num_blocks=_num_blocks(o))

    warm = engine()
    warm_up(warm, o, model.config, n_adapters)
    del warm
    return timed_scenario(engine(), o, n_adapters, ceil, progress)


def timed_scenario(eng: _RecordingEngine, o: BatchBenchOptions, n_adapters: int, ceil: Ceilings, progress=None,
                   tp: TPFloor | None = None) -> dict:
    """Queue the scenario's rows on ``eng`` (warmed up), run them against the clock and
    return the scenario's record (``tp``: rank 0 of a tensor-parallel group, its floor terms)."""
    model = eng.model
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    queue(eng, _requests(o, model.config, n_adapters, o.rows, o.max_new_tokens, o.seed),
          "lower --prompt-max or --max-new-tokens")
    t = timed_run(eng, o.rank, ceil, tp)
    decode, wall = t.decode, t.wall_s
    generated = eng.stats["generated_tokens"]
    full = [d for d in decode if d["rows"] >= 0.9 * o.max_num_seqs]
    result = dict(adapters=n_adapters, rows=o.rows, generated_tokens=generated, wall_s=wall,
                  tokens_per_s=generated / wall, iterations=eng.stats["iterations"],
                  prefill_tokens=eng.stats["prefill_tokens"], decode=iteration_summary(decode),
                  decode_full_batch=iteration_summary(full), prefill=prefill_summary(t.mixed),
                  adapter_bytes=(adapter_bytes(model.config, o.rank, itemsize) if tp is None  # on this device
                                 else tp_lora_elements(tp.config, tp.layout, o.rank) * itemsize),
                  graph_capture_s=t.graph_capture_s,
                  gc=t.gc, lookahead_iterations=eng.lookahead_used, chained_iterations=eng.chained,
                  # the GPU's SM clock and power during the full-batch decode iterations (None without NVML)
                  clocks_full_batch=t.clocks.summary([(d["t0"], d["t0"] + d["seconds"]) for d in full]),
                  # the rows' generated tokens in row order: equal digests, equal outputs (TP=2 against one device)
                  tokens_sha256=tokens_digest(t.results))
    # wall time outside every iteration's step (job set-up inside the clock, empty steps): with
    # the decode outliers (max_s: kernel compiles) it shows where a gap to the
    # medians comes from
    result["outside_iterations_s"] = wall - result["prefill"]["seconds"] - (result["decode"] or {}).get("total_s", 0.0)
    if progress:
        progress(result)
    return result


def tokens_digest(results: list[Result]) -> str:
    """SHA-256 of every row's generated token ids, in row order."""
    h = hashlib.sha256()
    for r in sorted(results, key=lambda r: r.row):
        h.update(f"{r.row}:{','.join(map(str, r.token_ids))};".encode())
    return h.hexdigest()


def check_options(o: BatchBenchOptions) -> ModelConfig:
    """The preset's config once ``o`` is known to run (ValueError: an option's own domain;
    ``BenchError`` for a combination that cannot: a model part larger than a device)."""
    if o.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {o.dtype!r}; use one of {', '.join(DTYPES)}")
    if not 1 <= o.prompt_min <= o.prompt_max:
        raise ValueError("need 1 <= prompt_min <= prompt_max")
    if o.tensor_parallel_size < 1:
        raise ValueError("the tensor-parallel size must be at least 1")
    config = preset_config(o.preset, o.dtype)
    if o.prompt_max + o.max_new_tokens > config.max_position_embeddings:
        raise ValueError(f"prompt_max + max_new_tokens exceeds the preset's context {config.max_position_embeddings}")
    size = o.tensor_parallel_size
    if size > 1:
        try:
            check_size(config, size)
        except CodedError as e:
            raise BenchError(e.code, f"--preset {o.preset}: {e.message}") from e
    dev = torch.device(o.device)
    if dev.type == "cuda" and torch.cuda.device_count() < size:
        raise BenchError("E_TP_UNSUPPORTED", f"--tensor-parallel-size {size} puts one rank on each GPU, but "
                         f"{torch.cuda.device_count()} are visible: use at most that many")
    check_fits(config, o, device_bytes(dev), shared=dev.type != "cuda")
    return config


class BenchError(CodedError, ValueError):
    """A benchmark that cannot run as asked; ``code`` is stable, the message says what to change."""


def device_bytes(dev: torch.device) -> int:
    """The memory one rank can hold at most: the GPU's, or the host's on the CPU."""
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rank_bytes(config: ModelConfig, o: BatchBenchOptions, size: int) -> dict:
    """What one rank of ``size`` holds for ``o``'s job at its peak: its part of the weights, the
    KV cache of :func:`_num_blocks`, one slot per adapter of the largest scenario, and, while
    the weights are generated, the largest whole tensor in float32 and in the model's dtype."""
    itemsize = torch.empty((), dtype=DTYPES[o.dtype]).element_size()
    layout = TPLayout(0, size)
    local = shard_config(config, layout) if size > 1 else config
    weights = (local.num_layers * layer_params(local) + 2 * local.vocab_size * local.hidden_size) * itemsize
    kv = _num_blocks(o) * KVCache.block_bytes(local.num_layers, o.block_size, local.num_kv_heads, local.head_dim,
                                              DTYPES[o.dtype])
    per_adapter = (tp_lora_elements(config, layout, o.rank) if size > 1 else adapter_bytes(config, o.rank, 1))
    adapters = max(o.adapters, default=0) * per_adapter * itemsize
    largest = max(max(config.vocab_size, 2 * config.intermediate_size) * config.hidden_size, 1)
    generating = largest * (4 + itemsize)
    return dict(weights=weights, kv=kv, adapters=adapters, total=max(weights + generating, weights + kv + adapters))


# the share of a device's memory a rank's weights, KV cache and adapter slots may fill: the
# rest is activations, decode graphs' pools and the CUDA context
FIT_SHARE = 0.92


def check_fits(config: ModelConfig, o: BatchBenchOptions, capacity: int, shared: bool = False) -> None:
    """Refuse (``E_BENCH_MEMORY``) a job whose rank would not fit ``capacity`` bytes (a GPU's), or
    with ``shared`` whose ranks together would not (the host's, on the CPU), naming the
    tensor-parallel sizes that would fit one GPU per rank."""
    size = o.tensor_parallel_size

    def need(n: int) -> int:
        return rank_bytes(config, o, n)["total"] * (n if shared else 1)

    if need(size) <= FIT_SHARE * capacity:
        return
    parts = rank_bytes(config, o, size)
    gib = 2**30
    fits = [] if shared else [n for n in tp_sizes(config) if n > size and need(n) <= FIT_SHARE * capacity]
    hint = f"use --tensor-parallel-size >= {fits[0]} (one GPU per rank), or lower" if fits else "lower"
    where = f"of this {'host' if shared else 'GPU'}'s {capacity / gib:.0f} GiB"
    raise BenchError("E_BENCH_MEMORY", f"--preset {o.preset} at --tensor-parallel-size {size} needs "
                     f"{need(size) / gib:.0f} GiB ({f'{size} ranks on the host, ' if shared else ''}per rank: "
                     f"weights {parts['weights'] / gib:.0f}, KV cache {parts['kv'] / gib:.0f} for --max-num-seqs "
                     f"{o.max_num_seqs} rows of --prompt-max + --max-new-tokens tokens, adapters "
                     f"{parts['adapters'] / gib:.1f}), more than {FIT_SHARE:.0%} {where}: {hint} --max-num-seqs, "
                     "--prompt-max or the adapter counts")


def run_batch_bench(o: BatchBenchOptions, progress=None, scenario=None) -> dict:
    """Every scenario of ``o`` and the run's record. ``scenario(n, ceil, progress)``: runs the
    scenario of ``n`` adapters and returns its record (default: on one device, the model built
    once; ``mlora.bench.tpbatch``: a tensor-parallel group per scenario)."""
    config = check_options(o)
    if o.tensor_parallel_size > 1 and scenario is None:
        raise ValueError("a tensor-parallel bench runs through mlora.bench.tpbatch.run_tp_batch_bench")
    dev = torch.device(o.device)
    clocks_before = gpu_clocks(dev)
    ceil = measure_ceilings(dev)
    build_s = None
    if scenario is None:
        t0 = time.perf_counter()
        model = random_model(config, dev, DTYPES[o.dtype], o.seed)
        _sync(dev)
        build_s = time.perf_counter() - t0

        def scenario(n, ceil, progress):
            return run_scenario(model, o, n, ceil, progress)

    scenarios = [scenario(n, ceil, progress) for n in o.adapters]
    if o.repeat_base and o.adapters and o.adapters[0] == 0 and len(o.adapters) > 1:
        # the first scenario of a run can pay lazy compiles and cold caches inside its timed
        # part, which flatters every ratio to it: run the base again last and take the faster
        again = scenario(0, ceil, progress)
        again["repeat"] = True
        scenarios.append(again)
    bases = [s for s in scenarios if s["adapters"] == 0]
    base = max(bases, key=lambda s: s["tokens_per_s"]) if bases else None
    for s in scenarios:
        s["tokens_per_s_vs_base"] = s["tokens_per_s"] / base["tokens_per_s"] if base else None
    machine = machine_of(dev)
    machine["clocks_before"], machine["clocks_after"] = clocks_before, gpu_clocks(dev)
    out = dict(
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", machine=machine,
        torch=torch.__version__, options=o.__dict__ | {"adapters": list(o.adapters)},
        ceilings=dict(copy_bytes_per_s=ceil.copy_bytes_per_s, matmul_flops_per_s=ceil.matmul_flops_per_s,
                      sustained_matmul_flops_per_s=ceil.sustained_matmul_flops_per_s),
        model_build_s=build_s, scenarios=scenarios,
    )
    return out


def machine_of(dev: torch.device) -> dict:
    """Which machine a run measured: the host name and, on CUDA, the GPU's UUID, its SM count and
    the CUDA runtime torch was built with. Two GPUs of one model differ by a few percent
    (BENCHMARKS.md), so a comparison across runs must name them."""
    out = {"host": socket.gethostname()}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        out["gpu_uuid"] = str(getattr(props, "uuid", "")) or None
        out["sm_count"] = props.multi_processor_count
        out["cuda_runtime"] = torch.version.cuda
    return out
