"""Agent-harness behaviours, agentkv ON vs vLLM's prefix cache alone: which later turns reuse, and how much.

    python -m bench.harness [--turns 4] [--behaviours tool_loop,dropped_answer,...]

Each behaviour is one conversation of ``--turns`` turns whose later requests are built the way a harness
builds them (``next_messages``):

- ``tool_loop``: every turn re-sends the history and the previous answer verbatim, then a tool result;
- ``dropped_answer``: the next request keeps every earlier message but not the model's last answer, and
  appends a user message (mini-swe-agent's format-error path);
- ``rewritten_answer``: the last answer is re-sent rewritten, its tail cut and a summary note in its place;
- ``stop_string``: every request carries ``stop`` (the answer ends on one of them; ``finish`` in the rows says
  whether it did) and the answer is re-sent as the client got it;
- ``client_left``: the client stops reading each streamed answer after a few chunks and re-sends what it read;
- ``declined``: a tool loop over a ~2,800-token history, more than decode may retain (its KV is 160 blocks of
  32 tokens, the retention cap half of them), so decode declines to retain it.

Legs, each on engines of their own with the same requests: ``on`` is a 1P1D cluster as ``agentkv up``
starts it (agentkv's engines, prefill and decode prefix caching on, 160 blocks of 32 tokens each) behind
the router with its default settings; ``prefix_cache`` is one vLLM server with its prefix cache and the KV
of both (320 blocks), the client talking to it directly. After a behaviour's last turn on ``on`` the client
deletes its conversation (``DELETE /v1/conversations/{id}``), so its retained blocks do not take the room
of the next behaviour's.

Per turn: prompt tokens (the server's ``/tokenize`` of the request), tokens reused (``on``: the router's
``x-agentkv-reused-tokens``, what prefill did not compute from either cache or, on a decode-local turn, what
decode's prefix cache served; ``prefix_cache``: the server's ``vllm:prompt_tokens_by_source_total`` with
``source="local_cache_hit"`` across the turn), TTFT (first streamed token, from a client kept for the leg).
Conversations run one at a time, so a counter's change across a turn is that turn's. Per behaviour the
summary gives the share of later turns (2..N) that reused anything, the share of their prompt tokens reused
and the mean TTFT of later turns.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench._common import (
    bar_chart,
    command_line,
    console,
    print_table,
    results_dir,
    sse_chunks,
    write_results,
)

__all__ = [
    "BEHAVIOURS",
    "Request",
    "first_messages",
    "main",
    "next_messages",
    "request_for",
    "summarize_rows",
]

NAME = "harness_cpu"
BEHAVIOURS = ("tool_loop", "dropped_answer", "rewritten_answer", "stop_string", "client_left", "declined")
LEGS = ("on", "prefix_cache")
BLOCK, ENGINE_BLOCKS = 32, 160
MAX_MODEL_LEN = 4096
# Characters frequent in the tiny model's answers: a greedy answer of 16 tokens ends on one of them.
STOP = ["e", "a", "o"]
FORMAT_ERROR = "Format error: please always provide EXACTLY ONE action in triple backticks."
# The first message's words (~3 tokens each): ~1,000 tokens for most behaviours, ~2,800 for `declined`.
FIRST_WORDS = {"declined": 870}
DEFAULT_FIRST_WORDS = 320
TOOL_WORDS = 60
ANSWER_TOKENS = 16
LEAVE_AFTER_CHUNKS = 4
LEFT_ANSWER_TOKENS = 400  # long enough that the client leaves while decode is still generating
# Clear of the tests' and other benches' ports (an engine's service listens 1,000 above it).
PORTS = {"prefill": 27500, "decode": 27600, "side": 9800, "router": 27700, "single": 27800}

Messages = list[dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class Request:
    """What a harness sends for one turn besides its messages, and how it reads the answer."""

    max_tokens: int = ANSWER_TOKENS
    stop: list[str] | None = None
    leave_after_chunks: int | None = None  # stop reading the stream after this many content chunks
    logprobs: bool = False  # costlier events: decode is still generating when the client leaves
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self, model: str, messages: Messages) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.stop is not None:
            body["stop"] = list(self.stop)
        else:
            body["ignore_eos"] = True
        if self.logprobs:
            body |= {"logprobs": True, "top_logprobs": 20}
        return body | self.extra


def request_for(behaviour: str) -> Request:
    if behaviour == "stop_string":
        return Request(stop=STOP)
    if behaviour == "client_left":
        return Request(max_tokens=LEFT_ANSWER_TOKENS, leave_after_chunks=LEAVE_AFTER_CHUNKS, logprobs=True)
    return Request()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"{rng.choice('abcdefghij')}{rng.randint(0, 999)}" for _ in range(n))


def first_messages(behaviour: str, *, seed: int) -> Messages:
    """The conversation's first request: a system prompt and a task whose text is this behaviour's alone, so
    no turn of one behaviour finds another's blocks in a cache."""
    rng = random.Random(f"{seed}-{behaviour}")
    n = FIRST_WORDS.get(behaviour, DEFAULT_FIRST_WORDS)
    return [
        {"role": "system", "content": f"You are an agent ({behaviour}, run {seed}). Use the tools."},
        {"role": "user", "content": f"Task: {_words(rng, n)}"},
    ]


def tool_result(behaviour: str, *, seed: int, turn: int) -> str:
    rng = random.Random(f"{seed}-{behaviour}-tool-{turn}")
    return f"tool result {turn}: {_words(rng, TOOL_WORDS)}"


def rewrite(answer: str) -> str:
    """The last answer as a harness that summarises or trims it re-sends it: its tail cut, a note instead."""
    return f"{answer[: len(answer) // 2]} [... answer trimmed by the harness]"


def next_messages(behaviour: str, history: Messages, answer: str, result: str) -> Messages:
    """The request after ``history`` was answered with ``answer`` (as the client read it) and a tool returned
    ``result``: what this behaviour's harness sends next."""
    if behaviour not in BEHAVIOURS:
        raise ValueError(f"unknown behaviour {behaviour!r}; one of {', '.join(BEHAVIOURS)}")
    if behaviour == "dropped_answer":
        return [*history, {"role": "user", "content": f"{FORMAT_ERROR}\n{result}"}]
    said = rewrite(answer) if behaviour == "rewritten_answer" else answer
    return [*history, {"role": "assistant", "content": said}, {"role": "user", "content": result}]


def summarize_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per behaviour and leg: turns, and over later turns (turn >= 1) the share that reused any token, the
    share of their prompt tokens reused and their mean TTFT. None where there are no later turns."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    keys = sorted({(r["behaviour"], r["leg"]) for r in rows}, key=lambda k: (_order(k[0]), k[1]))
    for behaviour, leg in keys:
        mine = [r for r in rows if r["behaviour"] == behaviour and r["leg"] == leg]
        later = [r for r in mine if r["turn"] >= 1]
        prompt = sum(r["prompt_tokens"] for r in later)
        out.setdefault(behaviour, {})[leg] = {
            "turns": len(mine),
            "later_turns": len(later),
            "later_turns_reused": sum(1 for r in later if r["reused_tokens"] > 0),
            "turns_reused_share": (
                sum(1 for r in later if r["reused_tokens"] > 0) / len(later) if later else None
            ),
            "prompt_tokens_later": prompt,
            "reused_tokens_later": sum(r["reused_tokens"] for r in later),
            "tokens_reused_share": sum(r["reused_tokens"] for r in later) / prompt if prompt else None,
            "ttft_ms_later_mean": sum(r["ttft_ms"] for r in later) / len(later) if later else None,
        }
    return out


def _order(behaviour: str) -> int:
    return BEHAVIOURS.index(behaviour) if behaviour in BEHAVIOURS else len(BEHAVIOURS)


# --- running it ----------------------------------------------------------------------------------------


def _local_cache_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total") and 'source="local_cache_hit"' in line
    )


def _prompt_tokens(client: httpx.Client, url: str, model: str, messages: Messages) -> int:
    body = {"model": model, "messages": messages, "add_generation_prompt": True}
    r = client.post(f"{url}/tokenize", json=body, timeout=60)
    r.raise_for_status()
    return int(r.json()["count"])


def _stream(
    client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str], leave_after: int | None
) -> dict[str, Any]:
    t0 = time.perf_counter()
    first: float | None = None
    text, chunks, finish = "", 0, None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
        got = dict(r.headers)
        for chunk in sse_chunks(r):
            for choice in chunk.get("choices", []):
                first = first or time.perf_counter()
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    text += piece
                    chunks += 1
                finish = choice.get("finish_reason") or finish
            if leave_after is not None and chunks >= leave_after:
                finish = "client_left"
                break
    return {
        "ttft_ms": round(((first or time.perf_counter()) - t0) * 1e3, 2),
        "text": text,
        "finish": finish,
        "reuse": got.get("x-agentkv-reuse"),
        "path": got.get("x-agentkv-path"),
        "header_reused": int(got.get("x-agentkv-reused-tokens") or 0),
        "pulled_tokens": int(got.get("x-agentkv-pulled-tokens") or 0),
    }


def run_leg(
    leg: str,
    url: str,
    model: str,
    *,
    tokenize_url: str,
    behaviours: Sequence[str],
    turns: int,
    seed: int,
) -> list[dict[str, Any]]:
    """One leg's conversations through ``url``; prompts counted by ``tokenize_url`` (an engine: the router
    serves no ``/tokenize``)."""
    rows: list[dict[str, Any]] = []
    with httpx.Client() as client:
        for behaviour in behaviours:
            request = request_for(behaviour)
            messages = first_messages(behaviour, seed=seed)
            cid = f"harness-{seed}-{behaviour}"
            for turn in range(turns):
                headers = {"x-session-id": cid}
                prompt = _prompt_tokens(client, tokenize_url, model, messages)
                before = _local_cache_hits(url) if leg == "prefix_cache" else 0.0
                got = _stream(client, url, request.body(model, messages), headers, request.leave_after_chunks)
                if leg == "prefix_cache":
                    # The engine counts a request's hits when it schedules it, before its first token.
                    reused = int(_local_cache_hits(url) - before)
                else:
                    reused = got["header_reused"]
                answer = got.pop("text")
                rows.append(
                    {
                        "leg": leg,
                        "behaviour": behaviour,
                        "turn": turn,
                        "prompt_tokens": prompt,
                        "reused_tokens": reused,
                        "answer_chars": len(answer),
                        **got,
                    }
                )
                console.print(
                    f"[{leg}] {behaviour} turn {turn}: {prompt} prompt tokens, {reused} reused, "
                    f"{got['ttft_ms']:.0f} ms ({got['reuse']}, {got['path']}, {got['finish']})"
                )
                messages = next_messages(
                    behaviour, messages, answer, tool_result(behaviour, seed=seed, turn=turn + 1)
                )
            if leg == "on":
                # The conversation ends, untimed: its retained blocks must not take the next one's room. Not
                # `x-agentkv-final-turn` on its last turn, which would change how that turn is served.
                client.delete(f"{url}/v1/conversations/{cid}", timeout=30).raise_for_status()
    return rows


def _engine_args() -> dict[str, Any]:
    from agentkv.server.launch._model import tiny_serving

    serving = tiny_serving()
    serving["extra_args"] += ["--num-gpu-blocks-override", str(ENGINE_BLOCKS)]
    return serving


def run_on(args: argparse.Namespace, model: str) -> list[dict[str, Any]]:
    from agentkv.server.launch._cluster import Cluster, ClusterConfig
    from bench._servers import router_server

    log_dir = Path(args.log_dir)
    cluster = Cluster(
        config=ClusterConfig(
            model=model,
            router_port=None,
            prefill_port=PORTS["prefill"],
            decode_port=PORTS["decode"],
            side_channel_port=PORTS["side"],
            block_size=BLOCK,
            max_model_len=MAX_MODEL_LEN,
            log_dir=log_dir / "on",
            **_engine_args(),
        )
    )
    with console.status("starting the 1P1D cluster ..."):
        cluster.up()
    try:
        p_url, d_url = cluster.prefills[0].spec.url, cluster.decodes[0].spec.url
        router = router_server(
            port=PORTS["router"], prefill_url=p_url, decode_url=d_url, log_dir=log_dir / "on"
        )
        with router:
            url = f"http://127.0.0.1:{PORTS['router']}"
            return run_leg(
                "on",
                url,
                args.served_model,
                tokenize_url=p_url,
                behaviours=args.behaviours,
                turns=args.turns,
                seed=args.seed,
            )
    finally:
        cluster.down()


def run_prefix_cache(args: argparse.Namespace, model: str) -> list[dict[str, Any]]:
    from agentkv.server.launch._launcher import Engine, EngineSpec
    from bench._plugin_args import plugin_fields

    serving = _engine_args()
    serving["extra_args"][-1] = str(2 * ENGINE_BLOCKS)  # the KV of prefill and decode together
    spec = EngineSpec(
        role="single",
        model=model,
        port=PORTS["single"],
        prefix_caching=True,
        block_size=BLOCK,
        max_model_len=MAX_MODEL_LEN,
        **plugin_fields(args, reuse=False),  # vLLM as a user would run it alone
        log_path=Path(args.log_dir) / "prefix_cache" / "single.log",
        **serving,
    )
    engine = Engine(spec=spec, name="single")
    engine.start()
    try:
        with console.status("starting one vLLM server with its prefix cache ..."):
            engine.wait_healthy(timeout_s=900)
        return run_leg(
            "prefix_cache",
            spec.url,
            args.served_model,
            tokenize_url=spec.url,
            behaviours=args.behaviours,
            turns=args.turns,
            seed=args.seed,
        )
    finally:
        engine.stop()


def plot(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], out: Path) -> Path:
    labels = list(summary)
    series = {
        leg: [float(summary[b].get(leg, {}).get("tokens_reused_share") or 0.0) for b in labels]
        for leg in LEGS
    }
    return bar_chart(
        out / "harness_tokens_reused.png",
        title="share of later turns' prompt tokens reused, per harness behaviour",
        labels=[b.replace("_", "\n") for b in labels],
        series=series,
        ylabel="reused / prompt tokens",
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.harness", description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--behaviours", type=lambda s: s.split(","), default=list(BEHAVIOURS))
    ap.add_argument("--legs", type=lambda s: s.split(","), default=list(LEGS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=".agentkv/models/tiny")
    ap.add_argument("--served-model", default="tiny", help="the model name the engines serve")
    ap.add_argument("--log-dir", default=".agentkv/bench-logs/harness")
    ap.add_argument("--out", type=Path, default=None, help="output dir (default bench/results/harness_cpu)")
    args = ap.parse_args(argv)
    unknown = [b for b in args.behaviours if b not in BEHAVIOURS] + [g for g in args.legs if g not in LEGS]
    if unknown:
        ap.error(f"unknown behaviours or legs: {', '.join(unknown)}")
    from agentkv.server.launch._model import ensure_tiny_model

    out = results_dir(NAME, args.out)
    model = str(ensure_tiny_model(Path(args.model)))
    rows: list[dict[str, Any]] = []
    if "on" in args.legs:
        rows += run_on(args, model)
    if "prefix_cache" in args.legs:
        rows += run_prefix_cache(args, model)
    summary = summarize_rows(rows)
    data: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | {"block": BLOCK, "engine_blocks": ENGINE_BLOCKS, "stop": STOP},
        "summary": summary,
        "rows": rows,
    }
    print_table(
        "later turns (2..N) per harness behaviour: reused turns, reused prompt tokens, mean TTFT",
        ["behaviour", "leg", "turns", "turns reused", "tokens reused", "TTFT ms (mean)"],
        [
            [
                behaviour,
                leg,
                s["turns"],
                f"{s['later_turns_reused']}/{s['later_turns']}",
                s["tokens_reused_share"] if s["tokens_reused_share"] is not None else float("nan"),
                s["ttft_ms_later_mean"] if s["ttft_ms_later_mean"] is not None else float("nan"),
            ]
            for behaviour, legs in summary.items()
            for leg, s in legs.items()
        ],
    )
    console.print(f"wrote {write_results(NAME, data, command_line(), out_dir=out)}")
    console.print(f"wrote {plot(summary, out)}")
    return data


if __name__ == "__main__":
    main()
