"""The token path's prefill hop on its two routes: an id prompt on `/v1/completions` (what vLLM 0.26 needs)
beside `/inference/v1/generate` with `detokenize: false` (what the router sends to vLLM >= 0.32).

    python -m bench.prefill_route [--lengths 8193,32769,65537] [--rounds 7]

One vLLM server (tiny model, prefix caching on, no P/D: the KV transfer is not what differs). Per length, one
request computes the prompt; then both routes ask for one token of the same ids ``--rounds`` times each,
alternating, so the engine computes only the last token each time. What is left to differ is the API
server: an id prompt's first token goes through vLLM's incremental detokenizer, which it primes with the
whole prompt (its first step decodes every prompt token); the generate route with `detokenize` off skips it.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import httpx

from bench._common import (
    command_line,
    console,
    line_chart,
    print_table,
    results_dir,
    summarize,
    write_results,
)

NAME = "prefill_route"
# Label -> the router's `generate` choice: the bodies are the router's own (`agentkv._wire.token_prefill`),
# with empty kv_transfer_params (one server, nothing to transfer).
ROUTES = {"completions (id prompt)": False, "generate (detokenize off)": True}


def _timed(client: httpx.Client, ids: list[int], model: str, *, generate: bool) -> float:
    from agentkv._wire import token_prefill

    path, body = token_prefill({"token_ids": ids}, model=model, kv_params={}, generate=generate)
    t0 = time.perf_counter()
    r = client.post(path, json=body)
    ms = (time.perf_counter() - t0) * 1e3
    r.raise_for_status()
    return ms


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill_route", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="8193,32769,65537", help="prompt lengths in tokens")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model", default=".agentkv/models/tiny")
    ap.add_argument("--port", type=int, default=25400)
    ap.add_argument("--out", type=Path, default=None, help="output dir (default bench/results/prefill_route)")
    args = ap.parse_args(argv)
    from agentkv.server._launcher import Engine, EngineSpec
    from agentkv.server._model import ensure_tiny_model

    lengths = [int(n) for n in args.lengths.split(",")]
    model = ensure_tiny_model(Path(args.model))
    spec = EngineSpec(
        role="single",
        model=str(model),
        port=args.port,
        max_model_len=max(lengths) + 64,
        cpu_kvcache_gib=4,
        env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},  # beyond the tiny model's 32k positions
        log_path=Path(".agentkv/bench-logs/prefill_route/engine.log"),
    )
    engine = Engine(spec=spec, name="single")
    vocab = 2000  # ids every tokenizer of the tiny model has
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    with console.status("starting one vLLM server ..."):
        engine.start()
        engine.wait_healthy(timeout_s=600)
    try:
        with httpx.Client(base_url=spec.url, timeout=900) as client:
            name = model.name
            for n in lengths:
                ids = [rng.randrange(100, vocab) for _ in range(n)]
                with console.status(f"computing a {n:,}-token prompt once ..."):
                    _timed(client, ids, name, generate=False)
                times: dict[str, list[float]] = {label: [] for label in ROUTES}
                for _ in range(args.rounds):
                    for label, generate in ROUTES.items():
                        times[label].append(_timed(client, ids, name, generate=generate))
                rows.append({"tokens": n, **{label: summarize(ms) for label, ms in times.items()}})
    finally:
        engine.stop()
    labels = list(ROUTES)
    table = [
        [r["tokens"], *(r[label]["p50"] for label in labels), r[labels[0]]["p50"] - r[labels[1]]["p50"]]
        for r in rows
    ]
    print_table(
        "prefill hop, one token of a cached prompt, median ms",
        ["prompt tokens", *labels, "saved"],
        table,
    )
    out = results_dir(NAME, args.out)
    line_chart(
        out / "prefill_route.png",
        title="prefill hop for one token of a cached prompt (median)",
        series={label: ([r["tokens"] for r in rows], [r[label]["p50"] for r in rows]) for label in labels},
        xlabel="prompt tokens",
        ylabel="ms",
    )
    data: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    console.print(f"wrote {write_results(NAME, data, command_line(), out_dir=out)}")
    return data


if __name__ == "__main__":
    main()
