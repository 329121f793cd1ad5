"""`mlora batch-run` before its first row and around it: option ranges, an OUTPUT that
cannot be written, resume messages, jobs without an adapter source, the served-adapter
counts of the summary and the start-up phases. A four-row job on the demo workspace."""

import json
import math
import os
import stat
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DEMO

from mlora.batch import runner
from mlora.batch.config import JobConfig
from mlora.batch.errors import JobError
from mlora.batch.job.metrics import JobMetrics
from mlora.batch.job.output import JobOutput, JobOutputError
from mlora.batch.job.prepare import JobSummary, finish_job
from mlora.batch.runner import run_job
from mlora.cli.batch_run import _print_summary

BASE, ADAPTERS = os.path.join(DEMO, "base"), os.path.join(DEMO, "adapters")
ROW_ADAPTERS = [None, "upper", "rot13", "nope"]


@pytest.fixture(scope="module")
def tiny_input(tmp_path_factory):
    path = tmp_path_factory.mktemp("in") / "in.parquet"
    pq.write_table(pa.table({"id": ["b", "u", "r", "n"], "prompt": ["<|bos|>hello world="] * 4,
                             "adapter": pa.array(ROW_ADAPTERS, pa.string())}), path)
    return str(path)


def _opts(inp, out, **kw) -> JobConfig:
    base = dict(input=inp, output=str(out), base=BASE, adapters_dir=ADAPTERS, max_new_tokens=3, device="cpu",
                dtype="float32")
    base.update(kw)
    return JobConfig(**base)


def _cli_args(inp, out):
    return ["batch-run", inp, out, "--base", BASE, "--adapters", ADAPTERS, "--max-new-tokens", "3",
            "--device", "cpu", "--dtype", "float32", "--quiet"]


@pytest.fixture(scope="module")
def served_job(tiny_input, tmp_path_factory):
    """The tiny job with the demo adapters, every callback recorded in order."""
    out = tmp_path_factory.mktemp("served") / "out"
    events = []
    summary = run_job(_opts(tiny_input, out),
                      progress=lambda s, p: events.append(("progress", p.rows_total, p.rows_done)),
                      note=lambda text: events.append(("note", text)),
                      phase=lambda text, total, done: events.append(("phase", text, total, done)))
    return summary, events, out


# -- option ranges (JobConfig.validate: the CLI and the Python API alike) ---------------------------

OUT_OF_RANGE = [
    ("max_num_seqs", 0), ("max_num_seqs", 2.5), ("max_batch_tokens", 0), ("max_gpu_adapters", 0),
    ("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5), ("gpu_memory_utilization", math.nan),
    ("kv_cache_gb", -1.0), ("kv_cache_gb", 0.0), ("kv_cache_gb", math.inf), ("host_cache_gb", -0.5),
    ("block_size", 0), ("schedule_window", 0), ("prefetch_adapters", -1), ("prefetch_gpu_adapters", -1),
    ("image_build_processes", -1), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.01), ("top_k", -1),
    ("shard_rows", 0), ("workers", 0),
]


@pytest.mark.parametrize("field, value", OUT_OF_RANGE)
def test_a_value_outside_its_range_is_a_usage_error(field, value):
    with pytest.raises(JobError) as info:
        JobConfig(input="", output="", base="", **{field: value}).validate()
    assert (info.value.code, info.value.exit_code) == ("E_OPTION_RANGE", 2)
    option = field.replace("_", "-")
    assert option in info.value.message or field in info.value.message


@pytest.mark.parametrize("field, value", [
    ("host_cache_gb", 0.0), ("prefetch_adapters", 0), ("prefetch_gpu_adapters", 0), ("gpu_memory_utilization", 1.0),
    ("top_p", 1.0), ("temperature", 0), ("top_k", 0), ("kv_cache_gb", 0.25), ("max_gpu_adapters", None),
])
def test_the_edges_of_each_range_are_accepted(field, value):
    JobConfig(input="", output="", base="", **{field: value}).validate()


@pytest.mark.parametrize("option, value", [("--kv-cache-gb", "-1"), ("--max-num-seqs", "0"),
                                           ("--gpu-memory-utilization", "0"), ("--schedule-window", "0"),
                                           ("--host-cache-gb", "-1"), ("--top-p", "0")])
def test_the_cli_refuses_an_out_of_range_option_before_any_work(run_cli, tiny_input, tmp_path, option, value):
    code, _, err = run_cli(*_cli_args(tiny_input, tmp_path / "out"), option, value)
    assert code == 2 and "E_OPTION_RANGE" in err and option in err, err
    assert not (tmp_path / "out").exists()


def test_prefix_cache_and_alora_options_reach_the_job_config(run_cli, tiny_input, tmp_path, monkeypatch):
    """--prefix-cache/--no-prefix-cache and --alora-without-invocation become the JobConfig
    fields the engine reads (defaults: on, error)."""
    seen = []
    monkeypatch.setattr(runner, "run_job", lambda opts, **kw: seen.append(opts) or JobSummary())
    for extra in ((), ("--no-prefix-cache", "--alora-without-invocation", "base"), ("--prefix-cache",)):
        code, _, err = run_cli(*_cli_args(tiny_input, tmp_path / "out"), *extra)
        assert code == 0, err
    assert [(o.prefix_cache, o.alora_without_invocation) for o in seen] == [(True, "error"), (False, "base"),
                                                                            (True, "error")]


def test_an_unknown_alora_without_invocation_value_is_a_usage_error(run_cli, tiny_input, tmp_path):
    code, _, err = run_cli(*_cli_args(tiny_input, tmp_path / "out"), "--alora-without-invocation", "skip")
    assert code == 2 and "E_OPTION_RANGE" in err and "--alora-without-invocation" in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(JobError) as info:  # the Python API alike
        run_job(_opts(tiny_input, tmp_path / "out", alora_without_invocation="skip"))
    assert (info.value.code, info.value.exit_code) == ("E_OPTION_RANGE", 2)


def test_host_cache_zero_means_no_host_cache(tiny_input, tmp_path, monkeypatch):
    """--host-cache-gb 0 gives the residency bank a host cache of 0 bytes (not the unbounded
    default), and the job still serves every adapter."""
    from mlora.batch.job import session

    seen = []

    class Recording(session.ResidencyBank):
        def __init__(self, *args, **kw):
            seen.append(kw["host_cache_bytes"])
            super().__init__(*args, **kw)

    monkeypatch.setattr(session, "ResidencyBank", Recording)
    summary = run_job(_opts(tiny_input, tmp_path / "out", host_cache_gb=0))
    assert seen == [0]
    assert summary.errors_by_code == {"E_ADAPTER_UNKNOWN": 1}


# -- OUTPUT that cannot be written ---------------------------------------------------------------------

def test_an_unwritable_output_is_refused_before_hashing(run_cli, tiny_input, tmp_path, monkeypatch):
    """Exit 1 with E_OUTPUT_NOT_WRITABLE (not a runtime failure that advises --resume), fresh
    and with --resume, before the base is hashed."""
    from mlora.batch.job import prepare

    locked = tmp_path / "locked"
    (locked / "out").mkdir(parents=True)
    (locked / "out" / "_manifest.json").write_text("{}")
    os.chmod(locked / "out", 0o555)
    os.chmod(locked, 0o555)
    if os.access(locked, os.W_OK):  # root: mode bits bind nobody, so os.access answers from them here
        real = os.access

        def by_mode(path, mode, *a, **kw):
            if str(path).startswith(str(locked)) and mode & os.W_OK:
                return bool(os.stat(path).st_mode & stat.S_IWUSR)
            return real(path, mode, *a, **kw)

        monkeypatch.setattr(os, "access", by_mode)
    hashed = []
    monkeypatch.setattr(prepare, "base_identity", lambda *a, **kw: hashed.append(a))
    try:
        for out, extra in ((locked / "new", ()), (locked / "out", ("--resume",))):
            code, _, err = run_cli(*_cli_args(tiny_input, out), *extra)
            assert code == 1 and "E_OUTPUT_NOT_WRITABLE" in err, err
            assert "--resume" not in err and str(locked) in err
    finally:
        os.chmod(locked, 0o755)
        os.chmod(locked / "out", 0o755)
    assert hashed == []


def test_an_output_below_a_file_is_not_writable(run_cli, tiny_input, tmp_path):
    """The OS's own refusal while creating OUTPUT (here: a path through a regular file) is
    E_OUTPUT_NOT_WRITABLE too, with the OS's reason."""
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(*_cli_args(tiny_input, tmp_path / "file" / "out"))
    assert code == 1 and "E_OUTPUT_NOT_WRITABLE" in err and "Not a directory" in err, err


# -- resume ----------------------------------------------------------------------------------------------

def test_resume_mismatch_names_each_differing_field_with_both_values_whole(tmp_path):
    path = "data/" + "very-long-directory-name/" * 6 + "prompts.parquet"
    old = {"kind": "mlora-batch-run", "input": [{"path": path, "size": 123456, "mtime_ns": 1796409586867607090}],
           "sampling": {"temperature": "0.0", "stop": ["\n\n"]}}
    new = json.loads(json.dumps(old))
    new["input"][0]["mtime_ns"] = 1796409600000000001
    new["sampling"]["stop"] = ["\n\n", "###"]
    new["sampling"]["seed"] = 7
    JobOutput.open(str(tmp_path / "out"), old, resume=False).close()
    with pytest.raises(JobOutputError) as info:
        JobOutput.open(str(tmp_path / "out"), new, resume=True)
    msg = info.value.message
    assert info.value.code == "E_RESUME_MISMATCH"
    assert "input[0].mtime_ns: 1796409586867607090 (stored) vs 1796409600000000001 (now)" in msg
    assert 'sampling.stop: ["\\n\\n"] (stored) vs ["\\n\\n", "###"] (now)' in msg
    assert "sampling.seed: absent (stored) vs 7 (now)" in msg
    assert "input[0].path" not in msg and "..." not in msg  # only what differs, nothing cut


def test_resuming_a_finished_job_says_it_is_complete(run_cli, served_job, tiny_input):
    _, _, out = served_job
    code, stdout, err = run_cli(*_cli_args(tiny_input, out), "--resume")
    assert code == 0, err
    assert "already complete" in stdout and "nothing to do" in stdout
    code, stdout, err = run_cli(*_cli_args(tiny_input, out), "--resume", "--json")
    assert code == 0 and json.loads(stdout)["already_complete"] is True


def test_resume_keeps_to_the_alora_policy_but_not_to_the_prefix_cache(run_cli, served_job, tiny_input, tmp_path):
    """The prefix cache does not change a row's tokens: a job resumes with it off. Running aLoRA
    rows without their invocation on the base does: resuming with the other policy is refused,
    naming the field (absent from the fingerprint of an "error" job, so earlier outputs resume)."""
    _, _, out = served_job
    code, stdout, err = run_cli(*_cli_args(tiny_input, out), "--resume", "--no-prefix-cache")
    assert code == 0 and "already complete" in stdout, err
    code, _, err = run_cli(*_cli_args(tiny_input, out), "--resume", "--alora-without-invocation", "base")
    assert code == 1 and "E_RESUME_MISMATCH" in err, err
    assert 'alora_without_invocation: absent (stored) vs "base" (now)' in " ".join(err.split())
    manifest = json.loads((out / "_manifest.json").read_text())
    assert "alora_without_invocation" not in manifest["fingerprint"]["parts"]
    on_base = tmp_path / "on-base"
    code, _, err = run_cli(*_cli_args(tiny_input, on_base), "--alora-without-invocation", "base")
    assert code == 0, err
    code, _, err = run_cli(*_cli_args(tiny_input, on_base), "--resume")
    assert code == 1 and "E_RESUME_MISMATCH" in err and "alora_without_invocation" in err, err
    code, stdout, err = run_cli(*_cli_args(tiny_input, on_base), "--resume", "--alora-without-invocation", "base",
                                "--no-prefix-cache")
    assert code == 0 and "already complete" in stdout, err


# -- the prefix cache in the summary --------------------------------------------------------------------

class _Sink:
    def finish(self, data):
        self.data = data


def test_the_summary_and_metrics_file_carry_the_prefix_cache_figures(tmp_path):
    """finish_job copies the prompt tokens computed / reused and the block hit rate of the job's
    metrics into the summary (top level of _metrics.json and --json) beside the full metrics."""
    metrics = JobMetrics()
    metrics.prefix_admission(reused=0, computed=40)
    metrics.prefix_admission(reused=32, computed=8)
    metrics.prefix_cache(looked_up=4, hit=2, evicted=1, published=3, shared=2)
    prep = SimpleNamespace(summary=JobSummary(), t0=0.0, opts=SimpleNamespace(output=str(tmp_path)), sink=_Sink())
    summary = finish_job(prep, metrics)
    assert (summary.prefill_tokens_computed, summary.prefill_tokens_reused, summary.prefix_cache_hit_rate) == (48, 32, 0.5)
    written = prep.sink.data
    assert (written["prefill_tokens_computed"], written["prefill_tokens_reused"]) == (48, 32)
    assert written["metrics"]["prefix_cache"] == {"hit_rate": 0.5, "hit_blocks": 2, "looked_up_blocks": 4,
                                                  "evictions": 1, "published_blocks": 3, "shared_blocks_peak": 2}
    assert "mlora_prefill_tokens_reused_total 32.0" in (tmp_path / "_metrics.prom").read_text()


@pytest.mark.parametrize("figures, line", [
    ((48, 32, 0.5), "prompt tokens computed 48, reused 32; prefix cache hit rate 50.0%"),
    ((1200, 0, 0.0), "prompt tokens computed 1,200, reused 0; prefix cache hit rate 0.0%"),  # looked up, none found
    ((1200, 0, None), None),  # nothing looked up: the cache did nothing, no line
])
def test_the_printed_summary_has_a_prefix_line_only_when_the_cache_was_used(capsys, tmp_path, figures, line):
    computed, reused, rate = figures
    _print_summary(JobSummary(rows=3, prefill_tokens_computed=computed, prefill_tokens_reused=reused,
                              prefix_cache_hit_rate=rate), tmp_path)
    text = " ".join(capsys.readouterr().out.split())
    if line is None:
        assert "prompt tokens computed" not in text and "hit rate" not in text, text
    else:
        assert line in text, text


# -- adapters: no source, served and unknown counts ----------------------------------------------------

def test_summary_counts_served_adapters_and_lists_unknown_ones(served_job):
    summary, _, out = served_job
    assert summary.adapters == 2 and summary.unknown_adapters == ["nope"] and summary.unservable_adapters == {}
    stored = json.loads((out / "_metrics.json").read_text())
    assert stored["adapters"] == 2 and stored["unknown_adapters"] == ["nope"]


def test_without_an_adapter_source_rows_say_so(tiny_input, tmp_path):
    from mlora.batch.job.output import read_output

    notes = []
    summary = run_job(_opts(tiny_input, tmp_path / "out", adapters_dir=None), note=notes.append)
    assert summary.adapters == 0 and summary.unknown_adapters == ["nope", "rot13", "upper"]
    rows = {r["id"]: r for r in read_output(str(tmp_path / "out")).to_pylist()}
    assert rows["b"]["error_code"] is None
    for rid in ("u", "r", "n"):
        assert rows[rid]["error_code"] == "E_ADAPTER_UNKNOWN"
        assert "no adapter source was given" in rows[rid]["error_message"]
        assert "catalog:" not in rows[rid]["error_message"]
    assert len(notes) == 1 and "--adapters" in notes[0] and "--catalog" in notes[0]
    with pytest.raises(JobError) as info:
        run_job(_opts(tiny_input, tmp_path / "strict", adapters_dir=None, strict=True))
    assert info.value.code == "E_ADAPTER_UNKNOWN" and "no adapter source was given" in info.value.message


# -- start-up phases -----------------------------------------------------------------------------------

def test_start_up_phases_come_before_the_first_row_with_the_total_once_known(served_job):
    _, events, _ = served_job
    first_progress = next(i for i, e in enumerate(events) if e[0] == "progress")
    phases = [e for e in events[:first_progress] if e[0] == "phase"]
    names = [p[1] for p in phases]
    assert names[0] == "reading the input" and phases[0][2] is None
    for expected in ("hashing the base", "validating 3 adapter(s)", "loading the weights"):
        assert expected in names, names
    assert names[-1].startswith("compiling")
    assert all(p[2] == len(ROW_ADAPTERS) for p in phases[1:])
    assert not any(e[0] == "phase" for e in events[first_progress:])
