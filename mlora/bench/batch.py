"""The engine benchmark behind ``mlora bench batch`` (its targets: BENCHMARKS.md).

Owns the measurement method; the figures go into BENCHMARKS.md.

* Model: a named shape preset (``llama-3-8b``; ``tiny`` for CPU tests) with
  random weights generated on the device (no files), EOS ids removed so every
  row generates exactly ``max_new_tokens``.
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
* Reported per scenario: generated tokens per second over the whole job (wall
  clock, prefill included), and for decode-only iterations the median time,
  the median floor and the median of time / floor, overall and at full batch
  (at least 90 % of ``max_num_seqs`` running). Iterations with prefill chunks
  are summed: their time against the sum of their floors (:func:`mixed_floor`:
  causal attention counted per query-key pair), usually compute-bound.
"""

from __future__ import annotations

import dataclasses
import random
import socket
import statistics
import time
from dataclasses import dataclass

import torch

from mlora.batch.adapters.catalog import PinnedAdapter
from mlora.batch.adapters.slots import SlotBank
from mlora.batch.config import EngineConfig
from mlora.batch.engine.engine import Engine, Request, Result
from mlora.batch.gcpauses import RunPauses
from mlora.batch.model.decoder import DecoderLayer, DecoderModel, ModelConfig
from mlora.batch.model.kvcache import KVCache
from mlora.batch.model.lora import config_role_shapes
from mlora.bench.gpuclocks import ClockSampler, gpu_clocks

PRESETS: dict[str, dict] = {
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
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


def preset_config(name: str, dtype: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    p = PRESETS[name]
    return ModelConfig(arch="llama", rms_norm_eps=1e-5, rope_scaling=None, tie_word_embeddings=False,
                       qkv_bias=False, o_bias=False, qk_norm=False, eos_token_ids=(), bos_token_id=None,
                       dtype=dtype, **p)


def random_model(config: ModelConfig, device, dtype: torch.dtype, seed: int) -> DecoderModel:
    """Random weights generated on ``device`` (std 0.02, unit norm gains)."""
    c = config
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def ones(n):
        return torch.ones(n, device=device, dtype=dtype)

    layers = []
    for i in range(c.num_layers):
        w = {"qkv_weight": rnd(c.q_out + 2 * c.kv_out, c.hidden_size), "qkv_bias": None,
             "o_weight": rnd(c.hidden_size, c.q_out), "o_bias": None,
             "gate_up_weight": rnd(2 * c.intermediate_size, c.hidden_size),
             "down_weight": rnd(c.hidden_size, c.intermediate_size),
             "input_norm_weight": ones(c.hidden_size), "post_norm_weight": ones(c.hidden_size),
             "q_norm_weight": None, "k_norm_weight": None}
        layers.append(DecoderLayer(i, c, w))
    return DecoderModel(c, rnd(c.vocab_size, c.hidden_size), ones(c.hidden_size), rnd(c.vocab_size, c.hidden_size),
                        layers)


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
                    lora_rows: int, distinct: int, rank: int, ceil: Ceilings) -> dict:
    """Floor of one iteration of ``rows`` packed rows (module docstring): ``pairs`` causal
    query-key pairs attended, ``kv_tokens`` cached tokens read, ``sampled`` rows through the
    LM head, ``lora_rows`` rows through the LoRA branches of ``distinct`` adapters.
    flops = 2 * rows * layer weights + 4 * heads * head_dim * layers per pair + LM head + LoRA;
    bytes = weights (norms included) + distinct adapters at true rank + K/V read + each GEMM's
    input and output rows + the logits of the sampled rows."""
    c = config
    itemsize = torch.empty((), dtype=dtype).element_size()
    weights = (c.num_layers * layer_params(c) + c.vocab_size * c.hidden_size) * itemsize \
        + (2 * c.num_layers + 1) * c.hidden_size * itemsize
    kv_per_token = KVCache.block_bytes(c.num_layers, 1, c.num_kv_heads, c.head_dim, dtype)
    per_row_act = c.num_layers * (4 * c.hidden_size + 2 * c.q_out + 2 * c.kv_out + 3 * c.intermediate_size) * itemsize
    act = rows * per_row_act + sampled * c.vocab_size * itemsize  # logits written once, in the model's dtype
    total = weights + distinct * adapter_bytes(c, rank, itemsize) + kv_tokens * kv_per_token + act
    flops = 2 * rows * c.num_layers * layer_params(c) + 4 * pairs * c.num_heads * c.head_dim * c.num_layers \
        + 2 * sampled * c.vocab_size * c.hidden_size + 2 * lora_rows * adapter_bytes(c, rank, 1)
    t_bytes, t_flops = total / ceil.copy_bytes_per_s, flops / ceil.matmul_flops_per_s
    bw, rate = ceil.copy_bytes_per_s, ceil.matmul_flops_per_s
    stages = (  # (bytes, flops) of the GEMMs, attention and LoRA: the terms above, each counted once
        (weights + act, 2 * rows * c.num_layers * layer_params(c) + 2 * sampled * c.vocab_size * c.hidden_size),
        (kv_tokens * kv_per_token, 4 * pairs * c.num_heads * c.head_dim * c.num_layers),
        (distinct * adapter_bytes(c, rank, itemsize), 2 * lora_rows * adapter_bytes(c, rank, 1)),
    )
    staged = sum(max(b / bw, f / rate) for b, f in stages)
    return dict(rows=rows, bytes=total, flops=flops, floor_s=max(t_bytes, t_flops), staged_floor_s=staged,
                bound="memory" if t_bytes >= t_flops else "compute")


def decode_floor(config: ModelConfig, dtype: torch.dtype, rows: int, context_tokens: int, distinct: int, rank: int,
                 ceil: Ceilings) -> dict:
    """Floor of one decode iteration: every row one new token (attending to its whole
    context) and sampled; LoRA on every row when any adapter is in the batch."""
    return iteration_floor(config, dtype, rows, context_tokens, context_tokens, rows, rows if distinct else 0,
                           distinct, rank, ceil)


def mixed_floor(config: ModelConfig, dtype: torch.dtype, seqs: list[tuple[int, int]], sampled: int, lora_rows: int,
                distinct: int, rank: int, ceil: Ceilings) -> dict:
    """Floor of an iteration with prefill chunks: ``seqs`` = (new rows n, context after it c)
    per sequence; row i of a chunk attends to the c - n + i + 1 keys up to its position."""
    rows = sum(n for n, _ in seqs)
    pairs = sum(n * (ctx - n) + n * (n + 1) // 2 for n, ctx in seqs)
    return iteration_floor(config, dtype, rows, pairs, sum(ctx for _, ctx in seqs), sampled, lora_rows, distinct,
                           rank, ceil)


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


def timed_run(eng: _RecordingEngine, rank: int, ceil: Ceilings) -> TimedRun:
    """Run the rows queued on ``eng`` to the end against the clock, every iteration timed
    beside its floor (module docstring; ``rank``: the adapters' true rank). The whole timed
    span of a bench job is this function."""
    model = eng.model
    dev, dtype = model.device, model.dtype
    decode, mixed, results = [], [], []
    # the decode graphs of every bucket, before the clock: a fresh engine would otherwise capture
    # each bucket inside the timed job the first time the running rows shrink to it (batch-run
    # pays that once per job; reported as graph_capture_s)
    _sync(dev)
    t_capture = time.perf_counter()
    if eng.graphs is not None:
        eng.graphs.capture_all()
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
                f = mixed_floor(model.config, dtype, seqs, sum(plan.sample), lora_rows, distinct, rank, ceil)
                mixed.append(dict(seconds=seconds, **f))
                continue
            ctx = sum(s.num_computed for s in plan.seqs)  # after the step: the context each row attended to
            distinct = len({s.adapter for s in plan.seqs if s.adapter is not None})
            f = decode_floor(model.config, dtype, len(plan.seqs), ctx, distinct, rank, ceil)
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
                bound=statistics.mode(d["bound"] for d in items))


def prefill_summary(mixed: list[dict]) -> dict:
    """The iterations with prefill chunks, summed: their time against the sum of their floors."""
    seconds, floor = sum(m["seconds"] for m in mixed), sum(m["floor_s"] for m in mixed)
    return dict(iterations=len(mixed), seconds=seconds, floor_s=floor, rows=sum(m["rows"] for m in mixed),
                ratio=seconds / floor if mixed else None)


def run_scenario(model: DecoderModel, o: BatchBenchOptions, n_adapters: int, ceil: Ceilings, progress=None) -> dict:
    """One scenario from warm-up to its record (the timed span: :func:`timed_run`)."""
    dev = model.device
    dtype = model.dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    bank, pinned = random_bank(model, n_adapters, o.rank, o.seed) if n_adapters else (None, {})

    # a scheduling window of 256 rows: the setting of the figures BENCHMARKS.md records
    config = EngineConfig(block_size=o.block_size, max_num_seqs=o.max_num_seqs, max_batch_tokens=o.max_batch_tokens,
                          schedule_window=256, cuda_graphs=o.cuda_graphs and dev.type == "cuda", lookahead=o.lookahead)

    def engine():
        return _RecordingEngine(model, bank, pinned, config, num_blocks=_num_blocks(o))

    # compile the kernels outside the timed job: enough rows for full prefill chunks and
    # most of the integer specialisations Triton compiles lazily, then one chunk of short
    # prompts over 1,024 rows when the limits allow: with many adapters its segments average
    # under 32 rows, so it compiles the 16-row-tile variants of the fused SiLU launch
    # (invocations of >= 1,024 rows) that the job's mixed iterations need and full chunks never do
    warm = engine()
    for batch in (_requests(o, model.config, n_adapters, min(o.rows, 256), 2, o.seed + 99),
                  _short_requests(o, model.config, n_adapters, o.seed + 98)):
        drain(warm, batch)
    del warm

    eng = engine()
    queue(eng, _requests(o, model.config, n_adapters, o.rows, o.max_new_tokens, o.seed),
          "lower --prompt-max or --max-new-tokens")
    t = timed_run(eng, o.rank, ceil)
    decode, wall = t.decode, t.wall_s
    generated = eng.stats["generated_tokens"]
    full = [d for d in decode if d["rows"] >= 0.9 * o.max_num_seqs]
    result = dict(adapters=n_adapters, rows=o.rows, generated_tokens=generated, wall_s=wall,
                  tokens_per_s=generated / wall, iterations=eng.stats["iterations"],
                  prefill_tokens=eng.stats["prefill_tokens"], decode=iteration_summary(decode),
                  decode_full_batch=iteration_summary(full), prefill=prefill_summary(t.mixed),
                  adapter_bytes=adapter_bytes(model.config, o.rank, itemsize), graph_capture_s=t.graph_capture_s,
                  gc=t.gc, lookahead_iterations=eng.lookahead_used, chained_iterations=eng.chained,
                  # the GPU's SM clock and power during the full-batch decode iterations (None without NVML)
                  clocks_full_batch=t.clocks.summary([(d["t0"], d["t0"] + d["seconds"]) for d in full]))
    # wall time outside every iteration's step (job set-up inside the clock, empty steps): with
    # the decode outliers (max_s: kernel compiles) it shows where a gap to the
    # medians comes from
    result["outside_iterations_s"] = wall - result["prefill"]["seconds"] - (result["decode"] or {}).get("total_s", 0.0)
    if progress:
        progress(result)
    return result


def run_batch_bench(o: BatchBenchOptions, progress=None) -> dict:
    from mlora.batch.model.decoder import DTYPES

    if o.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {o.dtype!r}; use one of {', '.join(DTYPES)}")
    if not 1 <= o.prompt_min <= o.prompt_max:
        raise ValueError("need 1 <= prompt_min <= prompt_max")
    dev = torch.device(o.device)
    config = preset_config(o.preset, o.dtype)
    if o.prompt_max + o.max_new_tokens > config.max_position_embeddings:
        raise ValueError(f"prompt_max + max_new_tokens exceeds the preset's context {config.max_position_embeddings}")
    clocks_before = gpu_clocks(dev)
    ceil = measure_ceilings(dev)
    t0 = time.perf_counter()
    model = random_model(config, dev, DTYPES[o.dtype], o.seed)
    _sync(dev)
    build_s = time.perf_counter() - t0
    scenarios = [run_scenario(model, o, n, ceil, progress) for n in o.adapters]
    if o.repeat_base and o.adapters and o.adapters[0] == 0 and len(o.adapters) > 1:
        # the first scenario of a run can pay lazy compiles and cold caches inside its timed
        # part, which flatters every ratio to it: run the base again last and take the faster
        again = run_scenario(model, o, 0, ceil, progress)
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
