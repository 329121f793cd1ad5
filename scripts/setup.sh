#!/usr/bin/env bash
# Create (or reuse) the project virtual environment .venv with mlora installed.
# The CPU build of torch is installed first, pinned, so that no CUDA build is
# pulled in (README "Dependencies"). Usage: scripts/setup.sh [--test]
# --test adds the test extra at the versions pinned in constraints/test.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
.venv/bin/python -c 'import torch' 2>/dev/null || pip install "torch==${MLORA_TORCH_VERSION:-2.13.0}"
if [ "${1:-}" = "--test" ]; then
  pip install -e '.[test]' -c constraints/test.txt
else
  pip install -e .
fi
