"""Host time of the engine's admission pass and scheduling on the CPU (no GPU needed).

Runs the step-4 residency job's limited run on the tiny preset (the same
scheduling problem as the H200 job: 1,000 adapters, Zipf(1.0), 64 slots,
8,000 rows, the default 8,192-row window) with timers around
``Engine._admit`` (counted only when it admits a row) and ``Engine.schedule``,
and prints them with the job's iterations, loads and amplification (which an
admission change must leave as they are).

    PYTHONPATH=. python scripts/admission_cost.py [--rows 8000] [--window 8192]
"""

import argparse
import time

from mlora.batch.engine import engine as engine_mod
from mlora.bench.residency import ResidencyBenchOptions, run_residency_bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/mlora-admission-cost")
    ap.add_argument("--rows", type=int, default=8000)
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--window", type=int, default=None, help="--schedule-window (default: batch-run's)")
    args = ap.parse_args()
    acc = {"admit": [0.0, 0], "schedule": [0.0, 0]}
    admit, schedule = engine_mod.Engine._admit, engine_mod.Engine.schedule

    def timed_admit(self, chosen, budget):
        t0, n0 = time.perf_counter(), len(chosen)
        out = admit(self, chosen, budget)
        if len(chosen) > n0:
            acc["admit"][0] += time.perf_counter() - t0
            acc["admit"][1] += 1
        return out

    def timed_schedule(self, *a, **k):
        t0 = time.perf_counter()
        out = schedule(self, *a, **k)
        acc["schedule"][0] += time.perf_counter() - t0
        acc["schedule"][1] += 1
        return out

    engine_mod.Engine._admit, engine_mod.Engine.schedule = timed_admit, timed_schedule
    if args.window is not None:
        init = engine_mod.Engine.__init__

        def with_window(self, *a, **k):
            k["max_wait"] = args.window
            init(self, *a, **k)

        engine_mod.Engine.__init__ = with_window
    o = ResidencyBenchOptions(preset="tiny", device="cpu", dtype="float32", adapters=args.adapters, rows=args.rows,
                              slots=64, max_new_tokens=8, prompt_min=16, prompt_max=64, runs=("limited",), warmup_rows=0)
    r = run_residency_bench(args.workdir, o)["runs"][0]
    m = r["metrics"]
    (a_s, a_n), (s_s, s_n) = acc["admit"], acc["schedule"]
    print(f"{m['iterations']} iterations, {r['loads']} loads, amplification {m['load_amplification']}; admission "
          f"{1e3 * a_s / max(a_n, 1):.2f} ms per admitting step ({a_n} steps), schedule {1e3 * s_s / max(s_n, 1):.2f} ms "
          f"per step ({s_n} steps)")


if __name__ == "__main__":
    main()
