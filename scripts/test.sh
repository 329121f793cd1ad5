#!/usr/bin/env bash
# Quickstart command 2: set up (with test extras), lint (ruff, then the import layers
# of pyproject.toml's [tool.importlinter]), then run the test suite in two processes (pytest-xdist;
# worksteal balances single tests, so no test may rely on another having run), one torch thread
# each (tiny CPU ops slow down by an order of magnitude when threads outnumber free cores).
# Extra arguments go to pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/ruff check mlora tests scripts examples
.venv/bin/lint-imports
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -n 2 --dist worksteal --durations=15 "$@"  # the slowest tests listed: the suite must stay short
