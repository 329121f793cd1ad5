"""The engine/builder turn-taking gate (mlora.batch.gate) and its use by the prefetcher."""

import threading
import time

from mlora.batch.gate import Gate, pause_point
from mlora.batch.residency.host import HostArtifact, HostCache
from mlora.batch.residency.prefetch import HostPrefetcher


def _builder(gate: Gate, steps: list, stop: threading.Event):
    gate.install()
    while not stop.is_set():
        pause_point()
        steps.append(time.monotonic())
        time.sleep(0.001)


def test_builders_pause_during_the_engine_turn_and_resume_after():
    gate, steps, stop = Gate(), [], threading.Event()
    t = threading.Thread(target=_builder, args=(gate, steps, stop), daemon=True)
    t.start()
    time.sleep(0.05)
    assert steps, "the builder never ran outside an engine turn"
    with gate.engine_turn():
        time.sleep(0.02)  # at most the step in progress finishes
        n = len(steps)
        time.sleep(0.1)
        assert len(steps) <= n + 1  # paused at its pause point
        with gate.builders_run():  # the engine waits for a build: builders run
            time.sleep(0.05)
            assert len(steps) > n + 1
        m = len(steps)
        time.sleep(0.1)
        assert len(steps) <= m + 1  # the turn is back
    time.sleep(0.05)
    assert len(steps) > m + 1  # resumed after the turn
    stop.set()
    t.join(1)


def test_pause_point_without_a_gate_returns_at_once():
    pause_point()  # this thread installed no gate: nothing to wait for


def test_a_load_that_waits_for_a_build_inside_the_engine_turn_does_not_deadlock():
    host = HostCache()
    pf = HostPrefetcher(host, workers=1)
    started = threading.Event()

    def source():
        started.set()
        for _ in range(20):
            pause_point()
            time.sleep(0.001)
        return HostArtifact("k", "d", [], name="k")

    host.register("k", "d", source)
    with pf.gate.engine_turn():
        assert pf.request("d")
        assert started.wait(1)
        done = []
        t = threading.Thread(target=lambda: done.append(host.get("d")), daemon=True)
        t.start()  # stands in for the engine thread's load (it holds the turn)
        t.join(5)
        assert done and done[0].digest == "d"
    pf.close()
