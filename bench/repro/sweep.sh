#!/usr/bin/env bash
# Step 2 of 3: the multi-turn sweep against the leg serve.sh started (router :8000, prefill :8100,
# decode :8200 by default). Extra flags go to bench.multiturn_sweep (e.g. --lengths 2048,8192,16384,24576).
set -euo pipefail
cd "$(dirname "$0")/../.."
LEG=${LEG:-$(cat .agentkv/repro/current)}
RUN=${RUN:-.agentkv/repro/$LEG}
python3 -m bench.multiturn_sweep --router "${ROUTER:-http://127.0.0.1:8000}" \
  --prefill-url "${PREFILL:-http://127.0.0.1:8100}" --decode-url "${DECODE:-http://127.0.0.1:8200}" \
  --legs "$LEG" --shape "${SHAPE:-published}" --out "$RUN/sweep" "$@"
