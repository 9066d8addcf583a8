"""The router's one structured log line per turn (`TurnBook.log`), through the real app over fake engines."""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
import pytest

from agentkv._constants import PULLED_KEY

from .conftest import FakeEngines

CHAT = "/v1/chat/completions"
USER1 = [{"role": "user", "content": "list the files"}]
FIELDS = [
    "conversation_id",
    "request_id",
    "prefill",
    "decode",
    "path",
    "reuse",
    "reused_tokens",
    "pulled_tokens",
    "prompt_tokens",
    "prefill_ms",
    "ttft_ms",
    "host_tokens",
    "decode_had",
]


@pytest.fixture
def turn_lines(caplog: pytest.LogCaptureFixture) -> Any:
    caplog.set_level(logging.INFO, logger="agentkv.router")

    def lines() -> list[dict[str, str]]:
        out = []
        for rec in caplog.records:
            msg = rec.getMessage()
            if rec.name == "agentkv.router" and msg.startswith("turn "):
                assert rec.levelno == logging.INFO
                fields = dict(re.findall(r"(\w+)=(\S+)", msg))
                assert list(fields) == FIELDS, msg  # every field, in a fixed order: greppable/parsable
                out.append(fields)
        return out

    return lines


async def chat(
    client: httpx.AsyncClient, messages: list[dict[str, Any]], cid: str | None = "c1", **body: Any
):
    headers = {"x-session-id": cid} if cid else {}
    return await client.post(CHAT, json={"model": "tiny", "messages": messages, **body}, headers=headers)


def next_messages(first: list[dict[str, Any]], answer: dict[str, Any]) -> list[dict[str, Any]]:
    return [*first, answer["choices"][0]["message"], {"role": "user", "content": "and now?"}]


def served_by(engines: FakeEngines, role: str, request_id: str) -> list[str]:
    """Backend names (p0, d1, ...) that got a completion with this request id."""
    return [
        host.split(".")[0]
        for host, method, path, _body, headers in engines.seen
        if host.startswith(role)
        and method == "POST"
        and path == CHAT
        and headers["x-request-id"] == request_id
    ]


async def test_each_turn_logs_one_line_naming_backends_and_reuse(
    engines: FakeEngines, make_client, turn_lines
) -> None:
    async with make_client() as client:
        first = await chat(client, USER1)
        assert len(turn_lines()) == 1  # written by the time the client has the answer
        engines.p_cached_tokens = 7  # not recomputed: 5 read from decode, 2 from P's own prefix cache
        engines.p_pulled_tokens = 5
        second = await chat(client, next_messages(USER1, first.json()))
    one, two = turn_lines()

    assert one["conversation_id"] == "c1" and two["conversation_id"] == "c1"
    assert one["request_id"] != two["request_id"]
    for line, resp in ((one, first), (two, second)):
        assert served_by(engines, "p", line["request_id"]) == [line["prefill"]]
        assert served_by(engines, "d", line["request_id"]) == [line["decode"]]
        # The same numbers the client sees in the response headers.
        assert line["path"] == resp.headers["x-agentkv-path"]
        assert line["reuse"] == resp.headers["x-agentkv-reuse"]
        assert line["reused_tokens"] == resp.headers["x-agentkv-reused-tokens"]
        assert line["prefill_ms"] == resp.headers["x-agentkv-prefill-ms"]
        assert float(line["prefill_ms"]) >= 0.0
        assert line["prompt_tokens"] == str(resp.json()["usage"]["prompt_tokens"])
        assert line["ttft_ms"] == "-"  # a whole JSON answer has no first-token time

    assert (one["path"], one["reuse"], one["reused_tokens"]) == ("recompute", "miss", "0")
    assert (two["path"], two["reuse"], two["reused_tokens"]) == ("pull", "hit", "7")
    assert (one["pulled_tokens"], two["pulled_tokens"]) == ("-", "5")  # nothing offered on the first turn
    assert "x-agentkv-pulled-tokens" not in first.headers
    assert second.headers["x-agentkv-pulled-tokens"] == "5"
    # Taken off P's params: the decode hop carries only what vLLM and our decode connector read.
    assert all(PULLED_KEY not in body["kv_transfer_params"] for body in engines.completions("d"))
    assert two["decode"] == one["decode"]  # sticky: the decode that holds the blocks


async def test_a_miss_counts_what_prefills_own_prefix_cache_held(engines: FakeEngines, make_client) -> None:
    """No decode KV offered (a first turn here), but prefill's prefix cache held 40 prompt tokens (a shared
    system prompt, a conversation whose retention was declined): not recomputed, still a miss."""
    engines.p_cached_tokens = 40
    async with make_client() as client:
        r = await chat(client, USER1)
    assert (r.headers["x-agentkv-reuse"], r.headers["x-agentkv-reused-tokens"]) == ("miss", "40")
    assert "x-agentkv-pulled-tokens" not in r.headers  # nothing was offered from decode


async def test_a_streamed_turn_logs_once_after_the_stream_with_its_ttft(
    engines: FakeEngines, make_client, turn_lines
) -> None:
    async with make_client() as client:
        r = await chat(client, USER1, stream=True, stream_options={"include_usage": True})
    assert r.text.rstrip().endswith("data: [DONE]")
    [line] = turn_lines()
    assert (line["conversation_id"], line["path"], line["reuse"]) == ("c1", "recompute", "miss")
    assert served_by(engines, "d", line["request_id"]) == [line["decode"]]
    assert float(line["ttft_ms"]) > 0.0
    assert line["prefill_ms"] == r.headers["x-agentkv-prefill-ms"]


async def test_a_decode_local_turn_logs_no_prefill(engines: FakeEngines, make_client, turn_lines) -> None:
    async with make_client(path_policy="always-local", exact=False) as client:
        first = (await chat(client, USER1)).json()
        r = await chat(client, next_messages(USER1, first))
    _, local = turn_lines()
    assert (local["path"], local["reuse"], local["prefill"]) == ("decode-local", "local", "-")
    assert local["prefill_ms"] == "0.0" and served_by(engines, "p", local["request_id"]) == []
    assert local["reused_tokens"] == r.headers["x-agentkv-reused-tokens"] and int(local["reused_tokens"]) > 0


async def test_a_failed_turn_and_a_turn_without_id_still_log_exactly_once(
    engines: FakeEngines, make_client, turn_lines
) -> None:
    async with make_client() as client:
        anonymous = await chat(client, USER1, cid=None)
        engines.status = {"p0.test": (500, {}), "p1.test": (500, {})}
        failed = await chat(client, USER1)
    assert anonymous.status_code == 200 and failed.status_code == 502
    no_id, broke = turn_lines()
    assert (no_id["conversation_id"], no_id["reuse"]) == ("-", "none")
    assert no_id["decode"] != "-"
    assert broke["conversation_id"] == "c1"
    assert broke["reuse"] == "miss/failed" and broke["decode"] == "-"  # never reached decode
