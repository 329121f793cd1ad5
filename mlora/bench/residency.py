"""The residency benchmark behind ``mlora bench residency``.

Owns a synthetic on-disk workspace and the comparison of limited GPU slots
against every adapter resident; the figures go into BENCHMARKS.md.

* Workspace (``write_workspace``): a Hugging Face base checkpoint of a shape
  preset (``mlora.bench.batch.PRESETS``) with random weights, sharded
  safetensors, no EOS id (every row runs to ``max_new_tokens``); ``n`` PEFT
  LoRA adapters (rank ``rank`` on ``targets``, random factors, safetensors +
  adapter_config.json); an input Parquet of ``rows`` prompts (random token
  ids, lengths uniform in ``[prompt_min, prompt_max]``) whose adapter column
  follows a Zipf(``zipf``) popularity over the adapters (adapter k has weight
  1 / (k + 1)^s), rows in random order. Deterministic in ``seed``.
* Runs: the real ``mlora batch-run`` job (``run_job``: pinning, residency
  bank, scheduler, prefetch, CUDA graphs) once with ``slots`` GPU adapter
  slots and once with every adapter resident from the start (slots = n,
  ``--preload-adapters``: loaded before the first row and before the job's
  metrics clock, so its loads do not appear in its metrics). Before each
  timed run, a warm-up job over the first ``warmup_rows`` rows with the same
  slots (16 new tokens, output discarded) compiles the Triton kernels that
  run needs: the compile cache is on disk, so without it whichever run comes
  first pays compilation the other does not.
* Reported per run: generated tokens/s over the generation phase (the job's
  metrics clock starts after pinning and model loading, which both runs pay
  alike), the job's wall time, load amplification, loads, evictions, prefetch
  precision, mean adapter load latency (the engine's wait for ``ensure``:
  copy and validation, plus the host build when it was not prefetched; with
  asynchronous loads only the part that did not overlap device work), the
  copy stream's time per load (copies and validation reads, from CUDA
  events: what the cold-load target compares with its floor; mean, median,
  p90, and the copies alone), H2D
  bytes; and the ratio of the two throughputs. The cold-load floor is one adapter's
  bytes over the host-to-device bandwidth of pinned memory, measured in the
  same run (CUDA only).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass

import torch

from mlora.batch.model.lora import group_shapes, module_name, role_shapes
from mlora.bench.batch import PRESETS


@dataclass
class ResidencyBenchOptions:
    preset: str = "llama-3-8b"
    adapters: int = 1000
    rank: int = 16
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    rows: int = 8000
    zipf: float = 1.0
    prompt_min: int = 128
    prompt_max: int = 1024
    max_new_tokens: int = 128
    slots: int = 64
    max_num_seqs: int = 256
    max_batch_tokens: int = 8192
    device: str = "cuda"
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    runs: tuple[str, ...] = ("limited", "all-resident")
    prefetch_gpu_adapters: int = 4  # batch-run's option (0: loads block the engine)
    image_build_processes: int = 0  # JobConfig.image_build_processes (0: prefetch threads build images)
    warmup_rows: int = 256  # rows of the untimed warm-up job before each run (0: none)
    memory_ledger: str = "split"  # batch-run's --memory-ledger (joint: KV and slots from one arena)
    warmup_new_tokens: int = 16


def module_shapes(p: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of every linear module of one layer of preset ``p``."""
    return role_shapes(group_shapes(p["hidden_size"], p["intermediate_size"], p["num_heads"], p["num_kv_heads"],
                                    p["head_dim"]))


def write_base(path: str, preset: str, dtype: torch.dtype, seed: int, device: str = "cpu", layers_per_shard: int = 4) -> None:
    """A random Llama checkpoint of ``preset`` (weights made on ``device``, written shard by shard)."""
    from safetensors.torch import save_file

    p = PRESETS[preset]
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * 0.02).to(dtype).cpu()

    h, L = p["hidden_size"], p["num_layers"]
    weight_map, shard, n_shard = {}, {}, 0

    def flush():
        nonlocal shard, n_shard
        if shard:
            name = f"model-{n_shard:05d}.safetensors"
            save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, n_shard = {}, n_shard + 1

    shard["model.embed_tokens.weight"] = rnd(p["vocab_size"], h)
    for layer in range(L):
        pre = f"model.layers.{layer}."
        for m, (o, i) in module_shapes(p).items():
            shard[f"{module_name(layer, m)}.weight"] = rnd(o, i)
        shard[pre + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        shard[pre + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
        if (layer + 1) % layers_per_shard == 0:
            flush()
    shard["model.norm.weight"] = torch.ones(h, dtype=dtype)
    shard["lm_head.weight"] = rnd(p["vocab_size"], h)
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": h, "intermediate_size": p["intermediate_size"], "num_hidden_layers": L,
        "num_attention_heads": p["num_heads"], "num_key_value_heads": p["num_kv_heads"], "head_dim": p["head_dim"],
        "vocab_size": p["vocab_size"], "max_position_embeddings": p["max_position_embeddings"],
        "rms_norm_eps": 1e-5, "rope_theta": p["rope_theta"], "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def write_adapter(path: str, preset: str, rank: int, targets, seed: int, dtype: torch.dtype, device: str = "cpu") -> None:
    """One PEFT LoRA adapter (rank ``rank`` on ``targets`` of every layer, alpha = 2 * rank)."""
    p = PRESETS[preset]
    shapes = module_shapes(p)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for layer in range(p["num_layers"]):
        for m in targets:
            o, i = shapes[m]
            pre = f"base_model.model.{module_name(layer, m)}"
            tensors[pre + ".lora_A.weight"] = (torch.randn(rank, i, generator=gen, device=device) / i ** 0.5).to(dtype).cpu()
            tensors[pre + ".lora_B.weight"] = (torch.randn(o, rank, generator=gen, device=device) * 0.01).to(dtype).cpu()
    save_adapter(path, tensors, preset, rank, targets)


def save_adapter(path: str, tensors: dict, preset: str, rank: int, targets) -> None:
    """A PEFT adapter directory: ``tensors`` in adapter_model.safetensors and the LoRA config
    (alpha = 2 * rank, the benchmark base of ``preset``)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": sorted(targets), "base_model_name_or_path": f"mlora-bench/{preset}",
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "lora_dropout": 0.0, "inference_mode": True}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def zipf_choices(n: int, rows: int, s: float, rng: random.Random) -> list[int]:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights=weights, k=rows)


def write_input(path: str, o: ResidencyBenchOptions) -> dict[int, int]:
    """The job's Parquet input; returns adapter index -> rows naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(o.seed)
    vocab = PRESETS[o.preset]["vocab_size"]
    picks = zipf_choices(o.adapters, o.rows, o.zipf, random.Random(o.seed + 1))
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(o.prompt_min, o.prompt_max))] for _ in range(o.rows)]
    pq.write_table(pa.table({
        "id": [str(i) for i in range(o.rows)],
        "prompt_ids": pa.array(prompts, pa.list_(pa.int64())),
        "adapter": [f"a{k:04d}" for k in picks],
    }), path)
    counts: dict[int, int] = {}
    for k in picks:
        counts[k] = counts.get(k, 0) + 1
    return counts


def write_workspace(root: str, o: ResidencyBenchOptions, progress=None) -> dict:
    """Base, adapters and input under ``root`` (reused when already complete)."""
    dtype = getattr(torch, o.dtype)
    dev = o.device if o.device == "cuda" and torch.cuda.is_available() else "cpu"
    done = os.path.join(root, ".complete")
    t0 = time.perf_counter()
    if not os.path.exists(done):
        write_base(os.path.join(root, "base"), o.preset, dtype, o.seed, dev)
        for k in range(o.adapters):
            write_adapter(os.path.join(root, "adapters", f"a{k:04d}"), o.preset, o.rank, o.targets, o.seed + 1000 + k,
                          dtype, dev)
            if progress and (k + 1) % 100 == 0:
                progress(f"{k + 1} adapters written")
        with open(done, "w") as f:
            f.write(json.dumps(o.__dict__ | {"targets": list(o.targets)}))
    counts = write_input(os.path.join(root, "input.parquet"), o)
    return dict(seconds=time.perf_counter() - t0, distinct_adapters_used=len(counts))


H2D_PROBE_BYTES = 64 << 20


def h2d_bandwidth(nbytes: int = H2D_PROBE_BYTES) -> float | None:
    """Host (pinned) to device copy rate in bytes/s: one untimed copy, then the median of 5
    (CUDA only). The bench measures it at a fixed 64 MiB, not at the adapter's size: a
    single large copy can run well below the rate the job's loads reach, and the floor
    is a property of the machine."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / sorted(times)[2]


def warmup_input(root: str, source: str, rows: int) -> str:
    """``root/warmup-SOURCE``: the first ``rows`` rows of ``root/SOURCE``, the input of an
    untimed warm-up job (it compiles the kernels and captures the graphs the timed run would
    otherwise pay for inside its timing)."""
    import pyarrow.parquet as pq

    path = os.path.join(root, f"warmup-{source}")
    pq.write_table(pq.read_table(os.path.join(root, source)).slice(0, rows), path)
    return path


def fresh_output(root: str, name: str) -> str:
    """``root/out-NAME``, an earlier run's output there removed (a benchmark's job always
    writes a new output)."""
    import shutil

    out = os.path.join(root, f"out-{name}")
    if os.path.exists(out):
        shutil.rmtree(out)
    return out


def run_residency_bench(root: str, o: ResidencyBenchOptions, progress=None) -> dict:
    """The benchmark's runs in sequence, kept in one piece so their order and what is timed read top to bottom."""
    from mlora.batch.config import JobConfig
    from mlora.batch.runner import run_job

    ws = write_workspace(root, o, progress)
    adapter_file = os.path.join(root, "adapters", "a0000", "adapter_model.safetensors")
    adapter_bytes = os.path.getsize(adapter_file)
    runs = []

    def job(name: str, slots: int, rows_file: str, max_new_tokens: int):
        """(output directory, summary) of one batch-run job over ``rows_file``."""
        out = fresh_output(root, name)
        return out, run_job(JobConfig(
            input=rows_file, output=out, base=os.path.join(root, "base"),
            adapters_dir=os.path.join(root, "adapters"), prompt_column=None, prompt_ids_column="prompt_ids",
            max_new_tokens=max_new_tokens, device=o.device, dtype=o.dtype, max_num_seqs=o.max_num_seqs,
            max_batch_tokens=o.max_batch_tokens, max_gpu_adapters=slots, preload_adapters=name.endswith("all-resident"),
            gpu_memory_utilization=o.gpu_memory_utilization, prefetch_gpu_adapters=o.prefetch_gpu_adapters,
            image_build_processes=o.image_build_processes, memory_ledger=o.memory_ledger))

    warm_input = warmup_input(root, "input.parquet", o.warmup_rows) if o.warmup_rows else None
    for name, slots in (("limited", o.slots), ("all-resident", o.adapters)):
        if name not in o.runs:
            continue
        if o.warmup_rows:
            if progress:
                progress(f"warm-up for {name}: {o.warmup_rows} rows, {o.warmup_new_tokens} new tokens (untimed)")
            job(f"warmup-{name}", slots, warm_input, o.warmup_new_tokens)
        if progress:
            progress(f"running {name} ({slots} slots)")
        out, summary = job(name, slots, os.path.join(root, "input.parquet"), o.max_new_tokens)
        with open(os.path.join(out, "_metrics.json")) as f:
            m = json.load(f)["metrics"]
        lat = m["histograms"]["adapter_load_latency_seconds"]
        count = sum(h["count"] for h in lat.values())
        runs.append(dict(name=name, slots=slots, wall_s=summary.wall_s, job_tokens_per_s=summary.tokens_per_s,
                         tokens_per_s=m["tokens_per_s"], error_rows=summary.error_rows,
                         errors_by_code=dict(summary.errors_by_code), kv_blocks=summary.engine.get("kv_blocks"),
                         image_builds={k: v for k, v in summary.bank.items() if k.startswith("image")},
                         pinned_pool={k: v for k, v in summary.bank.items() if k.startswith("pinned_pool")},
                         # --memory-ledger joint: the arena's pages, a slot's pages, the KV's peak pages
                         ledger={k: summary.bank[k] for k in ("memory_ledger", "arena_pages", "pages_per_slot",
                                                              "kv_pages_peak") if k in summary.bank},
                         loads=sum(m["adapter_loads"].values()),
                         load_device_ms_mean=summary.bank.get("load_device_ms_mean"),
                         load_device_ms_p50=summary.bank.get("load_device_ms_p50"),
                         load_device_ms_p90=summary.bank.get("load_device_ms_p90"),
                         load_copy_ms_mean=summary.bank.get("load_copy_ms_mean"),
                         load_copy_ms_p50=summary.bank.get("load_copy_ms_p50"),
                         load_issue_ms_p50=summary.bank.get("load_issue_ms_p50"),
                         load_issue_ms_p90=summary.bank.get("load_issue_ms_p90"),
                         load_issue_cpu_ms_p50=summary.bank.get("load_issue_cpu_ms_p50"),
                         load_issue_cpu_ms_p90=summary.bank.get("load_issue_cpu_ms_p90"),
                         # the collector's pauses inside load issues, and in the whole run (gcpauses.py)
                         load_issue_gc_ms_mean=summary.bank.get("load_issue_gc_ms_mean"),
                         load_issue_gc_ms_p90=summary.bank.get("load_issue_gc_ms_p90"),
                         load_issues_with_gc=summary.bank.get("load_issues_with_gc"),
                         gc={k: summary.engine[k] for k in ("gc_collections", "gc_pause_seconds", "gc_pause_max_ms")
                             if k in summary.engine},
                         # what a load really copied (the whole-view image: slot views incl. their zeros), against
                         # the adapter's bytes that the amplification metric counts
                         copied_bytes_per_load=(summary.bank["h2d_bytes"] / summary.bank["load_attempts"]
                                                if summary.bank.get("load_attempts") else None),
                         mean_load_s=sum(h["sum"] for h in lat.values()) / count if count else None, metrics=m))
        if progress:  # each run's figures as soon as it ends: a later run that overruns a time limit loses only itself
            r = runs[-1]
            progress(f"{name}: {r['wall_s']:.1f} s, {r['tokens_per_s']:.0f} tok/s, {m['iterations']} iterations taking "
                     f"{m['iteration_seconds']:.1f} of {m['elapsed_s']:.1f} s, {r['loads']} loads, mean load "
                     + ("-" if r["mean_load_s"] is None else f"{r['mean_load_s'] * 1e3:.1f} ms")
                     # no load in the job: the per-load figures are the preload's (before the metrics clock)
                     + (" (preload: " if not r["loads"] and r["load_device_ms_p50"] is not None else " (")
                     + f"copy stream {r['load_device_ms_mean']} ms mean, {r['load_device_ms_p50']} p50, "
                     f"{r['load_device_ms_p90']} p90; copies alone {r['load_copy_ms_mean']} mean, "
                     f"{r['load_copy_ms_p50']} p50; host issue {r['load_issue_ms_p50']} p50, "
                     f"{r['load_issue_ms_p90']} p90, its CPU time {r['load_issue_cpu_ms_p50']} p50, "
                     f"{r['load_issue_cpu_ms_p90']} p90, collector pauses in {r['load_issues_with_gc']} issues, "
                     f"{r['load_issue_gc_ms_mean']} ms mean; "
                     + ("-" if r["copied_bytes_per_load"] is None else f"{r['copied_bytes_per_load'] / 1e6:.1f}")
                     + " MB copied per load), amplification "
                     f"{m.get('load_amplification')}, {summary.error_rows} error rows, {r['image_builds']}, {r['pinned_pool']}"
                     + (f", one arena: {r['ledger']}" if r["ledger"] else "") + f", collector {r['gc']}")
    bw = h2d_bandwidth()
    return dict(options=options_record(o), workspace=ws,
                adapter_bytes=adapter_bytes, h2d_bytes_per_s=bw, cold_load_floor_s=adapter_bytes / bw if bw else None,
                runs=runs, throughput_ratio=throughput_ratio(runs),
                device=torch.cuda.get_device_name() if torch.cuda.is_available() and o.device == "cuda" else "cpu")


COMPARABLE = ("preset", "adapters", "rank", "targets", "rows", "zipf", "prompt_min", "prompt_max", "max_new_tokens",
              "max_num_seqs", "max_batch_tokens", "dtype", "seed")


def options_record(o: ResidencyBenchOptions) -> dict:
    """The options as the results record them (JSON types)."""
    return o.__dict__ | {"targets": list(o.targets), "runs": list(o.runs)}


def throughput_ratio(runs: list[dict]) -> float | None:
    """Tokens/s of the limited run over the all-resident run's (None without both)."""
    by = {r["name"]: r for r in runs}
    if "limited" in by and "all-resident" in by and by["all-resident"]["tokens_per_s"]:
        return by["limited"]["tokens_per_s"] / by["all-resident"]["tokens_per_s"]
    return None


COLD_LOAD_TARGET = 2.0  # a cold load within 2x its floor (adapter bytes / H2D bandwidth)


def cold_load_vs_floor(run: dict, floor_s: float | None) -> dict[str, float] | None:
    """A run's copy-stream time per job load (mean, p50, p90) as multiples of the cold-load
    floor; None when the run loaded nothing in the job (its figures would be a preload's) or
    there is no floor (no CUDA)."""
    if not floor_s or not run.get("loads"):
        return None
    out = {}
    for stat in ("mean", "p50", "p90"):
        ms = run.get(f"load_device_ms_{stat}")
        if ms is not None:
            out[stat] = ms / 1e3 / floor_s
    return out or None


def check_comparable(options: dict, other) -> None:
    """Raise ValueError unless ``other`` (a result) is of the job ``options`` describe."""
    if not isinstance(other, dict) or not isinstance(other.get("options"), dict):
        raise ValueError("not a bench residency result (no options)")
    b = other["options"]
    differ = [k for k in COMPARABLE if options.get(k) != b.get(k)]
    if differ or not isinstance(other.get("runs"), list):
        raise ValueError("not the same job: " + (", ".join(f"{k} {b.get(k)!r} there, {options.get(k)!r} here"
                                                          for k in differ) or "it has no runs"))


def combine(results: dict, other: dict) -> dict:
    """``results`` with the runs of ``other`` (an earlier ``run_residency_bench`` result of the
    same job, e.g. the other run written by another call) that it lacks, and the throughput
    ratio recomputed. Raises ValueError when the two are not the same job (an option of
    ``COMPARABLE`` differs)."""
    check_comparable(results["options"], other)
    have = {r["name"] for r in results["runs"]}
    runs = results["runs"] + [dict(r, from_earlier_call=True) for r in other["runs"] if r["name"] not in have]
    return dict(results, runs=runs, throughput_ratio=throughput_ratio(runs))

