#!/usr/bin/env bash
# The README's by-hand engine install, as a new user runs it: a fresh virtualenv, `pip install 'agentkv[cpu]'`
# (from this checkout), then `agentkv model tiny`. Passes where that builds the model, or fails with an error that
# names the fix and, once the fix is run, builds. Downloads ~1 GB; not part of scripts/test.sh (CI's time).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
PY=${PYTHON:-python3}
"$PY" -m venv "$work/venv" || exit 1
pip=("$work/venv/bin/python" -m pip install -q --disable-pip-version-check)
echo "check_install: pip install '$repo[cpu]' into a fresh venv ..." >&2
"${pip[@]}" "$repo[cpu]" || { echo "check_install: FAILED: pip install" >&2; exit 1; }
if out=$("$work/venv/bin/agentkv" model tiny "$work/model" 2>&1); then
  echo "check_install: OK: the tiny model builds right after the install" >&2
  exit 0
fi
echo "$out" >&2
# The CLI wraps its error to the terminal's width: read it as one line.
fix=$(tr -s '\n ' '  ' <<<"$out" | grep -o "pip uninstall -y [a-z ]*[a-z]" | head -n 1)
if [ -z "$fix" ]; then
  echo "check_install: FAILED: agentkv model tiny failed with an error that names no fix" >&2
  exit 1
fi
echo "check_install: the error names its fix: $fix" >&2
"$work/venv/bin/python" -m $fix >/dev/null || { echo "check_install: FAILED: $fix" >&2; exit 1; }
if "$work/venv/bin/agentkv" model tiny "$work/model" >&2; then
  echo "check_install: OK: after '$fix' the tiny model builds" >&2
  exit 0
fi
echo "check_install: FAILED: the model does not build after '$fix'" >&2
exit 1
