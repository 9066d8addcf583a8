"""The token path's hops for one token of a cached prompt, on each vLLM route they can take: the prefill
hop as an id prompt on `/v1/completions` (what vLLM 0.26 needs) or `/inference/v1/generate` with
`detokenize: false` (what the router sends to vLLM >= 0.32), and the decode hop's shape, a chat request whose
`kv_transfer_params` carry the prompt's ids (rendered by no one: vLLM 0.32+ or agentkv's plugin run them), as
a list or packed (`agentkv._wire.pack_ids`, what the router sends where agentkv's plugin reads them).

    python -m bench.prefill_route [--lengths 8193,32769,65537] [--rounds 7] [--spy DIR]

One vLLM server (tiny model, prefix caching on, agentkv's plugin as `agentkv serve` runs it, no P/D: the KV
transfer is not what differs). Per length, one request computes the prompt; then each route asks for one
token of the same ids ``--rounds`` times, alternating, so the engine computes only the last token each time.
What is left is what vLLM does per request over the whole prompt outside the model: an id prompt's first
token goes through vLLM's incremental detokenizer (primed with the prompt unless agentkv's tail is on), the
chat request carries the conversation's text as well (as the router's decode hop does).

``--spy DIR`` (needs `py-spy`): the rounds run route by route instead, each under `py-spy record
--subprocesses`; the JSON then says per route where the busy samples of the API server and the engine core
went (`bench.spy_summary`'s stages), and DIR keeps the raw profiles.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from agentkv.server.router import _codec
from bench._common import (
    console,
    line_chart,
    print_table,
    results_dir,
    summarize,
    write_rows,
)
from bench._plugin_args import add_env_arg, add_fast_json_arg

NAME = "prefill_route"
# Label -> the hop: the router's own bodies (`agentkv._wire`), with empty kv_transfer_params (one server,
# nothing to transfer): its prefill hop on either route, its decode hop with the ids forwarded.
ROUTES = {
    "completions (id prompt)": "completions",
    "generate (detokenize off)": "generate",
    "chat (forwarded ids)": "chat",
    "chat (packed ids)": "chat-packed",
    # The decode hop as an agent's conversation reaches it (`bench.client_body`'s: a 512-token tool result a
    # turn, 514 messages at 131k), whole and cut to its last message (`agentkv._wire.cut_messages`).
    "chat (packed ids, agent's messages)": "chat-agent",
    "chat (packed ids, last message)": "chat-agent-cut",
    "render (chat template + tokenizer)": "render",
}
_WORDS = ("the", "file", "lists", "tool", "result", "line", "error", "ok", "path", "value")
# One token each on the tiny model's tokenizer: the render route's text is then about as long as the ids.
_ONE_TOKEN_WORDS = ("the", "file", "tool", "result", "error", "value")


def _request(route: str, ids: list[int], text: str, model: str) -> tuple[str, dict[str, Any]]:
    from agentkv._wire import cut_messages, decode_local_body, token_prefill

    if route == "render":
        # The router's one render per turn, on prefill's API server (the token path's first hop).
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        return "/v1/chat/completions/render", body
    if route.startswith("chat"):
        # The conversation's text rides along as it does on the router's decode hop; nothing renders it.
        agent = route.startswith("chat-agent")
        messages = _agent_messages(len(ids)) if agent else [{"role": "user", "content": text}]
        body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}
        pack, cut = route != "chat", route == "chat-agent-cut"
        hop = decode_local_body(body, prompt_ids=ids, pack=pack)
        return "/v1/chat/completions", cut_messages(hop) if cut else hop
    return token_prefill({"token_ids": ids}, model=model, kv_params={}, generate=route == "generate")


@functools.cache
def _agent_messages(tokens: int) -> list[dict[str, Any]]:
    from bench.client_body import conversation

    return conversation(tokens, 512, random.Random(0))


def _timed(client: httpx.Client, route: str, ids: list[int], text: str, model: str) -> float:
    path, body = _request(route, ids, text, model)
    content = _codec.encode(body)  # as the router encodes its hops, outside the timing
    t0 = time.perf_counter()
    r = client.post(path, content=content, headers={"content-type": "application/json"})
    ms = (time.perf_counter() - t0) * 1e3
    if r.is_error:
        raise SystemExit(f"{route}: HTTP {r.status_code}: {r.text[:300]}")
    return ms


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill_route", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="8193,32769,65537", help="prompt lengths in tokens")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model", default=".agentkv/models/tiny")
    ap.add_argument("--port", type=int, default=25400)
    ap.add_argument("--out", type=Path, default=None, help="output dir (default bench/results/prefill_route)")
    ap.add_argument("--spy", type=Path, default=None, help="profile each route's rounds with py-spy into DIR")
    ap.add_argument(
        "--forwarded-ids",
        choices=("on", "always"),
        default="always",
        help="the plugin's AGENTKV_FORWARDED_IDS: `always` runs agentkv's wrapper on vLLM >= 0.32 too (it "
        "reads the packed form; with `on` vLLM 0.32+'s own code takes the list and renders a packed request)",
    )
    add_fast_json_arg(ap)
    add_env_arg(ap)
    args = ap.parse_args(argv)
    from agentkv.server.launch._launcher import Engine, EngineSpec
    from agentkv.server.launch._model import ensure_tiny_model

    lengths = [int(n) for n in args.lengths.split(",")]
    model = ensure_tiny_model(Path(args.model))
    spec = EngineSpec(
        role="single",
        model=str(model),
        port=args.port,
        max_model_len=max(lengths) + 256,  # the render route adds the chat template's tokens
        cpu_kvcache_gib=4,
        forwarded_ids=args.forwarded_ids,
        fast_json=args.fast_json == "on",
        # Positions beyond the tiny model's 32k would read past vLLM's rotary cache (NaN logits, and a NaN
        # logprob that the completions route cannot encode): the model's positions raised to the length.
        extra_args=["--hf-overrides", json.dumps({"max_position_embeddings": max(lengths) + 256})],
        env=dict(args.env),
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
                text = " ".join(rng.choice(_WORDS) for _ in range(n))
                render_text = " ".join(rng.choice(_ONE_TOKEN_WORDS) for _ in range(n - 16))
                texts = {route: render_text if route == "render" else text for route in ROUTES.values()}

                with console.status(f"computing a {n:,}-token prompt once ..."):
                    _timed(client, "completions", ids, text, name)
                times: dict[str, list[float]] = {label: [] for label in ROUTES}
                spy: dict[str, Any] = {}
                if args.spy is None:
                    for _ in range(args.rounds):
                        for label, route in ROUTES.items():
                            times[label].append(_timed(client, route, ids, texts[route], name))
                else:
                    for label, route in ROUTES.items():
                        raw = args.spy / f"{route}-{n}.txt"
                        with _spied(engine.pid, raw):
                            times[label] = [
                                _timed(client, route, ids, texts[route], name) for _ in range(args.rounds)
                            ]
                        spy[label] = _spy_stages(raw, args.rounds)
                row = {"tokens": n, **{label: summarize(ms) for label, ms in times.items()}}
                rows.append(row | ({"spy": spy} if spy else {}))
    finally:
        engine.stop()
    labels = list(ROUTES)
    table = [[r["tokens"], *(r[label]["p50"] for label in labels)] for r in rows]
    print_table("one token of a cached prompt, median ms", ["prompt tokens", *labels], table)
    for r in rows:
        for label, per_process in r.get("spy", {}).items():
            for process, stages in per_process.items():
                busy = ", ".join(f"{k} {v}" for k, v in stages.items())
                console.print(f"{r['tokens']:>7} {label}, {process} (busy ms per request): {busy}")
    out = results_dir(NAME, args.out)
    line_chart(
        out / "prefill_route.png",
        title="a token-path hop for one token of a cached prompt (median)",
        series={label: ([r["tokens"] for r in rows], [r[label]["p50"] for r in rows]) for label in labels},
        xlabel="prompt tokens",
        ylabel="ms",
    )
    return write_rows(NAME, args, rows, out)


@contextlib.contextmanager
def _spied(pid: int | None, raw: Path) -> Iterator[None]:
    """py-spy on the server and its engine processes for the block's duration (raw samples at 200 Hz)."""
    exe = shutil.which("py-spy")
    if exe is None or pid is None:
        raise SystemExit("--spy needs py-spy on PATH and a running server")
    raw.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        exe,
        "record",
        "--nonblocking",
        "--subprocesses",
        "-r",
        "200",
        "-f",
        "raw",
        "-o",
        str(raw),
        "-p",
        str(pid),
    ]
    spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2)  # attached to every process before the first request
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)


def _spy_stages(raw: Path, requests: int) -> dict[str, dict[str, float]]:
    """Busy ms per request, per process (API server, engine core, worker) and stage."""
    from bench.spy_summary import summarise_processes

    ms_per_sample = 1e3 / 200
    return {
        process: {stage: round(n * ms_per_sample / requests, 1) for stage, n in stages.items()}
        for process, stages in summarise_processes(raw).items()
    }


if __name__ == "__main__":
    main()
