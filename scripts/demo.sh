#!/usr/bin/env bash
# Install agentkv with the CPU engine and run the demo: tiny model, 1P1D + router, an agent with reuse OFF vs ON.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m agentkv demo "$@"
