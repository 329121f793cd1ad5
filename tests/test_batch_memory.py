"""Memory does not grow with the number of input rows.

A 200k-row job and a 20k-row job (tiny model, one new token per row) run in
fresh processes; the larger one's peak RSS must stay within 1.3x of the
smaller one's. About half a minute on two cores.
"""

import os
import subprocess
import sys

import factory
import pyarrow as pa
import pyarrow.parquet as pq
from conftest import REPO

JOB = """
import resource, sys
from mlora.batch.config import JobConfig
from mlora.batch.runner import run_job
s = run_job(JobConfig(input=sys.argv[1], output=sys.argv[2], base=sys.argv[3], prompt_column=None,
                       prompt_ids_column="prompt_ids", max_new_tokens=1, device="cpu",
                       max_num_seqs=512, max_batch_tokens=4096, shard_rows=20000))
assert s.ok_rows == s.rows, s
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _peak_kib(tmp_path, base, rows):
    inp = str(tmp_path / f"in-{rows}.parquet")
    ids = pa.array([[3 + i % 50, 4 + i % 7, 5] for i in range(rows)], pa.list_(pa.int64()))
    pq.write_table(pa.table({"prompt_ids": ids, "adapter": pa.array([None] * rows, pa.string())}), inp,
                   row_group_size=10000)
    r = subprocess.run([sys.executable, "-c", JOB, inp, str(tmp_path / f"out-{rows}"), base],
                       env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.split()[-1])


def test_peak_rss_does_not_grow_with_rows(tmp_path):
    base = str(tmp_path / "base")
    factory.save_base(factory.tiny_model("llama", seed=0), base)
    small = _peak_kib(tmp_path, base, 20_000)
    large = _peak_kib(tmp_path, base, 200_000)
    print(f"peak RSS: 20k rows {small // 1024} MiB, 200k rows {large // 1024} MiB")
    assert large <= 1.3 * small, (small, large)
