#!/usr/bin/env bash
# Everything pending on the GPU machine, in one call that fits the 10-minute limit
# (run with the device tool from the repository root; results land in $OUT):
#   bash scripts/gpu_session.sh quick      GPU-only tests + demo check + bench batch (about 6 min)
#   bash scripts/gpu_session.sh residency  the step-4 residency benchmark, limited run (about 8 min)
#   bash scripts/gpu_session.sh resident   the step-4 residency benchmark, all-resident run (about 6 min)
# Each part writes JSON/text under $OUT; copy the figures into BENCHMARKS.md.
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
case "${1:-quick}" in
  quick)
    timeout 240 python -m pytest -q -x tests/test_batch_graphs.py tests/test_batch_attention.py tests/test_batch_model.py \
      tests/test_residency.py tests/test_residency_validate.py tests/test_kernels_triton.py 2>&1 | tail -5
    for dt in float32 bfloat16; do
      rm -rf "/tmp/demo-$dt"
      timeout 90 python -m mlora batch-run examples/demo/prompts.parquet "/tmp/demo-$dt" --base examples/demo/base \
        --adapters examples/demo/adapters --max-new-tokens 40 --device cuda --dtype "$dt" -q >/dev/null 2>"$OUT/demo-$dt.err"
      echo "demo $dt: $(python scripts/check_demo_outputs.py "/tmp/demo-$dt" | tail -1)"
    done
    timeout 300 python -m mlora bench batch --rows 1024 --adapters 0,1,8,64 --out "$OUT/batch-h200.json" 2>&1 | grep adapters
    ;;
  residency)
    timeout 560 python -m mlora bench residency /tmp/rb --adapters 1000 --rows 8000 --slots 64 --runs limited \
      --out "$OUT/residency-limited.json" 2>&1 | tail -12
    ;;
  resident)
    timeout 560 python -m mlora bench residency /tmp/rb --adapters 1000 --rows 8000 --runs all-resident \
      --out "$OUT/residency-all-resident.json" 2>&1 | tail -12
    ;;
esac
