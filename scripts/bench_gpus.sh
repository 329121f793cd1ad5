#!/usr/bin/env bash
# `mlora bench gpus` with the scale-out settings: the `mlora bench batch` synthetic job (Llama-3-8B
# shape, 64 rank-16 adapters on every projection, prompts of 128-1024 tokens, 128 new tokens) run by
# `mlora batch-run` on one GPU and with --gpus 0,1; prints both generation tokens/s and the speed-up.
# `--tensor-parallel-size 2` adds a run with --gpus 0,1 --tensor-parallel-size 2 (docs/bench.md).
#
# Usage: scripts/bench_gpus.sh [WORKDIR] [extra `mlora bench gpus` options]
#   WORKDIR holds the synthetic workspace (about 21 GB: base + adapters; reused when complete)
#   and the runs' outputs. Results: gpus-bench.json in the current directory (OUT=... to change);
#   GPUS=0,1 picks the GPUs.
# CPU smoke run: scripts/bench_gpus.sh /tmp/w --device cpu --preset tiny --dtype float32 --rows 32 \
#                  --prompt-max 64 --max-new-tokens 8 --adapters 4 --num-workers 2 --tensor-parallel-size 2
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-/tmp/mlora-bench-gpus}
shift || true
PY=${PYTHON:-python}
"$PY" -m mlora bench gpus "$WORK" --gpus "${GPUS:-0,1}" --adapters 64 --out "${OUT:-gpus-bench.json}" "$@"
