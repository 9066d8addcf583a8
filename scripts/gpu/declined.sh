#!/usr/bin/env bash
# On the lent GPU host (after .gpu/setup.sh, see scripts/gpu/stage.sh): a retention decode declines at the
# default cap, and the next turn. Qwen3-8B shape, dummy weights, 127k-token conversation, 512-token turn.
#   bash scripts/gpu/declined.sh OUT [extra multiturn_sweep flags]
#   DRY_RUN=1 bash scripts/gpu/declined.sh OUT     # prints the command, runs nothing (any machine)
# Legs, one after the other in one run, each on its own engines:
#   on   P and D with 18 GiB of KV each (131k tokens: decode holds one 127k conversation at 97 % of its KV,
#        so the default agentkv_max_retained_fraction 0.5 declines its retention), router defaults; the
#        suffix turn should go decode-local over what decode still caches (x-agentkv-reuse: cached).
#   agg  one vLLM server with prefix caching and the KV memory of P and D together (36 GiB).
# Done when the suffix turn's ttft_ms of leg on <= that of leg agg (printed at the end, from the JSON).
# ~4-5 min on an H100 (two engine starts of ~70 s and ~50 s, two 127k-token context turns, two suffix
# turns); the sweep gets DECLINED_BUDGET_S (default 540 s) of the host's 10 minutes.
set -uo pipefail
OUT=${1:?out dir}; shift || true
ARGS=(--device gpu --model /root/model --shape agentic --lengths 126976 --suffix 512 --conversations 1
  --output-tokens 32 --max-model-len 131072 --legs on,agg --env VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
  --engine-arg=--load-format --engine-arg=dummy
  --engine-arg=--gpu-memory-utilization --engine-arg=0.40
  --engine-arg=--kv-cache-memory-bytes --engine-arg=19327352832
  --agg-engine-arg=--load-format --agg-engine-arg=dummy
  --agg-engine-arg=--gpu-memory-utilization --agg-engine-arg=0.8
  --agg-engine-arg=--kv-cache-memory-bytes --agg-engine-arg=38654705664
  "$@")
if [ -n "${DRY_RUN:-}" ]; then
  echo python3 -m bench.multiturn_sweep "${ARGS[@]}" --log-dir LOGS --out RESULTS
  exit 0
fi
source scripts/gpu/_prelude.sh bench.multiturn_sweep
LOGS=/tmp/agentkv-declined-logs RES=/tmp/agentkv-declined
rm -rf "$LOGS" "$RES"; mkdir -p "$LOGS" "$RES" "$OUT"
timeout -s INT "${DECLINED_BUDGET_S:-540}" python3 -m bench.multiturn_sweep "${ARGS[@]}" \
  --log-dir "$LOGS" --out "$RES"
rc=$?
# A killed sweep leaves no engines behind it (each leg's cluster is in its own process group).
pkill -f vllm.entrypoints.openai.api_server 2>/dev/null
grep -h -i -E "Traceback|Error|retention|retained" "$LOGS"/*/*.log 2>/dev/null | sort | uniq -c | sort -rn | head -20
cp "$RES"/*.json "$OUT"/ 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
python3 - "$RES" <<'PY'
import json, pathlib, sys
res = pathlib.Path(sys.argv[1])
files = sorted(res.glob("multiturn_sweep*.json")) or sorted(res.glob("partial_*.json"))
rows = [r for f in files for r in json.loads(f.read_text())["data"]["requests"]]
suffix = {r["leg"]: r for r in rows if r.get("label") == "suffix"}
for leg in ("on", "agg"):
    r = suffix.get(leg)
    if r is None:
        print(f"{leg}: no suffix turn")
        continue
    print(f"{leg}: ttft_ms={r['ttft_ms']:.1f} input={r.get('input_num_tokens')} path={r.get('path')} "
          f"reuse={r.get('reuse')} reused_tokens={r.get('reused_tokens')}")
if "on" in suffix and "agg" in suffix:
    met = suffix["on"]["ttft_ms"] <= suffix["agg"]["ttft_ms"]
    print("done-when (on <= agg, suffix turn):", "met" if met else "NOT met")
PY
ls -la "$OUT"
exit $rc
