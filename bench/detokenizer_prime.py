"""What building a request's detokenizer costs in vLLM's API server, vLLM's way beside agentkv's plugin (CPU,
no engine; needs vLLM installed).

    python -m bench.detokenizer_prime [--lengths 8192,32768,131072] [--rounds 31]

vLLM builds a `FastIncrementalDetokenizer` for every request and primes its `tokenizers.DecodeStream` with
the whole prompt; the first output token then decodes that prompt. agentkv's plugin
(`AGENTKV_DETOKENIZER_PRIME_TOKENS`, 128 by default in `agentkv serve`) primes it with the prompt's last ids.
Per prompt length, the median of ``--rounds`` over: vLLM's constructor and its first step; the plugin's
constructor as it was first written (vLLM's, then the stream replaced, so the whole prompt is still copied
into Rust) and as it is (vLLM's constructor given a copy of the request holding only the tail), each with its
first step. The tiny model's tokenizer, random ids of its vocabulary.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench._common import bar_chart, print_table, results_dir, summarize, write_rows

NAME = "detokenizer_prime"
_KEEP = 128


def _median_ms(build: Callable[[], Any], rounds: int) -> tuple[float, float]:
    """Median ms of building a detokenizer and of its first step."""
    built: list[float] = []
    stepped: list[float] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        detokenizer = build()
        t1 = time.perf_counter()
        detokenizer.decode_next(1000)
        t2 = time.perf_counter()
        built.append((t1 - t0) * 1e3)
        stepped.append((t2 - t1) * 1e3)
    return float(summarize(built)["p50"]), float(summarize(stepped)["p50"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.detokenizer_prime", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--model", default=".agentkv/models/tiny")
    ap.add_argument("--out", default=None, help="output dir (default bench/results/detokenizer_prime)")
    args = ap.parse_args(argv)

    import tokenizers
    from vllm.sampling_params import SamplingParams
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine import detokenizer as vllm_detokenizer

    from agentkv.server.engine.plugin._register import _prime_with_tail
    from agentkv.server.launch._model import ensure_tiny_model

    tokenizer = get_tokenizer(str(ensure_tiny_model(Path(args.model))))
    cls = vllm_detokenizer.FastIncrementalDetokenizer
    vllms = cls.__init__
    ours = _prime_with_tail(vllms, keep=_KEEP)

    def replaced(self: Any, tok: Any, request: Any) -> None:
        vllms(self, tok, request)
        tail = list(request.prompt_token_ids[-_KEEP:])
        self.stream = tokenizers.decoders.DecodeStream(ids=tail, skip_special_tokens=self.skip_special_tokens)

    variants: dict[str, Callable[..., None]] = {
        "vLLM (whole prompt)": vllms,
        "agentkv before (whole, then replaced)": replaced,
        "agentkv (tail only)": ours,
    }
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    for n in (int(x) for x in args.lengths.split(",")):
        request = EngineCoreRequest(
            request_id="r",
            prompt_token_ids=[rng.randrange(100, 2000) for _ in range(n)],
            mm_features=None,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        row: dict[str, Any] = {"tokens": n}
        for label, init in variants.items():

            def build(init: Callable[..., None] = init, request: Any = request) -> Any:
                detokenizer = cls.__new__(cls)
                init(detokenizer, tokenizer, request)
                return detokenizer

            built, stepped = _median_ms(build, args.rounds)
            row[label] = {"build_ms": round(built, 3), "first_step_ms": round(stepped, 3)}
        rows.append(row)

    labels = list(variants)
    print_table(
        "a request's detokenizer: build / first step, median ms",
        ["prompt tokens", *labels],
        [[r["tokens"], *(f"{r[k]['build_ms']} / {r[k]['first_step_ms']}" for k in labels)] for r in rows],
    )
    out = results_dir(NAME, args.out)
    bar_chart(
        out / f"{NAME}.png",
        title="building a request's detokenizer plus its first step (median)",
        labels=[f"{r['tokens']:,}" for r in rows],
        series={k: [r[k]["build_ms"] + r[k]["first_step_ms"] for r in rows] for k in labels},
        ylabel="ms",
        log=True,
    )
    return write_rows(NAME, args, rows, out)


if __name__ == "__main__":
    main()
