#!/usr/bin/env bash
# On the lent GPU host (after .gpu/setup.sh): bench.exactness on a GPU 1P1D, Qwen3-8B shape, dummy weights.
# Is a reuse turn bit-identical to an independent recompute on GPU kernels too?
#   bash scripts/gpu/exactness.sh OUT [extra bench.exactness flags, e.g. --env VLLM_BATCH_INVARIANT=1]
set -uo pipefail
OUT=${1:?out dir}; shift
if [ -d .whl/deps ] && ! PYTHONPATH=/root/site python3 -c "import pydantic_settings, tenacity" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .whl/deps/*.whl || exit 1
fi
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
mkdir -p "$OUT"
timeout -s INT "${EXACTNESS_BUDGET_S:-240}" python3 -m bench.exactness --device gpu --model /root/model \
  --max-model-len 8192 --seeds "${SEEDS:-8}" --out "$OUT" --engine-arg=--load-format --engine-arg=dummy \
  --engine-arg=--gpu-memory-utilization --engine-arg=0.42 --engine-arg=--kv-cache-memory-bytes \
  --engine-arg=8589934592 "$@" 2>&1 | grep -v -E 'it/s\]|Initializing' | tail -40
rc=${PIPESTATUS[0]}
pkill -f vllm.entrypoints.openai.api_server 2>/dev/null
grep -h -E "Traceback|Error|batch.invariant" .agentkv/bench-logs/exactness/*.log 2>/dev/null | sort | uniq -c | head
tar -czf "$OUT/logs.tgz" -C .agentkv/bench-logs exactness 2>/dev/null
exit $rc
