#!/usr/bin/env bash
# Quickstart command 1: set up, then run the main job on the embedded demo
# workspace (examples/demo, CPU, no downloads): validate the demo adapters
# against the demo base, then `mlora batch-run` 40 rows (8 prompts x 4 adapters
# and the base model, mixed in every batch) into demo-output/, and show a few
# rows so you can see what each adapter does.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
mlora validate examples/demo/adapters --base examples/demo/base
rm -rf demo-output
mlora batch-run examples/demo/prompts.parquet demo-output --keep-columns prompt \
    --base examples/demo/base --adapters examples/demo/adapters --max-new-tokens 40 --device cpu
python - <<'PY'
import pyarrow.parquet as pq

rows = pq.read_table("demo-output").to_pylist()
print(f"\n{'adapter':<10} {'prompt':<16} completion")
for r in rows[:15]:
    prompt = r["prompt"].removeprefix("<|bos|>").removesuffix("=")
    print(f"{r['adapter'] or '(base)':<10} {prompt:<16} {r['completion']}")
print(f"... {len(rows)} rows in demo-output/ (Parquet; _manifest.json, _metrics.json, _SUCCESS)")
PY
