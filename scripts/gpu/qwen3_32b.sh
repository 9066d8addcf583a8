#!/usr/bin/env bash
# On the lent GPU host: derive a Qwen3-32B-shaped dummy model dir from the Qwen3-8B-shaped one (/root/model,
# made by .gpu/setup.sh): 64 layers, hidden 5120, 64 query heads, 8 KV heads, intermediate 25600, same vocab
# and tokenizer. Weights stay dummy (--load-format dummy): 61 GiB of bf16 per engine.
#   bash scripts/gpu/qwen3_32b.sh [/root/model32]
set -euo pipefail
DST=${1:-/root/model32}; SRC=${SRC:-/root/model}
rm -rf "$DST" && cp -r "$SRC" "$DST" && chmod -R u+w "$DST"
python3 - "$DST/config.json" <<'PY'
import json, sys
path = sys.argv[1]
cfg = json.load(open(path))
cfg.update(hidden_size=5120, num_hidden_layers=64, max_window_layers=64, num_attention_heads=64,
           num_key_value_heads=8, head_dim=128, intermediate_size=25600)
json.dump(cfg, open(path, "w"), indent=2)
print("wrote", path)
PY
