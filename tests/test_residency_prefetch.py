"""Host-tier prefetch: a build in flight is what a load gets, a failed build raises
exactly where a synchronous build would have, and nothing is built twice."""

import threading

import pytest
import torch

from mlora.batch.adapters.residency.host import HostArtifact, HostCache, Piece
from mlora.batch.adapters.residency.prefetch import HostPrefetcher


class Source:
    """A verified source that blocks until released and counts its calls."""

    def __init__(self, key, fail=None):
        self.key, self.fail, self.calls = key, fail, 0
        self.gate = threading.Event()

    def __call__(self):
        self.calls += 1
        assert self.gate.wait(5)
        if self.fail:
            raise self.fail
        src = torch.arange(1, 7, dtype=torch.float32).reshape(2, 3) * (1 + len(self.key))
        return HostArtifact(self.key, self.key, [Piece("A", (0,), src)])


def setup(*keys, fail=None):
    host = HostCache()
    pf = HostPrefetcher(host)
    sources = {k: Source(k, fail) for k in keys}
    for k, s in sources.items():
        host.register(k, k, s)
    return host, pf, sources


def test_a_load_takes_the_build_in_flight_and_nothing_is_built_twice():
    host, pf, src = setup("a", "b")
    assert pf.request("a") and not pf.request("a")  # one build per digest
    assert pf.in_flight == 1 and pf.issued == 1
    src["a"].gate.set()
    art = host.get("a")  # waits for the build, does not call the source again
    assert src["a"].calls == 1 and art.digest == "a" and host.cached("a")
    assert pf.used == 1 and pf.in_flight == 0
    host.get("a")
    assert pf.used == 1  # counted once
    assert not pf.request("a")  # cached: nothing to build
    pf.close()


def test_collect_moves_finished_builds_into_the_cache():
    host, pf, src = setup("a")
    pf.request("a")
    src["a"].gate.set()
    pf._inflight["a"].result(timeout=5)
    pf.collect()
    assert host.cached("a") and pf.in_flight == 0 and pf.used == 0  # built, not yet used
    pf.close()


def test_a_failed_build_raises_at_the_load_and_the_next_load_builds_again():
    host, pf, src = setup("a", fail=OSError("E_TEST: file changed"))
    pf.request("a")
    src["a"].gate.set()
    pf.collect()  # a failed build is not absorbed
    assert not host.cached("a")
    with pytest.raises(OSError, match="file changed"):
        host.get("a")
    with pytest.raises(OSError, match="file changed"):  # synchronous build, same outcome
        host.get("a")
    assert src["a"].calls == 2 and not host.cached("a")
    pf.close()


def test_no_source_no_build():
    host = HostCache()
    pf = HostPrefetcher(host)
    assert not pf.request("unknown") and pf.issued == 0
    pf.close()
