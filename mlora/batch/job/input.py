"""The input side of ``mlora batch-run``: Parquet files read as a stream of row batches.

Owns locating the input files, validating their schema before any work
starts, fingerprinting them for resume, and turning Parquet row batches into
plain Python rows (:class:`InputBatch`). Must not know about tokenizers,
adapters or the engine: prompts and adapter names pass through unchanged.

Rules:

* INPUT is a Parquet file, a directory (every ``*.parquet`` below it,
  recursively, sorted by relative path; names starting with ``.`` or ``_``
  are skipped, as Spark and Hive do) or a glob (``*``, ``?``, ``[``; ``**``
  recurses; matched directories are expanded as above).
* Rows are numbered by their global position: files in order, rows in file
  order. Row position is the identity used by resume; ids are only copied.
* Column types, checked in every file before any row is read: id string or
  integer; prompt string; prompt_ids list of integers; adapter string;
  max_new_tokens integer; kept columns any type; messages a list of structs
  with string ``role`` and ``content`` fields (other fields allowed: they
  reach the chat template as they are). Strings may also be
  dictionary encoded; a column whose type is ``null`` (all values null) is
  accepted where nulls are. The id and the kept columns pass through to the
  output in their input type, so their type must be the same in every file;
  the other role columns are converted to Python values, so ``string`` in
  one file and ``large_string`` in another is fine there.
* ids: when the id column is absent and has its default name ``id``, the id
  of a row is ``str(position)``. A null id is refused (``E_INPUT_NULL_ID``):
  up front where Parquet statistics carry null counts, else when the row is
  read. :meth:`InputSource.check_unique_ids` refuses a repeated id
  (``E_INPUT_DUPLICATE_ID``) by reading the id column alone.
* The file fingerprint is (relative path, size, mtime_ns, num_rows,
  footer_sha256), where footer_sha256 hashes the Parquet footer (the
  serialized metadata with its length and magic): it changes with the schema,
  row counts, column statistics and byte offsets, at the cost of reading a few
  kilobytes. Paths are relative to the input root so a moved input still
  resumes; touching or copying a file without its mtime makes resume refuse,
  which is the safe direction. A file that changes between open and read
  stops the job (``E_INPUT_CHANGED``).
* Memory: one file open at a time, read without pre-buffering
  (``iter_batches``, about one row group held at a time); only the needed
  columns are read. Batches never span files. A single huge row group is
  still read whole: write inputs with row groups of a sane size. The
  duplicate check holds the whole id column once, in Arrow form (about 8
  bytes an int64 id, its length plus 4 a string id).
"""

from __future__ import annotations

import glob
import hashlib
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mlora.batch.config import InputColumns
from mlora.batch.errors import CodedError
from mlora.batch.job.output import OUTPUT_COLUMNS

# CLI flag of each column role, for messages that tell the user what to pass.
_FLAG = {
    "id": "--id-column",
    "prompt": "--prompt-column",
    "prompt_ids": "--prompt-ids-column",
    "messages": "--messages-column",
    "adapter": "--adapter-column",
    "max_new_tokens": "--max-new-tokens-column",
    "keep": "--keep-columns",
}


class JobInputError(CodedError, ValueError):
    """The input cannot be read as asked. ``code`` is stable; the message says what to do.

    Codes: E_INPUT_USAGE (contradictory column options), E_INPUT_NOT_FOUND,
    E_INPUT_NOT_PARQUET, E_INPUT_COLUMN_MISSING, E_INPUT_COLUMN_TYPE,
    E_INPUT_SCHEMA_MISMATCH, E_INPUT_NULL_ID, E_INPUT_DUPLICATE_ID, E_INPUT_CHANGED."""


@dataclass(kw_only=True)
class InputSpec(InputColumns):
    """Which input column plays which role, checked: exactly one of ``prompt_column``,
    ``prompt_ids_column`` and ``messages_column`` is set, the kept columns are distinct and
    clash with no output column (else ``E_INPUT_USAGE``, a usage error)."""

    def __post_init__(self):
        self.keep_columns = tuple(self.keep_columns)
        prompts = (self.prompt_column, self.prompt_ids_column, self.messages_column)
        if sum(c is not None for c in prompts) != 1:
            raise JobInputError("E_INPUT_USAGE", "give exactly one of --prompt-column, --prompt-ids-column and "
                                "--messages-column")
        if len(set(self.keep_columns)) != len(self.keep_columns):
            raise JobInputError("E_INPUT_USAGE", f"--keep-columns names a column twice: {list(self.keep_columns)}")
        clash = [c for c in self.keep_columns if c in OUTPUT_COLUMNS]
        if clash:
            raise JobInputError(
                "E_INPUT_USAGE",
                f"--keep-columns {clash} would clash with output columns {list(OUTPUT_COLUMNS)}; rename them in the input",
            )

    def roles(self) -> dict[str, str]:
        """role -> column name, for the roles in use (``id`` always listed)."""
        roles = {"id": self.id_column, "adapter": self.adapter_column}
        if self.prompt_column is not None:
            roles["prompt"] = self.prompt_column
        if self.prompt_ids_column is not None:
            roles["prompt_ids"] = self.prompt_ids_column
        if self.messages_column is not None:
            roles["messages"] = self.messages_column
        if self.max_new_tokens_column is not None:
            roles["max_new_tokens"] = self.max_new_tokens_column
        return roles


@dataclass
class InputBatch:
    """Rows ``first_row .. first_row + len(ids) - 1`` of the input, as Python values."""

    first_row: int
    ids: list[str | int]  # the id column's values (generated ids: str(position))
    prompts: list[str | None] | None
    prompt_ids: list[list[int] | None] | None
    adapters: list[str | None]
    max_new_tokens: list[int | None]
    kept: pa.Table
    messages: list[list[dict] | None] | None = None  # with --messages-column, instead of prompts

    def __len__(self) -> int:
        return len(self.ids)

    def kept_rows(self) -> list[dict]:
        """The kept columns of each row as a dict (for output records)."""
        return self.kept.to_pylist()


# -- column types ------------------------------------------------------------


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return _is_text(t.value_type)
    view = getattr(pa.types, "is_string_view", None)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or bool(view and view(t))


def _is_int_list(t: pa.DataType) -> bool:
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    return any(p(t) for p in lists) and pa.types.is_integer(t.value_type)


def _is_messages(t: pa.DataType) -> bool:
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    if not (any(p(t) for p in lists) and pa.types.is_struct(t.value_type)):
        return False
    item = t.value_type
    names = [item.field(i).name for i in range(item.num_fields)]
    return all(names.count(k) == 1 and _is_text(item.field(k).type) for k in ("role", "content"))


# role -> (accepts, expected type in words, nulls allowed)
_TYPES = {
    "id": (lambda t: _is_text(t) or pa.types.is_integer(t), "string or integer", False),
    "prompt": (_is_text, "string", True),
    "prompt_ids": (_is_int_list, "list<integer>", True),
    "messages": (_is_messages, "list<struct<role: string, content: string>>", True),
    "adapter": (_is_text, "string", True),
    "max_new_tokens": (pa.types.is_integer, "integer", True),
}


# -- files -------------------------------------------------------------------


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def _walk_parquet(root: str) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _hidden(d)]
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".parquet") and not _hidden(f)]
    return sorted(found, key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))


def _resolve(path: str) -> tuple[list[str], str]:
    """(files, root that fingerprint paths are relative to)."""
    if os.path.isfile(path):
        return [os.path.abspath(path)], os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        root = os.path.abspath(path)
        files = _walk_parquet(root)
        if not files:
            raise JobInputError("E_INPUT_NOT_FOUND", f"directory {path} holds no *.parquet file; check INPUT")
        return files, root
    if any(c in path for c in "*?["):
        files = []
        for match in sorted(glob.glob(path, recursive=True)):
            if os.path.isdir(match):
                files += _walk_parquet(match)
            elif os.path.isfile(match):
                files.append(match)
        files = [os.path.abspath(f) for f in dict.fromkeys(files)]
        if not files:
            raise JobInputError("E_INPUT_NOT_FOUND", f"glob {path!r} matches no file; check INPUT (quote it so the shell does not expand it)")
        root = os.path.commonpath([os.path.dirname(f) for f in files])
        return files, root
    raise JobInputError("E_INPUT_NOT_FOUND", f"{path} does not exist; INPUT is a Parquet file, a directory of them or a glob")


def _footer_sha256(path: str) -> str:
    """sha256 of the Parquet footer: metadata, its 4-byte length and the magic."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size < 12:
            raise JobInputError("E_INPUT_NOT_PARQUET", f"{path} is too short to be a Parquet file")
        f.seek(size - 8)
        tail = f.read(8)
        (length,) = struct.unpack("<I", tail[:4])
        if tail[4:] != b"PAR1" or length + 12 > size:
            raise JobInputError("E_INPUT_NOT_PARQUET", f"{path} is not a (plain, unencrypted) Parquet file")
        f.seek(size - 8 - length)
        return hashlib.sha256(f.read(length + 8)).hexdigest()


@dataclass
class _File:
    path: str
    rel: str
    size: int
    mtime_ns: int
    num_rows: int
    first_row: int
    row_group_rows: list[int]
    footer_sha256: str
    has_id: bool
    id_type: pa.DataType | None  # the id column's Arrow type (None without one)


def _null_count_from_stats(meta: pq.FileMetaData, column: str) -> int | None:
    """Nulls in a flat column per the row-group statistics; None when unknown."""
    index = next((j for j in range(meta.num_columns) if meta.schema.column(j).path == column), None)
    if index is None:
        return None
    total = 0
    for i in range(meta.num_row_groups):
        stats = meta.row_group(i).column(index).statistics
        if stats is None or not stats.has_null_count:
            return None
        total += stats.null_count
    return total


# -- the source --------------------------------------------------------------


class InputSource:
    """A validated input. Build it with :func:`open_input`."""

    def __init__(self, spec: InputSpec, files: list[_File], kept_schema: pa.Schema):
        self.spec = spec
        self._files = files
        self.files = [f.path for f in files]
        self.num_rows = sum(f.num_rows for f in files)
        self.kept_schema = kept_schema
        # ids come from the row position when the default id column is absent
        self.generated_ids = not files[0].has_id
        # the output's id type: the input's (the same in every file), string for generated ids
        self.id_type = pa.string() if self.generated_ids else files[0].id_type

    def fingerprint(self) -> list[dict]:
        return [
            {"path": f.rel, "size": f.size, "mtime_ns": f.mtime_ns, "num_rows": f.num_rows, "footer_sha256": f.footer_sha256}
            for f in self._files
        ]

    def batches(self, start_row: int = 0, batch_rows: int = 1024, end_row: int | None = None) -> Iterator[InputBatch]:
        """Rows ``[start_row, end_row)`` by global position (``end_row`` None: to the end),
        at most ``batch_rows`` per batch.

        Files and row groups wholly outside the range are not read."""
        end_row = self.num_rows if end_row is None else end_row
        if batch_rows < 1:
            raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
        if not 0 <= start_row <= end_row <= self.num_rows:
            raise ValueError(f"rows [{start_row}, {end_row}) are not a range of the input (0..{self.num_rows})")
        roles = self.spec.roles()
        if self.generated_ids:
            del roles["id"]
        columns = list(dict.fromkeys([*roles.values(), *self.spec.keep_columns]))
        for f in self._files:
            if f.first_row + f.num_rows <= start_row or f.num_rows == 0:
                continue
            if f.first_row >= end_row:
                break
            yield from self._file_batches(f, columns, start_row, batch_rows, end_row)

    def check_unique_ids(self) -> None:
        """Refuse a repeated id (``E_INPUT_DUPLICATE_ID``, naming its first repetition and where
        the id occurs first) or a null one (``E_INPUT_NULL_ID``), across every file, reading
        only the id column. Generated ids are unique by construction and read nothing."""
        if self.generated_ids:
            return
        column, chunks = self.spec.id_column, []
        value_type = self.id_type.value_type if pa.types.is_dictionary(self.id_type) else self.id_type
        for f in self._files:
            _check_unchanged(f)
            with pq.ParquetFile(f.path, pre_buffer=False) as pf:
                ids = pf.read(columns=[column], use_threads=False).column(column)
            if ids.null_count:
                row = ids.to_pylist().index(None)
                raise JobInputError("E_INPUT_NULL_ID", f"row {f.first_row + row} ({f.rel}, row {row}) has a null "
                                    f"id in column {column!r}; fill in every id")
            chunks.append(ids.cast(value_type))
        every = pa.chunked_array([a for c in chunks for a in c.chunks], value_type)
        if pc.count_distinct(every).as_py() == len(every):
            return
        first: dict = {}  # only on the way to the error: where each id occurs first
        for f, ids in zip(self._files, chunks):
            for i, value in enumerate(ids.to_pylist()):
                if value in first:
                    row, rel, local = first[value]
                    raise JobInputError(
                        "E_INPUT_DUPLICATE_ID",
                        f"id {value!r} of row {f.first_row + i} ({f.rel}, row {i}) repeats row {row} ({rel}, row "
                        f"{local}); make the ids in column {column!r} unique, or pass --allow-duplicate-ids to run "
                        "every row as it is (resume goes by row position)",
                    )
                first[value] = (f.first_row + i, f.rel, i)

    def _file_batches(self, f: _File, columns: list[str], start_row: int, batch_rows: int,
                      end_row: int) -> Iterator[InputBatch]:
        _check_unchanged(f)
        # first row group that holds start_row, and how many of its rows to skip
        row, group = f.first_row, 0
        while row + f.row_group_rows[group] <= start_row:
            row += f.row_group_rows[group]
            group += 1
        skip = max(0, start_row - row)
        # pre_buffer=False: pyarrow's default pre-buffers every requested row
        # group, so memory grew with the file size (6 MB for a 5.5 MB file);
        # without it about one row group is held. One thread is as fast here.
        with pq.ParquetFile(f.path, pre_buffer=False) as pf:
            groups = list(range(group, len(f.row_group_rows)))
            for rb in pf.iter_batches(batch_size=batch_rows, row_groups=groups, columns=columns, use_threads=False):
                if skip >= rb.num_rows:
                    skip -= rb.num_rows
                    row += rb.num_rows
                    continue
                if skip:
                    rb, row, skip = rb.slice(skip), row + skip, 0
                if row + rb.num_rows >= end_row:
                    if end_row > row:
                        yield self._convert(f, rb.slice(0, end_row - row), row)
                    return
                yield self._convert(f, rb, row)
                row += rb.num_rows

    def _convert(self, f: _File, rb: pa.RecordBatch, first_row: int) -> InputBatch:
        spec, n = self.spec, rb.num_rows
        if self.generated_ids:
            ids = [str(first_row + i) for i in range(n)]
        else:
            raw = rb.column(spec.id_column).to_pylist()
            if None in raw:
                row = first_row + raw.index(None)
                raise JobInputError("E_INPUT_NULL_ID", f"row {row} ({f.rel}) has a null id in column {spec.id_column!r}; fill in every id")
            ids = raw
        prompts = rb.column(spec.prompt_column).to_pylist() if spec.prompt_column is not None else None
        prompt_ids = rb.column(spec.prompt_ids_column).to_pylist() if spec.prompt_ids_column is not None else None
        messages = rb.column(spec.messages_column).to_pylist() if spec.messages_column is not None else None
        adapters = rb.column(spec.adapter_column).to_pylist()
        if spec.max_new_tokens_column is not None:
            max_new_tokens = rb.column(spec.max_new_tokens_column).to_pylist()
        else:
            max_new_tokens = [None] * n
        if spec.keep_columns:
            kept = pa.Table.from_arrays([rb.column(c) for c in spec.keep_columns], schema=self.kept_schema)
        else:  # no columns, but still n rows
            kept = pa.Table.from_batches([rb.select([])])
        return InputBatch(first_row, ids, prompts, prompt_ids, adapters, max_new_tokens, kept, messages)


def _check_unchanged(f: _File) -> None:
    stat = os.stat(f.path)
    if (stat.st_size, stat.st_mtime_ns) != (f.size, f.mtime_ns):
        raise JobInputError("E_INPUT_CHANGED", f"{f.path} changed after the job started; rerun the job on a stable input")


def _missing(role: str, column: str, path: str, schema: pa.Schema) -> JobInputError:
    return JobInputError(
        "E_INPUT_COLUMN_MISSING",
        f"{role} column {column!r} is not in {path}; available columns: {', '.join(schema.names) or '(none)'}. "
        f"Name the right one with {_FLAG[role]}",
    )


def _check_roles(spec: InputSpec, path: str, schema: pa.Schema, has_id: bool) -> None:
    for role, column in spec.roles().items():
        if role == "id" and not has_id:
            continue
        if column not in schema.names:
            raise _missing(role, column, path, schema)
        if schema.get_field_index(column) < 0:
            raise JobInputError("E_INPUT_SCHEMA_MISMATCH", f"{path} has more than one column named {column!r}")
        accepts, expected, nullable = _TYPES[role]
        t = schema.field(column).type
        if not (accepts(t) or (nullable and pa.types.is_null(t))):
            raise JobInputError(
                "E_INPUT_COLUMN_TYPE",
                f"{role} column {column!r} in {path} has type {t}; expected {expected}. Convert it or choose another column with {_FLAG[role]}",
            )


def open_input(path: str, spec: InputSpec) -> InputSource:
    """Locate and validate the input (schemas and footers only; no row is read)."""
    paths, root = _resolve(path)
    files: list[_File] = []
    kept_schema: pa.Schema | None = None
    first_row = 0
    for p in paths:
        rel = os.path.relpath(p, root).replace(os.sep, "/")
        stat = os.stat(p)
        footer = _footer_sha256(p)
        try:
            meta = pq.read_metadata(p)
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, OSError) as exc:
            raise JobInputError("E_INPUT_NOT_PARQUET", f"{p} is not a readable Parquet file ({exc})") from None
        has_id = spec.id_column in schema.names
        if not files:
            if not has_id and spec.id_column != "id":
                raise _missing("id", spec.id_column, rel, schema)
            first_has_id, first_rel = has_id, rel
        elif has_id != first_has_id:
            present, absent = (rel, first_rel) if has_id else (first_rel, rel)
            raise JobInputError(
                "E_INPUT_SCHEMA_MISMATCH",
                f"id column {spec.id_column!r} is in {present} but not in {absent}; every input file needs the same columns",
            )
        _check_roles(spec, rel, schema, has_id)
        id_type = schema.field(spec.id_column).type if has_id else None
        if files and id_type != files[0].id_type:
            raise JobInputError(
                "E_INPUT_SCHEMA_MISMATCH",
                f"id column {spec.id_column!r} is {files[0].id_type} in {first_rel} but {id_type} in {rel}; the ids "
                "keep their type in the output, so make it the same in every input file",
            )
        for column in spec.keep_columns:
            if column not in schema.names:
                if files:
                    raise JobInputError(
                        "E_INPUT_SCHEMA_MISMATCH",
                        f"kept column {column!r} is in {first_rel} but not in {rel}; every input file needs the same columns",
                    )
                raise _missing("keep", column, rel, schema)
            if schema.get_field_index(column) < 0:
                raise JobInputError("E_INPUT_SCHEMA_MISMATCH", f"{rel} has more than one column named {column!r}")
        kept = pa.schema([schema.field(c).with_nullable(True).remove_metadata() for c in spec.keep_columns])
        if kept_schema is None:
            kept_schema = kept
        elif not kept.equals(kept_schema):
            diff = [
                f"{c}: {kept_schema.field(c).type} in {first_rel} vs {kept.field(c).type} in {rel}"
                for c in spec.keep_columns
                if kept.field(c).type != kept_schema.field(c).type
            ]
            raise JobInputError(
                "E_INPUT_SCHEMA_MISMATCH", f"kept columns differ between input files ({'; '.join(diff)}); make their types agree"
            )
        if has_id and _null_count_from_stats(meta, spec.id_column):
            raise JobInputError("E_INPUT_NULL_ID", f"{rel} has null ids in column {spec.id_column!r}; fill in every id")
        groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        files.append(_File(p, rel, stat.st_size, stat.st_mtime_ns, meta.num_rows, first_row, groups, footer, has_id, id_type))
        first_row += meta.num_rows
    return InputSource(spec, files, kept_schema)


