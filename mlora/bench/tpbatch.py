"""``mlora bench batch --tensor-parallel-size N``: the engine benchmark over a tensor-parallel group.

Owns running :mod:`mlora.bench.batch`'s scenarios with the model cut over N rank processes,
one GPU each (gloo on the CPU): the job, the timed span, the records and the floor's
definition are ``bench batch``'s (its module docstring, "Under tensor parallelism"). This
process is rank 0 and drives the engine as ``batch-run`` does (docs/scaleout.md, "One model
over several GPUs"); the followers run ``mlora.batch.engine.tpfollow.follow``.

* Model: :class:`~mlora.bench.batch.GeneratedModel` as the group's model source: every rank
  generates the random model's tensors on its GPU and keeps its slices (no checkpoint: a
  Llama-3-70B shape needs 141 GB, more than a GPU host's disk may hold).
* Adapters: followers load adapters from files, so the scenarios' random adapters are PEFT
  directories (``mlora.bench.gpus.write_gpus_adapters``: ``bench batch``'s shape, rank 16 on
  every projection), written once under ``adapters_dir`` (reused while the preset, rank,
  seed, dtype and count match) and pinned against the base they declare. Every adapter of a
  scenario is loaded on every rank before its warm-up (all resident, as on one device).
* Per scenario a group of its own, started before the warm-up and stopped after the timed
  job: the followers size their bank and decode graphs once from rank 0's ``Setup``, so a
  scenario's adapter slots and graphs are those of one group. The warm-up engine runs
  without decode graphs; the timed engine's graphs are captured by every rank before the
  clock (as ``batch-run`` captures them at start); no lookahead (not served under TP).
* Reported beside ``bench batch``'s figures: the group's all-reduce times (the floor's
  collective term), each rank's free memory after its weights, weight generation time,
  and the followers' graph replays.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import tempfile
import time

import torch

from mlora.batch.adapters.catalog import PinnedAdapter, load_catalog
from mlora.batch.adapters.residency import ResidencyBank
from mlora.batch.adapters.slots import TPShard
from mlora.batch.engine.tpfollow import Leader, Setup, follow, rank_devices, tp_graphs
from mlora.batch.model.decoder import DTYPES
from mlora.batch.model.tp import TPLayout
from mlora.batch.model.tpgroup import LeadGroup
from mlora.bench.batch import (
    BatchBenchOptions,
    BenchError,
    Ceilings,
    GeneratedModel,
    TPFloor,
    _num_blocks,
    _RecordingEngine,
    _sync,
    check_options,
    engine_config,
    run_batch_bench,
    timed_scenario,
    warm_up,
)
from mlora.bench.gpus import write_gpus_adapters


def run_tp_batch_bench(o: BatchBenchOptions, progress=None, note=None) -> dict:
    """Every scenario of ``o`` over a group of ``o.tensor_parallel_size`` ranks (module docstring);
    ``note(message)``: set-up steps (adapters written, each group's weights built)."""
    if o.tensor_parallel_size < 2:
        return run_batch_bench(o, progress)
    config = check_options(o)
    n_max = max(o.adapters, default=0)
    root = o.adapters_dir or tempfile.mkdtemp(prefix="mlora-bench-tp-")
    try:
        pinned = bench_adapters(root, o, n_max, note) if n_max else {}
        source = GeneratedModel(config, o.seed, probe_rows=(1, o.max_num_seqs, o.max_batch_tokens), rank=o.rank)

        def scenario(n, ceil, progress):
            return tp_scenario(o, source, pinned, n, ceil, progress, note)

        out = run_batch_bench(o, progress, scenario)
    finally:
        if o.adapters_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    out["tensor_parallel"] = dict(size=o.tensor_parallel_size, backend=_backend(o),
                                  floor="per rank: its weights, K/V and adapter cut over the copy bandwidth (or its "
                                        "flops over the matmul rate), plus layers x (2 hidden-width all-reduces + 2 "
                                        "rank-width ones with adapters) at the measured all-reduce times")
    return out


def _backend(o: BatchBenchOptions) -> str:
    return "nccl" if torch.device(o.device).type == "cuda" else "gloo"


def bench_adapters(root: str, o: BatchBenchOptions, n: int, note=None) -> dict[str, PinnedAdapter]:
    """``bench-0`` .. ``bench-{n-1}`` as PEFT directories under ``root`` (written unless the ones
    there match), pinned; a bad one is a bench set-up error."""
    key = dict(preset=o.preset, rank=o.rank, seed=o.seed, dtype=o.dtype, adapters=n)
    done = os.path.join(root, ".complete")
    if not (os.path.exists(done) and json.load(open(done)) == key):
        t0 = time.perf_counter()
        for entry in os.listdir(root) if os.path.isdir(root) else ():
            if entry.startswith("bench-"):
                shutil.rmtree(os.path.join(root, entry))
        dev = "cuda" if torch.device(o.device).type == "cuda" else "cpu"
        write_gpus_adapters(root, o.preset, n, o.rank, o.seed, DTYPES[o.dtype], dev, note)
        with open(done, "w") as f:
            json.dump(key, f)
        if note:
            note(f"{n} adapters written to {root} in {time.perf_counter() - t0:.1f} s")
    ids = {f"bench-{k}" for k in range(n)}
    pinned = load_catalog(root, None).pin(ids, None)
    bad = [p for p in pinned.values() if not p.ok]
    if bad:
        raise BenchError(bad[0].error_code, f"bench adapter {bad[0].id} under {root}: {bad[0].error_message}; "
                         "remove the directory to write them again")
    return pinned


def tp_scenario(o: BatchBenchOptions, source: GeneratedModel, pinned_all: dict[str, PinnedAdapter], n: int,
                ceil: Ceilings, progress=None, note=None) -> dict:
    """The scenario of ``n`` adapters over a group of its own (module docstring), stopped at the end."""
    size, dtype = o.tensor_parallel_size, DTYPES[o.dtype]
    backend = _backend(o)
    devices = rank_devices(torch.device(o.device).type, size)
    device = torch.device(devices[0])
    graphs = engine_config(o, device).cuda_graphs and tp_graphs(backend, device.type)
    pinned = {f"bench-{k}": pinned_all[f"bench-{k}"] for k in range(n)}
    t0 = time.perf_counter()
    threads = torch.get_num_threads() if device.type == "cpu" else None  # each follower as many as rank 0
    leader = Leader(LeadGroup(follow, size, (source, devices, o.dtype, threads), backend))
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = source.build(device, dtype, TPLayout(0, size), leader.collective)
        memory = leader.memory(device)
        build_s = time.perf_counter() - t0
        layout = TPLayout(0, size)
        bank = None
        if n:
            bank = ResidencyBank.for_rank(TPShard(source.config, layout, leader.collective), n, o.rank, dtype, device,
                                          leader.mirror, backend="triton" if graphs else "auto", prefetch_workers=0)
        num_blocks = _num_blocks(o)
        leader.setup(Setup(num_blocks, o.block_size, n, o.rank, pinned,
                           graph_seqs=o.max_num_seqs if graphs else 0))
        if bank is not None:  # every adapter resident on every rank before the warm-up
            bank.ensure(sorted(pinned), pinned)
        _sync(device)
        if note:
            note(f"{n} adapters: {size} ranks built their weights in {build_s:.1f} s; one all-reduce of "
                 f"[{o.max_num_seqs}, {source.config.hidden_size}] takes "
                 f"{source.probed.at('hidden', o.max_num_seqs) * 1e6:.0f} us")
        config = dataclasses.replace(engine_config(o, device), lookahead=False)
        # the warm-up without graphs: the followers hold one set of decode graphs, the timed engine's
        warm = _RecordingEngine(model, bank, pinned, dataclasses.replace(config, cuda_graphs=False),
                                num_blocks=num_blocks, tp=leader)
        warm_up(warm, o, model.config, n)
        del warm
        gc.collect()  # the warm-up engine's KV cache freed before the timed one's
        if device.type == "cuda":
            torch.cuda.empty_cache()
        eng = _RecordingEngine(model, bank, pinned, dataclasses.replace(config, cuda_graphs=graphs),
                               num_blocks=num_blocks, tp=leader)
        floor = TPFloor(source.config, source.probed)
        result = timed_scenario(eng, o, n, ceil, None, floor)
        leader.stop()
    except BaseException as e:
        raise leader.abort(e) from e
    result.update(tensor_parallel_size=size, model_build_s=build_s, all_reduce=source.probed.record(),
                  rank_memory=[list(m) if m is not None else None for m in memory],
                  follower_graph_replays=[r.get("graph_replays") for r in leader.reports or []])
    del eng, model, bank
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if progress:
        progress(result)
    return result
