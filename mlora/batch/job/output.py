"""The output side of ``mlora batch-run``: atomic shards, the manifest, resume.

Owns everything written under OUTPUT (``part-NNNNN.parquet``, ``_manifest.json``,
``_metrics.json``, ``_SUCCESS`` and the lock file) and the rules that make an
interrupted job resumable without losing or duplicating a row. Must not know
how rows are produced: the engine hands finished rows to a :class:`ResultSink`
by input row position, in any order.

Commit protocol (docs/design.md, Shard and manifest):

* Every file is written as ``.tmp.<name>.<random>`` in OUTPUT, flushed,
  fsynced, renamed over its final name with ``os.replace`` and the directory
  is fsynced. A reader never sees a half-written file.
* A shard is committed by writing the shard file first and then the manifest
  that names it. A ``part-*.parquet`` file that the manifest does not name was
  never committed: resume deletes it, together with stale ``.tmp.*`` files.
* Shards hold contiguous ranges of input rows in input order. A shard is
  committed when the contiguous run of finished rows reaches ``shard_rows``,
  or, with a commit interval, when a row is added at least that many seconds
  after the last commit (then the run so far, however short): an interrupted
  job loses at most the rows finished within one interval. The manifest
  records each shard's ``[first_row, last_row)`` and sha256, and
  ``rows_committed``. Resume continues at ``next_row = rows_committed``: rows
  that were finished but not yet committed are generated again, never
  written twice. Shard boundaries depend on timing; the rows do not.
* ``_SUCCESS`` is written last (after ``_metrics.json``), only when every row
  was committed.

Decisions:

* ``--resume`` on an OUTPUT that does not exist or is empty starts the job
  fresh (nothing to resume), so scripts can always pass ``--resume``. An
  OUTPUT holding only the lock file and temp files (a job killed before its
  first manifest) counts as empty.
* ``--resume`` of a finished job (``_SUCCESS`` present, same fingerprint) is a
  no-op success: :attr:`JobOutput.complete` is true and the runner has
  nothing to do. A different fingerprint is refused even then.
* A job with zero input rows is a successful job with no rows: closing its
  sink with ``final=True`` writes one empty shard (so readers get the schema)
  and ``_SUCCESS``.
* One writer per OUTPUT: an advisory lock (``.lock``, ``fcntl.flock`` where
  available) refuses a second concurrent job with ``E_OUTPUT_LOCKED``; the
  kernel drops the lock when the process dies, so kill -9 never blocks a
  resume.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import time
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mlora import __version__
from mlora.batch.errors import CodedError
from mlora.lora_tools.canonical import canonical_json, canonicalize_floats, file_sha256, sha256_hex

try:  # POSIX only; elsewhere the job runs without the concurrent-writer guard
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

MANIFEST_NAME = "_manifest.json"
SUCCESS_NAME = "_SUCCESS"
METRICS_NAME = "_metrics.json"  # leading underscore: Parquet readers of OUTPUT skip it
LOCK_NAME = ".lock"
TMP_PREFIX = ".tmp."
MANIFEST_SCHEMA_VERSION = 1
DEFAULT_SHARD_ROWS = 10000
MISMATCH_FIELDS_SHOWN = 8  # differing fingerprint fields an E_RESUME_MISMATCH message lists, each whole

_SHARD_RE = re.compile(r"^part-\d{5,}\.parquet$")

# The columns every output row has after ``id`` and the kept input columns.
RESULT_FIELDS: tuple[pa.Field, ...] = (
    pa.field("adapter", pa.string()),  # null: the base model on purpose
    pa.field("adapter_sha256", pa.string()),  # semantic digest; null for base rows
    pa.field("completion", pa.string()),
    pa.field("completion_token_ids", pa.list_(pa.int32())),
    pa.field("finish_reason", pa.string()),  # stop | length | error
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_completion_tokens", pa.int32()),
    pa.field("error_code", pa.string()),
    pa.field("error_message", pa.string()),
)
OUTPUT_COLUMNS: tuple[str, ...] = ("id",) + tuple(f.name for f in RESULT_FIELDS)


class JobOutputError(CodedError, ValueError):
    """OUTPUT cannot be used as asked. ``code`` is stable; the message says what to do.

    Codes: E_OUTPUT_EXISTS, E_OUTPUT_LOCKED, E_OUTPUT_NOT_WRITABLE, E_OUTPUT_CORRUPT,
    E_OUTPUT_EMPTY (:func:`read_output` before any shard), E_RESUME_NO_MANIFEST,
    E_RESUME_MISMATCH."""


def output_schema(kept_schema: pa.Schema, id_type: pa.DataType = pa.string()) -> pa.Schema:
    """``id`` (in the input's type, ``id_type``), the kept input columns in their input types,
    then :data:`RESULT_FIELDS`."""
    clash = [name for name in kept_schema.names if name in OUTPUT_COLUMNS]
    if clash:
        raise ValueError(f"kept columns {clash} clash with output columns {list(OUTPUT_COLUMNS)}")
    return pa.schema([pa.field("id", id_type), *kept_schema, *RESULT_FIELDS])


def job_fingerprint(parts: dict) -> str:
    """SHA-256 (hex) of the canonical JSON of ``parts``, floats tagged by
    :func:`canonicalize_floats` (so ``0.7`` and ``"0.7"`` differ)."""
    return sha256_hex(canonical_json(canonicalize_floats(parts)))


# -- atomic file writes ------------------------------------------------------


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def atomic_write(directory: str, name: str, data: bytes | memoryview | pa.Buffer) -> None:
    """Write ``directory/name`` so that it is either absent/old or complete."""
    tmp = os.path.join(directory, f"{TMP_PREFIX}{name}.{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _whole(value: Any) -> str:
    return "absent" if value is _ABSENT else json.dumps(value, sort_keys=True, ensure_ascii=False)


_ABSENT = object()  # a key one side of a fingerprint comparison lacks


def differing_fields(old: Any, new: Any, path: str = "") -> list[str]:
    """Every leaf where two fingerprint parts differ, as ``path: old (stored) vs new (now)`` with
    both values whole (lists of unequal length are one leaf)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [line for key in sorted(set(old) | set(new), key=str)
                for line in differing_fields(old.get(key, _ABSENT), new.get(key, _ABSENT),
                                             f"{path}.{key}" if path else str(key))]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [line for i, (a, b) in enumerate(zip(old, new)) for line in differing_fields(a, b, f"{path}[{i}]")]
    if old is not _ABSENT and new is not _ABSENT and (
            canonical_json(canonicalize_floats(old)) == canonical_json(canonicalize_floats(new))):
        return []
    return [f"{path}: {_whole(old)} (stored) vs {_whole(new)} (now)"]


# -- the output directory ----------------------------------------------------


class JobOutput:
    """One job's OUTPUT directory. Create it with :meth:`open`.

    ``next_row`` is the first input row position not yet committed; the
    runner streams its input from there. ``complete`` is true when a resumed
    job had already finished (``_SUCCESS``): there is nothing to do."""

    def __init__(self, out_dir: str, manifest: dict, shard_rows: int, lock_file, resumed: bool, complete: bool):
        self.out_dir = out_dir
        self.shard_rows = shard_rows
        self.resumed = resumed
        self.complete = complete
        self._manifest = manifest
        self._lock_file = lock_file

    # construction

    @classmethod
    def open(cls, out_dir: str, fingerprint_parts: dict, resume: bool, shard_rows: int = DEFAULT_SHARD_ROWS) -> "JobOutput":
        """OUTPUT opened fresh or resumed; an OS error creating, locking or cleaning it is
        E_OUTPUT_NOT_WRITABLE (a rerun cannot fix it: another OUTPUT or its permissions can)."""
        try:
            return cls._open(out_dir, fingerprint_parts, resume, shard_rows)
        except OSError as exc:
            raise _not_writable(os.path.abspath(out_dir), exc.strerror or str(exc)) from None

    @classmethod
    def _open(cls, out_dir: str, fingerprint_parts: dict, resume: bool, shard_rows: int) -> "JobOutput":
        if shard_rows < 1:
            raise ValueError(f"shard_rows must be >= 1, got {shard_rows}")
        out_dir = os.path.abspath(out_dir)
        digest = job_fingerprint(fingerprint_parts)
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise JobOutputError("E_OUTPUT_EXISTS", f"{out_dir} exists and is not a directory; choose another OUTPUT")
        has_entries = _has_entries(out_dir)
        if has_entries and not resume:
            raise _exists(out_dir)
        if resume and has_entries:
            if not os.path.isfile(os.path.join(out_dir, MANIFEST_NAME)):
                raise JobOutputError(
                    "E_RESUME_NO_MANIFEST",
                    f"{out_dir} has no {MANIFEST_NAME}, so it is not the OUTPUT of an mlora batch-run job; "
                    "choose another OUTPUT (or empty this one) and run without --resume",
                )
            lock = _lock(out_dir)
            try:
                manifest = _load_manifest(out_dir)
                _check_fingerprint(out_dir, manifest, digest, fingerprint_parts)
                _check_shards(out_dir, manifest)
                _remove_uncommitted(out_dir, manifest)
            except BaseException:
                lock.close()
                raise
            complete = os.path.exists(os.path.join(out_dir, SUCCESS_NAME))
            return cls(out_dir, manifest, shard_rows, lock, resumed=True, complete=complete)

        os.makedirs(out_dir, exist_ok=True)
        lock = _lock(out_dir)
        if _has_entries(out_dir):  # another job started here between the check and the lock
            lock.close()
            raise _exists(out_dir)
        _remove_uncommitted(out_dir, {"shards": []})
        now = _now()
        manifest = {
            "schema_version": MANIFEST_SCHEMA_VERSION,
            "kind": "mlora.batch_output",
            "mlora_version": _mlora_version(),
            "fingerprint": {"sha256": digest, "parts": fingerprint_parts},
            "shards": [],
            "rows_committed": 0,
            "created": now,
            "updated": now,
        }
        out = cls(out_dir, manifest, shard_rows, lock, resumed=False, complete=False)
        out._write_manifest()
        return out

    # state

    @property
    def fingerprint(self) -> str:
        return self._manifest["fingerprint"]["sha256"]

    @property
    def next_row(self) -> int:
        return self._manifest["rows_committed"]

    @property
    def shards(self) -> list[dict]:
        return [dict(s) for s in self._manifest["shards"]]

    # writes

    def commit_shard(self, table: pa.Table, first_row: int) -> dict:
        """Commit ``table`` as input rows ``[first_row, first_row + len)``; returns the manifest entry.

        ``first_row`` must equal :attr:`next_row` (shards are contiguous)."""
        if first_row != self.next_row:
            raise ValueError(f"shard must start at row {self.next_row}, got {first_row}")
        if table.num_rows == 0 and self._manifest["shards"]:
            raise ValueError("only an empty job commits an empty shard")
        name = f"part-{len(self._manifest['shards']):05d}.parquet"
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        data = sink.getvalue()
        atomic_write(self.out_dir, name, data)
        entry = {
            "file": name,
            "first_row": first_row,
            "last_row": first_row + table.num_rows,
            "rows": table.num_rows,
            "bytes": data.size,
            "sha256": sha256_hex(data),
        }
        self._manifest["shards"].append(entry)
        self._manifest["rows_committed"] = entry["last_row"]
        self._write_manifest()
        return dict(entry)

    def write_file(self, name: str, data: bytes) -> None:
        """Atomically write an extra file into OUTPUT (``metrics.prom``, ...)."""
        if os.path.basename(name) != name or name in (MANIFEST_NAME, SUCCESS_NAME) or _SHARD_RE.match(name):
            raise ValueError(f"{name!r} is not a free file name in OUTPUT")
        atomic_write(self.out_dir, name, data)

    def mark_success(self) -> None:
        atomic_write(self.out_dir, SUCCESS_NAME, b"")
        self.complete = True

    def close(self) -> None:
        """Release the OUTPUT lock. Committed data stays committed."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def _write_manifest(self) -> None:
        self._manifest["updated"] = _now()
        data = json.dumps(self._manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        atomic_write(self.out_dir, MANIFEST_NAME, data.encode("utf-8"))


def _mlora_version() -> str:
    return __version__


def _has_entries(out_dir: str) -> bool:
    """Whether OUTPUT holds anything but the lock and temp files (all a job
    killed before its first manifest leaves)."""
    if not os.path.isdir(out_dir):
        return False
    return any(e.name != LOCK_NAME and not e.name.startswith(TMP_PREFIX) for e in os.scandir(out_dir))


def check_writable(out_dir: str) -> None:
    """Refuse (E_OUTPUT_NOT_WRITABLE) an OUTPUT this process may not create or write into: the
    nearest existing directory on its path must let it add and remove entries. Creates nothing;
    :meth:`JobOutput.open` maps the errors of its real writes the same way."""
    path = os.path.abspath(out_dir)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK):
        raise _not_writable(os.path.abspath(out_dir), f"{path} is not writable by this user")


def _not_writable(out_dir: str, why: str) -> JobOutputError:
    return JobOutputError("E_OUTPUT_NOT_WRITABLE", f"cannot write OUTPUT {out_dir} ({why}); choose an OUTPUT in a "
                          "directory you may write to, or change that directory's permissions")


def _exists(out_dir: str) -> JobOutputError:
    return JobOutputError(
        "E_OUTPUT_EXISTS",
        f"{out_dir} exists and is not empty; pass --resume to continue the job written there, or choose another OUTPUT",
    )


def _lock(out_dir: str):
    f = open(os.path.join(out_dir, LOCK_NAME), "a+b")
    if fcntl is not None:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise JobOutputError(
                "E_OUTPUT_LOCKED", f"another mlora batch-run is writing to {out_dir}; wait for it or choose another OUTPUT"
            ) from None
        except OSError:  # pragma: no cover - file systems without flock
            pass
    return f


def _load_manifest(out_dir: str) -> dict:
    path = os.path.join(out_dir, MANIFEST_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise JobOutputError("E_OUTPUT_CORRUPT", f"{path} is unreadable ({exc}); start again in a new OUTPUT") from None
    fingerprint = manifest.get("fingerprint") if isinstance(manifest, dict) else None
    well_formed = (
        isinstance(fingerprint, dict)
        and isinstance(fingerprint.get("sha256"), str)
        and isinstance(fingerprint.get("parts"), dict)
        and isinstance(manifest.get("shards"), list)
        and isinstance(manifest.get("rows_committed"), int)
    )
    if not well_formed:
        raise JobOutputError("E_OUTPUT_CORRUPT", f"{path} is not an mlora batch manifest; start again in a new OUTPUT")
    version = manifest.get("schema_version")
    if version != MANIFEST_SCHEMA_VERSION:
        raise JobOutputError(
            "E_OUTPUT_CORRUPT",
            f"{path} has schema_version {version!r}; this mlora reads {MANIFEST_SCHEMA_VERSION}. Use the mlora that wrote it or a new OUTPUT",
        )
    return manifest


def _check_fingerprint(out_dir: str, manifest: dict, digest: str, parts: dict) -> None:
    old_digest = manifest["fingerprint"]["sha256"]
    if old_digest == digest:
        return
    differing = differing_fields(manifest["fingerprint"]["parts"], parts)
    shown = differing[:MISMATCH_FIELDS_SHOWN]
    if len(differing) > len(shown):
        shown.append(f"and {len(differing) - len(shown)} more field(s)")
    detail = "; ".join(shown) if shown else f"stored digest {old_digest} does not match its parts"
    raise JobOutputError(
        "E_RESUME_MISMATCH",
        f"{out_dir} holds a different job (fingerprint {old_digest[:12]} vs {digest[:12]}): {detail}. "
        "Resume only with the same input, model, adapters and options, or write to a new OUTPUT",
    )


def _check_shards(out_dir: str, manifest: dict) -> None:
    try:
        _check_shard_files(out_dir, manifest)
    except (KeyError, TypeError) as exc:
        raise JobOutputError(
            "E_OUTPUT_CORRUPT", f"{MANIFEST_NAME} in {out_dir} has a malformed shard entry ({exc!r}); start again in a new OUTPUT"
        ) from None


def _check_shard_files(out_dir: str, manifest: dict) -> None:
    expected_first = 0
    for shard in manifest["shards"]:
        path = os.path.join(out_dir, shard["file"])
        if shard["first_row"] != expected_first or shard["last_row"] - shard["first_row"] != shard["rows"]:
            raise JobOutputError(
                "E_OUTPUT_CORRUPT", f"{MANIFEST_NAME} in {out_dir} has a non-contiguous shard list at {shard['file']}; start again in a new OUTPUT"
            )
        expected_first = shard["last_row"]
        if not os.path.isfile(path):
            raise JobOutputError("E_OUTPUT_CORRUPT", f"committed shard {path} is missing; start again in a new OUTPUT")
        if file_sha256(path) != shard["sha256"]:
            raise JobOutputError(
                "E_OUTPUT_CORRUPT", f"committed shard {path} does not match its sha256 in {MANIFEST_NAME}; start again in a new OUTPUT"
            )
    if expected_first != manifest["rows_committed"]:
        raise JobOutputError(
            "E_OUTPUT_CORRUPT", f"{MANIFEST_NAME} in {out_dir}: rows_committed disagrees with its shards; start again in a new OUTPUT"
        )


def _remove_uncommitted(out_dir: str, manifest: dict) -> None:
    committed = {s["file"] for s in manifest["shards"]}
    removed = False
    for entry in os.scandir(out_dir):
        stale_tmp = entry.name.startswith(TMP_PREFIX)
        stray_shard = _SHARD_RE.match(entry.name) and entry.name not in committed
        if (stale_tmp or stray_shard) and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
            removed = True
    if removed:
        _fsync_dir(out_dir)


# -- the sink the engine writes to -------------------------------------------


class ResultSink:
    """Collects finished rows in any order and commits them as ordered shards.

    ``add(row, record)`` takes the input row position and a dict with exactly
    the columns of ``schema``. Whenever the contiguous run of rows starting at
    ``output.next_row`` reaches ``shard_rows``, that run is committed as the
    next shard; with ``commit_interval`` (seconds of ``clock``), so is the
    run so far when a row is added that long after the last commit (or the
    sink's start).

    Memory: the sink holds rows that are finished but not committed, i.e. at
    most ``shard_rows - 1`` rows of the contiguous prefix plus every row
    finished after the oldest unfinished row. The runner keeps the second term
    bounded by its admission window (rows in flight); :attr:`pending` tells it
    how many rows are held.

    ``total_rows`` (optional) is the number of input rows; with it, rows
    outside the input are refused and ``close(final=True)`` checks that all
    of them were committed."""

    def __init__(self, output: JobOutput, schema: pa.Schema, shard_rows: int | None = None, total_rows: int | None = None,
                 commit_interval: float | None = None, clock=time.monotonic):
        self.output = output
        self.schema = schema
        self.shard_rows = shard_rows or output.shard_rows
        self.total_rows = total_rows
        self.commit_interval = commit_interval
        self._clock = clock
        self._last_commit = clock()
        self._names = frozenset(schema.names)
        self._buffer: dict[int, dict] = {}
        self._contiguous_end = output.next_row  # rows [next_row, end) are all buffered
        self._closed = False

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def add(self, row: int, record: dict) -> None:
        if self._closed:
            raise RuntimeError("ResultSink is closed")
        if row < self.output.next_row:
            raise ValueError(f"row {row} is already committed (next row {self.output.next_row})")
        if row in self._buffer:
            raise ValueError(f"row {row} was added twice")
        if self.total_rows is not None and row >= self.total_rows:
            raise ValueError(f"row {row} is outside the input ({self.total_rows} rows)")
        if record.keys() != self._names:
            missing = sorted(self._names - record.keys())
            extra = sorted(record.keys() - self._names)
            raise ValueError(f"row {row}: record columns differ from the output schema (missing {missing}, unknown {extra})")
        self._buffer[row] = record
        while self._contiguous_end in self._buffer:
            self._contiguous_end += 1
        while self._contiguous_end - self.output.next_row >= self.shard_rows:
            self._commit(self.shard_rows)
        if (self.commit_interval is not None and self._contiguous_end > self.output.next_row
                and self._clock() - self._last_commit >= self.commit_interval):
            self._commit(self._contiguous_end - self.output.next_row)

    def close(self, final: bool) -> None:
        """Commit the contiguous prefix still buffered. With ``final``, the
        caller says every row was added: check it and write ``_SUCCESS``.
        Without it (interrupt), rows after a gap are dropped and are generated
        again on resume."""
        self._finish(final, metrics=None)

    def close_after_failure(self) -> None:
        """``close(final=False)`` on the way out of a failed or interrupted job: commit the
        contiguous prefix; an error doing so never hides the job's own exception."""
        try:
            self.close(final=False)
        except Exception:
            pass

    def finish(self, metrics: dict) -> None:
        """``close(final=True)`` that also writes ``_metrics.json`` before ``_SUCCESS``."""
        self._finish(True, metrics=metrics)

    def _finish(self, final: bool, metrics: dict | None) -> None:
        if self._closed:
            raise RuntimeError("ResultSink is closed")
        try:
            if self._contiguous_end > self.output.next_row:
                self._commit(self._contiguous_end - self.output.next_row)
            if not final:
                return
            if self._buffer:
                raise RuntimeError(f"cannot finish: row {self.output.next_row} was never added but {len(self._buffer)} later rows were")
            if self.total_rows is not None and self.output.next_row != self.total_rows:
                raise RuntimeError(f"cannot finish: {self.output.next_row} of {self.total_rows} rows committed")
            if not self.output._manifest["shards"]:
                self.output.commit_shard(self.schema.empty_table(), 0)
            if metrics is not None:
                data = json.dumps(metrics, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"
                atomic_write(self.output.out_dir, METRICS_NAME, data.encode("utf-8"))
            self.output.mark_success()
        finally:
            self._closed = True
            self._buffer.clear()
            self.output.close()

    def _commit(self, n: int) -> None:
        first = self.output.next_row
        records = [self._buffer.pop(r) for r in range(first, first + n)]
        self.output.commit_shard(pa.Table.from_pylist(records, schema=self.schema), first)
        self._last_commit = self._clock()


def read_output(out_dir: str) -> pa.Table:
    """All committed shards of OUTPUT in input order, as one table."""
    manifest = _load_manifest(os.path.abspath(out_dir))
    tables = [pq.read_table(os.path.join(out_dir, s["file"])) for s in manifest["shards"]]
    if not tables:
        raise JobOutputError("E_OUTPUT_EMPTY", f"{out_dir} has no committed shard yet")
    return pa.concat_tables(tables)
