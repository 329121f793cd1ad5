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
* Runs: the real ``mlora batch-run`` command, each run a fresh process: once
  as a plain one-GPU job on the first listed GPU, then with ``--gpus`` over
  every listed GPU (``--device cpu``: one process, then ``--num-workers``
  CPU worker processes, a smoke run).
* Reported per run: generated tokens/s over the generation phase (the job's
  metrics clock: it starts once the first engine is built), the job's wall
  time (model loading included), load amplification; and the speed-up of the
  scaled run over the one-GPU run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

from mlora.bench.batch import BatchBenchOptions, _requests, preset_config
from mlora.bench.residency import write_adapter, write_base

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class GpusBenchOptions:
    preset: str = "llama-3-8b"
    gpus: str = "0,1"
    num_workers: int = 2  # --device cpu only
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


def write_gpus_workspace(root: str, o: GpusBenchOptions, progress=None) -> dict:
    """Base, adapters and input under ``root`` (module docstring)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    dtype = getattr(torch, o.dtype)
    dev = "cuda" if o.device == "cuda" and torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    key = {k: v for k, v in asdict(o).items() if k not in ("gpus", "num_workers", "max_num_seqs", "max_batch_tokens",
                                                            "device")}
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
    """Write the workspace, then run the job twice, each run a fresh ``mlora batch-run``
    process (no CUDA context or cached memory carried from one run to the next)."""
    ws = write_gpus_workspace(root, o, progress)
    common = [os.path.join(root, "input.parquet"), None, "--base", os.path.join(root, "base"),
              "--adapters", os.path.join(root, "adapters"), "--prompt-ids-column", "prompt_ids",
              "--max-new-tokens", str(o.max_new_tokens), "--dtype", o.dtype, "--max-num-seqs", str(o.max_num_seqs),
              "--max-batch-tokens", str(o.max_batch_tokens), "--json", "--quiet"]
    env = dict(os.environ)
    if o.device == "cuda":
        first = o.gpus.split(",")[0].strip()
        one_env = dict(env, CUDA_VISIBLE_DEVICES=_visible("0" if first == "all" else first))
        plans = [("one", ["--device", "cuda"], one_env), ("scaled", ["--gpus", o.gpus], env)]
    else:
        plans = [("one", ["--device", "cpu"], env),
                 ("scaled", ["--device", "cpu", "--num-workers", str(o.num_workers)], env)]
    runs = []
    for name, extra, run_env in plans:
        out = os.path.join(root, f"out-{name}")
        shutil.rmtree(out, ignore_errors=True)
        if progress:
            progress(f"running {name}: batch-run {' '.join(extra)}")
        args = [sys.executable, "-m", "mlora", "batch-run", common[0], out, *common[2:], *extra]
        proc = subprocess.run(args, env=run_env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"batch-run {' '.join(extra)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        with open(os.path.join(out, "_metrics.json")) as f:
            m = json.load(f)["metrics"]
        runs.append(dict(name=name, args=extra, device=summary["device"], wall_s=summary["wall_s"],
                         tokens_per_s=m["tokens_per_s"], generated_tokens=m["completion_tokens"],
                         error_rows=summary["error_rows"], load_amplification=m["load_amplification"],
                         workers=summary["workers"]))
    one, scaled = runs
    return dict(options=asdict(o), workspace=ws, runs=runs,
                speedup=scaled["tokens_per_s"] / one["tokens_per_s"] if one["tokens_per_s"] else None,
                wall_speedup=one["wall_s"] / scaled["wall_s"] if scaled["wall_s"] else None,
                device=torch.cuda.get_device_name() if o.device == "cuda" and torch.cuda.is_available() else "cpu",
                torch=torch.__version__)


def _visible(first: str) -> str:
    """CUDA_VISIBLE_DEVICES naming only GPU ``first`` (an index as this process sees the devices)."""
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    return current.split(",")[int(first)].strip() if current else first
