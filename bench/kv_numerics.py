"""Which reused KV leaves a greedy continuation bit-identical? One vLLM engine, in-process, no P/D (issue 5)

    python -m bench.kv_numerics                 # the tiny model on CPU, 8 prompts (~3 min)
    python -m bench.kv_numerics --prompts 16 --model PATH

The question behind exact reuse: a recompute computes a prompt's KV in one prefill; a reuse turn computes
with KV made another way. Three ways, each against a cold run of the same prompt (a fresh ``cache_salt``,
so nothing is read from the prefix cache), comparing the logprobs of 16 greedy tokens bit for bit:

- ``prefill, other chunking``: the prefix cache holds the prompt's first blocks from an earlier, shorter
  prefill (what a pull of prefill-computed blocks gives prefill);
- ``decode-computed``: the prefix cache holds the blocks of an earlier request that *generated* part of the
  prompt one token at a time (what a decode's retained blocks hold past the prompt);
- ``prefill of the same tokens``: the same prompt, but its blocks were cached by a prefill of them.

The answer decides what agentkv reuses: only KV a prefill computed (``_hashing.prefill_computed_tokens``).
"""

from __future__ import annotations

import argparse
import os
import random
import uuid
from pathlib import Path
from typing import Any

from bench._common import bar_chart, make_progress, print_table, results_dir, write_results

NAME = "kv_numerics"
WAYS = ("prefill, other chunking", "decode-computed", "prefill of the same tokens")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".agentkv/models/tiny")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--answer-tokens", type=int, default=300, help="tokens generated for the decode case")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from agentkv.server.launch._model import ensure_tiny_model

    ensure_tiny_model(Path(args.model))
    rows = _measure(args)
    counts = {way: sum(r[way]["same_logprobs"] for r in rows) for way in WAYS}
    tokens = {way: sum(r[way]["same_tokens"] for r in rows) for way in WAYS}
    print_table(
        f"cached KV vs a cold recompute, {len(rows)} prompts: continuations with bit-identical logprobs",
        ["KV in the prefix cache", "bit-identical logprobs", "same greedy tokens"],
        [[way, f"{counts[way]} of {len(rows)}", f"{tokens[way]} of {len(rows)}"] for way in WAYS],
    )
    out = results_dir(NAME, args.out)
    bar_chart(
        out / "kv_numerics.png",
        title="continuations bit-identical to a cold recompute",
        labels=list(WAYS),
        series={"logprobs": [counts[w] for w in WAYS], "tokens": [tokens[w] for w in WAYS]},
        ylabel=f"of {len(rows)} prompts",
    )
    write_results(NAME, {"prompts": rows, "bit_identical": counts, "same_tokens": tokens}, out_dir=args.out)


def _measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=8192,
        enable_prefix_caching=True,
        block_size=128,
    )
    vocab = llm.get_tokenizer().vocab_size

    def run(ids: list[int], salt: str, n: int = 16) -> tuple[list[int], list[float]]:
        params = SamplingParams(temperature=0, max_tokens=n, logprobs=1)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=salt)], params, use_tqdm=False)
        completion = out[0].outputs[0]
        # logprobs=1 gives every sampled position its entry (a None would fail here, not skew the figure).
        chosen = [
            lp[t].logprob  # type: ignore[index]
            for t, lp in zip(completion.token_ids, completion.logprobs or [], strict=True)
        ]
        return list(completion.token_ids), chosen

    def compare(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> dict[str, Any]:
        diff = max((abs(x - y) for x, y in zip(a[1], b[1], strict=True)), default=0.0)
        return {"same_tokens": a[0] == b[0], "same_logprobs": a[1] == b[1], "max_logprob_diff": diff}

    rng = random.Random(0)
    rows = []
    with make_progress() as progress:
        task = progress.add_task("prompts", total=args.prompts)
        for i in range(args.prompts):
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(400, 900))]
            cold = run(prompt, uuid.uuid4().hex)
            salt = uuid.uuid4().hex
            run(prompt[: rng.randint(130, len(prompt) - 1)], salt, 1)  # an earlier, shorter prefill
            other_chunking = run(prompt, salt)
            salt = uuid.uuid4().hex
            answer, _ = run(prompt, salt, args.answer_tokens)  # these blocks hold decode-computed KV
            longer = prompt + answer + [rng.randrange(3, vocab) for _ in range(40)]
            cold_longer = run(longer, uuid.uuid4().hex)
            from_decode = run(longer, salt)
            salt = uuid.uuid4().hex
            run(prompt + answer, salt, 1)  # the same tokens, cached by a prefill
            from_prefill = run(longer, salt)
            rows.append(
                {
                    "prompt": i,
                    "prompt_tokens": len(prompt),
                    WAYS[0]: compare(other_chunking, cold),
                    WAYS[1]: compare(from_decode, cold_longer),
                    WAYS[2]: compare(from_prefill, cold_longer),
                }
            )
            progress.advance(task)
    return rows


if __name__ == "__main__":
    main()
