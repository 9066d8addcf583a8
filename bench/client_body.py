"""The client's request per agent turn: the openai SDK's ``create`` beside agentkv's ``Transport`` (CPU, no
server): what an agent spends before its request leaves, as the conversation grows.

    python -m bench.client_body [--lengths 8192,32768,65536,131072] [--tool-tokens 512] [--rounds 9]

A conversation of N tokens is an agent's: a task, then steps of an assistant tool call and a tool result of
``--tool-tokens`` tokens (~4 characters a token), so N / tool-tokens steps and twice as many messages. Each
side sends the whole conversation once per turn through the same ``openai.OpenAI`` client to an in-process
transport that answers at once: ``chat.completions.create`` as an application calls it (the SDK walks every
message through its TypedDict transform), and ``agentkv.client.Transport`` (``Session``'s transport, which
hands the SDK the messages as they are, ``agentkv.client._transport.messages_as_is``). Both send the same
body (tests/unit/client/test_transport.py). With the ``langchain`` extra installed, also LangChain's
``ChatOpenAI`` beside agentkv's ``AgentKVChatOpenAI``, and with the ``llamaindex`` extra LlamaIndex's
``OpenAILike`` beside ``AgentKVLLM``, on the same messages (tests/unit/integrations).
Median ms of ``--rounds`` per turn.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai

from agentkv.client import Transport
from bench._common import line_chart, print_table, results_dir, summarize, tool_step, write_rows

NAME = "client_body"
WORDS = "agent tool search file row column query report number answer table cache block def return".split()
_ANSWER = {
    "id": "x",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
}


def conversation(tokens: int, tool_tokens: int, rng: random.Random) -> list[dict[str, Any]]:
    def text(n: int) -> str:
        return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(n // 2))

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": text(200)},
        {"role": "user", "content": text(200)},
    ]
    for step in range(max(1, tokens // tool_tokens)):
        messages += tool_step(f"call_{step}", text(tool_tokens))
    return messages


def _langchain_sides(http: httpx.Client, messages: list[dict[str, Any]]) -> dict[str, Callable[[], object]]:
    from langchain_core.messages import convert_to_messages
    from langchain_openai import ChatOpenAI

    from agentkv.integrations.langchain import AgentKVChatOpenAI

    history = convert_to_messages(messages)
    options: dict[str, Any] = {"model": "m", "base_url": "http://router.test/v1", "api_key": "k"}
    plain = ChatOpenAI(**options, http_client=http, max_retries=0)
    ours = AgentKVChatOpenAI(**options, http_client=http, max_retries=0)
    return {
        "LangChain ChatOpenAI": lambda: plain.invoke(history, max_tokens=8),
        "AgentKVChatOpenAI": lambda: ours.invoke(history, max_tokens=8),
    }


def _llamaindex_sides(http: httpx.Client, messages: list[dict[str, Any]]) -> dict[str, Callable[[], object]]:
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    from agentkv.integrations.llamaindex import AgentKVLLM

    history = [
        ChatMessage(
            role=m["role"],
            content=m["content"],
            additional_kwargs={k: m[k] for k in ("tool_calls", "tool_call_id") if k in m},
        )
        for m in messages
    ]
    options: dict[str, Any] = {"model": "m", "api_base": "http://router.test/v1", "api_key": "k"}
    plain = OpenAILike(**options, is_chat_model=True, http_client=http, max_retries=0)
    ours = AgentKVLLM(**options, is_chat_model=True, http_client=http, max_retries=0)
    return {
        "LlamaIndex OpenAILike": lambda: plain.chat(history, max_tokens=8),
        "AgentKVLLM": lambda: ours.chat(history, max_tokens=8),
    }


def _median_ms(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return float(summarize(times)["p50"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.client_body", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="8192,32768,65536,131072", help="context lengths in tokens")
    ap.add_argument("--tool-tokens", type=int, default=512, help="tokens per tool result")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None, help="output dir (default bench/results/client_body)")
    args = ap.parse_args(argv)
    http = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, json=_ANSWER)))
    sdk = openai.OpenAI(base_url="http://router.test/v1", api_key="k", http_client=http, max_retries=0)
    ours = Transport(base_url="http://router.test/v1", api_key="k", http_client=http)
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    for n in [int(x) for x in args.lengths.split(",")]:
        messages = conversation(n, args.tool_tokens, rng)
        params = {"model": "m", "messages": messages, "max_tokens": 8}
        # One warm-up call each: the SDK builds and caches its type information on first use.
        sides: dict[str, Callable[[], object]] = {
            "openai create": functools.partial(sdk.chat.completions.create, **params),
            "agentkv Transport": functools.partial(ours.complete, params),
        }
        if importlib.util.find_spec("langchain_openai") is not None:
            sides.update(_langchain_sides(http, messages))
        if importlib.util.find_spec("llama_index.llms.openai_like") is not None:
            sides.update(_llamaindex_sides(http, messages))
        row: dict[str, Any] = {"tokens": n, "messages": len(messages)}
        for label, send in sides.items():
            send()
            row[label] = _median_ms(send, args.rounds)
        rows.append(row)
    print_table(
        "the client's request per turn (send through an in-process transport), median ms",
        ["context tokens", "messages", *(label for label in rows[0] if label not in ("tokens", "messages"))],
        [list(r.values()) for r in rows],
    )
    out = results_dir(NAME, args.out)
    line_chart(
        out / "client_body.png",
        title="the client's request per agent turn, median",
        series={
            label: ([r["tokens"] for r in rows], [r[label] for r in rows])
            for label in ("openai create", "agentkv Transport")
        },
        xlabel="context tokens",
        ylabel="ms",
    )
    return write_rows(NAME, args, rows, out)


if __name__ == "__main__":
    main()
