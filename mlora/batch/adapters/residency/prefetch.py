"""Host-tier prefetch: build the verified host images of adapters the scheduler will need next.

Owns a small thread pool and the set of builds in flight. A build runs an
adapter's registered verified source (``catalog.load_factors``: read the
pinned file bytes, re-hash them against the pinned digests, lay the factors
out for a slot, copy them into a pinned block) on a background thread, so that
a cold adapter's disk read and digest check overlap the GPU work of the rows
already running. Must not touch slots, the page ledger or the device: it only
fills the host cache, from the main thread (``collect`` / ``wait``), so the
cache itself stays single-threaded.

Semantics are those of a synchronous ``HostCache.get``: a build that fails
(file changed, unreadable) stores its exception, which is raised to the
caller that needs the adapter, exactly where the synchronous build would
have raised; nothing is served from a failed build, and the next attempt
builds again. Prefetching changes when bytes are read, never which.

Counters: ``issued`` builds started, ``used`` prefetched artifacts that a
load later took from the cache (precision = used / issued).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from mlora.batch.adapters.residency.errors import ResidencyError
from mlora.batch.adapters.residency.host import HostArtifact, HostCache


class HostPrefetcher:
    def __init__(self, host: HostCache, workers: int = 1):
        self.host = host
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mlora-prefetch")
        self._inflight: dict[str, Future] = {}
        self._unused: set[str] = set()  # digests put by a prefetch and not yet taken
        self.issued = 0
        self.used = 0
        host.prefetcher = self

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def request(self, digest: str, build=None) -> bool:
        """Start building ``digest`` unless it is cached, in flight or has no source; True if
        started. ``build``: how to build it here (e.g. in a worker process); default its
        registered source."""
        if digest in self._inflight or self.host.cached(digest):
            return False
        source = self.host.source(digest)
        if source is None:
            return False
        source = build or source
        host = self.host

        def build() -> HostArtifact:
            art = source()
            return art.pinned(host.pool) if host.needs_pinning(art) else art

        self._inflight[digest] = self._pool.submit(build)
        self.issued += 1
        return True

    def building(self, digest: str) -> bool:
        """A build of ``digest`` is in flight and has not failed (a failed one raises at ``wait``)."""
        fut = self._inflight.get(digest)
        return fut is not None and not (fut.done() and fut.exception() is not None)

    def collect(self) -> None:
        """Move finished builds into the cache (failed builds stay until someone needs them)."""
        self.host.reclaim()
        for digest, fut in list(self._inflight.items()):
            if fut.done() and fut.exception() is None:
                del self._inflight[digest]
                self._absorb(digest, fut.result())

    def wait(self, digest: str) -> HostArtifact | None:
        """The artifact of an in-flight build (waiting for it), None if none is in flight.
        A failed build raises its exception here, once."""
        fut = self._inflight.pop(digest, None)
        if fut is None:
            return None
        art = fut.result()  # raises the build's exception
        self._absorb(digest, art)
        return art

    def taken(self, digest: str) -> None:
        """A load took ``digest`` from the cache."""
        if digest in self._unused:
            self._unused.discard(digest)
            self.used += 1

    def _absorb(self, digest: str, art: HostArtifact) -> None:
        if art.digest != digest:
                raise ResidencyError("E_RESIDENCY_HOST_SOURCE", f"the source of {digest[:16]} produced {art.digest[:16]}")
        self.host.put(art, key_names_it=False)
        self._unused.add(digest)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._inflight.clear()
