"""Every Triton kernel compile (or disk-cache load) of one mlora command, as it happens: shows
compiles that land inside a benchmark's timed runs, and how many variants each kernel compiles.

    PYTHONPATH=. python scripts/compile_log.py bench batch --rows 1024 --adapters 64 --no-repeat-base

Runs the mlora command line with Triton's JIT hooks installed and prints to stderr, per compile:
seconds since start, seconds the compile took, the kernel with its launch options, constexpr
values and specialisation attributes (which arguments were taken as 16-byte aligned or divisible
by 16). Ends with the count of compiles per kernel. Changes nothing else.
"""
import collections
import sys
import time

import triton
from triton import knobs

T0 = time.perf_counter()
_started: dict[int, float] = {}
COUNTS: collections.Counter = collections.Counter()


def _short(repr_: str, compile: dict) -> str:  # noqa: A002 (Triton's name)
    """Kernel name, launch options, constexpr values and the specialisation attributes
    (alignment / divisibility marks per argument): what tells two variants apart."""
    options = repr_.partition("(")[0]
    constants = {k: v for k, v in (compile.get("constants") or {}).items()}
    marks: dict[str, list[int]] = {}  # attribute -> the argument indices it marks (all of them)
    for config in compile.get("configs") or ():
        for key, attrs in (config or {}).items():
            for name, value in attrs:
                marks.setdefault(f"{name.removeprefix('tt.')}={value}", []).append(key[0] if key else -1)
    shown = " ".join(f"{k}:{sorted(v)}" for k, v in sorted(marks.items()))
    return f"{options} constexprs={constants} {shown or 'no marks'}"


def _pre(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
    _started[id(key)] = time.perf_counter()
    return False  # never skip the compile


def _post(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
    now = time.perf_counter()
    took = now - _started.pop(id(key), now)
    COUNTS[repr.split("[")[0]] += 1
    print(f"[compile {now - T0:7.1f} s, {took:5.2f} s] {_short(repr, compile)}", file=sys.stderr, flush=True)


def main() -> None:
    if not hasattr(knobs.runtime, "jit_post_compile_hook"):
        raise SystemExit(f"triton {triton.__version__} has no knobs.runtime.jit_post_compile_hook (3.4 or newer needed)")
    knobs.runtime.jit_cache_hook = _pre
    knobs.runtime.jit_post_compile_hook = _post
    from mlora.cli.app import app

    try:
        app(sys.argv[1:], standalone_mode=False)
    finally:
        print(f"triton {triton.__version__}: {sum(COUNTS.values())} compiles", file=sys.stderr)
        for name, n in COUNTS.most_common():
            print(f"  {n:4d}  {name}", file=sys.stderr)


if __name__ == "__main__":
    main()
