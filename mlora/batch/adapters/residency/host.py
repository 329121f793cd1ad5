"""The host tier: verified adapter images ready to copy, in a bounded LRU cache.

Owns :class:`HostArtifact` (what one slot must hold, as a list of pieces to
copy plus the digests and non-zero counts that validation compares against)
and :class:`HostCache` (digest -> artifact, bounded by bytes, with a
registered *verified source* per digest that can rebuild an evicted artifact,
e.g. ``catalog.load_factors`` re-hashing the pinned file bytes). Must not
know slots or devices beyond pinning host memory for CUDA transfers.

A trusted host source is what rollback restores victims from (docs/design.md,
Load transaction) and what the eviction predicate asks for (``host_source_verified``;
docs/design.md, Eviction eligibility).
"""

from __future__ import annotations

import hashlib
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from mlora.batch.adapters.residency.errors import ResidencyError
from mlora.kernels import wordstats


@dataclass(frozen=True)
class Piece:
    """Copy ``src`` (host) into ``view[index]`` of the slot view named ``view``."""

    view: str
    index: tuple
    src: torch.Tensor


@dataclass
class HostArtifact:
    """One adapter generation's bytes on the host, laid out for a slot.

    ``digest`` is the artifact identity a handle carries; ``pieces`` are the
    only bytes transferred (everything else in the slot is zeroed on the
    device first); ``view_checks`` gives the expected per-view statistics the
    fast validation compares on the device; ``image_sha256`` hashes the pieces
    and ``nonzeros`` counts non-zero elements per view (``reference()``: the
    exact diagnosis of a failed validation re-hashes what landed and catches a
    stale value in a padded tail by one integer comparison)."""

    key: str
    digest: str
    pieces: list[Piece]
    name: str = ""  # human id for messages and fault matching (an adapter id)
    pages: int = 0  # ledger pages it needs when resident
    meta: dict = field(default_factory=dict)
    image_sha256: str = ""
    nonzeros: dict[str, int] = field(default_factory=dict)
    checks: dict = field(default_factory=dict)  # view shapes -> expected view_stats (see view_checks)
    transfer_ready: bool = False  # bytes in page-locked memory (or a PinnedPool's block): copies are asynchronous

    def __post_init__(self):
        self.name = self.name or self.key

    def reference(self) -> tuple[str, dict[str, int]]:
        """(``image_sha256``, ``nonzeros``), computed on first use: only a failed fast
        validation needs them."""
        if not self.image_sha256:
            self.image_sha256 = pieces_sha256((p.view, p.index, p.src) for p in self.pieces)
        if not self.nonzeros:
            for p in self.pieces:
                self.nonzeros[p.view] = self.nonzeros.get(p.view, 0) + int(torch.count_nonzero(p.src))
        return self.image_sha256, self.nonzeros

    def header(self) -> "HostArtifact":
        """The same artifact without its bytes (no pieces): what a published entry keeps
        (identity, name, pages, metadata, check numbers). A rollback restores a victim from
        the host cache or its verified source, never from the entry, so a resident adapter
        holds no host memory (no pinned block) of its own."""
        return HostArtifact(self.key, self.digest, [], self.name, self.pages, self.meta, self.image_sha256,
                            dict(self.nonzeros), dict(self.checks))

    @property
    def nbytes(self) -> int:
        return sum(p.src.numel() * p.src.element_size() for p in self.pieces)

    def pinned(self, pool=None) -> "HostArtifact":
        """The same artifact in page-locked memory (for asynchronous host-to-device copies):
        every piece copied into one buffer (one allocation per artifact, not one per piece),
        each piece at a 64-byte aligned offset. With ``pool`` (a ``pinned.PinnedPool``) the
        buffer is one of its blocks, given back when the new artifact is garbage collected,
        and no driver call is made; when the pool has no free block, ``self`` is returned
        unchanged (pageable: still correct, its copies are merely synchronous)."""
        offsets, total = packed_offsets([p.src.numel() * p.src.element_size() for p in self.pieces])
        if pool is not None:
            buf = pool.take(total)
            if buf is None:
                return self  # no free block: stay pageable (no allocation made)
        else:
            buf = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        pieces = []
        for p, off in zip(self.pieces, offsets):
            n = p.src.numel() * p.src.element_size()
            dst = buf[off:off + n].view(p.src.dtype).view(p.src.shape)
            dst.copy_(p.src)
            pieces.append(Piece(p.view, p.index, dst))
        art = HostArtifact(self.key, self.digest, pieces, self.name, self.pages, self.meta, self.image_sha256,
                           dict(self.nonzeros), dict(self.checks), transfer_ready=True)
        if pool is not None:
            pool.own(art, buf)
        return art

    def view_checks(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, tuple[int, ...]]:
        """Expected :func:`view_stats` of every destination view once this artifact landed
        in a zeroed slot whose views have ``shapes`` (name -> (shape, dtype)): computed on
        the host from an image of each view (zeros, then the pieces), cached per layout."""
        key = tuple(sorted((n, tuple(sh), str(dt)) for n, (sh, dt) in shapes.items()))
        if key not in self.checks:
            out = {}
            for name, (shape, dtype) in shapes.items():
                mine = [p for p in self.pieces if p.view == name]
                if len(mine) == 1 and mine[0].index == () and tuple(mine[0].src.shape) == tuple(shape) \
                        and mine[0].src.dtype == dtype:
                    image = mine[0].src  # a whole-view piece is the view's image
                else:
                    image = torch.zeros(shape, dtype=dtype)
                    for p in mine:
                        image[p.index] = p.src
                out[name] = tuple(view_stats(image).tolist())
            self.checks[key] = out
        return self.checks[key]


def packed_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Each piece's offset in one buffer (64-byte aligned, so every dtype view is aligned)
    and the buffer's size."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // 64) * 64
    return offsets, max(total, 1)


def image_buffer(sizes: list[int], pin: bool, pool=None) -> tuple[torch.Tensor, list[int], bool]:
    """(uint8 host buffer, each piece's offset, whether the buffer is a block of ``pool``) for
    pieces of ``sizes`` bytes. With ``pool``: a free block of it, else pageable memory
    (never a new page-locked allocation: that takes the CUDA driver's lock, see
    ``pinned.py``); without: page-locked when ``pin``."""
    offsets, total = packed_offsets(sizes)
    if pool is not None:
        block = pool.take(total)
        if block is not None:
            return block, offsets, True
        return torch.empty(total, dtype=torch.uint8), offsets, False
    return torch.empty(total, dtype=torch.uint8, pin_memory=pin), offsets, False


CHECK_MODULUS = 65521  # position weights 1 .. 65521

# (exponent mask, magnitude mask) of a float dtype's bit pattern: finite iff the
# exponent is not all ones; non-zero (as a float: -0.0 is zero) iff any magnitude bit is set
_FLOAT_BITS = {
    torch.bfloat16: (torch.int16, 0x7F80, 0x7FFF),
    torch.float16: (torch.int16, 0x7C00, 0x7FFF),
    torch.float32: (torch.int32, 0x7F800000, 0x7FFFFFFF),
    torch.float64: (torch.int64, 0x7FF0000000000000, 0x7FFFFFFFFFFFFFFF),
}
_WEIGHTS: dict[str, torch.Tensor] = {}  # device -> int32 position weights, a growing prefix


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """int32 [n]: (position mod 65521) + 1, cached per device (every view shares the prefix)."""
    key = str(device)
    w = _WEIGHTS.get(key)
    if w is None or w.numel() < n:
        w = torch.arange(max(n, 1 << 20), dtype=torch.int64, device=device).remainder_(CHECK_MODULUS).add_(1)
        w = w.to(torch.int32)
        _WEIGHTS[key] = w
    return w[:n]


def view_stats(t: torch.Tensor) -> torch.Tensor:
    """int64 [4] on ``t``'s device: (non-finite count -- 0 exactly when every value is
    finite --, non-zero count, sum of the bytes read as 16-bit words, sum of word x
    ((position mod 65521) + 1)). Exact integer arithmetic:
    |word| <= 2^15 and weights <= 2^16, so every product fits in int32 and the sums stay
    below 2^63 for views of up to 2^31 words. The same bytes give the same four numbers
    on every device (host tensors take a numpy path: torch's int64 reductions on the
    CPU are an order of magnitude slower, and the host side runs once per adapter
    load); a landed view whose numbers equal its host image's is accepted without
    reading it back."""
    flat = _flat(t)
    if flat.device.type != "cpu" and _fused_eligible(flat) and _WORDSTATS_FAILED is None:
        return _view_stats_fused(flat)  # the one Triton kernel, unless it cannot run here
    return _view_stats_unfused(flat)


@dataclass
class StatsPart:
    """Rows of :func:`view_stats` numbers for ``names``: with ``counts`` (words per view) the
    rows are per-program partials of one word-stats launch, summed per view on reading;
    without, one row per view."""

    names: list[str]
    counts: list[int] | None
    rows: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> "StatsPart":
        return StatsPart(self.names, self.counts, self.rows.to(device, non_blocking=non_blocking))

    def stats(self) -> dict[str, list[int]]:
        """name -> view_stats as a list (read once the rows have landed)."""
        if self.counts is None:
            return dict(zip(self.names, self.rows.tolist()))
        return dict(zip(self.names, wordstats.split_sums(self.rows, self.counts)))


def word_stats_pairs(flats: dict[str, torch.Tensor]) -> list[list[str]]:
    """The word-stats launches of these views: names grouped by dtype (in first-seen order),
    two to a launch, in order."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for n, f in flats.items():
        by_dtype.setdefault(f.dtype, []).append(n)
    return [names[i : i + 2] for names in by_dtype.values() for i in range(0, len(names), 2)]


def view_stats_parts(views: dict[str, torch.Tensor], fused: bool | None = None) -> list[StatsPart]:
    """:func:`view_stats` of every view, issued on the current stream without waiting: a GPU's
    large 16-bit views two at a time (same dtype: :func:`word_stats_pairs`) in one word-stats
    launch each, writing per-chunk partials (no zeroed buffer, no atomics: ``wordstats.py``), any other view
    through view_stats into a row of its own. ``fused``: force the Triton path (tests, under
    the interpreter) or the other one; default: a GPU's large 16-bit views. If the kernel
    cannot run here, the same numbers come from torch reductions, said once per process."""
    global _WORDSTATS_FAILED
    flats = {n: _flat(v) for n, v in views.items()}
    take = [n for n, f in flats.items()
            if (fused if fused is not None else (_WORDSTATS_FAILED is None and takes_word_stats(f)))]
    parts: list[StatsPart] = []
    done = set()
    for pair in word_stats_pairs({n: flats[n] for n in take}):
        if _WORDSTATS_FAILED is not None and not fused:
            break
        try:
            rows = wordstats.word_partials([flats[n].view(torch.int16) for n in pair], *float_masks(flats[pair[0]].dtype),
                                 CHECK_MODULUS)
        except Exception as exc:  # noqa: BLE001 - the kernel cannot run here (e.g. it does not compile)
            if fused:
                raise
            # the same numbers the slower way (view_stats then takes torch reductions), for the
            # rest of the process; said once
            _WORDSTATS_FAILED = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            warnings.warn(f"mlora: the word-stats kernel failed ({_WORDSTATS_FAILED}); load validation uses "
                          "torch reductions instead (slower, same numbers)", RuntimeWarning)
            break
        parts.append(StatsPart(pair, [flats[n].numel() for n in pair], rows))
        done.update(pair)
    rest = [n for n in flats if n not in done]
    if rest:
        rows = torch.stack([_view_stats_unfused(flats[n]) for n in rest])
        parts.append(StatsPart(rest, None, rows))
    return parts


def _view_stats_unfused(flat: torch.Tensor) -> torch.Tensor:
    """:func:`view_stats` without the Triton kernel: numpy on the host, torch reductions on a device."""
    return _view_stats_host(flat) if flat.device.type == "cpu" else _view_stats_torch(flat)


_WORDSTATS_FAILED: str | None = None  # why the word-stats kernel could not run in this process (None: it can)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous 1-D tensor (a copy only when its one stride is not 1)."""
    flat = t.detach().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # e.g. a one-element column slice "contiguous" with stride > 1
        flat = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device).copy_(flat)
    if flat.numel() * flat.element_size() > 2**32:
        raise ValueError("view_stats: a view of more than 2^31 words could overflow the weighted sum")
    return flat


def wordstats_failed() -> bool:
    """Whether the word-stats kernel could not run in this process (the torch reductions stand in)."""
    return _WORDSTATS_FAILED is not None


def float_masks(dtype: torch.dtype) -> tuple[int, int]:
    """(exponent mask, magnitude mask) of a 16-bit float dtype's words: the word-stats kernel's EXP and MAG."""
    _, exp, mag = _FLOAT_BITS[dtype]
    return exp, mag


def takes_word_stats(flat: torch.Tensor) -> bool:
    """view_stats_parts' default: the word-stats kernel for a GPU's large 16-bit views (contiguous 1-D)."""
    return flat.device.type != "cpu" and _fused_eligible(flat)


def _fused_eligible(flat: torch.Tensor) -> bool:
    return flat.dtype in (torch.bfloat16, torch.float16) and flat.numel() >= FUSED_STATS_MIN


FUSED_STATS_MIN = 1 << 16  # 16-bit views at least this long take the one-pass Triton kernel on a GPU


def _view_stats_fused(flat: torch.Tensor) -> torch.Tensor:
    """:func:`view_stats` of a contiguous 1-D bfloat16/float16 tensor in one Triton pass
    (``wordstats.py``) and one sum of its partials, instead of about ten torch kernels with
    int32 temporaries twice the view's size."""
    exp, mag = float_masks(flat.dtype)
    return wordstats.word_stats(flat.view(torch.int16), exp, mag, CHECK_MODULUS)


def _view_stats_torch(flat: torch.Tensor) -> torch.Tensor:
    """:func:`view_stats` of a contiguous 1-D tensor with torch reductions on its device
    (no synchronisation: the result stays on the device)."""
    bits = _FLOAT_BITS.get(flat.dtype)
    if bits is not None:
        b = flat.view(bits[0])
        nonfinite = torch.count_nonzero((b & bits[1]) == bits[1])
        nonzero = torch.count_nonzero(b & bits[2])
    else:
        nonfinite = (torch.count_nonzero(~torch.isfinite(flat)) if flat.is_floating_point()
                     else torch.zeros((), dtype=torch.int64, device=flat.device))
        nonzero = torch.count_nonzero(flat)
    raw = flat.view(torch.uint8)
    if raw.numel() % 2:
        raw = torch.cat((raw, raw.new_zeros(1)))
    words = raw.view(torch.int16).to(torch.int32)
    weighted = (words * _weights(words.numel(), words.device)).sum(dtype=torch.int64)
    return torch.stack((nonfinite.to(torch.int64), nonzero.to(torch.int64), words.sum(dtype=torch.int64), weighted))


def _view_stats_host(flat: torch.Tensor) -> torch.Tensor:
    """:func:`view_stats` of a contiguous 1-D host tensor, with numpy reductions."""
    bits = _FLOAT_BITS.get(flat.dtype)
    if bits is not None:
        b = flat.view(bits[0]).numpy()
        nonfinite = int(np.count_nonzero((b & bits[1]) == bits[1]))
        nonzero = int(np.count_nonzero(b & bits[2]))
    else:
        nonfinite = int(torch.count_nonzero(~torch.isfinite(flat))) if flat.is_floating_point() else 0
        nonzero = int(torch.count_nonzero(flat))
    raw = flat.view(torch.uint8).numpy()
    if raw.size % 2:
        raw = np.concatenate((raw, np.zeros(1, dtype=np.uint8)))
    words = raw.view(np.int16)
    w32 = words.astype(np.int32)
    w32 *= _weights(words.size, torch.device("cpu")).numpy()
    return torch.tensor([nonfinite, nonzero, int(words.sum(dtype=np.int64)), int(w32.sum(dtype=np.int64))],
                        dtype=torch.int64)


def pieces_sha256(pieces) -> str:
    """sha256 over (view, index, dtype, shape, bytes) of each piece, in order; device tensors
    are read back to the host."""
    h = hashlib.sha256()
    for view, index, t in pieces:
        # a fresh 1-D copy: a one-element column slice can be "contiguous" with a stride > 1,
        # which view(uint8) refuses (clone() would keep that stride)
        t = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1))
        h.update(f"{view}|{index!r}|{t.dtype}|{t.numel()}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class HostCache:
    """digest -> :class:`HostArtifact`, least recently used first, at most ``capacity_bytes``
    (None: unbounded). ``key -> digest`` remembers which artifact an alias names now."""

    def __init__(self, capacity_bytes: int | None = None, pin: bool = False, pool=None):
        self.capacity_bytes, self.pin, self.pool = capacity_bytes, pin, pool  # pool: a pinned.PinnedPool
        self._cache: OrderedDict[str, HostArtifact] = OrderedDict()
        self._sources: dict[str, Callable[[], HostArtifact]] = {}
        self._current: dict[str, str] = {}
        self.hits = self.misses = self.bytes = 0
        self.prefetcher = None  # a residency.prefetch.HostPrefetcher attaches itself here

    def cached(self, digest: str) -> bool:
        return digest in self._cache

    def source(self, digest: str) -> Callable[[], HostArtifact] | None:
        return self._sources.get(digest)

    def register(self, key: str, digest: str, source: Callable[[], HostArtifact]) -> None:
        """A verified way to (re)build ``digest``; ``key`` now names it."""
        self._sources[digest] = source
        self._current[key] = digest

    def put(self, artifact: HostArtifact, key_names_it: bool = True) -> None:
        self.reclaim()
        if self.needs_pinning(artifact):
            artifact = artifact.pinned(self.pool)
        if artifact.digest in self._cache:
            self.bytes -= self._cache.pop(artifact.digest).nbytes
        self._cache[artifact.digest] = artifact
        self.bytes += artifact.nbytes
        if key_names_it:
            self._current[artifact.key] = artifact.digest
        self._shrink(keep=artifact.digest)

    def needs_pinning(self, artifact: HostArtifact) -> bool:
        return self.pin and bool(artifact.pieces) and not artifact.transfer_ready

    def reclaim(self) -> None:
        """Free the pinned blocks of images that are gone (their copies fenced; ``PinnedPool.reclaim``)."""
        if self.pool is not None:
            self.pool.reclaim()

    def digest_of(self, key: str) -> str:
        if key not in self._current:
            raise ResidencyError("E_RESIDENCY_HOST_SOURCE", f"no host artifact or source names {key!r}")
        return self._current[key]

    def has_source(self, digest: str) -> bool:
        return digest in self._cache or digest in self._sources

    def get(self, digest: str) -> HostArtifact:
        if self.prefetcher is not None and digest not in self._cache:
            self.prefetcher.wait(digest)  # a build in flight lands in the cache (or raises its error)
        art = self._cache.get(digest)
        if art is not None:
            self.hits += 1
            self._cache.move_to_end(digest)
            if self.prefetcher is not None:
                self.prefetcher.taken(digest)
            return art
        source = self._sources.get(digest)
        if source is None:
            raise ResidencyError("E_RESIDENCY_HOST_SOURCE", f"artifact {digest[:16]} has no verified host source")
        self.misses += 1
        art = source()  # the source verifies (e.g. re-hashes the pinned file bytes) or raises
        if art.digest != digest:
            raise ResidencyError("E_RESIDENCY_HOST_SOURCE", f"the source of {digest[:16]} produced {art.digest[:16]}")
        self.put(art, key_names_it=False)
        return self._cache[digest]

    def forget(self, digest: str) -> None:
        """Drop the cached bytes and the source (the host no longer has a trusted copy)."""
        art = self._cache.pop(digest, None)
        if art is not None:
            self.bytes -= art.nbytes
        self._sources.pop(digest, None)

    def _shrink(self, keep: str) -> None:
        if self.capacity_bytes is None:
            return
        for digest in list(self._cache):
            if self.bytes <= self.capacity_bytes:
                break
            if digest != keep and digest in self._sources:  # only what can be rebuilt may be dropped
                self.bytes -= self._cache.pop(digest).nbytes
