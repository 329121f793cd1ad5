"""What every way of running a ``mlora batch-run`` job shares: its preparation and its writer.

Owns :func:`prepare_job` (read the input's schema, pin the base and every
referenced adapter by digest, fingerprint the job, open OUTPUT fresh or resumed),
:class:`RowWriter` (each finished row to the output sink, the summary and the
row metrics, in the same way for every runner) and :func:`finish_job`. The
runners (``mlora.batch.runner`` in one process, ``mlora.batch.scaleout`` on
worker processes or Ray) drive engines between the two.

Row outcomes (``error_code``; ``finish_reason`` is ``error``):

    E_PROMPT_NULL        the prompt cell is null
    E_PROMPT_MESSAGES    the messages cell is not a non-empty list of {role, content} (``job/chat.py``)
    E_PROMPT_TEMPLATE    the base's chat template raised on the row's messages
    E_PROMPT_EMPTY       the prompt tokenizes to nothing
    E_PROMPT_TOO_LONG    the prompt does not fit the context (or prompt + max_new_tokens the KV cache)
    E_PROMPT_TOKEN_RANGE a prompt token id is outside the vocabulary
    E_MAX_NEW_TOKENS     the row's max_new_tokens is < 1
    E_ADAPTER_UNKNOWN    the adapter id is not in the catalog (or no --adapters / --catalog was given)
    other E_...          the adapter failed validation at job start (its ``mlora validate`` code)

A row's problem fails only that row; a job-wide one (no chat template for
``--messages-column``, a column of the wrong type) fails the job before any row runs.

With ``strict`` an adapter that is unknown, invalid or not servable fails the
whole job before any row runs (JobError, exit 1).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field, fields

import pyarrow as pa
import pyarrow.dataset as pads
import torch
from tokenizers import Tokenizer as HFTokenizer

from mlora.batch.adapters.catalog import BASE_ID, PinnedAdapter, load_catalog
from mlora.batch.config import InputColumns, JobConfig, resolve_dtype
from mlora.batch.errors import JobError, ModelError
from mlora.batch.job.chat import load_chat_template
from mlora.batch.job.input import InputSpec, open_input
from mlora.batch.job.output import JobOutput, ResultSink, check_writable, output_schema
from mlora.batch.model.decoder import load_config
from mlora.batch.model.tp import check_size
from mlora.lora_tools.manifest import BaseLoadError, base_identity, load_base

BASE_IDS = (None, "", BASE_ID)  # adapter-column values that mean the base model on purpose
NO_SOURCE = "no adapter source was given: pass --adapters DIR or --catalog FILE to serve the adapters the input names"
# the stderr note of a job whose base has no tokenizer.json (docs/batch.md, Output columns)
NO_TOKENIZER_NOTE = "the base has no tokenizer.json: completion is null, completion_token_ids holds each row's tokens"


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
    adapters: int = 0  # served: pinned and servable
    unknown_adapters: list = field(default_factory=list)  # named by the input, in no adapter source
    unservable_adapters: dict = field(default_factory=dict)  # named and found, refused: id -> code
    device: str = ""
    errors_by_code: dict = field(default_factory=dict)
    finish_reasons: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    bank: dict = field(default_factory=dict)
    output: str = ""
    resumed_from_row: int = 0
    workers: list = field(default_factory=list)  # one dict per worker process or actor (empty: one process)
    # the prefix cache's effect, from the job's metrics (docs/batch.md, Metrics): prompt tokens the
    # admitted rows computed / took from the cache, and blocks found / looked up (None: none looked up)
    prefill_tokens_computed: int = 0
    prefill_tokens_reused: int = 0
    prefix_cache_hit_rate: float | None = None
    already_complete: bool = False  # --resume of a finished job: nothing ran

    def to_json(self) -> dict:
        return asdict(self)


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
    """The base's tokenizer.json (special tokens added as its post-processor says) and, with
    ``chat``, its chat template (JobError ``E_CHAT_TEMPLATE_MISSING`` when it has none)."""

    def __init__(self, base_dir: str, chat: bool = False):
        path = os.path.join(base_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise JobError("E_TOKENIZER", f"{path} not found: the base needs a tokenizer.json "
                           "(or give --prompt-ids-column with token ids)")
        self._tok = HFTokenizer.from_file(path)
        self.chat_template = load_chat_template(base_dir) if chat else None

    @classmethod
    def for_job(cls, opts: JobConfig) -> Tokenizer | None:
        """The job's tokenizer: the base's when it has one (completions are decoded with it), with the
        chat template for ``--messages-column``. Text prompts, messages and stop strings need it
        (E_TOKENIZER without one); a job on token ids without one gets None (its completions are null)."""
        required = bool(opts.prompt_column or opts.messages_column or opts.stop)
        if required or os.path.exists(os.path.join(opts.base, "tokenizer.json")):
            return cls(opts.base, chat=bool(opts.messages_column))
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_chat(self, messages) -> list[int]:
        """One row's messages rendered with the chat template and the generation prompt, encoded without
        adding special tokens (the template writes them), as transformers' ``apply_chat_template`` does.
        Raises :class:`~mlora.batch.job.chat.ChatMessagesError`."""
        return self._tok.encode(self.chat_template.render(messages), add_special_tokens=False).ids

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

    opts: JobConfig
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


def input_spec(opts: JobConfig) -> InputSpec:
    """The roles of the input columns a job names (the driver's and every Ray reader's alike)."""
    return InputSpec(**{f.name: getattr(opts, f.name) for f in fields(InputColumns)})


def _device_label(device: torch.device, tensor_parallel_size: int) -> str:
    """The summary's device: ``cpu``, ``cuda:0``, with the rank count of a tensor-parallel group."""
    return str(device) if tensor_parallel_size <= 1 else f"{device} ({tensor_parallel_size} ranks)"


def prepare_job(opts: JobConfig, device: torch.device, phase=None, note=None) -> PreparedJob:
    """``opts`` validated: pin identities, fingerprint the job and open OUTPUT (fresh or resumed) for engines on ``device``.
    ``phase(text, rows_total, rows_done)`` names each start-up step (``rows_total`` None until the
    input is read); ``note(text)`` gets a line worth showing. Raises JobError / the I/O and
    catalog errors (with codes)."""
    t0 = time.perf_counter()
    phase = phase or (lambda text, rows_total, rows_done: None)
    check_writable(opts.output)  # before any hashing: a job that cannot write its rows must not start
    phase("reading the input", None, 0)
    config = load_config(opts.base)
    if opts.tensor_parallel_size > 1:  # before OUTPUT is opened: a size the base cannot take leaves nothing
        try:
            check_size(config, opts.tensor_parallel_size)
        except ModelError as e:
            raise JobError(e.code, e.message, 2) from e
    dtype = resolve_dtype(opts.dtype, config.dtype, device)
    source = open_input(opts.input, input_spec(opts))
    if not opts.allow_duplicate_ids:
        source.check_unique_ids()
    tokenizer = Tokenizer.for_job(opts)

    # identities: base, then every adapter the input names, pinned by digest now
    phase("hashing the base", source.num_rows, 0)
    try:
        base_id = base_identity(load_base(opts.base), opts.workers)
    except BaseLoadError as exc:
        raise JobError(exc.finding.code, exc.finding.message) from None
    names = distinct_adapters(source.files, opts.adapter_column)
    if opts.adapters_dir or opts.catalog_file:
        phase(f"validating {len(names)} adapter(s)", source.num_rows, 0)
        catalog = load_catalog(opts.adapters_dir, opts.catalog_file)
        pinned = (catalog.pin(names, opts.base, workers=opts.workers, base_identity=base_id,
                              allow_pickle=opts.allow_pickle) if names else {})
    else:  # no adapter source: every adapter the input names gives error rows that say so
        if opts.strict and names:
            raise JobError("E_ADAPTER_UNKNOWN", f"--strict: the input names {len(names)} adapter(s) "
                           f"({', '.join(sorted(names)[:10])}) but no adapter source was given; pass "
                           "--adapters DIR or --catalog FILE")
        pinned = {a: PinnedAdapter(a, None, False, "E_ADAPTER_UNKNOWN", NO_SOURCE) for a in sorted(names)}
        if names and note:
            note(f"no --adapters or --catalog given: the rows of the {len(names)} adapter(s) the input names "
                 "become error rows (E_ADAPTER_UNKNOWN)")
    bad = {a: p for a, p in pinned.items() if not p.ok}
    if opts.strict and bad:
        listing = "; ".join(f"{a}: {p.error_code}" for a, p in sorted(bad.items()))
        raise JobError("E_ADAPTER_INVALID", f"--strict: {len(bad)} adapter(s) cannot be served ({listing})")

    # how the job runs (workers, Ray, the prefix cache: same outputs) is not part of it: a job may resume
    # with other workers or the prefix cache off
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
    if source.id_type != pa.string():  # every shard of OUTPUT has one schema; string ids keep the older form
        parts["id_type"] = str(source.id_type)
    if opts.alora_without_invocation != "error":  # aLoRA rows without invocation run on the base: other outputs
        parts["alora_without_invocation"] = opts.alora_without_invocation  # absent by default: earlier outputs resume
    if opts.messages_column:  # the template makes the prompts: a changed template is a different job
        parts["columns"]["messages"] = opts.messages_column  # absent otherwise: earlier outputs still resume
        parts["chat_template_sha256"] = tokenizer.chat_template.sha256
    out = JobOutput.open(opts.output, parts, opts.resume, opts.shard_rows)
    start_row = out.next_row
    unknown = sorted(a for a, p in bad.items() if p.error_code == "E_ADAPTER_UNKNOWN")
    summary = JobSummary(rows=source.num_rows, adapters=len(pinned) - len(bad), unknown_adapters=unknown,
                         unservable_adapters={a: p.error_code for a, p in sorted(bad.items()) if a not in unknown},
                         device=_device_label(device, opts.tensor_parallel_size), output=opts.output,
                         resumed_from_row=start_row)
    sink = None
    if out.complete:  # --resume of a finished job: nothing to do, its metrics stay as they were
        out.close()
        summary.already_complete = True
    else:
        sink = ResultSink(out, output_schema(source.kept_schema, source.id_type), opts.shard_rows,
                          total_rows=source.num_rows, commit_interval=opts.commit_interval)
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
    snap = metrics.snapshot()
    summary.prefill_tokens_computed = snap["prefill_tokens_computed"]
    summary.prefill_tokens_reused = snap["prefill_tokens_reused"]
    summary.prefix_cache_hit_rate = snap["prefix_cache"]["hit_rate"]
    prep.sink.finish({**summary.to_json(), "metrics": snap})
    return summary
