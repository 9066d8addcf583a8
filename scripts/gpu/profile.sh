#!/usr/bin/env bash
# On the lent GPU host: scripts/gpu/sweep.sh with py-spy sampling every vLLM API server and the router, to
# say where the time of a hop goes outside the engines (render, tokenizer, JSON, detokenizer).
#   SPY=path/to/py-spy bash scripts/gpu/profile.sh OUT LEGS SHAPES [extra multiturn_sweep flags]
# SPY_RATE: samples per second (200). SPY_SUBPROCESSES=1 samples each server's engine core and worker
# processes too (where the engine's own time goes beside the GPU's).
# py-spy is one static binary: carry it along (e.g. in .spy/). Profiles (py-spy raw format, one per process,
# named role-pid, with the process's command line beside it) come back as OUT/spy.tgz; summarise them with
# `python -m bench.spy_summary DIR`.
set -uo pipefail
OUT=${1:?out dir}; shift
SPY=${SPY:-.spy/py-spy}
D=/tmp/agentkv-spy
rm -rf "$D"; mkdir -p "$D" "$OUT"
(
  declare -A seen
  while true; do
    for pid in $(pgrep -f "vllm.entrypoints.openai.api_server|agentkv.cli router"); do
      [ -n "${seen[$pid]:-}" ] && continue
      seen[$pid]=1
      cmd=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null) || continue
      case "$cmd" in
        *"agentkv.cli router"*) role=router ;;
        *kv_producer*) role=prefill ;;
        *kv_consumer*) role=decode ;;
        *) role=engine ;;
      esac
      echo "$cmd" > "$D/$role-$pid.cmd"
      # --nonblocking: never pause the server being measured.
      "$SPY" record --nonblocking ${SPY_SUBPROCESSES:+--subprocesses} -r "${SPY_RATE:-200}" -f raw \
        -o "$D/$role-$pid.txt" -p "$pid" -d 590 >/dev/null 2>&1 &
    done
    sleep 1
  done
) &
poller=$!
bash scripts/gpu/sweep.sh "$OUT" "$@"
rc=$?
kill "$poller" 2>/dev/null
sleep 3  # py-spy writes its file once its process is gone
tar -czf "$OUT/spy.tgz" -C "$D" .
exit $rc
