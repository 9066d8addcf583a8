#!/usr/bin/env bash
# Install agentkv with the CPU engine and run the demo: tiny model, 1P1D + router, an agent with reuse OFF vs ON.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "agentkv demo: 1/2 install (scripts/setup.sh)" >&2
bash scripts/setup.sh
echo "agentkv demo: 2/2 build the tiny model, start 1P1D + two routers, run the agent with reuse OFF then ON" >&2
exec "${PYTHON:-python3}" -m agentkv demo "$@"
