#!/usr/bin/env bash
# Step 1 of 3 (the published serve / sweep / cleanup trio): start one leg, 1P1D + router, in the background.
#   LEG=off|on|floor bash bench/repro/serve.sh
# BIDIR (bidirectional_kv_xfer) is the only difference between OFF and ON, and it is set on both servers
# from one config. Prefill runs without prefix caching (the cache-eviction case of the published result),
# except in the floor leg: OFF with prefill's own cache warm, the least a reused turn can cost.
# MODEL (default: the tiny model, built if missing), DEVICE (cpu|gpu, default: what vLLM is installed),
# MAX_MODEL_LEN, RUN (working dir, default .agentkv/repro/$LEG).
set -euo pipefail
cd "$(dirname "$0")/../.."
LEG=${LEG:-on}
case $LEG in
  on) BIDIR=true; PREFILL_CACHE=false ;;
  off) BIDIR=false; PREFILL_CACHE=false ;;
  floor) BIDIR=false; PREFILL_CACHE=true ;;
  *) echo "LEG must be off, on or floor" >&2; exit 2 ;;
esac
RUN=${RUN:-.agentkv/repro/$LEG}
MODEL=${MODEL:-.agentkv/models/tiny}
mkdir -p "$RUN"
[ -d "$MODEL" ] || python3 -m agentkv model tiny "$MODEL"
{
  echo "[cluster]"
  echo "model = \"$MODEL\""
  [ -n "${DEVICE:-}" ] && echo "device = \"$DEVICE\""
  echo "bidirectional = $BIDIR"
  echo "prefill_prefix_caching = $PREFILL_CACHE"
  echo "max_model_len = ${MAX_MODEL_LEN:-8192}"
  echo "log_dir = \"$RUN/logs\""
  echo "[cluster.router_env]"
  echo "AGENTKV_REUSE = \"$BIDIR\""
  echo "AGENTKV_PATH_POLICY = \"always-pd\""  # every ON turn pulls, so the transfer is what is measured
} > "$RUN/cluster.toml"
echo "$LEG" > .agentkv/repro/current
python3 -m agentkv up --config "$RUN/cluster.toml"
