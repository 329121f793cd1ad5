"""`mlora batch-run --engine ray` and the public actor class `MloraPredictor`.

With Ray installed (CI installs it: the test extra), a local Ray instance
with 2 CPUs runs the demo job on 2 actors and must write exactly the
single-process output; a Ray job interrupted after its first committed shard
resumes to the same output; an actor of two tensor-parallel ranks (its follower
started by the actor) gives the demo's expected rows; the predictor called
directly and the error mapping are checked too. `mlora.batch.scaleout.ray` imports Ray, so without Ray those
tests skip (the reason says so) and `--engine ray` exiting 1 with the install
hint still runs.
"""

import json
import os
import sys
import threading
import time

import pyarrow as pa
import pytest
from conftest import DEMO
from conftest import demo_job_options as _opts
from conftest import shard_digests as _shards

from mlora.batch.errors import JobError
from mlora.batch.job.metrics import JobMetrics
from mlora.batch.job.output import RESULT_FIELDS, read_output
from mlora.batch.runner import run_job

try:
    import ray  # noqa: F401
    import ray.data  # noqa: F401

    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install 'mlora[ray]'); CI installs it")

BASE, ADAPTERS = os.path.join(DEMO, "base"), os.path.join(DEMO, "adapters")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance (2 CPUs) for the module; the job reuses it and leaves it running."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@needs_ray
def test_two_ray_actors_write_exactly_the_single_process_output(tmp_path, single_process_output, local_ray):
    # --schedule-window 8: batches of 8 rows, windows of 16 (3 windows, 5 batches over 2 actors)
    summary = run_job(_opts(tmp_path / "out", engine="ray", num_workers=2, device="auto", schedule_window=8))
    assert read_output(str(tmp_path / "out")).equals(read_output(str(single_process_output)))
    assert _shards(tmp_path / "out") == _shards(single_process_output)  # the same shard files, byte for byte
    assert (tmp_path / "out" / "_SUCCESS").exists() and summary.device == "ray: cpu x2"
    m = json.loads((tmp_path / "out" / "_metrics.json").read_text())["metrics"]
    assert m["rows_finished"] == 40 and m["completion_tokens"] == summary.generated_tokens > 0
    # the actors' engine figures, merged as the coordinator merges workers: the same rows run to the
    # same tokens; each adapter loaded by one actor or both; unique adapter bytes counted once for the job
    one = json.loads((single_process_output / "_metrics.json").read_text())
    s = one["metrics"]
    assert m["iterations"] == summary.engine["iterations"] == m["histograms"]["iteration_seconds"]["count"] > 0
    assert m["decode_tokens"] == s["decode_tokens"] and summary.engine["generated_tokens"] == one["engine"][
        "generated_tokens"]
    assert m["prefill_tokens_computed"] + m["prefill_tokens_reused"] == s["prefill_tokens_computed"] + s[
        "prefill_tokens_reused"]
    loads, one_loads = sum(m["adapter_loads"].values()), sum(s["adapter_loads"].values())
    assert one_loads <= loads <= 2 * one_loads and m["unique_adapter_bytes"] == s["unique_adapter_bytes"] > 0
    assert 1.0 <= m["load_amplification"] <= 2.0 and m["h2d_bytes"] >= s["h2d_bytes"]
    assert sum(m["cache_hits"].values()) > 0 and summary.bank["loads"] == loads
    assert len(summary.workers) == 2 and sum(w["rows"] for w in summary.workers) == 40
    prom = (tmp_path / "out" / "_metrics.prom").read_text()
    assert f"mlora_iterations_total {float(m['iterations'])}" in prom
    assert local_ray.is_initialized()  # a cluster the job did not start is left running


@needs_ray
def test_an_interrupted_ray_job_resumes_to_the_same_output(tmp_path, single_process_output, local_ray):
    out = tmp_path / "out"
    committed = []

    def interrupt(summary, p):  # Ctrl-C as soon as the first shard is committed
        if p.rows_committed:
            committed.append(p.rows_committed)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_job(_opts(out, engine="ray", num_workers=2, schedule_window=8), progress=interrupt)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert 0 < manifest["rows_committed"] < 40 and not (out / "_SUCCESS").exists()
    # resumed on one actor: the job's fingerprint does not name the engine or the number of workers
    summary = run_job(_opts(out, engine="ray", num_workers=1, schedule_window=8, resume=True))
    assert summary.resumed_from_row == manifest["rows_committed"]
    assert summary.rows_this_run == 40 - manifest["rows_committed"]
    assert read_output(str(out)).equals(read_output(str(single_process_output)))


@needs_ray
def test_a_ray_job_keeps_integer_ids(tmp_path, local_ray):
    """int32 ids over two files: the Ray job's output equals one process's, ids in their type."""
    import pyarrow.parquet as pq

    demo = pq.read_table(os.path.join(DEMO, "prompts.parquet")).slice(0, 12)
    demo = demo.set_column(0, "id", pa.array(range(500, 512), pa.int32()))
    os.makedirs(tmp_path / "in")
    pq.write_table(demo.slice(0, 5), tmp_path / "in" / "a.parquet")
    pq.write_table(demo.slice(5), tmp_path / "in" / "b.parquet")
    kw = dict(input=str(tmp_path / "in"), max_new_tokens=8, commit_interval=0.01)
    run_job(_opts(tmp_path / "one", **kw))
    run_job(_opts(tmp_path / "ray", engine="ray", num_workers=2, schedule_window=4, **kw))
    table = read_output(str(tmp_path / "ray"))
    assert table.schema.field("id").type == pa.int32() and table.column("id").to_pylist() == list(range(500, 512))
    assert table.equals(read_output(str(tmp_path / "one")))


def _actor_followers() -> set[int]:
    """The live processes that a Ray Data actor (``ray::MapWorker...``) started with
    multiprocessing's spawn: the follower ranks of its engine (Linux /proc)."""
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                procs[int(pid)] = (state, int(ppid), f.read())
        except OSError:  # ended meanwhile
            continue
    return {pid for pid, (state, ppid, cmd) in procs.items()
            if state != "Z" and b"spawn_main" in cmd and procs.get(ppid, ("", 0, b""))[2].startswith(b"ray::MapWorker")}


@needs_ray
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the actor's follower ranks through /proc (Linux)")
def test_a_ray_actor_of_two_ranks_gives_the_expected_rows(tmp_path, local_ray):
    """--engine ray --tensor-parallel-size 2: one actor on the CPU, rank 0 of two gloo ranks, runs
    one demo row per adapter and one base row to exactly expected.json's completions; its follower
    rank runs while the job does and has exited once the job is done."""
    import pyarrow.parquet as pq

    with open(os.path.join(DEMO, "expected.json")) as f:
        expected = json.load(f)
    rows = pq.read_table(os.path.join(DEMO, "prompts.parquet")).take([0, 6, 12, 18, 24])
    pq.write_table(rows, tmp_path / "in.parquet")
    seen, done = set(), threading.Event()

    def watch():
        while not done.is_set():
            seen.update(_actor_followers())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        summary = run_job(_opts(tmp_path / "out", input=str(tmp_path / "in.parquet"), engine="ray",
                                tensor_parallel_size=2))
    finally:
        done.set()
        watcher.join()
    assert summary.device == "ray: cpu x1 (2 ranks each)" and summary.rows == 5
    # rank 0 reports the group's engine figures as one engine
    m = json.loads((tmp_path / "out" / "_metrics.json").read_text())["metrics"]
    assert [w["rows"] for w in summary.workers] == [5] and m["iterations"] == summary.engine["iterations"] > 0
    assert m["decode_tokens"] > 0 and sum(m["adapter_loads"].values()) >= 4  # one row per adapter, and a base row
    out = read_output(str(tmp_path / "out")).to_pylist()
    got = {r["id"]: r["completion"] for r in out}
    want = {}
    for i, name in enumerate(rows.column("id").to_pylist()):
        adapter, k = name.rsplit("-", 1)
        want[name] = expected["outputs"][adapter][int(k)]
    assert got == want
    assert len(seen) == 1, seen  # one follower rank
    deadline = time.monotonic() + 30
    while _actor_followers() & seen and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _actor_followers() & seen


def test_engine_ray_without_ray_exits_1_with_the_install_hint(tmp_path, run_cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    monkeypatch.setitem(sys.modules, "ray.data", None)
    monkeypatch.delitem(sys.modules, "mlora.batch.scaleout.ray", raising=False)  # imported again by the runner
    code, _, err = run_cli("batch-run", os.path.join(DEMO, "prompts.parquet"), tmp_path / "out", "--base", BASE,
                           "--adapters", ADAPTERS, "--engine", "ray", "--quiet")
    err = " ".join(err.split())  # the console wraps long lines
    assert code == 1 and "Error: E_RAY_MISSING:" in err and "pip install 'mlora[ray]'" in err, err
    assert not (tmp_path / "out").exists()


@needs_ray
def test_predictor_called_directly_gives_the_demo_answers():
    """MloraPredictor is a plain class: Ray constructs it once per actor and calls it per batch."""
    from mlora.batch.scaleout.ray import MloraPredictor, pin_adapters

    with open(os.path.join(DEMO, "expected.json")) as f:
        expected = json.load(f)
    pinned = pin_adapters(BASE, ADAPTERS, ids=["upper", "reverse"])
    p = MloraPredictor(BASE, pinned=pinned, device="cpu", max_new_tokens=expected["max_new_tokens"])
    prompts = [expected["format"].format(prompt=q) for q in expected["prompts"][:2]]
    table = pa.table({"id": [1, 2, 3, 4], "prompt": prompts * 2, "adapter": ["upper", "upper", "reverse", None],
                      "note": ["a", "b", "c", "d"]})
    out = p(table)
    # the batch's other columns, id, mlora's output columns: nothing else (engine_report is off)
    assert out.column_names == ["prompt", "note", "id", *[f.name for f in RESULT_FIELDS]]
    rows = out.to_pylist()
    assert out.schema.field("id").type == pa.int64()  # the batch's id type, for joins on id
    assert [r["id"] for r in rows] == [1, 2, 3, 4] and [r["note"] for r in rows] == ["a", "b", "c", "d"]
    assert [r["completion"] for r in rows] == [*expected["outputs"]["upper"][:2], expected["outputs"]["reverse"][0],
                                               expected["outputs"]["__base__"][1]]
    assert rows[0]["adapter_sha256"] == pinned["upper"].semantic_sha256 and rows[3]["adapter_sha256"] is None
    # a dict batch, an adapter that was not pinned (an error row), keep_columns
    p2 = MloraPredictor(BASE, pinned=pinned, device="cpu", max_new_tokens=4, keep_columns=[])
    out = p2({"id": ["x"], "prompt": [prompts[0]], "adapter": ["spell"]}).to_pylist()
    assert list(out[0])[0] == "id" and out[0]["error_code"] == "E_ADAPTER_UNKNOWN"
    with pytest.raises(TypeError):
        MloraPredictor(BASE, pinned=pinned, max_new_token=4)  # a misspelt option is refused


@needs_ray
def test_a_predictor_with_engine_report_carries_its_cumulative_figures_on_each_batch_last_row():
    """engine_report=True: one more column, null but on each batch's last row, which holds the
    actor's engine figures since it started; the latest one merges as a worker's report."""
    from mlora.batch.engine.engine import stored_adapter_bytes
    from mlora.batch.scaleout.engines import LatestReports, merge_reports
    from mlora.batch.scaleout.ray import ENGINE_REPORT, MloraPredictor, pin_adapters

    pinned = pin_adapters(BASE, ADAPTERS, ids=["upper"])
    p = MloraPredictor(BASE, pinned=pinned, device="cpu", max_new_tokens=4, engine_report=True)
    batch = {"id": [1, 2, 3], "prompt": ["<|bos|>abc="] * 3, "adapter": ["upper", None, "upper"]}
    first, second = p(batch), p(batch)
    assert first.column_names == ["prompt", "id", *[f.name for f in RESULT_FIELDS], ENGINE_REPORT]
    texts = [t.column(ENGINE_REPORT).to_pylist() for t in (first, second)]
    assert texts[0][:2] == texts[1][:2] == [None, None] and texts[0][2] and texts[1][2]
    latest = LatestReports()
    latest.add(texts[1][2])
    latest.add(texts[0][2])  # an older report of the same actor, seen later: ignored
    [report] = latest.reports()
    assert report.rows == 6 and report.adapters_used == ["upper"]
    job = JobMetrics()
    engine, _ = merge_reports(job, pinned, [report])
    m = job.snapshot()
    assert m["iterations"] == engine["iterations"] > 0 and engine["generated_tokens"] == report.generated_tokens
    assert m["unique_adapter_bytes"] == stored_adapter_bytes(pinned["upper"]) and sum(m["adapter_loads"].values())


@needs_ray
def test_a_predictor_of_two_ranks_gives_the_demo_answers_and_close_stops_its_follower():
    """MloraPredictor(tensor_parallel_size=2) outside Ray: rank 0 here, its follower a process it
    started; close() ends the follower."""
    import multiprocessing

    from mlora.batch.scaleout.ray import MloraPredictor, pin_adapters

    with open(os.path.join(DEMO, "expected.json")) as f:
        expected = json.load(f)
    p = MloraPredictor(BASE, pinned=pin_adapters(BASE, ADAPTERS, ids=["spell"]), device="cpu", dtype="float32",
                       max_new_tokens=expected["max_new_tokens"], tensor_parallel_size=2)
    try:
        assert [c.name for c in multiprocessing.active_children() if c.name.startswith("mlora-tp")] == \
            ["mlora-tp-rank-1"]
        prompts = [expected["format"].format(prompt=q) for q in expected["prompts"][:2]]
        out = p({"id": [1, 2], "prompt": prompts, "adapter": ["spell", None]}).to_pylist()
        assert [r["completion"] for r in out] == [expected["outputs"]["spell"][0], expected["outputs"]["__base__"][1]]
    finally:
        p.close()
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("mlora-tp")]


@needs_ray
def test_predictor_takes_and_returns_pandas():
    import pandas as pd

    from mlora.batch.scaleout.ray import MloraPredictor

    p = MloraPredictor(BASE, ADAPTERS, adapter_ids=["upper"], device="cpu", max_new_tokens=6)
    out = p(pd.DataFrame({"id": ["a"], "prompt": ["<|bos|>abc="], "adapter": ["upper"]}))
    assert isinstance(out, pd.DataFrame) and out["completion"].tolist() == ["ABC"]


@needs_ray
def test_failures_inside_ray_keep_their_codes():
    from mlora.batch.job.input import JobInputError
    from mlora.batch.scaleout.ray import _ray_failure

    class Wrapped(Exception):  # how Ray wraps a task's exception (RayTaskError.cause)
        def __init__(self, cause):
            super().__init__("task failed")
            self.cause = cause

    e = _ray_failure(Wrapped(Wrapped(JobInputError("E_INPUT_CHANGED", "x changed"))))
    assert (e.code, e.exit_code) == ("E_INPUT_CHANGED", 1)
    e = _ray_failure(Wrapped(RuntimeError("CUDA out of memory")))
    assert (e.code, e.exit_code) == ("E_RAY_FAILED", 3) and "--resume" in str(e) and "out of memory" in str(e)
    assert isinstance(e, JobError)
