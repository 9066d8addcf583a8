#!/usr/bin/env bash
# On the CPU machine, once per checkout: everything the GPU host needs that the tracked tree does not carry.
#   bash scripts/gpu/stage.sh        # ~2-10 min (downloads, then xz)
# Makes (all ignored by git through .git/info/exclude):
#   .gpu/         ../shared/gpu's recipe, with its model (Qwen3-8B shape, 131072 positions for the long runs)
#   .whl/stage.part{0,1,2,3}   vLLM 0.26.0 + NIXL 1.3.1 in four parts of ~25 MB: a call carries at most
#                 64 MiB with the tracked tree (~30 MB), so the recipe's two parts of ~47 MiB do not fit beside it
#   .whl/deps/    agentkv's own small dependencies the GPU image lacks (installed by scripts/gpu/_prelude.sh)
#   .spy/py-spy   the profiler for scripts/gpu/profile.sh (one static binary, ~8 MB)
# Then on the GPU host, four calls back to back (bench/README.md, "Next on the GPU"); the tiny model and
# py-spy ride with a part each, where there is room:
#   bash .gpu/stash.sh 0 && mkdir -p /root/spy && cp .spy/py-spy /root/spy/
#                                   carry [".whl/stage.part0", ".gpu/stash.sh", ".spy"]
#   bash .gpu/stash.sh 1 && cp -r .agentkv/models/tiny /root/tiny
#                                   carry [".whl/stage.part1", ".gpu/stash.sh", ".agentkv/models/tiny"]
#   bash .gpu/stash.sh 2            carry [".whl/stage.part2", ".gpu/stash.sh"]
#   bash .gpu/stash.sh 3 && bash .gpu/setup.sh && export PYTHONPATH=/root/site && <benchmark>
#                                   carry [".whl/stage.part3", ".gpu", ".whl/deps"]
set -euo pipefail
REPO=$(git rev-parse --show-toplevel); cd "$REPO"
SHARED=${SHARED:-$REPO/../shared/gpu}
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"; touch "$EXCLUDE"
for p in /.whl/ /.gpu/; do grep -qxF "$p" "$EXCLUDE" || echo "$p" >> "$EXCLUDE"; done

rm -rf .gpu && cp -r "$SHARED" .gpu && chmod -R u+w .gpu
# Four parts, and setup.sh unpacks however many there are.
sed -i 's/split -n 2 -d/split -n 4 -d/' .gpu/build_stage.sh
sed -i 's#cat /root/stage/stage.part0 /root/stage/stage.part1 |#cat /root/stage/stage.part* |#' .gpu/setup.sh
grep -q 'split -n 4' .gpu/build_stage.sh && grep -q 'stage.part\* |' .gpu/setup.sh \
  || { echo "stage.sh: ../shared/gpu changed; adapt the edits above" >&2; exit 1; }

python3 -c "import tokenizers" 2>/dev/null || python3 -m pip install -q tokenizers
python3 .gpu/make_model.py .gpu/model
# Dummy weights do not care about positions; the long-context runs need 131072 (../shared/gpu/README.md).
python3 - .gpu/model/config.json <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["max_position_embeddings"] = 131072
json.dump(cfg, open(sys.argv[1], "w"), indent=2)
PY

bash .gpu/build_stage.sh
rm -rf .whl/deps && mkdir -p .whl/deps
# The stage already holds pydantic and typing-inspection at vLLM's versions: only what it lacks.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl/deps \
  pydantic-settings python-dotenv tenacity
# py-spy's wheel is one static binary: the GPU host has no index to install it from.
rm -rf .spy && mkdir -p .spy
python3 -m pip download -q --no-deps --only-binary=:all: -d .spy py-spy  # this host's arch, as the GPU host's
python3 - <<'PY'
import glob, zipfile
with zipfile.ZipFile(glob.glob(".spy/py_spy-*.whl")[0]) as whl:
    name = next(n for n in whl.namelist() if n.endswith("/scripts/py-spy") or n.endswith("/py-spy"))
    open(".spy/py-spy", "wb").write(whl.read(name))
PY
chmod +x .spy/py-spy && rm -f .spy/*.whl
ls -la .whl .whl/deps .spy
