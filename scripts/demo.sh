#!/usr/bin/env bash
# The main job on the embedded default: creates the tiny model if missing, starts a local
# cluster (router + 2 engines with host-memory KV offloading and a shared file-system KV tier),
# replays a multi-turn workload with KV-aware routing + offloading and then round robin without,
# prints the comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvserve demo "$@"
