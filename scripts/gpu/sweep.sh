#!/usr/bin/env bash
# On the lent GPU host (see ../shared/gpu/README.md): the multi-turn sweep through our router and connector.
#   bash scripts/gpu/sweep.sh OUT LEGS SHAPES [extra multiturn_sweep flags]
#   e.g. bash scripts/gpu/sweep.sh "$OUT" off,on,floor published,agentic
# Needs vLLM unpacked in /root/site (.gpu/setup.sh), the model in /root/model, and the project's own small
# dependencies (pydantic-settings, python-dotenv, tenacity) as wheels in .whl/deps (installed here).
# The host gives a command 10 minutes: the sweep gets SWEEP_BUDGET_S (default 500 s), then whatever it has
# finished (per-shape partial JSON) and the engine logs are copied to OUT (at most 8 files come back).
# CUDA graphs of decode steps on both engines: add
#   --engine-arg=--compilation-config '--engine-arg={"mode":0,"cudagraph_mode":"FULL_DECODE_ONLY"}'
set -uo pipefail
OUT=${1:?out dir}; LEGS=${2:-off,on}; SHAPES=${3:-published,agentic}; shift 3 || true
source scripts/gpu/_prelude.sh bench.multiturn_sweep
LOGS=/tmp/agentkv-sweep-logs RES=/tmp/agentkv-sweep
rm -rf "$LOGS" "$RES"; mkdir -p "$LOGS" "$RES" "$OUT"
timeout -s INT "${SWEEP_BUDGET_S:-500}" python3 -m bench.multiturn_sweep --device gpu --model /root/model \
  --shape "$SHAPES" --lengths 2048,8192,16384,24576 --suffix 512 --conversations 2 --output-tokens 32 \
  --max-model-len 32768 --legs "$LEGS" --engine-arg=--load-format --engine-arg=dummy \
  --engine-arg=--gpu-memory-utilization --engine-arg=0.42 --engine-arg=--kv-cache-memory-bytes \
  --engine-arg=32212254720 --log-dir "$LOGS" --out "$RES" "$@"
rc=$?
# A killed sweep leaves no engines behind it (each leg's cluster is in its own process group).
pkill -f vllm.entrypoints.openai.api_server 2>/dev/null
# What the engines said about graphs, cross-layer blocks and transfers, and any error.
grep -h -i -E "cuda ?graph|capturing|cross layer|Traceback|Error" "$LOGS"/*/*.log 2>/dev/null \
  | sort | uniq -c | sort -rn | head -20
cp "$RES"/*.json "$OUT"/ 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
ls -la "$OUT"
exit $rc
