"""The prefix-sharing benchmark behind ``mlora bench prefix`` (its targets: BENCHMARKS.md).

Owns the measurement method; the figures go into BENCHMARKS.md. Model, adapters
and timing are ``mlora bench batch``'s (:mod:`mlora.bench.batch`): a shape
preset with random weights on the device and EOS removed (every row generates
exactly ``max_new_tokens``), ``adapters`` random rank-``rank`` adapters on every
linear module held in a slot bank with one slot each (all resident), an untimed
warm-up job before every timed one, the decode graphs captured before the clock,
every iteration timed beside its floor.

* Rows: ``contexts`` shared contexts of ``context_tokens`` random token ids,
  each row one of them followed by its own random question of
  ``question_tokens``, ``max_new_tokens`` new tokens. A row's context and
  execution identity (one of the adapters, or the base) cycle through every
  (context, identity) pair, so rows spread uniformly over both; the rows are
  then shuffled (seeded) and all queued at the start, under batch-run's default
  scheduling window (the whole job), which leaves the order rows run in to the
  engine's admission.
* Jobs, each run with the prefix cache on, then off (the same rows; a first
  run that pays what the warm-up missed counts against the cache):

  - ``lora``: the adapters are ordinary LoRA adapters (``adapters`` + 1
    execution identities). A context's KV depends on the identity that computed
    it, so the ideal computes each context once per (context, identity) pair
    the rows use: ideal = pairs * context_tokens + rows * question_tokens.
  - ``alora``: the same rows over activated LoRA (aLoRA) adapters invoked by a
    fixed 2-token sequence that opens every question (right after the context;
    question tokens never repeat it, so the activation starts there). The KV
    before the invocation is the base's, shared by the base and every aLoRA
    adapter: ideal = distinct contexts * context_tokens + rows * question_tokens.
  - ``unshared``: rows of the same length and identities with no shared prefix
    (every prompt random): the cost of the cache where it finds nothing
    (ideal = every prompt token).

* Reported per run: prompt tokens, those computed and those taken from the
  cache (``Engine.stats``: per row at its first admission; the prefill rows
  the engine ran, recomputation after a preemption included, are
  ``prefill_tokens_run``: a prompt's last chunk of one token runs as a decode
  row and is not among them), computed / ideal, generated
  tokens/s over the wall clock, wall time, preemptions, the cache's block
  lookups, hits, evictions, publications and peak of blocks shared by several
  rows (``Engine.prefix_stats``), the prefill and decode iterations against
  their floors (``mlora bench batch``'s), and a digest of every row's tokens;
  per job the on / off tokens/s ratio, the rows whose tokens differ between
  the two runs (none in float32; bf16 sums in another order when a context is
  computed in other chunks) and the targets: computed / ideal <= 1.1 (lora,
  alora), on / off >= 2.5 (lora), on / off >= 0.98 (unshared).
* KV cache: the same number of blocks for every run, enough for every
  (context, identity) pair's context blocks (what the cache keeps) plus
  ``max_num_seqs`` rows at their full length, so that a context is evicted
  only if the engine evicts it before it has to; on a GPU it must fit the
  memory the job may take (``gpu_memory_utilization`` of batch-run, 0.9 of
  the device, less what is allocated), else the bench stops before running.

Sizes: the issue's job is 4,096 rows; at 4,096 rows one job's two runs take
about 4 minutes on an H200 (estimate: ~40k prefill tokens/s, ~19 ms per decode
iteration of 256 rows), so all three jobs exceed one 10-minute device call. The
default of 2,048 rows runs all three in one call (about 7 minutes); the
4,096-row figures come from one call per job (``--rows 4096 --jobs lora``).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass

import torch

from mlora.batch.config import EngineConfig
from mlora.batch.engine.engine import Request
from mlora.batch.job.sizing import release_device_memory, usable_gpu_bytes
from mlora.batch.model.decoder import DTYPES, DecoderModel
from mlora.batch.model.kvcache import KVCache
from mlora.bench.batch import (
    Ceilings,
    _RecordingEngine,
    _short_requests,
    _sync,
    as_alora,
    drain,
    iteration_summary,
    machine_of,
    measure_ceilings,
    prefill_summary,
    preset_config,
    queue,
    random_bank,
    random_model,
    timed_run,
)
from mlora.bench.gpuclocks import gpu_clocks

JOBS = ("lora", "alora", "unshared")
# Engine.prefix_stats' counters (zeros when the cache is off)
PREFIX_KEYS = ("hit_blocks", "looked_up_blocks", "evictions", "published", "shared_blocks_peak")
INVOCATION_LENGTH = 2
WARMUP_ROWS = 256  # rows of each warm-up job (two new tokens each), as bench batch's


@dataclass
class PrefixBenchOptions:
    preset: str = "llama-3-8b"
    rows: int = 2048
    contexts: int = 8
    context_tokens: int = 1024
    question_tokens: int = 128
    max_new_tokens: int = 128
    adapters: int = 16
    rank: int = 16
    jobs: tuple[str, ...] = JOBS
    max_num_seqs: int = 256
    max_batch_tokens: int = 8192
    block_size: int = 16
    device: str = "cuda"
    dtype: str = "bfloat16"
    seed: int = 0
    cuda_graphs: bool = True  # decode steps from CUDA graphs (on a GPU), as batch-run does


def invocation_tokens(vocab_size: int, seed: int) -> tuple[int, ...]:
    """The aLoRA adapters' invocation: ``INVOCATION_LENGTH`` distinct token ids drawn from ``seed``."""
    return tuple(random.Random(seed + 7).sample(range(vocab_size), INVOCATION_LENGTH))


def identities(o: PrefixBenchOptions) -> list[str | None]:
    """The rows' execution identities: every adapter, then the base (None)."""
    return [f"bench-{k}" for k in range(o.adapters)] + [None]


def job_requests(o: PrefixBenchOptions, job: str, vocab_size: int, *, seed: int, rows: int,
                 max_new_tokens: int) -> list[Request]:
    """The rows of ``job`` (module docstring), drawn from ``seed``: the same contexts, identities,
    order and question tails for every job (an ``alora`` prompt is the ``lora`` one with the
    invocation over its question's first tokens; an ``unshared`` one replaces the context)."""
    inv = invocation_tokens(vocab_size, o.seed)
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:  # random ids that never start the invocation
        return [t + (t >= inv[0]) for t in (rng.randrange(vocab_size - 1) for _ in range(n))]

    names = identities(o)
    contexts = [draw(o.context_tokens) for _ in range(o.contexts)]
    pairs = [(c, e) for c in range(o.contexts) for e in range(len(names))]
    layout = [pairs[i % len(pairs)] for i in range(rows)]
    rng.shuffle(layout)
    out = []
    for i, (c, e) in enumerate(layout):
        question = draw(o.question_tokens)
        if job == "alora":
            question[:len(inv)] = inv
        context = draw(o.context_tokens) if job == "unshared" else contexts[c]
        out.append(Request(row=i, id=str(i), prompt_ids=context + question, adapter=names[e],
                           max_new_tokens=max_new_tokens))
    return out


def ideal_computed(requests: list[Request], context_tokens: int, job: str) -> int:
    """Prompt tokens a perfect prefix cache computes: each distinct context once per execution
    identity that computes its KV (the row's adapter or the base; for ``alora`` always the
    base), plus every token after the context."""
    if job == "alora":
        shared = {tuple(r.prompt_ids[:context_tokens]) for r in requests}
    else:
        shared = {(tuple(r.prompt_ids[:context_tokens]), r.adapter) for r in requests}
    return len(shared) * context_tokens + sum(len(r.prompt_ids) - context_tokens for r in requests)


def kv_sizing(o: PrefixBenchOptions, model: DecoderModel) -> dict:
    """KV blocks of every run (module docstring): the contexts' blocks of every (context,
    identity) pair plus ``max_num_seqs`` full-length rows; on CUDA checked against the memory
    the job may take (ValueError when it does not fit)."""
    c = model.config
    per_context = o.context_tokens // o.block_size  # full blocks: what the cache keeps
    per_row = -(-(o.context_tokens + o.question_tokens + o.max_new_tokens) // o.block_size)
    shared = o.contexts * (o.adapters + 1) * per_context
    running = o.max_num_seqs * per_row
    block = KVCache.block_bytes(c.num_layers, o.block_size, c.num_kv_heads, c.head_dim, model.dtype)
    out = dict(num_blocks=shared + running, context_blocks=shared, running_blocks=running, block_bytes=block,
               kv_bytes=(shared + running) * block, available_blocks=None)
    if model.device.type == "cuda":
        out["available_blocks"] = int(usable_gpu_bytes(EngineConfig(), model.device) // block)
        if out["num_blocks"] > out["available_blocks"]:
            raise ValueError(f"the KV cache needs {out['num_blocks']} blocks ({out['kv_bytes'] / 2**30:.1f} GiB: "
                             f"{shared} for the shared contexts, {running} for the running rows); the GPU holds "
                             f"{out['available_blocks']}: lower --max-num-seqs, --contexts, --adapters or "
                             "--context-tokens")
    return out


def run_job(model: DecoderModel, o: PrefixBenchOptions, job: str, prefix_cache: bool, bank, pinned: dict,
            num_blocks: int, ceil: Ceilings) -> tuple[dict, dict[int, list[int]]]:
    """One timed run of ``job`` from warm-up to its record; also every row's tokens by row."""
    dev = model.device
    config = EngineConfig(block_size=o.block_size, max_num_seqs=o.max_num_seqs, max_batch_tokens=o.max_batch_tokens,
                          cuda_graphs=o.cuda_graphs and dev.type == "cuda", prefix_cache=prefix_cache)

    def engine():
        return _RecordingEngine(model, bank, pinned, config, num_blocks=num_blocks)

    vocab = model.config.vocab_size
    # kernels compile outside the timed job, as in bench batch (mlora.bench.batch.run_scenario);
    # other contexts than the timed job's: a warm-up engine's cache is not the timed one's anyway
    warm = engine()
    drain(warm, job_requests(o, job, vocab, seed=o.seed + 99, rows=min(o.rows, WARMUP_ROWS), max_new_tokens=2))
    short = _short_requests(o, model.config, o.adapters, o.seed + 98)
    if job == "alora":  # invoked from their first token: adapted like LoRA rows, not refused
        for r in short:
            r.prompt_ids[:INVOCATION_LENGTH] = invocation_tokens(vocab, o.seed)
    drain(warm, short)
    del warm
    release_device_memory(dev)

    eng = engine()
    requests = job_requests(o, job, vocab, seed=o.seed, rows=o.rows, max_new_tokens=o.max_new_tokens)
    queue(eng, requests, "lower --context-tokens, --question-tokens or --max-new-tokens")
    t = timed_run(eng, o.rank, ceil)
    failed = [r for r in t.results if r.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"{len(failed)} of {o.rows} bench rows failed ({job}, prefix cache "
                           f"{'on' if prefix_cache else 'off'}); the first: {failed[0].error_code}: "
                           f"{failed[0].error_message}")
    tokens = {r.row: r.token_ids for r in t.results}
    stats = eng.stats
    cache = eng.prefix_stats or dict.fromkeys(PREFIX_KEYS, 0)
    cache = {k: cache[k] for k in PREFIX_KEYS}
    cache["hit_rate"] = cache["hit_blocks"] / cache["looked_up_blocks"] if cache["looked_up_blocks"] else None
    prompt = sum(len(r.prompt_ids) for r in requests)
    ideal = ideal_computed(requests, o.context_tokens, job)
    generated = stats["generated_tokens"]
    record = dict(job=job, prefix_cache=prefix_cache, rows=o.rows, prompt_tokens=prompt,
                  prefill_tokens_computed=stats["prefill_tokens_computed"],
                  prefill_tokens_reused=stats["prefill_tokens_reused"], ideal_computed=ideal,
                  computed_vs_ideal=stats["prefill_tokens_computed"] / ideal,
                  prefill_tokens_run=stats["prefill_tokens"], generated_tokens=generated, wall_s=t.wall_s,
                  tokens_per_s=generated / t.wall_s, iterations=stats["iterations"], preemptions=stats["preemptions"],
                  prefix=cache, prefill=prefill_summary(t.mixed), decode=iteration_summary(t.decode),
                  graph_capture_s=t.graph_capture_s, gc=t.gc,
                  tokens_sha256=hashlib.sha256(json.dumps([tokens[k] for k in sorted(tokens)]).encode()).hexdigest())
    return record, tokens


def _target(name: str, value: float, limit: float, at_most: bool) -> dict:
    return dict(name=name, value=value, limit=limit, at_most=at_most,
                met=value <= limit if at_most else value >= limit)


def run_prefix_job(model: DecoderModel, o: PrefixBenchOptions, job: str, num_blocks: int, ceil: Ceilings,
                   progress=None) -> dict:
    """``job`` with the prefix cache on, then off, on one bank; the on / off comparison and its targets."""
    bank, pinned = random_bank(model, o.adapters, o.rank, o.seed)
    if job == "alora":
        pinned = as_alora(pinned, invocation_tokens(model.config.vocab_size, o.seed))
    runs, tokens = [], []
    for on in (True, False):
        record, got = run_job(model, o, job, on, bank, pinned, num_blocks, ceil)
        runs.append(record)
        tokens.append(got)
        if progress:
            progress(record)
    del bank
    release_device_memory(model.device)
    on, off = runs
    ratio = on["tokens_per_s"] / off["tokens_per_s"]
    targets = []
    if job in ("lora", "alora"):
        targets.append(_target("prompt tokens computed / ideal (cache on)", on["computed_vs_ideal"], 1.1, True))
    if job == "lora":
        targets.append(_target("tokens/s on / off", ratio, 2.5, False))
    if job == "unshared":
        targets.append(_target("tokens/s on / off", ratio, 0.98, False))
    return dict(job=job, execution_identities=o.adapters + 1, ideal_computed=on["ideal_computed"],
                prompt_tokens=on["prompt_tokens"], tokens_per_s_ratio=ratio,
                rows_with_other_tokens=sum(tokens[0][k] != tokens[1].get(k) for k in tokens[0]),
                runs=runs, targets=targets)


def check_options(o: PrefixBenchOptions) -> None:
    """Raise ValueError for options the bench cannot run (the CLI's usage errors)."""
    if o.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {o.dtype!r}; use one of {', '.join(DTYPES)}")
    unknown = [j for j in o.jobs if j not in JOBS]
    if unknown or not o.jobs:
        raise ValueError(f"--jobs takes a comma-separated subset of {','.join(JOBS)}, not {','.join(o.jobs)!r}")
    for name in ("rows", "contexts", "context_tokens", "question_tokens", "max_new_tokens", "adapters", "rank",
                 "max_num_seqs", "max_batch_tokens", "block_size"):
        if getattr(o, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, not {getattr(o, name)}")
    if "alora" in o.jobs and o.question_tokens < INVOCATION_LENGTH + 1:
        raise ValueError(f"--question-tokens must be >= {INVOCATION_LENGTH + 1} with the alora job (the invocation "
                         f"opens every question and a question of its own follows), not {o.question_tokens}")
    config = preset_config(o.preset, o.dtype)
    if o.context_tokens + o.question_tokens + o.max_new_tokens >= config.max_position_embeddings:
        raise ValueError(f"context + question + new tokens ({o.context_tokens + o.question_tokens + o.max_new_tokens})"
                         f" must stay below the preset's context of {config.max_position_embeddings}")


def run_prefix_bench(o: PrefixBenchOptions, progress=None) -> dict:
    """Every job of ``o.jobs`` on one random model (module docstring); ``progress(record)`` after each run."""
    check_options(o)
    dev = torch.device(o.device)
    config = preset_config(o.preset, o.dtype)
    clocks_before = gpu_clocks(dev)
    ceil = measure_ceilings(dev)
    t0 = time.perf_counter()
    model = random_model(config, dev, DTYPES[o.dtype], o.seed)
    _sync(dev)
    build_s = time.perf_counter() - t0
    kv = kv_sizing(o, model)
    jobs = [run_prefix_job(model, o, job, kv["num_blocks"], ceil, progress) for job in o.jobs]
    machine = machine_of(dev)
    machine["clocks_before"], machine["clocks_after"] = clocks_before, gpu_clocks(dev)
    return dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", machine=machine,
                torch=torch.__version__, options=o.__dict__ | {"jobs": list(o.jobs)},
                ceilings=dict(copy_bytes_per_s=ceil.copy_bytes_per_s, matmul_flops_per_s=ceil.matmul_flops_per_s,
                              sustained_matmul_flops_per_s=ceil.sustained_matmul_flops_per_s),
                model_build_s=build_s, kv_cache=kv,
                invocation_tokens=list(invocation_tokens(config.vocab_size, o.seed)), jobs=jobs)
