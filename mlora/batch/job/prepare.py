"""The ``mlora batch-run`` job: Parquet rows in, one output row per input row out.

Owns the orchestration of one job: read the input as a stream, pin every
referenced adapter by digest at job start, fingerprint the job, resume from
the output's manifest (:func:`prepare_job`, shared by every way of running a
job), and, in one process, feed the engine (``session.py``) with a bounded
number of rows in flight and hand each finished row (or each row refused
before it ran) to the :class:`RowWriter`, which commits shards in input order
through the ResultSink. Several worker processes (``multi.py``) and Ray
(``ray.py``) use the same preparation, writer and finish.

Row outcomes (``error_code``; ``finish_reason`` is ``error``):

    E_PROMPT_NULL        the prompt cell is null
    E_PROMPT_EMPTY       the prompt tokenizes to nothing
    E_PROMPT_TOO_LONG    the prompt does not fit the context (or prompt + max_new_tokens the KV cache)
    E_PROMPT_TOKEN_RANGE a prompt token id is outside the vocabulary
    E_MAX_NEW_TOKENS     the row's max_new_tokens is < 1
    E_ADAPTER_UNKNOWN    the adapter id is not in the catalog
    other E_...          the adapter failed validation at job start (its step-1 code)

With ``strict`` an adapter that is unknown, invalid or not servable fails the
whole job before any row runs (JobError, exit 1).
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import asdict, dataclass, field

import pyarrow.dataset as pads
import torch

from mlora.batch.adapters.catalog import BASE_ID
from mlora.batch.engine.engine import Result
from mlora.batch.errors import CodedError
from mlora.batch.model.kvcache import KVCache

BASE_IDS = (None, "", BASE_ID)  # adapter-column values that mean the base model on purpose


class JobError(CodedError):
    """The job cannot start or continue; ``code`` is stable, the message says what to do."""

    def __init__(self, code: str, message: str, exit_code: int = 1):
        super().__init__(code, message)
        self.exit_code = exit_code


@dataclass
class JobOptions:
    input: str
    output: str
    base: str
    adapters_dir: str | None = None
    catalog_file: str | None = None
    id_column: str = "id"
    prompt_column: str | None = "prompt"
    prompt_ids_column: str | None = None
    adapter_column: str = "adapter"
    max_new_tokens_column: str | None = None
    keep_columns: tuple[str, ...] = ()
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    strict: bool = False
    resume: bool = False
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    max_gpu_adapters: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_gb: float | None = None
    host_cache_gb: float | None = None
    block_size: int = 16
    shard_rows: int = 10000
    schedule_window: int = 8192  # covers an 8,000-row job: each adapter loaded about once (BENCHMARKS.md, residency)
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs (GPU only)
    # build the next decode iteration's inputs while the device runs this one (Engine lookahead;
    # same outputs by construction; 6-8% off a 256-row decode iteration on the H200, BENCHMARKS.md)
    lookahead: bool = True
    prefetch_adapters: int = 16  # cold adapters of the waiting rows whose host images are built ahead
    prefetch_gpu_adapters: int = 4  # of those, loaded into free or unneeded GPU slots per iteration, ahead of use
    # host images built in this many worker processes instead of on the prefetch threads
    # (0 = threads; needs prefetch_adapters). Off by default: on the H200 four workers took 2.7 s per image and
    # starved the engine of CPU (BENCHMARKS.md, residency, sixth session)
    image_build_processes: int = 0
    preload_adapters: bool = False  # load up to max_gpu_adapters adapters before the first row
    bundle_operator: str = "auto"  # auto | three-stage | materialized | three-stage-triton (mlora.batch.adapters.bundle_bank)
    # split: KV cache and adapter slots sized once from one budget; joint: both carved from one arena of
    # pages, KV growth may evict idle adapters and a slot is usable while its pages are free
    # (docs/sizing.md; not measured on a GPU yet)
    memory_ledger: str = "split"
    workers: int | None = None  # hashing threads for pinning the base and adapters (default: all cores)
    # scale-out (docs/scaleout.md; none of these is part of the job fingerprint)
    gpus: str | None = None  # "0,1" or "all": one worker process per GPU (placement.py)
    num_workers: int | None = None  # local: CPU worker processes; ray: actors
    engine: str = "local"  # local | ray
    ray_address: str | None = None  # --engine ray: an existing cluster (default: start a local one)


@dataclass
class JobSummary:
    rows: int = 0
    rows_this_run: int = 0
    ok_rows: int = 0
    error_rows: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    adapters: int = 0
    device: str = ""
    errors_by_code: dict = field(default_factory=dict)
    finish_reasons: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    bank: dict = field(default_factory=dict)
    output: str = ""
    resumed_from_row: int = 0
    workers: list = field(default_factory=list)  # one dict per worker process or actor (empty: one process)

    def to_json(self) -> dict:
        return asdict(self)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise JobError("E_DEVICE", "--device cuda was asked for but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise JobError("E_DEVICE", f"--device must be auto, cuda or cpu, not {name!r}", 2)
    return torch.device(name)


def resolve_dtype(name: str, config_dtype: str | None, device: torch.device) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name == "auto":
        if device.type == "cpu":
            return torch.float32  # CPU matmuls in 16-bit are slow and the tests compare in fp32
        return table.get(config_dtype or "", torch.bfloat16)
    if name not in table:
        raise JobError("E_DTYPE", f"--dtype must be auto, float32, bfloat16 or float16, not {name!r}", 2)
    return table[name]


def distinct_adapters(files: list[str], column: str) -> set[str]:
    """Distinct non-base adapter ids of the input, reading only that column."""
    if not files:
        return set()
    ds = pads.dataset(files, format="parquet")
    if column not in ds.schema.names:
        return set()
    seen: set[str] = set()
    for batch in ds.to_batches(columns=[column]):
        seen.update(v for v in batch.column(0).unique().to_pylist() if v not in BASE_IDS)
    return seen


class Tokenizer:
    """The base's tokenizer.json (special tokens added as its post-processor says)."""

    def __init__(self, base_dir: str):
        from tokenizers import Tokenizer as _T

        path = os.path.join(base_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise JobError("E_TOKENIZER", f"{path} not found: the base needs a tokenizer.json "
                           "(or give --prompt-ids-column with token ids)")
        self._tok = _T.from_file(path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


@dataclass
class Progress:
    """What a job reports to its ``progress`` callback (rows of this run and the job)."""

    rows_total: int = 0
    rows_done: int = 0  # finished rows, committed or not (resumed rows included)
    rows_committed: int = 0
    generated_tokens: int = 0  # this run
    running: int = 0  # sequences in the engines
    adapters: int = 0  # distinct adapters among them
    workers: int = 1  # engines alive


@dataclass
class PreparedJob:
    """Everything a job decides before its first row runs, the same for every way of running it
    (one process, ``--gpus`` / ``--num-workers``, Ray): identities, fingerprint, the opened OUTPUT.
    ``sink`` is None when a resumed job had already finished (``summary`` is then final)."""

    opts: JobOptions
    device: torch.device
    dtype: torch.dtype
    config: object  # mlora.batch.model.decoder.ModelConfig
    source: object  # mlora.batch.job.input.InputSource
    tokenizer: Tokenizer | None
    pinned: dict  # adapter id -> PinnedAdapter, every adapter the input names
    start_row: int
    summary: JobSummary
    sink: object | None  # mlora.batch.job.output.ResultSink
    t0: float


def prepare_job(opts: JobOptions, device: torch.device) -> PreparedJob:
    """Pin identities, fingerprint the job and open OUTPUT (fresh or resumed) for engines on ``device``.
    Raises JobError / the I/O and catalog errors (with codes)."""
    from mlora.lora_tools.manifest import BaseLoadError, base_identity, load_base

    from mlora.batch.adapters.catalog import load_catalog
    from mlora.batch.job.input import InputSpec, open_input
    from mlora.batch.job.session import check_memory_ledger

    check_memory_ledger(opts.memory_ledger)  # a usage error, before OUTPUT is touched
    from mlora.batch.model.decoder import load_config
    from mlora.batch.job.output import JobOutput, ResultSink, output_schema

    t0 = time.perf_counter()
    if opts.max_new_tokens < 1:
        raise JobError("E_MAX_NEW_TOKENS", "--max-new-tokens must be >= 1", 2)
    config = load_config(opts.base)
    dtype = resolve_dtype(opts.dtype, config.dtype, device)
    spec = InputSpec(
        id_column=opts.id_column, prompt_column=opts.prompt_column, prompt_ids_column=opts.prompt_ids_column,
        adapter_column=opts.adapter_column, max_new_tokens_column=opts.max_new_tokens_column,
        keep_columns=tuple(opts.keep_columns),
    )
    source = open_input(opts.input, spec)
    tokenizer = Tokenizer(opts.base) if (opts.prompt_column or opts.stop) else None

    # identities: base, then every adapter the input names, pinned by digest now
    try:
        base_id = base_identity(load_base(opts.base), opts.workers)
    except BaseLoadError as exc:
        raise JobError(exc.finding.code, exc.finding.message) from None
    names = distinct_adapters(source.files, opts.adapter_column)
    if opts.adapters_dir or opts.catalog_file:
        catalog = load_catalog(opts.adapters_dir, opts.catalog_file)
        pinned = catalog.pin(names, opts.base, workers=opts.workers, base_identity=base_id) if names else {}
    else:  # no catalog: every adapter the input names is unknown (error rows, or --strict fails)
        pinned = {}
    unknown = sorted(names - set(pinned))
    if opts.strict and unknown:
        raise JobError("E_ADAPTER_UNKNOWN", f"--strict: adapter(s) not in the catalog: {', '.join(unknown[:10])}")
    bad = {a: p for a, p in pinned.items() if not p.ok}
    if opts.strict and bad:
        listing = "; ".join(f"{a}: {p.error_code}" for a, p in sorted(bad.items()))
        raise JobError("E_ADAPTER_INVALID", f"--strict: {len(bad)} adapter(s) cannot be served ({listing})")

    # how the job runs (workers, Ray) is not part of it: a job may resume with other workers
    parts = {
        "kind": "mlora-batch-run",
        "base_sha256": base_id.base_sha256,
        "adapters": {a: (p.semantic_sha256 if p.ok else p.error_code) for a, p in sorted(pinned.items())},
        "input": source.fingerprint(),
        "columns": {"id": opts.id_column, "prompt": opts.prompt_column, "prompt_ids": opts.prompt_ids_column,
                    "adapter": opts.adapter_column, "max_new_tokens": opts.max_new_tokens_column,
                    "keep": list(opts.keep_columns)},
        "sampling": {"temperature": repr(float(opts.temperature)), "top_p": repr(float(opts.top_p)),
                     "top_k": opts.top_k, "seed": opts.seed, "max_new_tokens": opts.max_new_tokens,
                     "stop": list(opts.stop)},
        "dtype": str(dtype).replace("torch.", ""),
    }
    out = JobOutput.open(opts.output, parts, opts.resume, opts.shard_rows)
    start_row = out.next_row
    summary = JobSummary(rows=source.num_rows, adapters=len(names), device=str(device), output=opts.output,
                         resumed_from_row=start_row)
    sink = None
    if out.complete:  # --resume of a finished job: nothing to do, its metrics stay as they were
        out.close()
    else:
        sink = ResultSink(out, output_schema(source.kept_schema), opts.shard_rows, total_rows=source.num_rows)
    return PreparedJob(opts, device, dtype, config, source, tokenizer, pinned, start_row, summary, sink, t0)


class RowWriter:
    """Finished rows -> the output sink, the job summary and the job's row metrics.

    The one place every runner (single process, coordinator, Ray driver) hands a
    row's complete output record to, so the counts mean the same everywhere."""

    def __init__(self, sink, summary: JobSummary, metrics):
        self.sink, self.summary, self.metrics = sink, summary, metrics

    def add(self, row: int, record: dict) -> None:
        reason, code = record["finish_reason"], record["error_code"]
        self.metrics.row_finished(reason, code, record["num_prompt_tokens"], record["num_completion_tokens"])
        self.sink.add(row, record)
        s = self.summary
        s.rows_this_run += 1
        s.finish_reasons[reason] = s.finish_reasons.get(reason, 0) + 1
        if code:
            s.error_rows += 1
            s.errors_by_code[code] = s.errors_by_code.get(code, 0) + 1
        else:
            s.ok_rows += 1
            s.generated_tokens += record["num_completion_tokens"]
            s.prompt_tokens += record["num_prompt_tokens"]

    def progress(self, running: int = 0, adapters: int = 0, workers: int = 1) -> Progress:
        s = self.summary
        return Progress(rows_total=s.rows, rows_done=s.resumed_from_row + s.rows_this_run,
                        rows_committed=self.sink.output.next_row, generated_tokens=s.generated_tokens,
                        running=running, adapters=adapters, workers=workers)


def finish_job(prep: PreparedJob, metrics) -> JobSummary:
    """Every row is in the sink: write the metrics files, the last shard and ``_SUCCESS``."""
    summary = prep.summary
    summary.wall_s = time.perf_counter() - prep.t0
    summary.tokens_per_s = summary.generated_tokens / summary.wall_s if summary.wall_s else 0.0
    metrics.write_prometheus(prep.opts.output)
    prep.sink.finish({**summary.to_json(), "metrics": metrics.snapshot()})
    return summary


def run_job(opts: JobOptions, progress=None, note=None) -> JobSummary:
    """Run (or resume) one batch job in this process, on worker processes (``opts.gpus`` /
    ``opts.num_workers``) or on Ray (``opts.engine == "ray"``); docs/scaleout.md.

    ``progress(summary, Progress)`` is called as rows finish; ``note(text)`` gets
    events worth a line on stderr (a worker that died). Raises JobError / the I/O
    and catalog errors (with codes)."""
    from mlora.batch.scaleout.placement import plan_workers

    plan = plan_workers(opts)  # usage errors (exit 2) before any work
    if plan.engine == "ray":
        from mlora.batch.scaleout.ray import run_ray_job

        return run_ray_job(opts, plan, progress, note)
    prep = prepare_job(opts, plan.device)
    if prep.sink is None:
        return prep.summary
    try:
        if plan.places:
            from mlora.batch.scaleout.coordinator import run_workers

            return run_workers(prep, plan.places, progress, note)
        return _run_single(prep, progress)
    except BaseException:
        prep.sink.close_after_failure()  # what is contiguous so far; rows after a gap run again on --resume
        raise


def _run_single(prep: PreparedJob, progress) -> JobSummary:
    """The job on one engine in this process."""
    from mlora.batch.job.session import EngineSession

    opts = prep.opts
    session = EngineSession(opts, prep.pinned, prep.device, prep.dtype)
    writer = RowWriter(prep.sink, prep.summary, session.metrics)
    kept: dict[int, dict] = {}
    # rows handed to the engine ahead of time: the window its adapter-aware admission
    # can reorder within (the sink buffers at most this many out-of-order results)
    queue_limit = max(8 * opts.max_num_seqs, opts.schedule_window)

    def emit(res: Result) -> None:
        record = session.record(res)
        record.update(kept.pop(res.row, {}))
        writer.add(res.row, record)

    batches = prep.source.batches(start_row=prep.start_row, batch_rows=max(64, opts.max_num_seqs))
    try:
        _drive(session, batches, prep, kept, emit, progress, writer, queue_limit)
    finally:
        session.close()
    prep.summary.engine, prep.summary.bank = session.stats()
    metrics = session.metrics
    del session  # (emit's cell too) the model, the KV cache or arena, the slot bank
    release_device_memory(prep.device)
    return finish_job(prep, metrics)


def release_device_memory(device) -> None:
    """Give a finished job's device memory back to the driver. The residency engine's
    reference cycles keep the KV cache, slots or one-arena ledger alive until the cyclic
    collector runs, and the caching allocator keeps freed blocks: the next job in the
    process (a bench's timed run after its warm-up) would load its weights into the
    freed arena's cached block, splitting it, and find that block neither free nor
    returnable (measured: 13.5 of 139.8 GiB free on the H200, a 0-page arena)."""
    gc.collect()
    if getattr(device, "type", device) == "cuda":
        torch.cuda.empty_cache()


def _drive(session, batches, prep, kept, emit, progress, writer, queue_limit) -> None:
    """Feed input batches to the engine (at most ``queue_limit`` rows queued) and step it until done."""
    from mlora.batch.job.session import requests_of

    engine = session.engine
    exhausted = False
    while True:
        while not exhausted and engine.num_queued < queue_limit:
            batch = next(batches, None)
            if batch is None:
                exhausted = True
                break
            for req_or_err in requests_of(batch, prep.opts, prep.tokenizer, prep.config.vocab_size, kept):
                if isinstance(req_or_err, Result):
                    emit(req_or_err)
                else:
                    err = engine.add(req_or_err)
                    if err is not None:
                        emit(err)
        if not engine.has_work():
            if exhausted:
                break
            continue
        for res in engine.step():
            emit(res)
        if progress:
            active = len({s.req.adapter for s in engine.running if s.req.adapter is not None})
            progress(prep.summary, writer.progress(len(engine.running), active))


ADAPTER_MEMORY_SHARE = 0.25  # of the usable free GPU memory, for adapter slots when --max-gpu-adapters is not given


def num_slots(opts: JobOptions, adapters: int, slot_bytes: int, device) -> int:
    """GPU adapter slots: ``--max-gpu-adapters`` (at most one per adapter), else on CUDA as
    many as fit in the adapters' share of the usable free memory (the residency engine swaps
    adapters through the slots), else (CPU) one per adapter. The share is a quarter, the rest
    being the KV cache's; with ``--kv-cache-gb`` the KV cache takes exactly that, and the
    adapters have everything else (at least one slot)."""
    if opts.max_gpu_adapters is not None:
        return max(1, min(adapters, opts.max_gpu_adapters))
    if device.type == "cuda":
        return max(1, min(adapters, int(adapter_share_bytes(opts, device) // max(slot_bytes, 1))))
    return max(1, adapters)


def adapter_share_bytes(opts: JobOptions, device) -> float:
    """Device bytes adapter slots (or a bundle's bases and core slots) may take on CUDA: a
    quarter of the usable free memory, or, when ``--kv-cache-gb`` fixes the KV cache, what
    the usable memory holds beside it (one budget: the two never add up to more than it)."""
    usable = _usable_gpu_bytes(opts, device)
    if opts.kv_cache_gb:
        return max(0.0, usable - opts.kv_cache_gb * 2**30)
    return ADAPTER_MEMORY_SHARE * usable


def _usable_gpu_bytes(opts: JobOptions, device) -> float:
    """Free device memory that ``--gpu-memory-utilization`` lets the job take now
    (blocks cached by the allocator, e.g. load temporaries, count as free). A job run
    before in this process (a bench's warm-up, a Ray worker's previous job) may still hold
    its slot bank or its whole one-arena ledger through reference cycles (the residency
    engine's bound methods and closures) until the cyclic collector runs: collect first."""
    release_device_memory(device)
    free, total = torch.cuda.mem_get_info(device)
    return max(0.0, free - (1 - opts.gpu_memory_utilization) * total)


def kv_blocks(opts: JobOptions, config, dtype, device) -> int:
    """KV blocks: from --kv-cache-gb, else on CUDA from free memory, else enough for
    max_num_seqs full contexts (CPU)."""
    def fit(budget_bytes) -> int:
        return max(1, KVCache.blocks_for_budget(budget_bytes, config.num_layers, opts.block_size,
                                                config.num_kv_heads, config.head_dim, dtype))

    if opts.kv_cache_gb:
        return fit(opts.kv_cache_gb * 2**30)
    if device.type == "cuda":
        return fit(_usable_gpu_bytes(opts, device))
    per_seq = -(-config.max_position_embeddings // opts.block_size)
    return max(1, opts.max_num_seqs * per_seq)
