#!/usr/bin/env bash
# Quickstart command 1: set up, then run the main job on the embedded demo
# workspace (examples/demo). Until `mlora batch-run` exists (step 3) the main
# job is: validate every demo adapter against the demo base, then hash them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
mlora validate examples/demo/adapters --base examples/demo/base
mlora hash examples/demo/adapters --base examples/demo/base
