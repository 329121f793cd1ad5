"""Compare a batch-run OUTPUT of examples/demo/prompts.parquet with
examples/demo/expected.json, or with another run's OUTPUT (REFERENCE); exit 1 on
any difference. Used to check the demo on a GPU against the CPU run, and a
scaled-out run (--gpus, --tensor-parallel-size) against the one-GPU run:

    python -m mlora batch-run examples/demo/prompts.parquet OUT --base examples/demo/base \
        --adapters examples/demo/adapters --max-new-tokens 40 --device cuda --dtype float32
    python scripts/check_demo_outputs.py OUT [REFERENCE]

With REFERENCE every row of either output must be in both with the same completion
tokens, text and finish reason.
"""

import json
import os
import sys

import pyarrow.parquet as pq

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "demo")
COMPARED = ("completion_token_ids", "completion", "finish_reason")


def against_expected(out_dir: str) -> int:
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


def against_reference(out_dir: str, reference: str) -> int:
    def rows(d):
        return {r["id"]: tuple(r[c] for c in COMPARED) for r in pq.read_table(d, columns=["id", *COMPARED]).to_pylist()}

    got, ref = rows(out_dir), rows(reference)
    bad = sorted(i for i in got.keys() | ref.keys() if got.get(i) != ref.get(i))
    for i in bad[:10]:
        print(f"{i}: {reference} has {ref.get(i)!r}, {out_dir} has {got.get(i)!r}")
    print(f"{len(got.keys() | ref.keys()) - len(bad)} of {len(got.keys() | ref.keys())} rows equal {reference}'s")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(f"usage: {sys.argv[0]} OUT [REFERENCE]")
    sys.exit(against_reference(*sys.argv[1:]) if len(sys.argv) == 3 else against_expected(sys.argv[1]))
