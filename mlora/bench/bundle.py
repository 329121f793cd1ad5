"""The bundle serving benchmark behind ``mlora bench bundle``.

Owns a synthetic workspace and the serving comparison of a bundle: members of
a Compress-then-Serve bundle served with the three-stage operator against the
same adapters served uncompressed from GPU slots under the same GPU memory
budget, and against the base model alone. The figures go into BENCHMARKS.md.

* Workspace (``write_workspace``, reused when complete): a random base
  checkpoint of a shape preset (``mlora.bench.residency.write_base``; default
  Mistral-7B); ``adapters`` PEFT adapters (rank ``rank`` on ``targets``)
  whose updates lie mostly in a per-module subspace of rank ``shared_rank``
  shared by the collection, plus independent noise of relative size
  ``noise`` (``write_collection``: the structure joint compression exploits;
  independent random adapters would fail the error gate, honestly); the
  job's input (``mlora.bench.residency.write_input``: random prompt ids, lengths
  uniform in [prompt_min, prompt_max], adapters drawn with Zipf(``zipf``)
  popularity, 0 = uniform) and the same prompts without adapters.
* Compression: the bundle is fitted once with ``mlora compress``'s library
  path (method, R, clusters, ``compress_device``) and its wall time recorded
  next to it (the compression-speed figure); reused when present.
* Runs (``run_job``, the real ``mlora batch-run``): ``bundle`` (every member
  resident, three-stage operator), ``adapters`` (the uncompressed adapters
  through ``slots`` GPU slots; default: as many slots as fit in the bundle's
  device bytes, ``BundleBank.bytes_needed``, so both hold the same adapter
  memory) and ``base`` (no adapters), each after an untimed warm-up job over
  the input's first ``warmup_rows`` rows (Triton compiles and graph captures
  outside the timing). Reported: generated tokens/s over the
  generation phase, wall time, the two ratios of the target (bundle /
  adapters, bundle / base), and the adapters run's loads and amplification.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from mlora.batch.model.lora import module_name
from mlora.bench.batch import PRESETS
from mlora.bench.residency import (
    fresh_output,
    module_shapes,
    save_adapter,
    warmup_input,
    write_base,
    write_input,
)


@dataclass
class BundleBenchOptions:
    preset: str = "mistral-7b"
    adapters: int = 1024
    rank: int = 16
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    shared_rank: int = 48
    noise: float = 0.05
    method: str = "jd-full"
    bundle_rank: int = 64
    clusters: int = 8
    max_error: float = 0.6
    compress_device: str = "auto"
    rows: int = 2048
    zipf: float = 0.0
    prompt_min: int = 128
    prompt_max: int = 1024
    max_new_tokens: int = 128
    slots: int | None = None  # the adapters run's GPU slots (None: the bundle's device bytes)
    max_num_seqs: int = 256
    max_batch_tokens: int = 8192
    device: str = "cuda"
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    runs: tuple[str, ...] = ("bundle", "adapters", "base")
    warmup_rows: int = 256  # rows of the untimed warm-up job before each run (0: none)
    warmup_new_tokens: int = 16


def write_collection(root: str, preset: str, n: int, rank: int, targets, shared_rank: int, noise: float, seed: int,
                     dtype: torch.dtype, device: str = "cpu", progress=None) -> None:
    """``n`` PEFT adapters ``root/aNNNN`` (alpha = 2 * rank) whose factors at each module are
    B = U0 S_i, A = T_i V0^T for a per-module pair (U0, V0) of rank ``shared_rank`` shared
    by the collection and random per-adapter mixes S_i, T_i, plus independent Gaussian
    noise of relative size ``noise``. Deterministic in ``seed``."""
    p = PRESETS[preset]
    shapes = module_shapes(p)
    gen = torch.Generator(device=device).manual_seed(seed)
    k = shared_rank
    bases = {(layer, m): (torch.randn(shapes[m][0], k, generator=gen, device=device),
                          torch.randn(shapes[m][1], k, generator=gen, device=device))
             for layer in range(p["num_layers"]) for m in targets}
    for i in range(n):
        tensors = {}
        for (layer, m), (U0, V0) in bases.items():
            o, d_in = shapes[m]
            b = U0 @ torch.randn(k, rank, generator=gen, device=device) / k ** 0.5
            a = torch.randn(rank, k, generator=gen, device=device) @ V0.T / k ** 0.5
            b += noise * b.std() * torch.randn(o, rank, generator=gen, device=device)
            a += noise * a.std() * torch.randn(rank, d_in, generator=gen, device=device)
            pre = f"base_model.model.{module_name(layer, m)}"
            tensors[pre + ".lora_A.weight"] = (a / d_in ** 0.5).to(dtype).cpu()
            tensors[pre + ".lora_B.weight"] = (b * 0.01).to(dtype).cpu()
        save_adapter(os.path.join(root, f"a{i:04d}"), tensors, preset, rank, targets)
        if progress and (i + 1) % 100 == 0:
            progress(f"{i + 1} adapters written")


def write_workspace(root: str, o: BundleBenchOptions, progress=None) -> dict:
    """Base, adapters, bundle and inputs under ``root`` (each reused when already complete)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    dtype = getattr(torch, o.dtype)
    dev = "cuda" if o.device == "cuda" and torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    done = os.path.join(root, ".adapters-complete")
    if not os.path.exists(done):
        write_base(os.path.join(root, "base"), o.preset, dtype, o.seed, dev)
        write_collection(os.path.join(root, "adapters"), o.preset, o.adapters, o.rank, o.targets, o.shared_rank,
                         o.noise, o.seed + 1000, dtype, dev, progress)
        with open(done, "w") as f:
            f.write(json.dumps(o.__dict__ | {"targets": list(o.targets), "runs": list(o.runs)}))
    ws = dict(data_seconds=time.perf_counter() - t0, compress=_compressed(root, o, progress))
    counts = write_input(os.path.join(root, "input.parquet"), o)
    table = pq.read_table(os.path.join(root, "input.parquet"))
    base_only = table.set_column(table.schema.get_field_index("adapter"), "adapter",
                                 pa.nulls(table.num_rows, pa.string()))
    pq.write_table(base_only, os.path.join(root, "input-base.parquet"))
    ws["distinct_adapters_used"] = len(counts)
    return ws


def _compressed(root: str, o: BundleBenchOptions, progress=None) -> dict:
    """Fit and write the bundle unless ``root/bundle`` exists; its compression record
    (wall seconds, worst error, device, ledger) either way."""
    from mlora.compress.bundle import CompressOptions, compress, write_bundle
    from mlora.compress.collection import load_collection

    bundle, record = os.path.join(root, "bundle"), os.path.join(root, "compress.json")
    if os.path.exists(bundle) and os.path.exists(record):
        with open(record) as f:
            return json.load(f)
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if o.compress_device == "auto" else o.compress_device
    if progress:
        progress(f"compressing {o.adapters} adapters: {o.method} R={o.bundle_rank}, {o.clusters} clusters on {dev}")
    t0 = time.perf_counter()
    col = load_collection([os.path.join(root, "adapters")])
    if progress:
        progress(f"collection validated in {time.perf_counter() - t0:.1f} s: {len(col.modules)} modules to fit")
    fitted = [0]

    def each(fit) -> None:  # a time limit that stops the fit still leaves its pace on the log
        fitted[0] += 1
        if progress and (fitted[0] % 8 == 0 or fitted[0] == len(col.modules)):
            progress(f"{fitted[0]}/{len(col.modules)} modules fitted, {time.perf_counter() - t0:.1f} s")

    result = compress(col, CompressOptions(method=o.method, rank=o.bundle_rank, clusters=o.clusters,
                                           max_error=o.max_error, seed=o.seed, device=dev), each)
    bad = result.offenders()
    if bad:
        raise RuntimeError(f"{len(bad)} member/module errors exceed {o.max_error} (worst "
                           f"{max(e for *_, e in bad):.3f}): the synthetic collection does not compress; raise "
                           "--bundle-rank or lower --noise")
    man = write_bundle(result, bundle)
    rec = dict(seconds=time.perf_counter() - t0, device=dev, members=len(col.members), modules=len(col.modules),
               worst_error=max(man["max_error_by_member"].values()), ledger=man["ledger"],
               bundle_sha256=man["bundle_sha256"])
    with open(record, "w") as f:
        json.dump(rec, f)
    return rec


def matched_slots(root: str, o: BundleBenchOptions) -> tuple[int, int, int]:
    """(slots, bundle device bytes, one slot's bytes): how many uncompressed adapters fit in
    the device bytes the resident bundle takes (at least one)."""
    from mlora.batch.adapters.bundle_bank import BundleBank
    from mlora.batch.adapters.residency import ResidencyBank
    from mlora.batch.model.lora import group_shapes, held_slices
    from mlora.compress.bundle import read_bundle

    p = PRESETS[o.preset]
    dtype = getattr(torch, o.dtype)
    need = BundleBank.bytes_needed(read_bundle(os.path.join(root, "bundle")), dtype)
    shapes = group_shapes(p["hidden_size"], p["intermediate_size"], p["num_heads"], p["num_kv_heads"], p["head_dim"])
    slices = held_slices(o.targets)  # the slots batch-run's bank holds for these adapters (session.py)
    slot = ResidencyBank.bytes_per_slot(p["num_layers"], {g: s for g, s in shapes.items() if g in slices}, o.rank,
                                        dtype, slices)
    return max(1, need // slot), need, slot


# the runs of one call, in this order: the bundle (torch three-stage operator), the base alone, the
# bundle through the Triton operator (--bundle-operator three-stage-triton), the adapters
# uncompressed last (the slowest: its loads churn through few slots; a call stopped by a time
# limit has printed the others' figures by then)
BUNDLE_RUNS = ("bundle", "base", "bundle-triton", "adapters")


def run_bundle_bench(root: str, o: BundleBenchOptions, progress=None) -> dict:
    from mlora.batch.config import JobConfig
    from mlora.batch.runner import run_job

    ws = write_workspace(root, o, progress)
    slots, bundle_bytes, slot_bytes = matched_slots(root, o)
    if o.slots is not None:
        slots = o.slots

    def job(name: str, out_name: str, rows_file: str, max_new_tokens: int):
        """(output directory, summary) of run ``name``'s batch-run job over ``rows_file``."""
        out = fresh_output(root, out_name)
        return out, run_job(JobConfig(
            input=rows_file, output=out, base=os.path.join(root, "base"),
            adapters_dir=None if name == "base" else os.path.join(root, "bundle" if name == "bundle-triton" else name),
            prompt_column=None, prompt_ids_column="prompt_ids", max_new_tokens=max_new_tokens, device=o.device,
            dtype=o.dtype, max_num_seqs=o.max_num_seqs, max_batch_tokens=o.max_batch_tokens,
            max_gpu_adapters=slots if name == "adapters" else None,
            bundle_operator="three-stage-triton" if name == "bundle-triton" else "auto",
            gpu_memory_utilization=o.gpu_memory_utilization))

    runs = []
    for name in BUNDLE_RUNS:
        if name not in o.runs:
            continue
        source = "input-base.parquet" if name == "base" else "input.parquet"
        if o.warmup_rows:  # untimed: a run's first job pays its Triton compiles
            if progress:
                progress(f"warm-up for {name}: {o.warmup_rows} rows, {o.warmup_new_tokens} new tokens (untimed)")
            job(name, f"warmup-{name}", warmup_input(root, source, o.warmup_rows), o.warmup_new_tokens)
        if progress:
            progress(f"running {name}" + (f" ({slots} slots)" if name == "adapters" else ""))
        out, summary = job(name, name, os.path.join(root, source), o.max_new_tokens)
        with open(os.path.join(out, "_metrics.json")) as f:
            m = json.load(f)["metrics"]
        runs.append(dict(name=name, wall_s=summary.wall_s, tokens_per_s=m["tokens_per_s"],
                         error_rows=summary.error_rows, errors_by_code=dict(summary.errors_by_code),
                         kv_blocks=summary.engine.get("kv_blocks"), loads=sum(m["adapter_loads"].values()),
                         load_amplification=m["load_amplification"], iterations=m["iterations"], metrics=m))
        if progress:  # each run's figures as soon as it ends
            progress(f"{name}: {summary.wall_s:.1f} s, {m['tokens_per_s']:.0f} tok/s, {runs[-1]['loads']} loads, "
                     f"{summary.error_rows} error rows")
    by = {r["name"]: r["tokens_per_s"] for r in runs}

    def ratio(a, b):
        return by[a] / by[b] if a in by and by.get(b) else None

    return dict(options=o.__dict__ | {"targets": list(o.targets), "runs": list(o.runs)}, workspace=ws,
                bundle_device_bytes=bundle_bytes, slot_bytes=slot_bytes, slots=slots, runs=runs,
                bundle_vs_adapters=ratio("bundle", "adapters"), bundle_vs_base=ratio("bundle", "base"),
                bundle_triton_vs_bundle=ratio("bundle-triton", "bundle"),
                device=torch.cuda.get_device_name() if torch.cuda.is_available() and o.device == "cuda" else "cpu")
