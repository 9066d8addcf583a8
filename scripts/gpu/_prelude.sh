# Sourced by the scripts/gpu/*.sh benchmarks on the lent GPU host, after `set -uo pipefail`:
#   source scripts/gpu/_prelude.sh bench.module_it_runs
# Installs the project's own small dependencies (pydantic-settings, python-dotenv, tenacity) from .whl/deps
# into /root/site where vLLM lives, sets the environment, and checks that everything imports.
if [ -d .whl/deps ] && ! PYTHONPATH=/root/site python3 -c "import pydantic_settings, tenacity" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .whl/deps/*.whl || exit 1
fi
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1
# agentkv runs from this checkout, not installed, so vLLM finds its plugin (the tokenizer cache) through a
# minimal distribution record with pyproject's entry points.
python3 - <<'PY' || exit 1
import pathlib, tomllib
eps = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]["entry-points"]
d = pathlib.Path("/root/site/agentkv_checkout-0.dist-info")
d.mkdir(exist_ok=True)
(d / "METADATA").write_text("Metadata-Version: 2.1\nName: agentkv-checkout\nVersion: 0\n")
(d / "entry_points.txt").write_text(
    "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in e.items()) for g, e in eps.items())
)
PY
# flashinfer is not carried; without this the engine dies at start (shared/gpu/README.md).
export VLLM_USE_FLASHINFER_SAMPLER=0
python3 -c "import agentkv.cli, agentkv.server.router, agentkv.server.engine.connector, ${1:?bench module}" || exit 1
