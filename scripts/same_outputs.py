"""Whether two batch-run outputs hold the same tokens row by row (GPU A/B of engine modes).

    PYTHONPATH=. python scripts/same_outputs.py OUT_A OUT_B

Prints the rows present in both, how many have identical ``completion_token_ids``, and
for the others the median position of the first different token (greedy bf16 jobs can
part ways after a near-tie when the two modes sum in another order). Exit status 1 when
the two outputs do not hold the same row ids or any row's tokens differ."""

import statistics
import sys

import pyarrow.parquet as pq


def tokens(path: str) -> dict[str, list[int]]:
    t = pq.read_table(path, columns=["id", "completion_token_ids"]).to_pydict()
    return dict(zip(t["id"], t["completion_token_ids"]))


def main() -> int:
    a, b = (tokens(p) for p in sys.argv[1:3])
    common = a.keys() & b.keys()
    differ = [k for k in common if a[k] != b[k]]
    first = [next((i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y), min(len(a[k]), len(b[k])))
             for k in differ]
    print(f"{len(common)} rows in both ({len(a)} and {len(b)}), {len(common) - len(differ)} identical"
          + (f", {len(differ)} differ (first different token at median position {statistics.median(first)})"
             if differ else ""))
    return 0 if not differ and len(common) == len(a) == len(b) else 1


if __name__ == "__main__":
    sys.exit(main())
