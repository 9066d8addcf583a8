#!/usr/bin/env bash
# On the lent GPU host (see ../shared/gpu/README.md): bench.agreement in bf16 on CUDA, the 8B shape with
# dummy weights (vLLM's dummy loader seeds them, so every engine holds the same weights).
#   bash scripts/gpu/agreement.sh OUT [--seeds N]
# MODEL=dir picks another model; one with weights (*.safetensors, e.g. the project's tiny model carried along)
# is loaded as is, whose logits do depend on the KV (dummy weights are drawn from +-1e-3).
# Needs vLLM unpacked in /root/site (.gpu/setup.sh), the model in /root/model, and the project's small
# dependencies as wheels in .whl/deps.
set -uo pipefail
OUT=${1:?out dir}; shift
source scripts/gpu/_prelude.sh bench.agreement
mkdir -p "$OUT"
MODEL=${MODEL:-/root/model}
DUMMY=(--engine-arg=--load-format --engine-arg=dummy)
compgen -G "$MODEL/*.safetensors" >/dev/null && DUMMY=()
timeout -s INT "${AGREE_BUDGET_S:-540}" python3 -m bench.agreement --device gpu --model "$MODEL" --out "$OUT" \
  "${DUMMY[@]}" --engine-arg=--gpu-memory-utilization --engine-arg=0.42 \
  --engine-arg=--kv-cache-memory-bytes --engine-arg=32212254720 "$@"
rc=$?
pkill -f vllm.entrypoints.openai.api_server 2>/dev/null
tar -czf "$OUT/logs.tgz" -C .agentkv/bench-logs/agreement . 2>/dev/null
exit $rc
