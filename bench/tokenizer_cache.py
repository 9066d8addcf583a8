"""agentkv's vLLM plugin beside vLLM, on one growing agent conversation (CPU, no engine): the tokenizer cache
beside a whole tokenization, and the detokenizer primed with the prompt's tail beside the whole prompt.

A vLLM API server tokenizes a turn's whole rendered prompt; agentkv's tokenizer cache
(`agentkv/server/engine/plugin/_tokenizer_cache.py`) tokenizes only what the turn adds. This replays one
agent's turns
(each: an assistant tool call and a tool result of `--result-tokens`) through the model's own chat template
and Hugging Face tokenizer, timing per turn: the whole tokenization (what vLLM does) and the cache (what
agentkv's plugin does), and checking that both give the same ids; then the first step of the answer's
incremental detokenizer (`tokenizers.DecodeStream`, as vLLM's `FastIncrementalDetokenizer` uses it) primed
with the whole prompt (vLLM) and with its last 128 ids (the plugin). This is what the API server spends per
turn beside the GPU; the chat template is timed too, since it still renders the whole prompt.

    python -m bench.tokenizer_cache                      # the tiny model's tokenizer, to ~128k tokens
    python -m bench.tokenizer_cache --model .gpu/model   # any model directory with a tokenizer
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any, cast

from agentkv.server.engine.plugin import DEFAULT_PRIME_TOKENS, prompt_tail
from agentkv.server.engine.plugin._tokenizer_cache import AddedTokenInfo, TokenizerCache

WORDS = "agent tool search file row column query report number answer table cache block def return".split()


def _result(rng: random.Random, n_words: int) -> str:
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(n_words))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tokenizers.decoders import DecodeStream
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)

    def encode(text: str, special: bool) -> list[int]:
        return list(tok(text, add_special_tokens=special)["input_ids"])

    # transformers' AddedToken has what AddedTokenInfo names; its stubs type the fields otherwise.
    added_tokens = cast("dict[int, AddedTokenInfo]", tok.added_tokens_decoder)
    cache = TokenizerCache(encode=encode, added=added_tokens, max_bytes=1 << 30, unknown_id=tok.unk_token_id)
    if not cache.reusing:
        raise SystemExit(f"{args.model}: this tokenizer fails the cache's probe; nothing to measure")
    # The answer's first token, and what the detokenizer part needs, are the same every turn.
    first = tok.encode(" Done.", add_special_tokens=False)[0]
    backend = tok.backend_tokenizer
    added = set(tok.added_tokens_decoder)
    rng = random.Random(args.seed)
    # Agents of one application: the same system prompt, their own task and history; turns round-robin.
    system = {"role": "system", "content": "You are a coding agent. " + _result(rng, 2000)}
    agents: list[list[dict[str, Any]]] = [
        [system, {"role": "user", "content": f"Task {i}: find and fix the failing test."}]
        for i in range(args.conversations)
    ]
    rows = []
    turn = 0
    while True:
        messages = agents[turn % len(agents)]
        messages.append({"role": "assistant", "content": f"Reading part {turn}."})
        messages.append({"role": "user", "content": _result(rng, args.result_tokens // 2)})
        t0 = time.perf_counter()
        text = str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        t1 = time.perf_counter()
        whole = encode(text, False)
        t2 = time.perf_counter()
        before = cache.stats.reused_tokens
        ids = cache.encode(text, add_special_tokens=False)
        t3 = time.perf_counter()
        if ids != whole:
            raise SystemExit(f"turn {turn}: the cache's ids differ from a whole tokenization")
        tail = prompt_tail(ids, DEFAULT_PRIME_TOKENS, added)
        steps = []
        for primed in (ids, ids if tail is None else list(tail)):
            stream = DecodeStream(ids=primed, skip_special_tokens=True)
            t4 = time.perf_counter()
            steps.append((stream.step(backend, first), (time.perf_counter() - t4) * 1e3))
        if steps[0][0] != steps[1][0]:
            raise SystemExit(f"turn {turn}: the tail-primed detokenizer streamed other text")
        rows.append(
            {
                "turn": turn,
                "prompt_tokens": len(ids),
                "template_ms": round((t1 - t0) * 1e3, 2),
                "whole_ms": round((t2 - t1) * 1e3, 2),
                "cache_ms": round((t3 - t2) * 1e3, 2),
                "reused_tokens": cache.stats.reused_tokens - before,
                "detok_whole_ms": round(steps[0][1], 3),
                "detok_tail_ms": round(steps[1][1], 3),
            }
        )
        rows[-1]["conversation"] = turn % len(agents)
        rows[-1]["cached_prompts"] = len(cache)
        turn += 1
        if len(ids) >= args.max_tokens and turn % len(agents) == 0:
            return rows


def main() -> None:
    from agentkv.server.launch._model import DEFAULT_MODEL_DIR

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=str(DEFAULT_MODEL_DIR), help="model directory (default: the tiny model)"
    )
    ap.add_argument("--max-tokens", type=int, default=131072, help="stop once the prompt is this long")
    ap.add_argument("--result-tokens", type=int, default=2048, help="about how long each tool result is")
    ap.add_argument(
        "--conversations", type=int, default=1, help="agents at once, one system prompt, turns in turn"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/tokenizer_cache")
    args = ap.parse_args()
    if args.model == str(DEFAULT_MODEL_DIR):
        from agentkv.server.launch._model import ensure_tiny_model

        ensure_tiny_model(Path(args.model))

    from bench._common import line_chart, print_table, write_results

    rows = run(args)
    path = write_results("tokenizer_cache", {"model": args.model, "turns": rows}, out_dir=args.out)
    shown = [r for r in rows if r["turn"] % max(1, len(rows) // 12) == 0 or r is rows[-1]]
    print_table(
        f"agentkv's vLLM plugin vs vLLM ({args.model}), ms per turn",
        [
            "prompt tokens",
            "tokenize: whole (vLLM)",
            "tokenize: cache",
            "reused ids",
            "chat template",
            "detokenizer 1st step: whole prompt (vLLM)",
            "detokenizer 1st step: 128-id tail",
        ],
        [
            [
                r["prompt_tokens"],
                r["whole_ms"],
                r["cache_ms"],
                r["reused_tokens"],
                r["template_ms"],
                r["detok_whole_ms"],
                r["detok_tail_ms"],
            ]
            for r in shown
        ],
    )
    xs = [float(r["prompt_tokens"]) for r in rows]
    line_chart(
        path.parent / "tokenizer_cache.png",
        title="Per-turn API-server work that grows with the conversation",
        series={
            "whole (vLLM)": (xs, [r["whole_ms"] for r in rows]),
            "tokenizer cache (agentkv)": (xs, [r["cache_ms"] for r in rows]),
            "chat template (both)": (xs, [r["template_ms"] for r in rows]),
            "detokenizer first step, whole prompt (vLLM)": (xs, [r["detok_whole_ms"] for r in rows]),
            "detokenizer first step, 128-id tail (agentkv)": (xs, [r["detok_tail_ms"] for r in rows]),
        },
        xlabel="prompt tokens",
        ylabel="ms",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
