"""Compare a batch-run OUTPUT of examples/demo/prompts.parquet with
examples/demo/expected.json; exit 1 on any difference. Used to check the demo on
a GPU against the CPU run:

    python -m mlora batch-run examples/demo/prompts.parquet OUT --base examples/demo/base \
        --adapters examples/demo/adapters --max-new-tokens 40 --device cuda --dtype float32
    python scripts/check_demo_outputs.py OUT
"""

import json
import os
import sys

import pyarrow.parquet as pq

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "demo")


def main(out_dir: str) -> int:
    with open(os.path.join(DEMO, "expected.json")) as f:
        expected = json.load(f)
    rows = {r["id"]: r for r in pq.read_table(out_dir).to_pylist()}
    bad = 0
    for i, _ in enumerate(expected["prompts"]):
        for adapter, outs in expected["outputs"].items():
            got = rows[f"{adapter}-{i}"]["completion"]
            if got != outs[i]:
                bad += 1
                print(f"{adapter}-{i}: expected {outs[i]!r}, got {got!r}")
    print(f"{len(rows) - bad} of {len(rows)} rows equal expected.json")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
