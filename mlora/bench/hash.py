"""Benchmark: ``mlora hash`` against coreutils ``sha256sum`` on the same files.

Owns the measurement behind ``mlora bench hash`` (BENCHMARKS.md). Both tools
run as child processes over the same bytes with a warm page cache; each is
timed ``runs`` times and the median wall time is reported with the child's
peak resident memory (``wait4`` rusage). The floor printed beside the figures
is the single-core SHA-256 rate of this machine's hashlib times the cores
used: hashing cannot go faster than that.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time

from mlora.lora_tools.adapter import CONFIG_FILE, PICKLE_FILE, SAFETENSORS_FILE, discover_adapters
from mlora.lora_tools.safetensors_io import default_workers


def adapter_files(paths: list[str]) -> list[str]:
    files = []
    for p in paths:
        for a in discover_adapters(p) or []:
            files += [os.path.join(a, f) for f in (CONFIG_FILE, SAFETENSORS_FILE, PICKLE_FILE) if os.path.isfile(os.path.join(a, f))]
    return files


def base_files(base: str) -> list[str]:
    return sorted(
        os.path.join(base, f) for f in os.listdir(base) if f.endswith(".safetensors") or f in ("config.json", "model.safetensors.index.json")
    )


def _timed(cmd: list[str]) -> tuple[float, int]:
    """Run ``cmd`` with stdout discarded: (wall seconds, peak RSS bytes)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in (0, 1):  # 1: an invalid adapter was reported, still a full pass
        raise RuntimeError(f"{cmd[:3]} exited {proc.returncode}: {proc.stderr.read().decode()[-500:]}")
    return wall, usage.ru_maxrss * 1024


def _measure(cmd: list[str], runs: int) -> dict:
    _timed(cmd)  # warm the page cache and imports
    walls, peaks = [], []
    for _ in range(runs):
        w, p = _timed(cmd)
        walls.append(w)
        peaks.append(p)
    return {"median_s": statistics.median(walls), "runs_s": walls, "peak_rss_bytes": max(peaks)}


def single_core_sha256_rate(nbytes: int = 256 * 1024 * 1024) -> float:
    """Bytes/s of one hashlib SHA-256 stream over in-memory data."""
    buf = os.urandom(16 * 1024 * 1024)
    h = hashlib.sha256()
    t0 = time.perf_counter()
    for _ in range(nbytes // len(buf)):
        h.update(buf)
    return nbytes / (time.perf_counter() - t0)


def run_hash_bench(adapters: list[str], base: str | None, runs: int = 5, workers: int | None = None) -> list[dict]:
    """One result per workload (``adapters`` and/or ``base``)."""
    sha256sum = shutil.which("sha256sum")
    if sha256sum is None:
        raise RuntimeError("coreutils sha256sum is not on PATH")
    mlora = [sys.executable, "-m", "mlora", "hash", "--quiet"] + (["--workers", str(workers)] if workers else [])
    cores = workers or default_workers()
    rate = single_core_sha256_rate()
    workloads = []
    if adapters:
        workloads.append(("adapters", adapter_files(adapters), mlora + list(adapters)))
    if base:
        workloads.append(("base", base_files(base), mlora + ["--base", base]))
    results = []
    for name, files, cmd in workloads:
        nbytes = sum(os.path.getsize(f) for f in files)
        ref = _measure([sha256sum, *files], runs)
        ours = _measure(cmd, runs)
        results.append(
            {
                "workload": name,
                "files": len(files),
                "bytes": nbytes,
                "runs": runs,
                "cores": cores,
                "sha256sum": ref,
                "mlora": ours,
                "speedup": ref["median_s"] / ours["median_s"],
                "mlora_bytes_per_s": nbytes / ours["median_s"],
                "sha256sum_bytes_per_s": nbytes / ref["median_s"],
                "floor_s": nbytes / (rate * cores),
                "single_core_sha256_bytes_per_s": rate,
            }
        )
    return results
