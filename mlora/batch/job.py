"""The ``mlora batch-run`` job: Parquet rows in, one output row per input row out.

Owns the orchestration of one job: read the input as a stream, pin every
referenced adapter by digest at job start, fingerprint the job, resume from
the output's manifest, feed the engine with a bounded number of rows in
flight, turn each finished row (or each row refused before it ran) into an
output record, and commit shards in input order through the ResultSink.

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

import os
import time
from dataclasses import asdict, dataclass, field

import pyarrow.dataset as pads
import torch

from .catalog import BASE_ID
from .engine import Engine, Request, Result
from .errors import CodedError
from .kvcache import KVCache
from .sampling import SamplingParams

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
    schedule_window: int = 2048
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs (GPU only)
    prefetch_adapters: int = 4  # cold adapters of the waiting rows whose host images are built ahead
    preload_adapters: bool = False  # load up to max_gpu_adapters adapters before the first row
    workers: int | None = None


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


def run_job(opts: JobOptions, progress=None) -> JobSummary:
    """Run (or resume) one batch job; ``progress(summary, engine)`` is called after
    every iteration. Raises JobError / the I/O and catalog errors (with codes)."""
    from mlora.lora_tools.manifest import BaseLoadError, base_identity, load_base

    from .catalog import load_catalog
    from .io import InputSpec, open_input
    from .model import load_config
    from .output import JobOutput, ResultSink, output_schema

    t0 = time.perf_counter()
    device = resolve_device(opts.device)
    sampling = SamplingParams(opts.temperature, opts.top_p, opts.top_k, opts.seed)
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
    tokenizer = Tokenizer(opts.base) if opts.prompt_column else None
    if opts.stop and tokenizer is None:
        tokenizer = Tokenizer(opts.base)

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
    good = {a: p for a, p in pinned.items() if p.ok}

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
    if out.complete:  # --resume of a finished job: nothing to do, its metrics stay as they were
        out.close()
        return JobSummary(rows=source.num_rows, adapters=len(names), device=str(device), output=opts.output,
                          resumed_from_row=start_row)
    sink = ResultSink(out, output_schema(source.kept_schema), opts.shard_rows, total_rows=source.num_rows)
    try:
        return _run(opts, source, sink, out, start_row, pinned, names, good, config, dtype, device, sampling,
                    tokenizer, progress, t0)
    except BaseException:
        try:  # commit what is contiguous so far; everything after a gap runs again on --resume
            sink.close(final=False)
        except Exception:
            pass
        raise


def _run(opts, source, sink, out, start_row, pinned, names, good, config, dtype, device, sampling, tokenizer,
         progress, t0) -> JobSummary:
    from .metrics import JobMetrics
    from .lora import ROLE_SLICE
    from .model import DecoderModel
    from .residency import ResidencyBank

    model = DecoderModel.from_pretrained(opts.base, device=device, dtype=dtype)
    max_rank = max((p.max_rank for p in good.values()), default=0)
    bank = None
    if good:
        host_bytes = int(opts.host_cache_gb * 2**30) if opts.host_cache_gb else None
        # slots only for the module groups some adapter of the job targets (q/v-only jobs need no MLP slots)
        used = {ROLE_SLICE[m.role][0] for p in good.values() for m in p.modules}
        shapes = {g: s for g, s in model.group_shapes().items() if g in used} or model.group_shapes()
        num_slots = _num_slots(opts, len(good), ResidencyBank.bytes_per_slot(config.num_layers, shapes,
                                                                           max(max_rank, 1), dtype), device)
        bank = ResidencyBank(config.num_layers, shapes, max(num_slots, 1), max(max_rank, 1), dtype, device,
                             host_cache_bytes=host_bytes, prefetch_workers=1 if opts.prefetch_adapters else 0)
    if opts.preload_adapters and bank is not None:
        # load the first num_slots adapters before the first row (and before the metrics clock)
        ids = sorted(good)[:bank.num_slots]
        bank.ensure(ids, good)
    num_blocks = _kv_blocks(opts, config, dtype, device)
    metrics = JobMetrics()
    engine = Engine(
        model, bank, pinned, metrics=metrics, num_blocks=num_blocks, block_size=opts.block_size, max_num_seqs=opts.max_num_seqs,
        max_batch_tokens=opts.max_batch_tokens, sampling=sampling, stop_strings=tuple(opts.stop),
        detokenize=tokenizer.decode if tokenizer else None, device=device, dtype=dtype,
        cuda_graphs=opts.cuda_graphs and device.type == "cuda", prefetch_depth=opts.prefetch_adapters,
        max_wait=opts.schedule_window,  # a row is overtaken by at most one scheduling window of rows
    )

    summary = JobSummary(rows=source.num_rows, adapters=len(names), device=str(device), output=opts.output,
                         resumed_from_row=start_row)
    kept: dict[int, dict] = {}
    # rows handed to the engine ahead of time: the window its adapter-aware admission
    # can reorder within (the sink buffers at most this many out-of-order results)
    queue_limit = max(8 * opts.max_num_seqs, opts.schedule_window)

    def emit(res: Result) -> None:
        metrics.row_finished(res.finish_reason, res.error_code, res.num_prompt_tokens, len(res.token_ids))
        p = pinned.get(res.adapter) if res.adapter is not None else None
        text = res.text if res.text is not None else (tokenizer.decode(res.token_ids) if tokenizer else "")
        rec = {
            "id": res.id, **kept.pop(res.row, {}),
            "adapter": res.adapter,
            "adapter_sha256": p.semantic_sha256 if (p is not None and p.ok) else None,
            "completion": text if res.finish_reason != "error" else "",
            "completion_token_ids": list(res.token_ids),
            "finish_reason": res.finish_reason,
            "num_prompt_tokens": res.num_prompt_tokens,
            "num_completion_tokens": len(res.token_ids),
            "error_code": res.error_code,
            "error_message": res.error_message,
        }
        sink.add(res.row, rec)
        summary.rows_this_run += 1
        summary.finish_reasons[res.finish_reason] = summary.finish_reasons.get(res.finish_reason, 0) + 1
        if res.error_code:
            summary.error_rows += 1
            summary.errors_by_code[res.error_code] = summary.errors_by_code.get(res.error_code, 0) + 1
        else:
            summary.ok_rows += 1
            summary.generated_tokens += len(res.token_ids)
            summary.prompt_tokens += res.num_prompt_tokens

    batches = source.batches(start_row=start_row, batch_rows=max(64, opts.max_num_seqs))
    try:
        _drive(engine, batches, opts, tokenizer, config.vocab_size, kept, emit, progress, summary, queue_limit)
    finally:
        if bank is not None:
            bank.close()  # prefetch threads
    summary.wall_s = time.perf_counter() - t0
    summary.tokens_per_s = summary.generated_tokens / summary.wall_s if summary.wall_s else 0.0
    summary.engine = dict(engine.stats, kv_blocks=engine.num_blocks)
    summary.bank = {k: v for k, v in bank.stats.as_dict().items() if k != "load_seconds"} if bank is not None else {}
    metrics.write_prometheus(opts.output)
    sink.finish({**summary.to_json(), "metrics": metrics.snapshot()})
    return summary


def _drive(engine, batches, opts, tokenizer, vocab_size, kept, emit, progress, summary, queue_limit) -> None:
    """Feed input batches to the engine (at most ``queue_limit`` rows queued) and step it until done."""
    exhausted = False
    while True:
        while not exhausted and engine.num_queued < queue_limit:
            batch = next(batches, None)
            if batch is None:
                exhausted = True
                break
            for req_or_err in _requests(batch, opts, tokenizer, vocab_size, kept):
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
            progress(summary, engine)


def _requests(batch, opts: JobOptions, tokenizer, vocab_size: int, kept: dict):
    """Requests (or refused rows as error Results) of one input batch, in order."""
    kept_rows = batch.kept.to_pylist() if batch.kept is not None and batch.kept.num_columns else None
    for i, rid in enumerate(batch.ids):
        row = batch.first_row + i
        if kept_rows is not None:
            kept[row] = kept_rows[i]
        adapter = batch.adapters[i]
        adapter = None if adapter in BASE_IDS else adapter
        mnt = batch.max_new_tokens[i] if batch.max_new_tokens is not None else None
        mnt = opts.max_new_tokens if mnt is None else int(mnt)
        if batch.prompt_ids is not None:
            ids = batch.prompt_ids[i]
            if ids is None:
                yield Result(row, rid, adapter, [], "error", 0, "E_PROMPT_NULL", "the prompt_ids cell is null")
                continue
            if any((t < 0 or t >= vocab_size) for t in ids):
                yield Result(row, rid, adapter, [], "error", len(ids), "E_PROMPT_TOKEN_RANGE",
                             f"a prompt token id is outside [0, {vocab_size})")
                continue
        else:
            text = batch.prompts[i]
            if text is None:
                yield Result(row, rid, adapter, [], "error", 0, "E_PROMPT_NULL", "the prompt cell is null")
                continue
            ids = tokenizer.encode(text)
        yield Request(row, rid, list(ids), adapter, mnt)


ADAPTER_MEMORY_SHARE = 0.25  # of the usable free GPU memory, for adapter slots when --max-gpu-adapters is not given


def _num_slots(opts: JobOptions, adapters: int, slot_bytes: int, device) -> int:
    """GPU adapter slots: ``--max-gpu-adapters`` (at most one per adapter), else on CUDA as
    many as fit in a quarter of the usable free memory (the rest is the KV cache's; the
    residency engine swaps adapters through the slots), else (CPU) one per adapter."""
    if opts.max_gpu_adapters is not None:
        return max(1, min(adapters, opts.max_gpu_adapters))
    if device.type == "cuda":
        usable = _usable_gpu_bytes(opts, device)
        return max(1, min(adapters, int(ADAPTER_MEMORY_SHARE * usable // max(slot_bytes, 1))))
    return max(1, adapters)


def _usable_gpu_bytes(opts: JobOptions, device) -> float:
    """Free device memory that ``--gpu-memory-utilization`` lets the job take now
    (blocks cached by the allocator, e.g. load temporaries, count as free)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return max(0.0, free - (1 - opts.gpu_memory_utilization) * total)


def _kv_blocks(opts: JobOptions, config, dtype, device) -> int:
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
