"""Where the engine thread of an ``mlora`` command spends its wall time (a sampling profiler).

Runs an mlora command line in this process (for example ``bench residency ...``)
while a background thread samples the main thread's Python stack every
``--interval-ms`` and counts, for every mlora function, the samples in which it
is on the stack (inclusive) and the innermost frames (self). Unlike cProfile it
sees time spent waiting (locks, futures, device syncs) and costs the engine
little. The table is rewritten to ``--out`` every ``--flush-s`` seconds, so a
run stopped by a time limit still leaves its profile.

    PYTHONPATH=. python scripts/sample_engine.py --out /tmp/prof.txt -- \
        bench residency /tmp/rb --adapters 300 --rows 600 --slots 64 --runs limited

Found, in the sixth session, that host images built in worker processes starved
the engine (BENCHMARKS.md, residency).
"""

import argparse
import collections
import sys
import threading
import time
import traceback


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--interval-ms", type=float, default=5.0)
    ap.add_argument("--flush-s", type=float, default=15.0)
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("argv", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    argv = [a for a in args.argv if a != "--"]
    main_id = threading.main_thread().ident
    incl: collections.Counter = collections.Counter()
    leaf: collections.Counter = collections.Counter()
    count = [0]
    t_start = time.perf_counter()
    stop = threading.Event()

    def write() -> None:
        n = max(count[0], 1)
        lines = [f"{' '.join(argv)}", f"{count[0]} samples over {time.perf_counter() - t_start:.1f} s "
                 f"(share of wall time on the main thread's stack)", "inclusive (mlora frames):"]
        lines += [f"  {100 * v / n:6.1f}%  {k}" for k, v in incl.most_common(args.top)]
        lines += ["innermost frame:"] + [f"  {100 * v / n:6.1f}%  {k}" for k, v in leaf.most_common(25)]
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")

    def sample() -> None:
        last = time.perf_counter()
        while not stop.wait(args.interval_ms / 1e3):
            frame = sys._current_frames().get(main_id)
            if frame is None:
                continue
            stack = traceback.extract_stack(frame)
            count[0] += 1
            if stack:
                f = stack[-1]
                leaf[f"{f.filename.rsplit('/', 2)[-2:][-1]}:{f.lineno} {f.name}"] += 1
            seen = set()
            for f in stack:
                if "/mlora/" in f.filename:
                    key = f"{f.filename.split('/mlora/', 1)[1]}:{f.name}"
                    if key not in seen:
                        seen.add(key)
                        incl[key] += 1
            if time.perf_counter() - last > args.flush_s:
                write()
                last = time.perf_counter()

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    from mlora.cli.app import main as cli

    sys.argv = ["mlora"] + argv
    try:
        cli()
    except SystemExit:
        pass
    finally:
        stop.set()
        t.join()
        write()


if __name__ == "__main__":
    main()
