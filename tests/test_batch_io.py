"""Parquet input, atomic output shards, manifest and resume (mlora.batch.job.input / .output)."""

import gc
import json
import os
import random
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mlora.batch.job.input import InputSpec, JobInputError, open_input
from mlora.batch.job.output import (
    MANIFEST_NAME,
    JobOutput,
    JobOutputError,
    ResultSink,
    job_fingerprint,
    output_schema,
    read_output,
)

PARTS = {"base": "b" * 64, "sampling": {"temperature": 0.7, "seed": 1}, "input": [{"path": "a.parquet"}]}


def rows_table(first: int, n: int, **extra) -> pa.Table:
    cols = {
        "id": [f"r{first + i}" for i in range(n)],
        "prompt": [f"prompt {first + i}" for i in range(n)],
        "adapter": [None if (first + i) % 3 == 0 else f"a{(first + i) % 3}" for i in range(n)],
        "score": [float(first + i) / 2 for i in range(n)],
    }
    cols.update(extra)
    types = {"id": pa.string(), "prompt": pa.string(), "adapter": pa.string(), "score": pa.float64()}
    return pa.table({k: v if isinstance(v, pa.Array) else pa.array(v, types.get(k)) for k, v in cols.items()})


def write(path, table, **kw):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(table, path, **kw)
    return str(path)


def collect(source, start_row=0, batch_rows=1024):
    ids, first_rows, kept = [], [], []
    for b in source.batches(start_row, batch_rows):
        assert 1 <= len(b) <= batch_rows
        assert b.first_row == start_row + len(ids)
        first_rows.append(b.first_row)
        ids += b.ids
        kept += b.kept_rows()
    return ids, first_rows, kept


def code_of(excinfo) -> str:
    assert str(excinfo.value).startswith(excinfo.value.code + ": ")
    return excinfo.value.code


# -- input: locating files -----------------------------------------------------


def test_single_file(tmp_path):
    path = write(tmp_path / "in.parquet", rows_table(0, 10), row_group_size=4)
    src = open_input(path, InputSpec(keep_columns=("score",)))
    assert src.files == [os.path.abspath(path)] and src.num_rows == 10
    assert src.kept_schema == pa.schema([pa.field("score", pa.float64())])
    (batch,) = list(src.batches())
    assert batch.first_row == 0
    assert batch.ids == [f"r{i}" for i in range(10)]
    assert batch.prompts == [f"prompt {i}" for i in range(10)] and batch.prompt_ids is None
    assert batch.adapters[:3] == [None, "a1", "a2"]
    assert batch.max_new_tokens == [None] * 10
    assert batch.kept.column("score").to_pylist() == [i / 2 for i in range(10)]


def test_directory_sorted_recursive_and_hidden_skipped(tmp_path):
    d = tmp_path / "in"
    write(d / "b.parquet", rows_table(5, 5))
    write(d / "a.parquet", rows_table(0, 5))
    write(d / "sub" / "c.parquet", rows_table(10, 5))
    write(d / "_tmp" / "x.parquet", rows_table(100, 5))
    write(d / ".hidden.parquet", rows_table(100, 5))
    (d / "_SUCCESS").write_text("")
    (d / "notes.txt").write_text("not parquet, not read")
    src = open_input(str(d), InputSpec())
    assert [os.path.relpath(f, d) for f in src.files] == ["a.parquet", "b.parquet", os.path.join("sub", "c.parquet")]
    assert [fp["path"] for fp in src.fingerprint()] == ["a.parquet", "b.parquet", "sub/c.parquet"]
    assert collect(src)[0] == [f"r{i}" for i in range(15)]


def test_glob(tmp_path):
    write(tmp_path / "part-1.parquet", rows_table(3, 3))
    write(tmp_path / "part-0.parquet", rows_table(0, 3))
    write(tmp_path / "other.parquet", rows_table(100, 3))
    src = open_input(str(tmp_path / "part-*.parquet"), InputSpec())
    assert src.num_rows == 6 and collect(src)[0] == [f"r{i}" for i in range(6)]


@pytest.mark.parametrize("name", ["missing.parquet", "nothing-*.parquet", "empty_dir"])
def test_input_not_found(tmp_path, name):
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(JobInputError) as e:
        open_input(str(tmp_path / name), InputSpec())
    assert code_of(e) == "E_INPUT_NOT_FOUND"


def test_input_not_parquet(tmp_path):
    (tmp_path / "data.parquet").write_text("id,prompt\n1,hello\n")
    with pytest.raises(JobInputError) as e:
        open_input(str(tmp_path / "data.parquet"), InputSpec())
    assert code_of(e) == "E_INPUT_NOT_PARQUET"


# -- input: streaming ------------------------------------------------------------


@pytest.fixture
def three_files(tmp_path):
    d = tmp_path / "in"
    write(d / "0.parquet", rows_table(0, 23), row_group_size=5)
    write(d / "1.parquet", rows_table(23, 0))
    write(d / "2.parquet", rows_table(23, 17), row_group_size=4)
    write(d / "3.parquet", rows_table(40, 9))
    return open_input(str(d), InputSpec(keep_columns=("score", "prompt")))


@pytest.mark.parametrize("start_row", [0, 1, 5, 12, 22, 23, 24, 30, 40, 48, 49])
@pytest.mark.parametrize("batch_rows", [1, 3, 8, 1024])
def test_batches_from_any_start_row(three_files, start_row, batch_rows):
    assert three_files.num_rows == 49
    ids, first_rows, kept = collect(three_files, start_row, batch_rows)
    assert ids == [f"r{i}" for i in range(start_row, 49)]
    assert kept == [{"score": i / 2, "prompt": f"prompt {i}"} for i in range(start_row, 49)]


@pytest.mark.parametrize("start_row, end_row", [(0, 49), (0, 0), (3, 4), (5, 23), (20, 24), (22, 41), (40, 49), (49, 49)])
def test_batches_of_a_row_range(three_files, start_row, end_row):
    for batch_rows in (1, 4, 1024):
        batches = list(three_files.batches(start_row, batch_rows, end_row=end_row))
        assert [i for b in batches for i in b.ids] == [f"r{i}" for i in range(start_row, end_row)]
        assert all(0 < len(b) <= batch_rows for b in batches)
        assert [b.first_row for b in batches] == sorted({b.first_row for b in batches})
    with pytest.raises(ValueError):
        list(three_files.batches(5, 8, end_row=4))


def test_start_row_out_of_range(three_files):
    with pytest.raises(ValueError):
        list(three_files.batches(50))


def test_resume_skips_files_and_row_groups_without_reading_them(three_files, monkeypatch):
    opened = []

    class Spy(pq.ParquetFile):
        def __init__(self, source, *args, **kw):
            self.source_name = os.path.basename(source)
            super().__init__(source, *args, **kw)

        def iter_batches(self, *args, row_groups=None, **kw):
            opened.append((self.source_name, row_groups))
            return super().iter_batches(*args, row_groups=row_groups, **kw)

    monkeypatch.setattr(pq, "ParquetFile", Spy)
    list(three_files.batches(start_row=23 + 9))  # row 9 of 2.parquet: its third row group
    assert opened == [("2.parquet", [2, 3, 4]), ("3.parquet", [0])]


def test_generated_ids_from_row_position(tmp_path):
    d = tmp_path / "in"
    write(d / "a.parquet", rows_table(0, 4).drop_columns(["id"]))
    write(d / "b.parquet", rows_table(4, 3).drop_columns(["id"]))
    src = open_input(str(d), InputSpec())
    assert src.generated_ids
    assert collect(src)[0] == [str(i) for i in range(7)]
    assert collect(src, start_row=5, batch_rows=1)[0] == ["5", "6"]


ID_TYPES = {  # an id column's Arrow type -> its values
    "int64": pa.array([7, -1, 2**40], pa.int64()),
    "int32": pa.array([7, -1, 2**30], pa.int32()),
    "uint64": pa.array([7, 0, 2**63], pa.uint64()),
    "string": pa.array(["7", "-1", "b"], pa.string()),
    "large_string": pa.array(["7", "-1", "b"], pa.large_string()),
    "dictionary": pa.array(["7", "-1", "b"]).dictionary_encode(),
}


@pytest.mark.parametrize("kind", sorted(ID_TYPES))
def test_ids_keep_their_arrow_type(tmp_path, kind):
    """Ids pass through as the input's values in its type (a user joins output to input on them)."""
    ids = ID_TYPES[kind]
    d = tmp_path / "in"
    write(d / "a.parquet", rows_table(0, 2).set_column(0, "id", ids.slice(0, 2)))
    write(d / "b.parquet", rows_table(2, 1).set_column(0, "id", ids.slice(2)))
    src = open_input(str(d), InputSpec())
    assert src.id_type == ids.type and not src.generated_ids
    assert collect(src)[0] == ids.to_pylist()
    assert output_schema(src.kept_schema, src.id_type).field("id").type == ids.type
    src.check_unique_ids()  # unique across the two files
    # generated ids (no id column) stay strings
    write(tmp_path / "gen.parquet", rows_table(0, 2).drop_columns(["id"]))
    assert open_input(str(tmp_path / "gen.parquet"), InputSpec()).id_type == pa.string()


@pytest.mark.parametrize("first, second", [(pa.int64(), pa.int32()), (pa.string(), pa.large_string()),
                                           (pa.string(), pa.int64())])
def test_id_type_must_agree_between_files(tmp_path, first, second):
    d = tmp_path / "in"
    write(d / "a.parquet", rows_table(0, 2).set_column(0, "id", pa.array([1, 2]).cast(first)))
    write(d / "b.parquet", rows_table(2, 2).set_column(0, "id", pa.array([3, 4]).cast(second)))
    with pytest.raises(JobInputError) as e:
        open_input(str(d), InputSpec())
    assert code_of(e) == "E_INPUT_SCHEMA_MISMATCH"
    assert f"is {first} in a.parquet but {second} in b.parquet" in str(e.value), str(e.value)


@pytest.mark.parametrize("kind", ["int64", "string", "dictionary"])
def test_duplicate_ids_are_found_across_files_reading_ids_only(tmp_path, kind, monkeypatch):
    values = {"int64": [10, 11, 12, 13, 14, 11], "string": ["a", "b", "c", "d", "e", "b"]}
    ids = pa.array(values.get(kind, values["string"]))
    if kind == "dictionary":
        ids = ids.dictionary_encode()
    d = tmp_path / "in"
    write(d / "a.parquet", rows_table(0, 4).set_column(0, "id", ids.slice(0, 4)))
    write(d / "b.parquet", rows_table(4, 2).set_column(0, "id", ids.slice(4)))
    src = open_input(str(d), InputSpec(keep_columns=("score",)))
    read = []
    real_read = pq.ParquetFile.read
    monkeypatch.setattr(pq.ParquetFile, "read", lambda self, columns=None, **kw: read.append(columns)
                        or real_read(self, columns=columns, **kw))
    with pytest.raises(JobInputError) as e:
        src.check_unique_ids()
    assert code_of(e) == "E_INPUT_DUPLICATE_ID"
    dup = ids.to_pylist()[1]
    assert f"id {dup!r} of row 5 (b.parquet, row 1) repeats row 1 (a.parquet, row 1)" in str(e.value), str(e.value)
    assert "--allow-duplicate-ids" in str(e.value)
    assert read == [["id"], ["id"]]  # the id column of each file, nothing else


def test_duplicate_check_refuses_null_ids_without_statistics(tmp_path):
    path = write(tmp_path / "in.parquet", pa.table({"id": ["a", "b", None], "prompt": ["x", "y", "z"],
                                                    "adapter": [None, None, None]}), write_statistics=False)
    src = open_input(path, InputSpec())  # no statistics: not found up front
    with pytest.raises(JobInputError) as e:
        src.check_unique_ids()
    assert code_of(e) == "E_INPUT_NULL_ID" and "row 2" in str(e.value)


def test_generated_ids_need_no_duplicate_check(tmp_path, monkeypatch):
    path = write(tmp_path / "in.parquet", rows_table(0, 3).drop_columns(["id"]))
    src = open_input(path, InputSpec())
    monkeypatch.setattr(pq, "ParquetFile", None)  # nothing is read
    src.check_unique_ids()


def test_named_id_column_must_exist(tmp_path):
    path = write(tmp_path / "in.parquet", rows_table(0, 3))
    with pytest.raises(JobInputError) as e:
        open_input(path, InputSpec(id_column="uid"))
    assert code_of(e) == "E_INPUT_COLUMN_MISSING"
    assert "'uid'" in str(e.value) and "id, prompt, adapter, score" in str(e.value) and "--id-column" in str(e.value)


def test_null_id_refused(tmp_path):
    path = write(tmp_path / "in.parquet", rows_table(0, 3).set_column(0, "id", pa.array(["a", None, "c"])))
    with pytest.raises(JobInputError) as e:
        open_input(path, InputSpec())
    assert code_of(e) == "E_INPUT_NULL_ID"
    # without statistics the null is found when the row is read
    path = write(tmp_path / "nostats.parquet", pa.table({"id": ["a", None], "prompt": ["x", "y"], "adapter": [None, None]}), write_statistics=False)
    src = open_input(path, InputSpec())
    with pytest.raises(JobInputError) as e:
        list(src.batches())
    assert code_of(e) == "E_INPUT_NULL_ID" and "row 1" in str(e.value)


def test_prompt_ids_and_max_new_tokens(tmp_path):
    table = pa.table(
        {
            "tokens": pa.array([[1, 2, 3], None, []], pa.list_(pa.int32())),
            "adapter": ["x", None, ""],
            "budget": pa.array([4, None, 1], pa.int16()),
        }
    )
    path = write(tmp_path / "in.parquet", table)
    src = open_input(path, InputSpec(prompt_column=None, prompt_ids_column="tokens", max_new_tokens_column="budget"))
    (b,) = list(src.batches())
    assert b.prompts is None and b.prompt_ids == [[1, 2, 3], None, []]
    assert b.adapters == ["x", None, ""] and b.max_new_tokens == [4, None, 1]
    assert b.ids == ["0", "1", "2"] and b.kept.num_columns == 0 and b.kept.num_rows == 3


def test_lenient_string_encodings(tmp_path):
    table = pa.table(
        {
            "id": pa.array(["a", "b"], pa.large_string()),
            "prompt": pa.array(["p", "q"]).dictionary_encode(),
            "adapter": pa.array([None, None], pa.null()),
        }
    )
    path = write(tmp_path / "in.parquet", table)
    (b,) = list(open_input(path, InputSpec()).batches())
    assert (b.ids, b.prompts, b.adapters) == (["a", "b"], ["p", "q"], [None, None])


# -- input: the errors, one mutation each ----------------------------------------

TYPE_CASES = [
    ("id", pa.array([1.5, 2.5]), InputSpec()),
    ("prompt", pa.array([1, 2]), InputSpec()),
    ("adapter", pa.array([1, 2]), InputSpec()),
    ("tokens", pa.array([["a"], ["b"]]), InputSpec(prompt_column=None, prompt_ids_column="tokens")),
    ("tokens", pa.array(["1 2", "3"]), InputSpec(prompt_column=None, prompt_ids_column="tokens")),
    ("budget", pa.array(["4", "5"]), InputSpec(max_new_tokens_column="budget")),
    ("budget", pa.array([4.0, 5.0]), InputSpec(max_new_tokens_column="budget")),
    ("id", pa.array([None, None], pa.null()), InputSpec()),
]


@pytest.mark.parametrize("column,values,spec", TYPE_CASES, ids=[f"{c}-{v.type}" for c, v, _ in TYPE_CASES])
def test_column_type_errors(tmp_path, column, values, spec):
    table = pa.table({"id": ["a", "b"], "prompt": ["p", "q"], "adapter": ["x", None], "tokens": [[1], [2]], "budget": [1, 2]})
    table = table.set_column(table.schema.get_field_index(column), column, values)
    path = write(tmp_path / "in.parquet", table)
    with pytest.raises(JobInputError) as e:
        open_input(path, spec)
    assert code_of(e) == "E_INPUT_COLUMN_TYPE"
    stored_type = pq.read_schema(path).field(column).type
    assert f"'{column}'" in str(e.value) and f"has type {stored_type}; expected" in str(e.value)


MISSING_CASES = [
    ("prompt", InputSpec(prompt_column="text"), "--prompt-column"),
    ("prompt_ids", InputSpec(prompt_column=None, prompt_ids_column="ids"), "--prompt-ids-column"),
    ("adapter", InputSpec(adapter_column="lora"), "--adapter-column"),
    ("max_new_tokens", InputSpec(max_new_tokens_column="budget"), "--max-new-tokens-column"),
    ("keep", InputSpec(keep_columns=("label",)), "--keep-columns"),
]


@pytest.mark.parametrize("role,spec,flag", MISSING_CASES, ids=[c[0] for c in MISSING_CASES])
def test_missing_columns(tmp_path, role, spec, flag):
    path = write(tmp_path / "in.parquet", rows_table(0, 2))
    with pytest.raises(JobInputError) as e:
        open_input(path, spec)
    assert code_of(e) == "E_INPUT_COLUMN_MISSING"
    assert "available columns: id, prompt, adapter, score" in str(e.value) and flag in str(e.value)


@pytest.mark.parametrize(
    "kw",
    [
        {"prompt_column": None},
        {"prompt_ids_column": "tokens"},
        {"keep_columns": ("score", "score")},
        {"keep_columns": ("completion",)},
        {"keep_columns": ("id",)},
    ],
)
def test_spec_usage_errors(kw):
    with pytest.raises(JobInputError) as e:
        InputSpec(**kw)
    assert code_of(e) == "E_INPUT_USAGE"


def test_schema_mismatch_between_files(tmp_path):
    d = tmp_path / "kept_type"
    write(d / "a.parquet", rows_table(0, 2))
    write(d / "b.parquet", rows_table(2, 2, score=pa.array(["x", "y"])))
    with pytest.raises(JobInputError) as e:
        open_input(str(d), InputSpec(keep_columns=("score",)))
    assert code_of(e) == "E_INPUT_SCHEMA_MISMATCH" and "score: double in a.parquet vs string in b.parquet" in str(e.value)
    # without keeping it, the differing column is not read and does not matter
    assert open_input(str(d), InputSpec()).num_rows == 4

    d = tmp_path / "kept_missing"
    write(d / "a.parquet", rows_table(0, 2))
    write(d / "b.parquet", rows_table(2, 2).drop_columns(["score"]))
    with pytest.raises(JobInputError) as e:
        open_input(str(d), InputSpec(keep_columns=("score",)))
    assert code_of(e) == "E_INPUT_SCHEMA_MISMATCH"

    d = tmp_path / "id_missing"
    write(d / "a.parquet", rows_table(0, 2).drop_columns(["id"]))
    write(d / "b.parquet", rows_table(2, 2))
    with pytest.raises(JobInputError) as e:
        open_input(str(d), InputSpec())
    assert code_of(e) == "E_INPUT_SCHEMA_MISMATCH" and "is in b.parquet but not in a.parquet" in str(e.value)

    # role columns only need an accepted type in each file
    d = tmp_path / "roles"
    write(d / "a.parquet", rows_table(0, 2))
    write(d / "b.parquet", rows_table(2, 2, adapter=pa.array([None, None], pa.null()), prompt=pa.array(["x", "y"], pa.large_string())))
    assert collect(open_input(str(d), InputSpec()))[0] == ["r0", "r1", "r2", "r3"]


def test_fingerprint_tracks_content(tmp_path):
    path = write(tmp_path / "in.parquet", rows_table(0, 5))
    first = open_input(path, InputSpec()).fingerprint()
    assert open_input(path, InputSpec()).fingerprint() == first
    (fp,) = first
    assert fp["path"] == "in.parquet" and fp["num_rows"] == 5 and fp["size"] == os.path.getsize(path)
    write(tmp_path / "in.parquet", rows_table(0, 5, prompt=[f"other {i}" for i in range(5)]))
    assert open_input(path, InputSpec()).fingerprint()[0]["footer_sha256"] != fp["footer_sha256"]


def test_input_changed_while_streaming(tmp_path):
    path = write(tmp_path / "in.parquet", rows_table(0, 5))
    src = open_input(path, InputSpec())
    write(tmp_path / "in.parquet", rows_table(0, 6))
    with pytest.raises(JobInputError) as e:
        list(src.batches())
    assert code_of(e) == "E_INPUT_CHANGED"


# -- output ----------------------------------------------------------------------


def test_output_schema_and_fingerprint():
    schema = output_schema(pa.schema([pa.field("score", pa.float64())]))
    assert schema.names == [
        "id", "score", "adapter", "adapter_sha256", "completion", "completion_token_ids", "finish_reason",
        "num_prompt_tokens", "num_completion_tokens", "error_code", "error_message",
    ]  # fmt: skip
    assert schema.field("completion_token_ids").type == pa.list_(pa.int32())
    assert schema.field("num_prompt_tokens").type == pa.int32()
    a = job_fingerprint({"x": 1, "t": 0.5})
    assert a == job_fingerprint({"t": 0.5, "x": 1}) and len(a) == 64
    assert a != job_fingerprint({"x": 1, "t": "0.5"}) and a != job_fingerprint({"x": 1, "t": 0.50000001})


def record(row: int, kept: dict | None = None) -> dict:
    """What the engine would write for input row ``row`` (a fake completion)."""
    base = row % 3 == 0
    rec = {
        "id": f"r{row}",
        "adapter": None if base else f"a{row % 3}",
        "adapter_sha256": None if base else f"{row % 3}" * 64,
        "completion": f"out {row}",
        "completion_token_ids": [row, row + 1],
        "finish_reason": "length",
        "num_prompt_tokens": 3,
        "num_completion_tokens": 2,
        "error_code": None,
        "error_message": None,
    }
    rec.update(kept if kept is not None else {"score": row / 2})
    return rec


SCHEMA = output_schema(pa.schema([pa.field("score", pa.float64())]))


def expected_table(n: int) -> pa.Table:
    return pa.Table.from_pylist([record(r) for r in range(n)], schema=SCHEMA)


def test_out_of_order_rows_commit_in_input_order(tmp_path):
    out_dir = str(tmp_path / "out")
    out = JobOutput.open(out_dir, PARTS, resume=False, shard_rows=5)
    sink = ResultSink(out, SCHEMA, total_rows=23)
    order = list(range(23))
    random.Random(0).shuffle(order)
    for r in order:
        sink.add(r, record(r))
        # committed rows are always a contiguous prefix, in whole shards
        assert out.next_row % 5 == 0 and all(q in order[: order.index(r) + 1] for q in range(out.next_row))
    assert out.next_row == 20 and sink.pending == 3
    sink.close(final=True)
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert [(s["file"], s["first_row"], s["last_row"], s["rows"]) for s in manifest["shards"]] == [
        (f"part-{i:05d}.parquet", 5 * i, min(5 * i + 5, 23), min(5, 23 - 5 * i)) for i in range(5)
    ]
    assert manifest["rows_committed"] == 23 and manifest["schema_version"] == 1
    assert manifest["fingerprint"] == {"sha256": job_fingerprint(PARTS), "parts": PARTS}
    assert os.path.exists(tmp_path / "out" / "_SUCCESS")
    assert read_output(out_dir).equals(expected_table(23))
    assert sorted(os.listdir(out_dir)) == [".lock", "_SUCCESS", "_manifest.json"] + [f"part-{i:05d}.parquet" for i in range(5)]


def test_a_shard_commits_when_the_commit_interval_has_passed(tmp_path):
    """Far below --shard-rows, the contiguous run so far is committed once a row is added
    ``commit_interval`` seconds after the last commit; rows behind a gap wait for it."""
    now = [0.0]
    out = JobOutput.open(str(tmp_path / "out"), PARTS, resume=False, shard_rows=100)
    sink = ResultSink(out, SCHEMA, total_rows=8, commit_interval=60.0, clock=lambda: now[0])
    for r in (0, 1, 2):
        sink.add(r, record(r))
    assert out.next_row == 0  # within the interval
    now[0] = 61.0
    sink.add(4, record(4))  # row 3 still runs: rows 0..2 are the contiguous run
    assert [(s["first_row"], s["last_row"]) for s in out.shards] == [(0, 3)] and sink.pending == 1
    now[0] = 100.0
    sink.add(3, record(3))
    assert out.next_row == 3  # 39 s since the last commit
    now[0] = 121.0
    sink.add(6, record(6))
    assert [(s["first_row"], s["last_row"]) for s in out.shards] == [(0, 3), (3, 5)]
    sink.add(5, record(5))
    sink.add(7, record(7))
    sink.close(final=True)
    assert [s["rows"] for s in out.shards] == [3, 2, 3]
    assert read_output(str(tmp_path / "out")).equals(expected_table(8))


def test_nothing_commits_before_the_first_row(tmp_path):
    out = JobOutput.open(str(tmp_path / "out"), PARTS, resume=False, shard_rows=4)
    sink = ResultSink(out, SCHEMA)
    for r in range(1, 9):
        sink.add(r, record(r))
    assert out.next_row == 0 and not out.shards
    sink.add(0, record(0))
    assert out.next_row == 8 and [s["rows"] for s in out.shards] == [4, 4]


def test_sink_refuses_misuse(tmp_path):
    out = JobOutput.open(str(tmp_path / "out"), PARTS, resume=False, shard_rows=2)
    sink = ResultSink(out, SCHEMA, total_rows=10)
    sink.add(0, record(0))
    sink.add(1, record(1))  # committed
    sink.add(3, record(3))
    for row in (0, 3, 10):
        with pytest.raises(ValueError):
            sink.add(row, record(row))
    bad = record(4)
    del bad["completion"]
    with pytest.raises(ValueError, match="missing \\['completion'\\]"):
        sink.add(4, bad)
    with pytest.raises(ValueError, match="unknown \\['extra'\\]"):
        sink.add(4, {**record(4), "extra": 1})
    with pytest.raises(RuntimeError, match="row 2 was never added"):
        sink.close(final=True)
    assert not os.path.exists(tmp_path / "out" / "_SUCCESS")


def test_finish_writes_metrics_then_success(tmp_path):
    out = JobOutput.open(str(tmp_path / "out"), PARTS, resume=False, shard_rows=2)
    sink = ResultSink(out, SCHEMA, total_rows=3)
    for r in (2, 0, 1):
        sink.add(r, record(r))
    sink.finish({"rows": 3, "tokens_per_s": 1.5})
    assert json.loads((tmp_path / "out" / "_metrics.json").read_text()) == {"rows": 3, "tokens_per_s": 1.5}
    assert os.path.exists(tmp_path / "out" / "_SUCCESS") and out.complete
    assert read_output(str(tmp_path / "out")).equals(expected_table(3))


def test_empty_input_is_a_successful_job_with_no_rows(tmp_path):
    path = write(tmp_path / "in.parquet", rows_table(0, 0))
    src = open_input(path, InputSpec(keep_columns=("score",)))
    assert src.num_rows == 0 and list(src.batches()) == []
    out = JobOutput.open(str(tmp_path / "out"), PARTS, resume=False)
    sink = ResultSink(out, output_schema(src.kept_schema), total_rows=0)
    sink.close(final=True)
    assert os.path.exists(tmp_path / "out" / "_SUCCESS")
    table = read_output(str(tmp_path / "out"))
    assert table.num_rows == 0 and table.schema == SCHEMA


def run_job(src, out_dir, resume, shard_rows, stop_after=None, batch_rows=7):
    """A stand-in for the engine: rows finish out of order within each batch."""
    out = JobOutput.open(out_dir, PARTS, resume=resume, shard_rows=shard_rows)
    sink = ResultSink(out, output_schema(src.kept_schema), total_rows=src.num_rows)
    rng, done = random.Random(out.next_row), 0
    for batch in src.batches(out.next_row, batch_rows):
        items = list(zip(range(batch.first_row, batch.first_row + len(batch)), batch.kept_rows()))
        rng.shuffle(items)
        for row, kept in items:
            if stop_after is not None and done == stop_after:
                return out, sink  # "killed": no close, rows still buffered are lost
            sink.add(row, record(row, kept))
            done += 1
    sink.close(final=True)
    return out, sink


def test_crash_and_resume_equals_uninterrupted_run(tmp_path):
    d = tmp_path / "in"
    write(d / "a.parquet", rows_table(0, 30), row_group_size=8)
    write(d / "b.parquet", rows_table(30, 25), row_group_size=8)
    src = open_input(str(d), InputSpec(keep_columns=("score",)))
    run_job(src, str(tmp_path / "clean"), resume=False, shard_rows=6)
    clean = read_output(str(tmp_path / "clean"))
    assert clean.equals(expected_table(55))

    out_dir = tmp_path / "crashed"
    out, sink = run_job(src, str(out_dir), resume=False, shard_rows=6, stop_after=26)
    committed = out.next_row
    assert committed % 6 == 0 and committed < 26 and sink.pending > 0  # finished rows not yet committed
    del out, sink
    gc.collect()
    # debris of a kill -9 in the middle of a commit: a temp file, and a shard
    # file written before the manifest could name it
    stray = f"part-{committed // 6:05d}.parquet"
    (out_dir / f".tmp.{stray}.abc123").write_bytes(b"half a shard")
    pq.write_table(expected_table(committed + 6).slice(committed), out_dir / stray)

    with pytest.raises(JobOutputError) as e:
        JobOutput.open(str(out_dir), PARTS, resume=False)
    assert code_of(e) == "E_OUTPUT_EXISTS" and "--resume" in str(e.value)

    resumed = JobOutput.open(str(out_dir), PARTS, resume=True, shard_rows=6)
    assert resumed.resumed and not resumed.complete and resumed.next_row == committed
    assert not os.path.exists(out_dir / f".tmp.{stray}.abc123")
    assert not os.path.exists(out_dir / stray)
    resumed.close()

    run_job(src, str(out_dir), resume=True, shard_rows=6)
    assert read_output(str(out_dir)).equals(clean)
    # resuming a finished job is a no-op success
    done = JobOutput.open(str(out_dir), PARTS, resume=True)
    assert done.complete and done.next_row == 55


@pytest.mark.parametrize("kind", ["int64", "int32", "large_string"])
def test_crash_and_resume_with_typed_ids_and_a_commit_interval(tmp_path, kind):
    """Ids over two files keep their type in every shard, also across a crash and resume;
    shards cut by the commit interval resume exactly like shards of --shard-rows."""
    ids = pa.array(range(100, 123)).cast({"int64": pa.int64(), "int32": pa.int32(),
                                          "large_string": pa.large_string()}[kind])
    d = tmp_path / "in"
    write(d / "a.parquet", rows_table(0, 13).set_column(0, "id", ids.slice(0, 13)), row_group_size=4)
    write(d / "b.parquet", rows_table(13, 10).set_column(0, "id", ids.slice(13)), row_group_size=4)
    src = open_input(str(d), InputSpec(keep_columns=("score",)))
    schema = output_schema(src.kept_schema, src.id_type)
    tick = iter(range(10**6))

    def run(out_dir, resume, stop_after=None):
        out = JobOutput.open(str(out_dir), PARTS, resume=resume, shard_rows=1000)
        sink = ResultSink(out, schema, total_rows=src.num_rows, commit_interval=5, clock=lambda: next(tick))
        done = 0
        for batch in src.batches(out.next_row, 6):
            order = list(range(len(batch)))
            random.Random(batch.first_row).shuffle(order)
            for i in order:
                if done == stop_after:
                    return out  # "killed"
                sink.add(batch.first_row + i, {**record(batch.first_row + i, batch.kept_rows()[i]), "id": batch.ids[i]})
                done += 1
        sink.close(final=True)
        return out

    run(tmp_path / "clean", resume=False)
    clean = read_output(str(tmp_path / "clean"))
    assert clean.schema.field("id").type == ids.type and clean.column("id").to_pylist() == ids.to_pylist()
    crashed = run(tmp_path / "crashed", resume=False, stop_after=15)
    assert 0 < crashed.next_row < 15  # the interval committed some rows, far below shard_rows
    del crashed
    gc.collect()
    run(tmp_path / "crashed", resume=True)
    assert read_output(str(tmp_path / "crashed")).equals(clean)
    for shard in JobOutput.open(str(tmp_path / "crashed"), PARTS, resume=True).shards:
        assert pq.read_schema(tmp_path / "crashed" / shard["file"]).field("id").type == ids.type


def test_resume_refuses_a_different_job(tmp_path):
    out_dir = str(tmp_path / "out")
    JobOutput.open(out_dir, PARTS, resume=False).close()
    changed = {**PARTS, "sampling": {"temperature": 0.8, "seed": 1}, "stop": ["\n"]}
    with pytest.raises(JobOutputError) as e:
        JobOutput.open(out_dir, changed, resume=True)
    assert code_of(e) == "E_RESUME_MISMATCH"
    message = str(e.value)
    assert "sampling.temperature: 0.7 (stored) vs 0.8 (now)" in message and 'stop: absent (stored) vs ["\\n"] (now)' in message
    assert "base" not in message.split("):", 1)[1].split(". Resume")[0]  # unchanged keys are not listed
    assert "new OUTPUT" in message


def test_resume_preconditions(tmp_path):
    # no OUTPUT yet, or an empty one: --resume starts the job
    fresh = JobOutput.open(str(tmp_path / "new"), PARTS, resume=True)
    assert not fresh.resumed and fresh.next_row == 0
    fresh.close()
    # killed before the first manifest: only the lock and a temp file
    early = tmp_path / "early"
    early.mkdir()
    (early / ".lock").write_bytes(b"")
    (early / ".tmp._manifest.json.0123").write_text("{")
    for resume in (True, False):
        again = JobOutput.open(str(early), PARTS, resume=resume)
        assert again.next_row == 0 and sorted(os.listdir(early)) == [".lock", MANIFEST_NAME]
        again.close()
        (early / MANIFEST_NAME).unlink()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.csv").write_text("x")
    with pytest.raises(JobOutputError) as e:
        JobOutput.open(str(foreign), PARTS, resume=True)
    assert code_of(e) == "E_RESUME_NO_MANIFEST"
    with pytest.raises(JobOutputError) as e:
        JobOutput.open(str(foreign / "data.csv"), PARTS, resume=False)
    assert code_of(e) == "E_OUTPUT_EXISTS"


def test_one_writer_per_output(tmp_path):
    first = JobOutput.open(str(tmp_path / "out"), PARTS, resume=False)
    with pytest.raises(JobOutputError) as e:
        JobOutput.open(str(tmp_path / "out"), PARTS, resume=True)
    assert code_of(e) == "E_OUTPUT_LOCKED"
    first.close()
    JobOutput.open(str(tmp_path / "out"), PARTS, resume=True).close()


@pytest.mark.parametrize("damage", ["flip_byte", "delete", "manifest_garbage"])
def test_corrupt_output_detected(tmp_path, damage):
    out_dir = tmp_path / "out"
    out = JobOutput.open(str(out_dir), PARTS, resume=False, shard_rows=4)
    sink = ResultSink(out, SCHEMA)
    for r in range(8):
        sink.add(r, record(r))
    sink.close(final=False)
    shard = out_dir / "part-00001.parquet"
    if damage == "flip_byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    else:
        (out_dir / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(JobOutputError) as e:
        JobOutput.open(str(out_dir), PARTS, resume=True)
    assert code_of(e) == "E_OUTPUT_CORRUPT"
    if damage != "manifest_garbage":
        assert "part-00001.parquet" in str(e.value)


# -- memory ------------------------------------------------------------------------


def test_streaming_memory_does_not_grow_with_rows(tmp_path):
    def make(n):
        path = str(tmp_path / f"in{n}.parquet")
        pq.write_table(
            pa.table({"prompt": pa.array([f"prompt number {i}" for i in range(n)]), "adapter": pa.array([None, "a", "b", "c"] * (n // 4))}),
            path,
            row_group_size=10_000,
        )
        return open_input(path, InputSpec(keep_columns=("prompt",)))

    def peaks(src):
        gc.collect()
        base_arrow = pa.total_allocated_bytes()
        tracemalloc.start()
        arrow_peak = rows = 0
        for b in src.batches(batch_rows=512):
            rows += len(b)
            arrow_peak = max(arrow_peak, pa.total_allocated_bytes() - base_arrow)
        py_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert rows == src.num_rows
        return py_peak, arrow_peak

    small_py, small_arrow = peaks(make(20_000))
    big_py, big_arrow = peaks(make(200_000))
    assert big_py <= 1.3 * small_py, (small_py, big_py)
    assert big_arrow <= 1.3 * small_arrow + (64 << 10), (small_arrow, big_arrow)
