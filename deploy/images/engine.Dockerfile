# Prefill and decode engines on GPUs: vLLM's OpenAI server image of one release, with agentkv (its KV
# connector, its vLLM plugin and the `agentkv` command) installed beside that vLLM.
#   docker build -f deploy/images/engine.Dockerfile -t agentkv-engine:0.1.0 .   (from the repository root)
# The chart runs `python3 -m vllm.entrypoints.openai.api_server ...` in it (deploy/helm/agentkv).
ARG VLLM_IMAGE_TAG=v0.34.0
FROM vllm/vllm-openai:${VLLM_IMAGE_TAG}

COPY pyproject.toml README.md /opt/agentkv/
COPY agentkv /opt/agentkv/agentkv
# The `gpu` extra accepts the image's vLLM where it lies in agentkv's range (pip keeps it) and brings the
# NIXL line that vLLM release was built for; the source is not needed once installed.
RUN python3 -m pip install --no-cache-dir "/opt/agentkv[gpu]" \
    && rm -rf /opt/agentkv
