#!/usr/bin/env bash
# On the lent GPU host (see ../shared/gpu/README.md): the multi-turn sweep through our router and connector.
#   bash scripts/gpu/sweep.sh OUT LEGS SHAPES [extra multiturn_sweep flags]
#   e.g. bash scripts/gpu/sweep.sh "$OUT" off,on published,agentic
# Needs vLLM unpacked in /root/site (.gpu/setup.sh), the model in /root/model, and the project's own small
# dependencies (pydantic-settings, python-dotenv, tenacity) as wheels in .whl/deps (installed here).
# Written 2026-12-01 and NOT yet run on the device (that session had no device time left). To try CUDA
# graphs of decode steps, add: --engine-arg=--compilation-config '--engine-arg={"mode":0,"cudagraph_mode":"FULL_DECODE_ONLY"}'
set -uo pipefail
OUT=${1:?out dir}; LEGS=${2:-off,on}; SHAPES=${3:-published,agentic}; shift 3 || true
if [ -d .whl/deps ] && ! PYTHONPATH=/root/site python3 -c "import pydantic_settings, tenacity" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .whl/deps/*.whl || exit 1
fi
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1
LOGS=/tmp/agentkv-sweep-logs
sweep() {
  python3 -m bench.multiturn_sweep --device gpu --model /root/model --shape "$SHAPES" \
    --lengths 2048,8192,16384,24576 --suffix 512 --conversations 2 --output-tokens 64 --max-model-len 32768 \
    --legs "$LEGS" --engine-arg=--load-format --engine-arg=dummy --engine-arg=--gpu-memory-utilization \
    --engine-arg=0.42 --engine-arg=--kv-cache-memory-bytes --engine-arg=32212254720 \
    --log-dir "$LOGS" --out "$OUT/sweep" "$@"
}
sweep "$@"
rc=$?
# What the engines said about graphs and transfers, and any error.
grep -h -i -E "cuda ?graph|capturing|cross layer|Traceback|Error" $LOGS/*/*.log 2>/dev/null | sort | uniq -c | sort -rn | head -20
exit $rc
