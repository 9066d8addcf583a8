#!/usr/bin/env bash
# On the lent GPU host (after the staging calls): issue 46's load. More long-context agents than decode's HBM
# retains, 8B shape, P and D on one H100-sized GPU (18 GiB of KV each, ~131k tokens), one leg per call:
#   bash scripts/gpu/tiers_load.sh OUT tiered     # ON with a host KV tier on decode (HOST_TIER_BYTES)
#   bash scripts/gpu/tiers_load.sh OUT on         # ON, HBM only
#   bash scripts/gpu/tiers_load.sh OUT agg        # one vLLM server with P + D's KV (36 GiB), prefix cache
# Eight conversations of 64k tokens arrive in 30 s, four turns each (512-token tool results, 64 tokens out),
# tool gaps lognormal around 15 s (most 5-40 s, at most 120 s). The first beat of a gap says a tool call
# started; `demote_idle_s=5` demotes on a later beat where decode refused the first (its tier still storing).
# Each leg takes ~4 min, engine start included; `python -m bench.goodput --merge` joins the legs' JSONs here.
set -uo pipefail
OUT=${1:?out dir}; LEG=${2:?leg: on, tiered or agg}; shift 2
# 48 GiB of pinned host memory (~350k tokens of 8B KV, about five of the eight conversations): 68 GiB failed
# to pin on the H100 host (CUDA out of memory in vLLM's CPUOffloadingWorker) though it has ~125 GB of RAM.
HOST_TIER=${HOST_TIER_BYTES:-51539607552}
LOAD_BUDGET_S=${LOAD_BUDGET_S:-480} LOAD_KILL_S=${LOAD_KILL_S:-560} bash scripts/gpu/load.sh "$OUT" "$LEG" \
  --max-model-len 131072 --env VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 --contexts 65536 --turns 4 --suffix 512 \
  --output-tokens 64 --gap-median-s 15 --gap-sigma 0.6 --max-gap-s 120 --rates 0.27 --window-s 30 \
  --drain-s 110 --host-tier-bytes "$HOST_TIER" --records --router-setting demote_idle_s=5 \
  --engine-arg=--gpu-memory-utilization --engine-arg=0.40 \
  --engine-arg=--kv-cache-memory-bytes --engine-arg=19327352832 \
  --agg-engine-arg=--gpu-memory-utilization --agg-engine-arg=0.8 \
  --agg-engine-arg=--kv-cache-memory-bytes --agg-engine-arg=38654705664 "$@"
