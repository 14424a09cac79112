#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvserve with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kvserve-installed
native=src/kvserve/kv/offload/_stream_copy.c  # compiled by `pip install -e` (setup.py)
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
    || [ "$native" -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  # torch first, pinned: the CPU build on this machine's disk (a bare `torch` pulls CUDA wheels).
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[test]"
  touch "$stamp"
fi
