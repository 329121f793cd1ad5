"""How much of the device a job's KV cache and adapter slots take.

Owns the sizing rules of one engine: KV blocks (:func:`kv_blocks`), adapter slots
(:func:`num_slots`), the adapters' share of the usable GPU memory and the one
arena of the joint memory ledger (:func:`joint_arena`; docs/sizing.md). Reads the
device's free memory; allocates nothing but the arena it returns.
"""

from __future__ import annotations

import gc
import os

import torch

from mlora.batch.adapters.residency import ResidencyBank
from mlora.batch.config import EngineConfig
from mlora.batch.errors import JobError
from mlora.batch.model.arena import ALIGN, PageArena
from mlora.batch.model.kvcache import KVCache


def decode_graphs(opts: EngineConfig, device: torch.device) -> bool:
    """Whether the job's decode steps replay graphs: ``cuda_graphs`` (the default) on a GPU;
    on the CPU only with ``MLORA_EMULATE_GRAPHS=1`` (a debugging aid: the graphs emulated, the
    slot bank on the Triton kernels, interpreted; ``mlora.batch.engine.graphs``)."""
    return bool(opts.cuda_graphs) and (device.type == "cuda" or os.environ.get("MLORA_EMULATE_GRAPHS") == "1")


def release_device_memory(device) -> None:
    """Give a finished job's device memory back to the driver. The residency engine's
    reference cycles keep the KV cache, slots or one-arena ledger alive until the cyclic
    collector runs, and the caching allocator keeps freed blocks: the next job in the
    process (a bench's timed run after its warm-up) would load its weights into the
    freed arena's cached block, splitting it, and find that block neither free nor
    returnable (the next arena could get no pages at all)."""
    gc.collect()
    if getattr(device, "type", device) == "cuda":
        torch.cuda.empty_cache()


ADAPTER_MEMORY_SHARE = 0.25  # of the usable free GPU memory, for adapter slots when --max-gpu-adapters is not given


def num_slots(opts: EngineConfig, adapters: int, slot_bytes: int, device, usable: float | None = None) -> int:
    """GPU adapter slots: ``--max-gpu-adapters`` (at most one per adapter), else on CUDA as
    many as fit in the adapters' share of the usable free memory (the residency engine swaps
    adapters through the slots), else (CPU) one per adapter. The share is a quarter, the rest
    being the KV cache's; with ``--kv-cache-gb`` the KV cache takes exactly that, and the
    adapters have everything else (at least one slot). ``usable``: the usable bytes
    (:func:`rank_usable`) instead of this device's."""
    if opts.max_gpu_adapters is not None:
        return max(1, min(adapters, opts.max_gpu_adapters))
    if device.type == "cuda":
        return max(1, min(adapters, int(adapter_share_bytes(opts, device, usable) // max(slot_bytes, 1))))
    return max(1, adapters)


def adapter_share_bytes(opts: EngineConfig, device, usable: float | None = None) -> float:
    """Device bytes adapter slots (or a bundle's bases and core slots) may take on CUDA: a
    quarter of the usable free memory (``usable``, else this device's now), or, when
    ``--kv-cache-gb`` fixes the KV cache, what the usable memory holds beside it (one
    budget: the two never add up to more than it)."""
    usable = usable_gpu_bytes(opts, device) if usable is None else usable
    if opts.kv_cache_gb:
        return max(0.0, usable - opts.kv_cache_gb * 2**30)
    return ADAPTER_MEMORY_SHARE * usable


def usable_gpu_bytes(opts: EngineConfig, device) -> float:
    """Free device memory that ``--gpu-memory-utilization`` lets the job take now
    (blocks cached by the allocator, e.g. load temporaries, count as free). A job run
    before in this process (a bench's warm-up, a Ray worker's previous job) may still hold
    its slot bank or its whole one-arena ledger through reference cycles (the residency
    engine's bound methods and closures) until the cyclic collector runs: collect first."""
    release_device_memory(device)
    free, total = torch.cuda.mem_get_info(device)
    return max(0.0, free - (1 - opts.gpu_memory_utilization) * total)


def rank_usable(memories: list[tuple[int, int, int] | None], utilization: float) -> float | None:
    """What each rank of a tensor-parallel group may take (every rank allocates the same KV
    blocks and slots): the least, over the group's GPUs, of what ``--gpu-memory-utilization``
    lets a job take of the GPU's free memory, split evenly among the ranks on it (ranks
    sharing one GPU in a debugging run). ``memories``: each rank's (GPU index, free, total)
    with every rank's weights loaded (``tpfollow.rank_memory``); None on the CPU."""
    gpus: dict[int, list] = {}
    for m in memories:
        if m is not None:
            gpus.setdefault(m[0], []).append(m)
    if not gpus:
        return None
    return min(max(0.0, free - (1 - utilization) * total) / len(ranks)
               for ranks in gpus.values() for _, free, total in ranks[:1])


def kv_blocks(opts: EngineConfig, config, dtype, device, usable: float | None = None) -> int:
    """KV blocks: from --kv-cache-gb, else on CUDA from free memory (``usable``, else this
    device's now), else enough for max_num_seqs full contexts (CPU)."""
    def fit(budget_bytes) -> int:
        return max(1, KVCache.blocks_for_budget(budget_bytes, config.num_layers, opts.block_size,
                                                config.num_kv_heads, config.head_dim, dtype))

    if opts.kv_cache_gb:
        return fit(opts.kv_cache_gb * 2**30)
    if device.type == "cuda":
        return fit(usable_gpu_bytes(opts, device) if usable is None else usable)
    per_seq = -(-config.max_position_embeddings // opts.block_size)
    return max(1, opts.max_num_seqs * per_seq)


def joint_arena(opts: EngineConfig, config, dtype: torch.dtype, device: torch.device, adapters: int, slot_bytes: int,
                groups: int, usable: float | None = None, graphs: bool | None = None):
    """(arena, adapter slots) of the joint memory mode: one ``PageArena`` of KV-block pages for
    the whole budget (``--kv-cache-gb`` when given, else the usable GPU memory; on the CPU the
    split mode's KV blocks plus the slots), with at most one slot per adapter
    (``--max-gpu-adapters``) and always room for one longest row's KV beside the slots. A
    slot's pages are KV pages while no adapter holds it. A tensor-parallel rank's arena:
    ``config`` and ``slot_bytes`` of its cut, ``usable`` the tightest rank's bytes
    (:func:`rank_usable`), ``graphs`` whether the group replays decode graphs (one spare page)."""
    page = KVCache.block_bytes(config.num_layers, opts.block_size, config.num_kv_heads, config.head_dim, dtype)
    graphs = decode_graphs(opts, device) if graphs is None else graphs
    spare = int(graphs)  # the decode graphs' scratch block
    pps = ResidencyBank.arena_pages_per_slot(slot_bytes, groups, page)
    want = max(1, min(adapters, opts.max_gpu_adapters or adapters))
    row_pages = -(-config.max_position_embeddings // opts.block_size)
    if opts.kv_cache_gb:
        budget = opts.kv_cache_gb * 2**30
    elif device.type == "cuda":
        budget = usable_gpu_bytes(opts, device) if usable is None else usable
    else:
        budget = (kv_blocks(opts, config, dtype, device) + want * pps + spare) * page
    pages = int(budget // page) - spare
    slots = min(want, (pages - row_pages) // pps) if pages > row_pages else 0
    if page % ALIGN:
        raise JobError("E_MEMORY_LEDGER", f"this model's KV block is {page} bytes, not a multiple of {ALIGN}: one "
                       "arena cannot carve aligned slots from such pages; use --memory-ledger split", 2)
    if not (opts.prefetch_adapters and opts.prefetch_gpu_adapters):
        raise JobError("E_MEMORY_LEDGER", "--memory-ledger joint loads cold adapters asynchronously (a load holds its "
                       "slot's pages from the moment its row is admitted); it needs --prefetch-adapters and "
                       "--prefetch-gpu-adapters above 0", 2)
    if slots < 1:
        source = ""  # where the budget came from
        if opts.kv_cache_gb:
            source = f" (from --kv-cache-gb {opts.kv_cache_gb:g})"
        elif device.type == "cuda" and usable is not None:
            source = f" (from the usable GPU memory of the tightest rank: {usable / 2**30:.2f} GiB)"
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            source = (f" (from the usable GPU memory: {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB after "
                      f"the weights, less the {1 - opts.gpu_memory_utilization:.0%} that --gpu-memory-utilization "
                      f"{opts.gpu_memory_utilization:g} keeps free)")
        raise JobError("E_MEMORY_LEDGER", f"one arena of {max(pages, 0)} pages of {page} bytes{source} cannot hold "
                       f"an adapter slot ({pps} pages) beside one longest row's KV ({row_pages} pages); give it more "
                       "memory (--kv-cache-gb, --gpu-memory-utilization) or use --memory-ledger split", 2)
    return PageArena(pages, page, device, spare), slots
