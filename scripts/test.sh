#!/usr/bin/env bash
# Quickstart command 2: set up (with test extras), lint (ruff, then the import layers
# of pyproject.toml's [tool.importlinter]), then run the test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/ruff check mlora tests scripts examples
.venv/bin/lint-imports
exec .venv/bin/python -m pytest -q "$@"
