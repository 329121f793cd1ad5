"""The scale-out benchmark behind ``mlora bench gpus`` (target: >= 1.8x on 2 GPUs).

Owns a synthetic on-disk workspace of ``mlora bench batch``'s job and the
one-GPU against several-GPU comparison; the figures go into BENCHMARKS.md.

* Workspace (``write_gpus_workspace``): the job of ``mlora bench batch`` as files,
  so the real ``mlora batch-run`` runs it: a base checkpoint of the shape preset
  with random weights and no EOS id (every row generates ``max_new_tokens``),
  ``adapters`` PEFT adapters of rank ``rank`` on every linear projection, and an
  input Parquet whose rows are :mod:`mlora.bench.batch`'s synthetic requests (the same
  prompts and the same uniform adapter picks as ``mlora bench batch``).
  Reused when already complete.
* Runs (``RUNS``, ``run_args``): the real ``mlora batch-run`` command, each run a
  fresh process: ``one``, a plain one-GPU job on the first listed GPU;
  ``replicas``, ``--gpus`` over every listed GPU (one engine per GPU); ``tp``,
  ``--gpus`` with ``--tensor-parallel-size N`` (one engine per N GPUs, its model
  sharded over them; N divides the GPU count). ``--device cpu`` is the smoke
  form: one process, ``--num-workers W`` CPU workers, and ``W / N`` workers of
  N gloo ranks each (the same process count as the replicas).
* Reported per run: generated tokens/s over the generation phase (the job's
  metrics clock: it starts once the first engine is built), the job's wall
  time (model loading included), load amplification, and how many output rows
  differ from the first run's (tokens, finish reason, error code), so a float32
  job shows whether the runs agree token for token (``outputs_equal``). In
  bfloat16 runs that batch rows differently may differ in a few rows; the count
  is reported, not judged. Speed-ups: every later run against ``one``, and
  ``tp`` against ``replicas``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from mlora.bench.batch import BatchBenchOptions, _requests, preset_config
from mlora.bench.residency import write_adapter, write_base

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RUNS = ("one", "replicas", "tp")
RESULT_COLUMNS = ("completion_token_ids", "finish_reason", "error_code")  # what two runs' rows must agree on


@dataclass
class GpusBenchOptions:
    preset: str = "llama-3-8b"
    gpus: str = "0,1"
    num_workers: int = 2  # --device cpu only
    tensor_parallel_size: int = 1  # the tp run's ranks per engine
    runs: tuple[str, ...] = ()  # () means one, replicas, and tp when tensor_parallel_size > 1
    adapters: int = 64
    rows: int = 2048
    rank: int = 16
    prompt_min: int = 128
    prompt_max: int = 1024
    max_new_tokens: int = 128
    max_num_seqs: int = 256
    max_batch_tokens: int = 8192
    device: str = "cuda"
    dtype: str = "bfloat16"
    seed: int = 0


def selected_runs(o: GpusBenchOptions) -> tuple[str, ...]:
    """The runs to make, in ``RUNS`` order."""
    wanted = o.runs or (RUNS if o.tensor_parallel_size > 1 else ("one", "replicas"))
    return tuple(r for r in RUNS if r in wanted)


def check_options(o: GpusBenchOptions) -> None:
    """Raise ValueError (a usage error) for runs the options cannot make, before anything is written."""
    unknown = [r for r in o.runs if r not in RUNS]
    if unknown:
        raise ValueError(f"--runs takes a comma-separated subset of {','.join(RUNS)}, not {','.join(o.runs)!r}")
    runs = selected_runs(o)
    n = o.tensor_parallel_size
    if "tp" in runs and n < 2:
        raise ValueError("--runs tp needs --tensor-parallel-size N (2 or more): the ranks of each tp engine")
    if n > 1 and "tp" not in runs:
        raise ValueError(f"--tensor-parallel-size {n} sizes the tp run, which --runs {','.join(runs)} leaves out: "
                         "add tp to --runs, or drop --tensor-parallel-size")
    if "tp" in runs:
        count = _unit_count(o)
        what = f"--num-workers {count}" if o.device == "cpu" else f"the {count} GPU(s) of --gpus {o.gpus}"
        if count % n:
            raise ValueError(f"--tensor-parallel-size {n} does not divide {what}: the tp run needs whole engines "
                             f"of {n} ranks; give a count that is a multiple of {n}")


def run_args(o: GpusBenchOptions, name: str) -> tuple[list[str], dict | None]:
    """The ``batch-run`` options of run ``name`` and its environment (None: this process's)."""
    n = o.tensor_parallel_size
    if o.device == "cpu":
        return {"one": ["--device", "cpu"],
                "replicas": ["--device", "cpu", "--num-workers", str(o.num_workers)],
                "tp": ["--device", "cpu", "--num-workers", str(o.num_workers // n), "--tensor-parallel-size", str(n)],
                }[name], None
    if name == "one":
        first = o.gpus.split(",")[0].strip()
        return ["--device", "cuda"], dict(os.environ, CUDA_VISIBLE_DEVICES=_visible("0" if first == "all" else first))
    if name == "replicas":
        return ["--gpus", o.gpus], None
    return ["--gpus", o.gpus, "--tensor-parallel-size", str(n)], None


def write_gpus_workspace(root: str, o: GpusBenchOptions, progress=None) -> dict:
    """Base, adapters and input under ``root`` (module docstring)."""
    dtype = getattr(torch, o.dtype)
    dev = "cuda" if o.device == "cuda" and torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    key = {k: v for k, v in asdict(o).items() if k not in ("gpus", "num_workers", "tensor_parallel_size", "runs",
                                                            "max_num_seqs", "max_batch_tokens", "device")}
    done = os.path.join(root, ".complete")
    if not (os.path.exists(done) and json.load(open(done)) == key):
        shutil.rmtree(root, ignore_errors=True)
        write_base(os.path.join(root, "base"), o.preset, dtype, o.seed, dev)
        write_gpus_adapters(os.path.join(root, "adapters"), o.preset, o.adapters, o.rank, o.seed, dtype, dev, progress)
        bo = BatchBenchOptions(preset=o.preset, prompt_min=o.prompt_min, prompt_max=o.prompt_max)
        reqs = _requests(bo, preset_config(o.preset, o.dtype), o.adapters, o.rows, o.max_new_tokens, o.seed)
        pq.write_table(pa.table({
            "id": [r.id for r in reqs],
            "prompt_ids": pa.array([r.prompt_ids for r in reqs], pa.list_(pa.int64())),
            "adapter": pa.array([r.adapter for r in reqs], pa.string()),
        }), os.path.join(root, "input.parquet"))
        with open(done, "w") as f:
            json.dump(key, f)
    return dict(seconds=time.perf_counter() - t0)


def write_gpus_adapters(root: str, preset: str, n: int, rank: int, seed: int, dtype: torch.dtype, device: str,
                        progress=None) -> None:
    """The workspace's adapters: ``bench-0`` .. ``bench-{n-1}`` under ``root``, PEFT LoRA of rank
    ``rank`` on every linear projection of ``preset`` (generated on ``device``)."""
    for k in range(n):
        write_adapter(os.path.join(root, f"bench-{k}"), preset, rank, ALL_PROJECTIONS, seed + 1000 + k, dtype, device)
        if progress and (k + 1) % 16 == 0:
            progress(f"{k + 1} adapters written")


def run_gpus_bench(root: str, o: GpusBenchOptions, progress=None) -> dict:
    """Write the workspace, then make each selected run, each a fresh ``mlora batch-run``
    process (no CUDA context or cached memory carried from one run to the next)."""
    check_options(o)
    ws = write_gpus_workspace(root, o, progress)
    common = ["--base", os.path.join(root, "base"), "--adapters", os.path.join(root, "adapters"),
              "--prompt-ids-column", "prompt_ids", "--max-new-tokens", str(o.max_new_tokens), "--dtype", o.dtype,
              "--max-num-seqs", str(o.max_num_seqs), "--max-batch-tokens", str(o.max_batch_tokens), "--json", "--quiet"]
    runs, first_rows = [], None
    for name in selected_runs(o):
        extra, env = run_args(o, name)
        out = os.path.join(root, f"out-{name}")
        shutil.rmtree(out, ignore_errors=True)
        if progress:
            progress(f"running {name}: batch-run {' '.join(extra)}")
        args = [sys.executable, "-m", "mlora", "batch-run", os.path.join(root, "input.parquet"), out, *common, *extra]
        proc = subprocess.run(args, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"batch-run {' '.join(extra)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        with open(os.path.join(out, "_metrics.json")) as f:
            m = json.load(f)["metrics"]
        rows = output_rows(out)
        first_rows = rows if first_rows is None else first_rows
        first = runs[0]["name"] if runs else name
        runs.append(dict(name=name, args=extra, device=summary["device"], wall_s=summary["wall_s"],
                         tokens_per_s=m["tokens_per_s"], generated_tokens=m["completion_tokens"],
                         error_rows=summary["error_rows"], load_amplification=m["load_amplification"],
                         workers=summary["workers"], compared_with=first,
                         rows_differing=rows_differing(first_rows, rows)))
        if progress:
            r = runs[-1]
            progress(f"{name}: {r['tokens_per_s']:.0f} tok/s (generation), wall {r['wall_s']:.1f} s"
                     + (f", {r['rows_differing']} row(s) differ from {first}" if runs[1:] else ""))
    by = {r["name"]: r for r in runs}
    later = runs[1:]
    return dict(options=asdict(o) | {"runs": [r["name"] for r in runs]}, workspace=ws, runs=runs,
                speedups=[_speedup(by[a], by[b]) for a, b in (("replicas", "one"), ("tp", "one"), ("tp", "replicas"))
                          if a in by and b in by],
                outputs_equal=all(r["rows_differing"] == 0 for r in later) if later else None,
                device=torch.cuda.get_device_name() if o.device == "cuda" and torch.cuda.is_available() else "cpu",
                torch=torch.__version__)


def output_rows(out: str) -> dict:
    """A batch-run OUTPUT's result columns by row id."""
    table = pq.read_table(out, columns=["id", *RESULT_COLUMNS])
    cols = [table.column(c).to_pylist() for c in RESULT_COLUMNS]
    return {i: tuple(c[k] for c in cols) for k, i in enumerate(table.column("id").to_pylist())}


def rows_differing(a: dict, b: dict) -> int:
    """Rows of either output whose results differ or that the other lacks."""
    return sum(a.get(i) != b.get(i) for i in a.keys() | b.keys())


def _speedup(run: dict, base: dict) -> dict:
    tps = run["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
    wall = base["wall_s"] / run["wall_s"] if run["wall_s"] else None
    return dict(run=run["name"], against=base["name"], tokens_per_s=tps, wall=wall)


def _unit_count(o: GpusBenchOptions) -> int:
    """What the replicas run spreads over: CPU workers, or the GPUs of ``--gpus``."""
    if o.device == "cpu":
        return o.num_workers
    text = o.gpus.strip()
    return torch.cuda.device_count() if text == "all" else len(text.split(","))


def _visible(first: str) -> str:
    """CUDA_VISIBLE_DEVICES naming only GPU ``first`` (an index as this process sees the devices)."""
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    return current.split(",")[int(first)].strip() if current else first
