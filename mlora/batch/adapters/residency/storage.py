"""Where a resident adapter's bytes live, and the validation of what landed there.

Owns the ``Storage`` protocol (named destination views of one slot, the
pages an artifact needs, host-side and device-side metadata checks) and two
implementations, plus :func:`validate_landed`, the one validation every load
and every rollback restoration runs before publication (docs/design.md, Load transaction).
Must not know states, leases or the page ledger's rules.

* :class:`SlotStorage` -- fixed max-rank slots: named device tensors with a
  slot axis (the GPU slot bank's A/B/ranks/scales, ``residency/bank.py``; a tiny
  rank-two slot table in the hotswap fixture). A slot's pages are ledger
  tokens and its bytes the slot's sub-tensors; or, with ``first_page`` (one
  arena, ``mlora/batch/model/arena.py``), its pages are a fixed run of the ledger's pages and
  the sub-tensors lie on them.
* :class:`PagedStorage` -- unified vector pages (the sixteen-slot fixture): one device tensor of
  ``num_pages`` pages; an adapter's pages *are* its storage, in page-table order.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from mlora.batch.adapters.residency import host as host_mod
from mlora.batch.adapters.residency.errors import ValidationError
from mlora.batch.adapters.residency.host import HostArtifact, StatsPart, pieces_sha256, view_stats, view_stats_parts
from mlora.kernels import wordstats


class Storage(Protocol):
    num_slots: int

    def pages_for(self, artifact: HostArtifact) -> int: ...

    def views(self, slot: int, pages: list[int]) -> dict[str, torch.Tensor]: ...

    def check_artifact(self, artifact: HostArtifact) -> None:
        """Host-side: the artifact fits the layout and its metadata is servable (before any eviction)."""

    def check_metadata(self, views: dict[str, torch.Tensor], artifact: HostArtifact) -> None:
        """Device-side: the landed metadata (ranks, scales) is servable."""


SMALL_VIEW = 4096  # elements: views up to this size (ranks, scales) are read back whole for the metadata checks


@dataclass
class Probe:
    """What validation reads of landed bytes: the :func:`~.host.view_stats` of every large
    view, computed on the device (one word-stats launch per two 16-bit views on a GPU:
    :func:`~.host.view_stats_parts`), and host copies of the small (metadata) views, whose
    numbers are computed on the host from those copies (a handful of tiny device kernels
    per view would cost more than the copy). Issued right after the copies on the copy
    stream (:func:`probe_landed` with ``non_blocking``), so that by the time the
    copy-complete event has completed everything is on the host and validation waits
    for nothing."""

    names: list[str]  # every view, in order
    parts: list[StatsPart]  # the large views' numbers (rows on the host)
    small: dict[str, torch.Tensor]

    def all_stats(self) -> list[list[int]]:
        """view_stats of every view of ``names``, in order (read once the probe has landed)."""
        large = {}
        for part in self.parts:
            large.update(part.stats())
        return [large[n] if n in large else view_stats(self.small[n]).tolist() for n in self.names]


def probe_landed(views: dict[str, torch.Tensor], non_blocking: bool = False) -> Probe:
    """The device work of validation, on the current stream. ``non_blocking``: the host copies
    land when the stream reaches them (read them only after an event recorded later has
    completed); otherwise they are complete on return."""
    names = list(views)
    small = {n: v.to("cpu", non_blocking=non_blocking) for n, v in views.items() if v.numel() <= SMALL_VIEW}
    parts = view_stats_parts({n: views[n] for n in names if n not in small})
    return Probe(names, [p.to("cpu", non_blocking=non_blocking) for p in parts], small)


PREPARED_DEVICES = ("cuda",)  # devices whose views take prepared probes (tests add "cpu" under the interpreter)


class SlotProber:
    """Issues :func:`probe_landed`'s device work for a slot's views from buffers prepared once
    per slot (a GPU's views: page-locked host buffers for every read-back, carved from one
    allocation per slot, the word-stats launches' output rows, the 16-bit word views): on the
    copy stream a load's probe is then
    one word-stats launch and a few asynchronous copies, with none of the per-load host
    allocation and view bookkeeping. The host enqueues a load's probe after its copies, and
    the copy stream cannot finish before the host has enqueued it, so this host time lies on
    a cold load's critical path.

    The same numbers as :func:`probe_landed` (tested). A slot's buffers are reused only
    once the Probe that read into them has been dropped (a weak reference): a probe issued
    while the slot's last one is still alive -- never the case in the residency manager,
    which reads or drops a load's probe before the slot is loaded again -- takes the plain
    path instead of overwriting it. Views that are not a GPU's, or that the word-stats
    kernel does not take, always take the plain path."""

    def __init__(self):
        self._plans: dict[int, _ProbePlan | None] = {}
        self.prepared = 0  # probes issued from prepared buffers (tests, diagnostics)

    def prepare(self, slot: int, views: dict[str, torch.Tensor]) -> None:
        """Build slot ``slot``'s buffers now, for its views ``views`` (the bank does for every
        slot when it is made): a slot's first load then allocates nothing, instead of pinning
        its read-back buffers while the load is being issued."""
        if slot not in self._plans:
            self._plans[slot] = _ProbePlan.build(views)

    def probe(self, slot: int, views: dict[str, torch.Tensor]) -> Probe:
        """Issue the probe of ``views`` (slot ``slot``'s) on the current stream without waiting;
        read it after an event recorded later has completed."""
        plan = self._plans.get(slot)
        if plan is None or not plan.matches(views):
            plan = self._plans[slot] = _ProbePlan.build(views)
        if plan is None or plan.live():
            return probe_landed(views, non_blocking=True)
        probe = plan.issue(views)
        if probe is None:  # the word-stats kernel failed here: the plain path from now on (it says why)
            self._plans[slot] = None
            return probe_landed(views, non_blocking=True)
        self.prepared += 1
        return probe


class _ProbePlan:
    """One slot's prepared probe (see :class:`SlotProber`)."""

    def __init__(self, names, keys, small, pairs):
        self.names, self.keys, self.small, self.pairs = names, keys, small, pairs
        self._owner = None  # weak reference to the last Probe issued from these buffers

    @staticmethod
    def _key(views) -> tuple:
        return tuple((n, v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.dtype) for n, v in views.items())

    @classmethod
    def build(cls, views: dict[str, torch.Tensor]) -> "_ProbePlan | None":
        if (not views or any(v.device.type not in PREPARED_DEVICES for v in views.values())
                or host_mod.wordstats_failed()):
            return None
        small, large = [], {}
        for n, v in views.items():
            if v.numel() <= SMALL_VIEW:
                small.append(n)
                continue
            flat = v.detach().reshape(-1)
            if flat.stride(0) != 1 or not host_mod.takes_word_stats(flat):
                return None  # a copy or another reduction per load: the plain path does that
            large[n] = flat
        groups = host_mod.word_stats_pairs(large)  # the launches view_stats_parts would make
        chunks = [sum(wordstats.chunks_for(views[n].numel()) for n in pair) for pair in groups]
        # every host buffer of the plan carved from one page-locked allocation: pinning takes a
        # process-wide driver lock that the engine thread's CUDA calls wait behind (pinned.py)
        host = _HostBuffers([(tuple(views[n].shape), views[n].dtype) for n in small]
                            + [((c, 4), torch.int64) for c in chunks],
                            pin=next(iter(views.values())).device.type == "cuda")
        pairs = []
        for k, (pair, c) in enumerate(zip(groups, chunks)):
            words = [large[n].view(torch.int16) for n in pair]  # the slot's memory itself
            dev_rows = torch.empty((c, 4), dtype=torch.int64, device=views[pair[0]].device)
            pairs.append((pair, [views[n].numel() for n in pair], words, host_mod.float_masks(views[pair[0]].dtype),
                          dev_rows, host.tensors[len(small) + k]))
        return cls(list(views), cls._key(views), dict(zip(small, host.tensors)), pairs)

    def matches(self, views) -> bool:
        return self._key(views) == self.keys

    def live(self) -> bool:
        return self._owner is not None and self._owner() is not None

    def issue(self, views: dict[str, torch.Tensor]) -> Probe | None:
        for n, buf in self.small.items():
            buf.copy_(views[n], non_blocking=True)
        parts = []
        for pair, counts, words, masks, dev_rows, host_rows in self.pairs:
            try:  # words alias the views' memory (the plan matches their addresses, shapes and strides)
                wordstats.word_partials(words, *masks, host_mod.CHECK_MODULUS, out=dev_rows)
            except Exception:  # noqa: BLE001 - the plain path records why and says it once
                return None
            host_rows.copy_(dev_rows, non_blocking=True)
            parts.append(StatsPart(pair, counts, host_rows))
        probe = Probe(self.names, parts, dict(self.small))
        self._owner = weakref.ref(probe)
        return probe


class _HostBuffers:
    """Host tensors of the given shapes and dtypes carved from one allocation (page-locked
    with ``pin``), each starting at a multiple of 64 bytes."""

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype]], pin: bool):
        sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
        self.storage, starts, _ = host_mod.image_buffer(sizes, pin)  # a host image's carve, 64-byte offsets
        self.tensors = [self.storage[a : a + n].view(dtype).view(shape)
                        for a, n, (shape, dtype) in zip(starts, sizes, specs)]


def validate_landed(storage: Storage, views: dict[str, torch.Tensor], artifact: HostArtifact,
                    probe: Probe | None = None) -> None:
    """Layout, metadata, finite values, digest of the landed pieces, zeroed tails -- in that
    order, the first failure raised as ValidationError with its E_VALIDATE_* code.
    ``probe``: the numbers read right after the copy (:func:`probe_landed`), else read now.

    Fast path: every view's :func:`~.host.view_stats` (non-finite count, non-zero count, two exact
    word sums) -- the large views' on the device (one Triton pass per 16-bit view on a
    GPU), the small metadata views' from their host copies -- read by the probe, issued
    right after the copies (without one, here, with one synchronisation), and compared
    with the host image's (``HostArtifact.view_checks``, built off the critical path when the artifact
    was prefetched). Equal numbers accept the load without reading the slot back. Any
    difference runs the exact diagnosis below (read back, SHA-256 of the landed pieces,
    per-view tail counts), so the error code names what is wrong; a difference the
    diagnosis cannot place is E_VALIDATE_DIGEST."""
    what = f"adapter {artifact.name!r}"
    for p in artifact.pieces:
        dst = views[p.view][p.index] if p.view in views else None
        if dst is None or dst.shape != p.src.shape or dst.dtype != p.src.dtype:
            raise ValidationError("E_VALIDATE_LAYOUT", f"{what}: piece {p.view}{list(p.index)} does not match the slot")
    if probe is None:
        probe = probe_landed(views)
    storage.check_metadata({**views, **probe.small}, artifact)
    names = probe.names
    want = artifact.view_checks({n: (tuple(views[n].shape), views[n].dtype) for n in names})
    got = probe.all_stats()
    if all(g[0] == 0 and tuple(g) == tuple(want[n]) for n, g in zip(names, got)):
        return
    _diagnose(views, artifact, what)
    bad = [n for n, g in zip(names, got) if tuple(g) != tuple(want[n])]
    raise ValidationError("E_VALIDATE_DIGEST", f"{what}: the landed bytes of {', '.join(bad)} differ from the host "
                          "image (word checksums)")


def _diagnose(views: dict[str, torch.Tensor], artifact: HostArtifact, what: str) -> None:
    """The exact checks behind a fast-path mismatch: raises the first failure."""
    for name, v in views.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise ValidationError("E_VALIDATE_NONFINITE", f"{what}: non-finite values landed in {name}")
    image_sha256, nonzeros = artifact.reference()
    landed = pieces_sha256((p.view, p.index, views[p.view][p.index]) for p in artifact.pieces)
    if landed != image_sha256:
        raise ValidationError("E_VALIDATE_DIGEST", f"{what}: the landed bytes hash to {landed[:16]}, the host "
                              f"artifact to {image_sha256[:16]}")
    for name, v in views.items():
        # Pieces are disjoint and matched bit for bit above, so any further non-zero lies
        # outside them: a stale value in a padded rank tail or an untargeted slice (docs/design.md,
        # Logical and physical rank).
        extra = int(torch.count_nonzero(v)) - nonzeros.get(name, 0)
        if extra:
            raise ValidationError("E_VALIDATE_TAIL", f"{what}: {extra} non-zero value(s) outside the adapter's "
                                  f"factors in {name} (padded tails must be zero)")


class SlotStorage:
    """``tensors``: name -> (device tensor, slot axis). Every tensor has ``num_slots`` along its axis.

    ``first_page``: the slots are carved from the ledger's own pages (one arena, ``model/arena.py``):
    slot ``s`` is pages ``first_page + s * pages_per_slot`` onwards, and only an adapter in
    slot ``s`` may own them (:meth:`slot_pages`); a slot whose pages hold anything else (KV
    blocks) cannot take an adapter until they are free. None: a slot's pages are budget tokens,
    any free pages will do."""

    def __init__(self, tensors: dict[str, tuple[torch.Tensor, int]], pages_per_slot: int = 1,
                 check_meta: Callable[[dict[str, torch.Tensor], str], None] | None = None,
                 first_page: int | None = None):
        sizes = {t.shape[d] for t, d in tensors.values()}
        if len(sizes) != 1:
            raise ValueError(f"slot tensors disagree on the number of slots: {sorted(sizes)}")
        self.tensors, self.pages_per_slot, self.check_meta = tensors, pages_per_slot, check_meta
        self.num_slots = sizes.pop()
        self.first_page = first_page

    def pages_for(self, artifact: HostArtifact) -> int:
        return self.pages_per_slot

    def slot_pages(self, slot: int) -> list[int] | None:
        """The ledger pages slot ``slot`` is made of (None: not fixed)."""
        if self.first_page is None:
            return None
        start = self.first_page + slot * self.pages_per_slot
        return list(range(start, start + self.pages_per_slot))

    def views(self, slot: int, pages: list[int]) -> dict[str, torch.Tensor]:
        return {name: t.select(d, slot) for name, (t, d) in self.tensors.items()}

    def check_artifact(self, artifact: HostArtifact) -> None:
        shapes = {name: t.select(d, 0) for name, (t, d) in self.tensors.items()}
        for p in artifact.pieces:
            dst = shapes[p.view][p.index] if p.view in shapes else None
            if dst is None or dst.shape != p.src.shape or dst.dtype != p.src.dtype:
                raise ValidationError("E_VALIDATE_LAYOUT", f"adapter {artifact.name!r}: piece {p.view}{list(p.index)} "
                                      f"{tuple(p.src.shape)} {p.src.dtype} does not fit the slot layout")
        if self.check_meta is not None:
            self.check_meta({p.view: p.src for p in artifact.pieces if p.index == ()}, artifact.name)

    def check_metadata(self, views: dict[str, torch.Tensor], artifact: HostArtifact) -> None:
        if self.check_meta is not None:
            self.check_meta(views, artifact.name)


class PagedStorage:
    """``num_pages`` vector pages of ``page_elems`` elements; page ``p`` is ``data[p]``.
    ``num_slots`` is the size of the pointer table (how many adapters may be mapped at once)."""

    def __init__(self, num_pages: int, page_elems: int, dtype: torch.dtype, device="cpu", num_slots: int = 16):
        self.data = torch.zeros(num_pages, page_elems, dtype=dtype, device=device)
        self.num_slots = num_slots

    @property
    def page_bytes(self) -> int:
        return self.data.shape[1] * self.data.element_size()

    def pages_for(self, artifact: HostArtifact) -> int:
        return artifact.pages

    def views(self, slot: int, pages: list[int]) -> dict[str, torch.Tensor]:
        return {str(i): self.data[p] for i, p in enumerate(pages)}

    def check_artifact(self, artifact: HostArtifact) -> None:
        names = [p.view for p in artifact.pieces]
        ok = names == [str(i) for i in range(artifact.pages)] and all(
            p.index == () and p.src.shape == self.data.shape[1:] and p.src.dtype == self.data.dtype
            for p in artifact.pieces)
        if not ok:
            raise ValidationError("E_VALIDATE_LAYOUT", f"adapter {artifact.name!r} is not {artifact.pages} whole "
                                  f"pages of {self.data.shape[1]} {self.data.dtype} elements")

    def check_metadata(self, views: dict[str, torch.Tensor], artifact: HostArtifact) -> None:
        pass
