"""Where a job's engines run: this process, one worker process per GPU, N CPU worker processes, or Ray.

Owns the meaning and the checks of ``--gpus``, ``--num-workers``, ``--engine``
and ``--ray-address`` (docs/scaleout.md). Must not start anything: the
coordinator (``coordinator.py``) and the Ray driver (``ray.py``) do. Every refusal
is a usage error (exit 2) with a stable code, decided before any work:

    --engine local (default)
      neither option       one engine in this process, on --device
      --gpus 0,1 | all     one worker process per listed GPU; indices number the devices this process
                           sees (CUDA_VISIBLE_DEVICES applies). Needs CUDA (E_GPUS_NO_CUDA), every index
                           present (E_GPUS_UNAVAILABLE), a comma list of distinct integers or "all"
                           (E_GPUS_INVALID); --device auto or cuda (E_GPUS_DEVICE). With
                           --tensor-parallel-size N: one worker per N GPUs in list order, each rank 0 of
                           a group on its N GPUs; a count that is not a multiple of N: E_SCALEOUT_USAGE
      --num-workers N      N worker processes on the CPU (CI, tests, CPU hosts). --device cpu, or auto on a
                           host without CUDA; auto on a CUDA host is refused rather than silently run on the
                           CPU: use --gpus, or say --device cpu (E_WORKERS_DEVICE). With
                           --tensor-parallel-size M: each worker is rank 0 of M gloo ranks
      both                 E_SCALEOUT_USAGE
    --engine ray           --num-workers N actors (``ray.py`` picks the device, ``ray_actors`` the default
                           count and each actor's resources); --gpus is refused (Ray places actors on GPUs
                           itself: E_SCALEOUT_USAGE). With --tensor-parallel-size N: each actor owns N GPUs
                           of one node and is rank 0 of a group on them; a cluster without a node of N
                           GPUs: E_SCALEOUT_USAGE
    --ray-address          only with --engine ray (E_SCALEOUT_USAGE)
    --engine other         E_SCALEOUT_USAGE
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from mlora.batch.config import JobConfig, resolve_device
from mlora.batch.errors import JobError


@dataclass(frozen=True)
class WorkerPlace:
    """One worker process: its index, the device it builds its engine on, and how it gets there."""

    index: int
    device: str  # "cuda" or "cpu": the torch device the worker's engine uses
    # CUDA_VISIBLE_DEVICES for the worker, None on CPU: it then sees exactly its GPU, or its tensor-parallel
    # group's GPUs in rank order (rank j on cuda:j, engine/tpfollow.rank_devices)
    cuda_visible: str | None
    label: str  # "cuda:1", "cuda:2+3" (a group), "cpu": for messages and the summary
    threads: int | None = None  # torch intra-op threads of a CPU worker (cores shared between workers)


@dataclass
class WorkerPlan:
    engine: str  # local | ray
    device: torch.device | None  # the engines' device (local); None for Ray (decided with the cluster)
    places: list[WorkerPlace] = field(default_factory=list)  # empty: one engine in this process


def _usage(code: str, message: str) -> JobError:
    return JobError(code, message, 2)


def plan_workers(opts: JobConfig) -> WorkerPlan:
    """Check the scale-out options of a validated ``opts`` against this host and say where the engines
    run (module docstring)."""
    if opts.engine == "ray":
        if opts.gpus is not None:
            raise _usage("E_SCALEOUT_USAGE", "--gpus is for --engine local; with --engine ray give --num-workers N "
                         "(Ray gives each actor --tensor-parallel-size GPUs of the cluster)")
        return WorkerPlan("ray", None)
    if opts.ray_address is not None:
        raise _usage("E_SCALEOUT_USAGE", "--ray-address needs --engine ray")
    if opts.gpus is not None and opts.num_workers is not None:
        raise _usage("E_SCALEOUT_USAGE", "give --gpus (one worker per GPU) or --num-workers (CPU workers), not both")
    if opts.gpus is not None:
        return WorkerPlan("local", torch.device("cuda"),
                          gpu_places(opts.gpus, opts.device, opts.tensor_parallel_size))
    if opts.num_workers is not None:
        if opts.device not in ("auto", "cpu"):
            raise _usage("E_WORKERS_DEVICE", f"--num-workers runs CPU workers, but --device is {opts.device!r}: "
                         "use --gpus 0,1,... for GPU workers, or --device cpu")
        if opts.device == "auto" and torch.cuda.is_available():
            raise _usage("E_WORKERS_DEVICE", "--num-workers runs CPU workers and this host has CUDA: use --gpus "
                         "0,1,... (or all) for GPU workers, or pass --device cpu to run on the CPU on purpose")
        n = opts.num_workers
        threads = rank_threads(_cores(), n, opts.tensor_parallel_size)
        return WorkerPlan("local", torch.device("cpu"),
                          [WorkerPlace(i, "cpu", None, "cpu", threads) for i in range(n)])
    return WorkerPlan("local", resolve_device(opts.device))


def rank_threads(cores: int, replicas: int, tp_size: int) -> int:
    """Torch threads of each rank process when ``replicas`` engines of ``tp_size`` ranks share
    ``cores`` on the CPU: every rank process gets an equal share, at least one."""
    return max(1, cores // (replicas * tp_size))


@dataclass(frozen=True)
class RayActors:
    """The actor pool of ``--engine ray``: how many actors (replicas), and what each asks Ray for."""

    count: int
    num_gpus: int  # the actor's GPUs: its tensor-parallel group, rank j on its cuda:j (0 on the CPU)
    num_cpus: int  # the cores Ray reserves for the actor (on the CPU: its share, which its ranks divide)
    threads: int | None  # torch threads of each rank process of a CPU actor; None on GPUs


def ray_actors(on_gpu: bool, node_gpus: list[int], cpus: int, num_workers: int | None, tp_size: int) -> RayActors:
    """Size the actor pool for a cluster of ``node_gpus`` (GPUs of each live node) and ``cpus``
    cores in all. On GPUs one actor per ``tp_size`` GPUs of one node (``num_workers`` default:
    every such group of the cluster); on the CPU one actor by default, each reserving its share
    of the cores, which its ``tp_size`` rank processes divide (as ``--num-workers`` replicas do)."""
    if on_gpu:
        groups = sum(g // tp_size for g in node_gpus)
        if not groups:
            most = max(node_gpus, default=0)
            raise _usage("E_SCALEOUT_USAGE", f"--tensor-parallel-size {tp_size} runs each Ray actor on {tp_size} "
                         f"GPUs of one node, but no node of the cluster has that many (GPUs per node: "
                         f"{', '.join(map(str, node_gpus))}): use --tensor-parallel-size {most} or less, "
                         "or add a node with enough GPUs")
        return RayActors(num_workers or groups, tp_size, 1, None)
    n = num_workers or 1
    return RayActors(n, 0, max(1, cpus // n), rank_threads(cpus, n, tp_size))


def gpu_places(gpus: str, device: str, tp_size: int = 1) -> list[WorkerPlace]:
    """One place per GPU of ``--gpus`` (``"0,1"`` or ``"all"``), or per ``tp_size`` GPUs of it in
    list order (a tensor-parallel group), checked against this host."""
    text = gpus.strip()
    if text != "all":
        try:
            indices = [int(x) for x in text.split(",")]
        except ValueError:
            raise _usage("E_GPUS_INVALID", f"--gpus {gpus!r}: give GPU indices like 0,1 or all") from None
        if any(i < 0 for i in indices) or len(set(indices)) != len(indices):
            raise _usage("E_GPUS_INVALID", f"--gpus {gpus!r}: indices must be distinct and >= 0")
    if device not in ("auto", "cuda"):
        raise _usage("E_GPUS_DEVICE", f"--gpus runs one worker per GPU; --device {device!r} contradicts it "
                     "(leave --device auto, or use --num-workers N --device cpu for CPU workers)")
    if not torch.cuda.is_available():
        raise _usage("E_GPUS_NO_CUDA", f"--gpus {gpus}: this host has no usable CUDA device; "
                     "drop --gpus (or use --num-workers N --device cpu for CPU workers)")
    count = torch.cuda.device_count()
    if text == "all":
        indices = list(range(count))
    missing = [i for i in indices if i >= count]
    if missing:
        raise _usage("E_GPUS_UNAVAILABLE", f"--gpus {gpus}: no GPU {', '.join(map(str, missing))} on this host; "
                     f"it has {count} (indices 0..{count - 1}, as CUDA_VISIBLE_DEVICES shows them)")
    if len(indices) % tp_size:
        raise _usage("E_SCALEOUT_USAGE", f"--gpus {gpus} gives {len(indices)} GPU(s), which do not split into "
                     f"groups of --tensor-parallel-size {tp_size}: {_group_hint(indices, tp_size)}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [v.strip() for v in visible.split(",")] if visible else None
    places = []
    for k in range(len(indices) // tp_size):
        group = indices[k * tp_size:(k + 1) * tp_size]
        cuda_visible = ",".join(physical[i] if physical else str(i) for i in group)
        places.append(WorkerPlace(k, "cuda", cuda_visible, "cuda:" + "+".join(map(str, group))))
    return places


def _group_hint(indices: list[int], tp_size: int) -> str:
    """A --gpus that does split into groups of ``tp_size``, or the sizes that divide the count."""
    if len(indices) >= tp_size:
        usable = indices[:len(indices) - len(indices) % tp_size]
        return f"give --gpus {','.join(map(str, usable))} ({len(usable) // tp_size} replica(s) of {tp_size} ranks)"
    sizes = [d for d in range(1, len(indices) + 1) if len(indices) % d == 0]
    return f"list at least {tp_size} GPUs, or use --tensor-parallel-size {' or '.join(map(str, sizes))}"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
