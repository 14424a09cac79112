#!/usr/bin/env bash
# The whole test suite from a fresh machine: venv + packages, lint, then pytest.
# Tests create the tiny model themselves and start their own servers (engines, routers, Redis).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis-server not found: installing Debian's redis-server (needed by the Redis tier tests)"
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) || echo "warning: could not install redis-server"
  fi
fi
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
exec .venv/bin/python -m pytest "$@"
