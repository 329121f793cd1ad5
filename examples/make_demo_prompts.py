"""Write examples/demo/prompts.parquet: every demo prompt with every demo adapter
and the base model, rows interleaved so that one batch mixes all adapters.

    python examples/make_demo_prompts.py
"""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")


def main() -> None:
    with open(os.path.join(DEMO, "expected.json")) as f:
        expected = json.load(f)
    adapters = ["__base__", "upper", "reverse", "spell", "rot13"]
    ids, prompts, names = [], [], []
    for i, p in enumerate(expected["prompts"]):
        for a in adapters:
            ids.append(f"{a}-{i}")
            prompts.append(expected["format"].format(prompt=p))
            names.append(None if a == "__base__" else a)
    table = pa.table({"id": ids, "prompt": prompts, "adapter": pa.array(names, pa.string())})
    pq.write_table(table, os.path.join(DEMO, "prompts.parquet"))


if __name__ == "__main__":
    main()
