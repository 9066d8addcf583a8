#!/usr/bin/env bash
# Step 3 of 3: stop the running leg (engines and router, by process group) and collect; once every leg has
# run, merge their JSONs into one side-by-side result with plots in OUT (default bench/results/repro).
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m agentkv down
rm -f .agentkv/repro/current
SHAPE=${SHAPE:-published}
mapfile -t legs < <(ls .agentkv/repro/*/sweep/multiturn_sweep_"$SHAPE".json 2>/dev/null)
if [ "${#legs[@]}" -gt 0 ]; then
  python3 -m bench.multiturn_sweep --merge "${legs[@]}" --out "${OUT:-bench/results/repro}"
fi
