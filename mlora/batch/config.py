"""Every choice of a batch job, typed, documented and validated once.

:class:`EngineConfig` holds the choices of one engine (device, memory, scheduling,
adapter residency), :class:`InputColumns` the roles of the input's columns;
:class:`JobConfig` adds what a job reads and writes (input, output, sampling) and
where its engines run (scale-out). The CLI and the Python API fill a JobConfig;
:meth:`JobConfig.validate` refuses a bad value with a :class:`~mlora.batch.errors.JobError`
(exit 2) before any weight is read. Imports nothing of mlora.batch but the errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mlora.batch.errors import JobError

DEVICES = ("auto", "cuda", "cpu")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# three-stage-triton: the three-stage operator on the segmented Triton kernels (CUDA only)
BUNDLE_OPERATORS = ("auto", "three-stage", "materialized", "three-stage-triton")
MEMORY_LEDGERS = ("split", "joint")
ALORA_WITHOUT_INVOCATION = ("error", "base")  # an aLoRA row whose prompt lacks the invocation: error row, or the base
ENGINES = ("local", "ray")


@dataclass(kw_only=True)
class EngineConfig:
    """The choices of one engine on one device (docs/batch.md, docs/sizing.md)."""

    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # auto (the checkpoint's on a GPU, float32 on the CPU) | float32 | bfloat16 | float16
    max_num_seqs: int = 64  # rows running at once
    max_batch_tokens: int = 2048  # tokens per model invocation (prefill chunks + decode rows)
    max_gpu_adapters: int | None = None  # GPU adapter slots (default: a quarter of the usable GPU memory)
    gpu_memory_utilization: float = 0.9  # share of the device memory the job may take
    kv_cache_gb: float | None = None  # KV cache size, > 0 (default: from the free memory)
    # host cache of verified adapter images (default: 128 images on a GPU, unbounded on the CPU;
    # 0: none, every load reads and verifies its adapter file again)
    host_cache_gb: float | None = None
    block_size: int = 16  # tokens per KV block
    schedule_window: int = 8192  # rows admission may reorder among (one residency job's adapters load about once)
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs (GPU only)
    lookahead: bool = True  # build the next decode iteration's inputs while the device runs this one
    prefetch_adapters: int = 16  # cold adapters of the waiting rows whose host images are built ahead
    prefetch_gpu_adapters: int = 4  # of those, loaded into free or unneeded GPU slots per iteration, ahead of use
    image_build_processes: int = 0  # host images built in this many processes (0: on the prefetch threads)
    preload_adapters: bool = False  # load up to max_gpu_adapters adapters before the first row
    bundle_operator: str = "auto"  # how a bundle's members are served (BUNDLE_OPERATORS; docs/compress.md)
    # split: KV cache and adapter slots sized once from one budget; joint: both carved from one
    # arena of pages, KV growth may evict idle adapters (docs/sizing.md)
    memory_ledger: str = "split"
    # full KV blocks shared between rows by content: a row computes only what no row computed
    # before it (docs/batch.md, Prefix cache); with the joint memory ledger it is off
    prefix_cache: bool = True
    alora_without_invocation: str = "error"  # ALORA_WITHOUT_INVOCATION (changes outputs: in the job fingerprint)
    # one model sharded over this many rank processes (docs/scaleout.md, Tensor parallelism); not
    # part of the job fingerprint, like --gpus
    tensor_parallel_size: int = 1

    def validate(self) -> None:
        """Raise JobError (exit 2) for a value outside its domain."""
        if self.device not in DEVICES:
            raise JobError("E_DEVICE", f"--device must be auto, cuda or cpu, not {self.device!r}", 2)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise JobError("E_DTYPE", f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}", 2)
        if self.memory_ledger not in MEMORY_LEDGERS:
            raise JobError("E_MEMORY_LEDGER", f"--memory-ledger must be one of {', '.join(MEMORY_LEDGERS)}, got "
                           f"{self.memory_ledger!r}", 2)
        if self.bundle_operator not in BUNDLE_OPERATORS:
            raise JobError("E_BUNDLE_OPERATOR", f"--bundle-operator must be one of {', '.join(BUNDLE_OPERATORS)}, "
                           f"not {self.bundle_operator!r}", 2)
        if self.alora_without_invocation not in ALORA_WITHOUT_INVOCATION:
            raise JobError("E_OPTION_RANGE", "--alora-without-invocation must be error or base, not "
                           f"{self.alora_without_invocation!r}", 2)
        check_ranges(self, ENGINE_RANGES)


@dataclass(kw_only=True)
class InputColumns:
    """Which input column plays which role (docs/batch.md, Input): exactly one of the prompt
    columns is set (``job.input.InputSpec`` checks it, with the kept columns)."""

    id_column: str = "id"
    prompt_column: str | None = "prompt"
    prompt_ids_column: str | None = None
    messages_column: str | None = None  # chat messages rendered with the base's chat template (docs/batch.md)
    adapter_column: str = "adapter"
    max_new_tokens_column: str | None = None
    keep_columns: tuple[str, ...] = ()  # input columns copied to the output


@dataclass(kw_only=True)
class JobConfig(EngineConfig, InputColumns):
    """One ``mlora batch-run`` job: its files and columns, sampling, and where its engines run."""

    input: str
    output: str
    base: str
    adapters_dir: str | None = None
    catalog_file: str | None = None
    allow_pickle: bool = False  # read adapter_model.bin adapters with torch.load(weights_only=True)
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    strict: bool = False
    resume: bool = False
    shard_rows: int = 10000
    commit_interval: float = 60.0  # seconds: a shard is also committed when this has passed since the last one
    allow_duplicate_ids: bool = False  # run rows whose ids repeat (each row once; resume goes by row position)
    workers: int | None = None  # hashing threads for pinning the base and adapters (default: all cores)
    # scale-out (docs/scaleout.md; none of these is part of the job fingerprint)
    gpus: str | None = None  # "0,1" or "all": one worker process per GPU
    num_workers: int | None = None  # local: CPU worker processes; ray: actors
    engine: str = "local"  # local | ray
    ray_address: str | None = None  # --engine ray: an existing cluster (default: start a local one)

    def validate(self) -> None:
        """Raise JobError (exit 2) for a value outside its domain; the host-dependent checks of
        the scale-out options are :func:`mlora.batch.scaleout.placement.plan_workers`'s."""
        if self.engine not in ENGINES:
            raise JobError("E_SCALEOUT_USAGE", f"--engine must be local or ray, not {self.engine!r}", 2)
        if self.num_workers is not None and self.num_workers < 1:
            raise JobError("E_SCALEOUT_USAGE", f"--num-workers must be >= 1, not {self.num_workers}", 2)
        super().validate()
        if self.max_new_tokens < 1:
            raise JobError("E_MAX_NEW_TOKENS", "--max-new-tokens must be >= 1", 2)
        if "" in self.stop:
            raise JobError("E_STOP_EMPTY", "--stop \"\" would end every row after its first token; give "
                           "non-empty stop strings (or no --stop)", 2)
        check_ranges(self, JOB_RANGES)


class Range(NamedTuple):
    """The values a numeric field takes: ``low`` (excluded when ``low_open``) up to ``high``, whole
    numbers when ``low`` is an int, finite ones else; ``optional``: None keeps the default; ``hint``
    says what an edge value or leaving the option out means."""

    option: str
    low: float
    high: float | None = None
    low_open: bool = False
    optional: bool = False
    hint: str = ""

    def holds(self, value) -> bool:
        if self.optional and value is None:
            return True
        whole = isinstance(self.low, int)
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            return False
        if not whole and not math.isfinite(value):
            return False
        return (value > self.low if self.low_open else value >= self.low) and (self.high is None or value <= self.high)

    def describe(self) -> str:
        kind = "an integer" if isinstance(self.low, int) else "a number"
        if self.high is None:
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        return f"{kind} in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


# every numeric field's range: a value outside is a usage error (docs/batch.md, Capacity)
ENGINE_RANGES = {
    "max_num_seqs": Range("--max-num-seqs", 1),
    "max_batch_tokens": Range("--max-batch-tokens", 1),
    "max_gpu_adapters": Range("--max-gpu-adapters", 1, optional=True, hint="leave it out to size the slots from memory"),
    "gpu_memory_utilization": Range("--gpu-memory-utilization", 0.0, 1.0, low_open=True),
    "kv_cache_gb": Range("--kv-cache-gb", 0.0, low_open=True, optional=True,
                         hint="leave it out to size the KV cache from free memory"),
    "host_cache_gb": Range("--host-cache-gb", 0.0, optional=True, hint="0: no host cache, every load reads its adapter again"),
    "block_size": Range("block_size", 1),
    "schedule_window": Range("--schedule-window", 1),
    "tensor_parallel_size": Range("--tensor-parallel-size", 1),
    "prefetch_adapters": Range("--prefetch-adapters", 0, hint="0 turns prefetching off"),
    "prefetch_gpu_adapters": Range("--prefetch-gpu-adapters", 0, hint="0 turns GPU-slot prefetching off"),
    "image_build_processes": Range("image_build_processes", 0),
}
JOB_RANGES = {
    "temperature": Range("--temperature", 0.0, hint="0 is greedy"),
    "top_p": Range("--top-p", 0.0, 1.0, low_open=True),
    "top_k": Range("--top-k", 0, hint="0 turns top-k off"),
    "shard_rows": Range("--shard-rows", 1),
    "commit_interval": Range("--commit-interval", 0.0, low_open=True, hint="seconds between shard commits"),
    "workers": Range("workers", 1, optional=True, hint="leave it out to hash on every core"),
}


def check_ranges(config, ranges: dict[str, Range]) -> None:
    """Raise JobError E_OPTION_RANGE (exit 2) for the first field of ``config`` outside its range."""
    for name, r in ranges.items():
        value = getattr(config, name)
        if not r.holds(value):
            hint = f"; {r.hint}" if r.hint else ""
            raise JobError("E_OPTION_RANGE", f"{r.option} must be {r.describe()}, not {value!r}{hint}", 2)


def resolve_device(name: str) -> torch.device:
    """The torch device of ``--device`` on this host (JobError when CUDA is asked for and absent)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise JobError("E_DEVICE", "--device cuda was asked for but no CUDA device is available; use --device cpu or auto", 2)
    if name not in ("cpu", "cuda"):
        raise JobError("E_DEVICE", f"--device must be auto, cuda or cpu, not {name!r}", 2)
    return torch.device(name)


def resolve_dtype(name: str, config_dtype: str | None, device: torch.device) -> torch.dtype:
    """The torch dtype of ``--dtype``: ``auto`` is float32 on the CPU (16-bit CPU matmuls are slow
    and the tests compare in float32), else the checkpoint's dtype (bfloat16 when it names none)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(config_dtype or "", torch.bfloat16)
    if name not in DTYPES:
        raise JobError("E_DTYPE", f"--dtype must be auto, float32, bfloat16 or float16, not {name!r}", 2)
    return DTYPES[name]
