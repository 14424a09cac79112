#!/usr/bin/env bash
# The whole test suite from a fresh machine: venv + packages, lint, then pytest.
# Tests create the tiny model themselves and start their own servers (engines, routers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
exec .venv/bin/python -m pytest "$@"
