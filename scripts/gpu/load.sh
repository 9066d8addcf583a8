#!/usr/bin/env bash
# On the lent GPU host (after .gpu/setup.sh): bench.goodput, many agent conversations at once on one H200,
# Qwen3-8B shape, dummy weights. Legs: off, on, exact (P/D through our router; on and exact share one
# cluster) and agg (one vLLM server with prefix caching and the memory of P + D, clients talk to it directly).
#   bash scripts/gpu/load.sh OUT LEGS [extra bench.goodput flags]
#   e.g. bash scripts/gpu/load.sh "$OUT" off,on,exact,agg
#        bash scripts/gpu/load.sh "$OUT" on,agg --rates 1,2,4,8
# The host gives a command 10 minutes. bench.goodput starts no rate step or leg it cannot finish within
# LOAD_BUDGET_S (default 450 s, engine starts included: ~70 s per P/D pair, ~50 s for agg) and writes
# goodput.partial.json after every step; a hard stop at LOAD_KILL_S (default 540 s) leaves that file.
# Legs the budget skipped are listed in the JSON ("skipped_legs"): run them in a second call.
set -uo pipefail
OUT=${1:?out dir}; LEGS=${2:-off,on,exact,agg}; shift 2 || true
source scripts/gpu/_prelude.sh bench.goodput
LOGS=/tmp/agentkv-load-logs RES=/tmp/agentkv-load
rm -rf "$LOGS" "$RES"; mkdir -p "$LOGS" "$RES" "$OUT"
# P and D: 30 GiB of KV each (~210k tokens of the 8B shape); agg: the same GPU memory as both, in one engine.
timeout -s INT "${LOAD_KILL_S:-540}" python3 -m bench.goodput --device gpu --model /root/model --legs "$LEGS" \
  --max-model-len 32768 --contexts 8192,16384 --turns 4 --suffix 512 --output-tokens 64 \
  --gap-median-s 2 --gap-sigma 1 --max-gap-s 20 --rates 0.5,1,2,4 --window-s 12 --drain-s 15 \
  --max-active 64 --budget-s "${LOAD_BUDGET_S:-450}" --start-estimate-s 90 \
  --engine-arg=--load-format --engine-arg=dummy \
  --engine-arg=--gpu-memory-utilization --engine-arg=0.42 \
  --engine-arg=--kv-cache-memory-bytes --engine-arg=32212254720 \
  --agg-engine-arg=--load-format --agg-engine-arg=dummy \
  --agg-engine-arg=--gpu-memory-utilization --agg-engine-arg=0.84 \
  --agg-engine-arg=--kv-cache-memory-bytes --agg-engine-arg=64424509440 \
  --log-dir "$LOGS" --out "$RES" "$@"
rc=$?
# A killed run leaves no engines behind it (each engine is in its own process group).
pkill -f vllm.entrypoints.openai.api_server 2>/dev/null
grep -h -i -E "Traceback|Error|preempt" "$LOGS"/*/*.log "$LOGS"/*/*/*.log 2>/dev/null \
  | sort | uniq -c | sort -rn | head -20
cp "$RES"/*.json "$OUT"/ 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
ls -la "$OUT"
exit $rc
