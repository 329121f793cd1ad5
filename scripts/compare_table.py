"""Table of an A/B speed comparison from the JSON files `gpu_session.sh compare` writes:
tokens/s per adapter count (`mlora bench batch`) and graph time per case (`mlora bench
kernels`) for tree A and tree B, each run listed, and the ratio of the means B/A (tokens/s:
above 1 is B faster; kernel time: above 1 is B slower), with the geometric mean of the ratios.

    python scripts/compare_table.py DIR     # DIR holds batch-A-1.json, kernels-B-2.json, ...
"""

import glob
import json
import math
import os
import re
import sys


def runs(folder: str, bench: str, tree: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(folder, f"{bench}-{tree}-*.json")),
                   key=lambda p: int(re.findall(r"(\d+)\.json$", p)[0]))
    out = []
    for p in files:
        with open(p) as f:
            out.append(json.load(f))
    return out


def table(title: str, unit: str, a: list[dict], b: list[dict], fmt: str) -> None:
    """a, b: one {case: value} per run of each tree; prints the cases both trees have."""
    cases = [c for c in a[0] if all(c in r for r in a + b)] if a and b else []
    if not cases:
        print(f"{title}: no runs of both trees")
        return
    print(f"{title} ({unit}; A runs | B runs | B/A of the means)")
    ratios = []
    for c in cases:
        va, vb = [r[c] for r in a], [r[c] for r in b]
        ratio = (sum(vb) / len(vb)) / (sum(va) / len(va))
        ratios.append(ratio)
        print(f"  {c:<28} {' '.join(fmt.format(v) for v in va)} | {' '.join(fmt.format(v) for v in vb)} | {ratio:.3f}")
    print(f"  geomean B/A over {len(ratios)} cases: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")


def batch(r: dict) -> dict:
    return {f"{s['adapters']} adapters" + (" (again)" if s.get("repeat") else ""): s["tokens_per_s"]
            for s in r["scenarios"]}


def kernels(r: dict) -> dict:
    return {f"{c['d_out']} r{c['R']} T={c['T']} A={c['adapters']}": c["triton_graph_s"] * 1e6 for c in r["cases"]}


def main(folder: str) -> int:
    table("bench batch", "tokens/s", *[[batch(r) for r in runs(folder, "batch", t)] for t in "AB"], "{:8.0f}")
    table("bench kernels", "graph us", *[[kernels(r) for r in runs(folder, "kernels", t)] for t in "AB"], "{:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
