"""Fake engines for the router's unit tests: one `httpx.MockTransport` stands in for every prefill,
decode and decode retention service (the one layer faked); the router itself runs for real."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from agentkv.server.router import RouterSettings, create_app

P_URLS = ["http://p0.test:8100", "http://p1.test:8100"]
D_URLS = ["http://d0.test:8200", "http://d1.test:8200"]


def prompt_tokens_of(body: dict[str, Any]) -> int:
    # The fake tokenizer: one token per 4 characters of JSON, enough for shapes and bounds.
    text = json.dumps(body.get("messages", body.get("prompt")))
    return max(len(text) // 4, 1)


class FakeEngines:
    """Scripted vLLM servers. `seen` records every request as (host, method, path, json body, headers)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str, Any, httpx.Headers]] = []
        self.down: set[str] = set()  # hosts refusing connections
        self.retention = {"d0.test", "d1.test"}  # decodes running our retention service
        self.engine_id = {"d0.test": "D0-ENGINE", "d1.test": "D1-ENGINE"}
        self.reply: Callable[[dict[str, Any]], dict[str, Any]] = lambda body: {"content": "sure, done."}
        self.p_cached_tokens: int | None = None  # what P reports as prompt_tokens_details.cached_tokens
        self.d_generated_tokens = 3  # D holds prompt + this (a long answer may re-tokenize shorter)
        self.d_fingerprints = True  # D's params carry agentkv fingerprints (our connector); False: stock vLLM
        self.d_params_in_body = True  # vLLM returns kv_transfer_params on non-streaming answers
        # vLLM >= 0.33 streams: every chunk has "kv_transfer_params", null but on the finishing chunk
        self.d_params_in_stream = False
        self.d_generation: int | None = None  # vLLM >= 0.33: remote_registration_generation in D's params
        self.stream_gate: asyncio.Event | None = None  # when set, D waits on it after its first chunk
        self.stream_break_after: int | None = None  # D's stream dies after this many chunks
        self.status: dict[str, tuple[int, dict[str, Any]]] = {}  # host -> forced (status, json)
        self.retained: dict[str, dict[str, Any]] = {}  # decode request id -> retained params
        self.released: list[str] = []
        self.renewed: list[tuple[str, float]] = []
        # D's KV block size as its /metrics reports it (None: a /metrics without vllm:cache_config_info);
        # D's retained block lists cover its tokens in blocks of this size.
        self.block_size: int | None = 4

    def requests(self, host_prefix: str, path: str | None = None) -> list[tuple[Any, httpx.Headers]]:
        return [
            (body, headers)
            for host, _m, p, body, headers in self.seen
            if host.startswith(host_prefix) and (path is None or p == path)
        ]

    def completions(self, role: str) -> list[dict[str, Any]]:
        return [
            body
            for host, m, p, body, _h in self.seen
            if host.startswith(role) and m == "POST" and p.startswith("/v1/") and "completions" in p
        ]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        body = json.loads(request.content) if request.content else None
        self.seen.append((host, request.method, path, body, request.headers))
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.port == 9200:
            return self._control(host, request.method, path, body)
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics":
            info = f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto"}} 1.0\n'
            return httpx.Response(200, text="# vllm\n" + (info if self.block_size else ""))
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        if host in self.status:
            status, payload = self.status[host]
            return httpx.Response(status, json=payload)
        rid = request.headers["x-request-id"]
        if host.startswith("p"):
            return self._prefill(rid, path, body)
        return self._decode(host, rid, path, body)

    def _prefill(self, rid: str, path: str, body: dict[str, Any]) -> httpx.Response:
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens_of(body), "completion_tokens": 1}
        if self.p_cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.p_cached_tokens}
        return httpx.Response(
            200,
            json={
                "id": f"cmpl-{rid}",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
                ],
                "usage": usage,
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": [[1, 2]],
                    "remote_engine_id": "P-ENGINE",
                    "remote_request_id": f"chatcmpl-{rid}",
                    "remote_host": "10.9.9.1",
                    "remote_port": 5600,
                    "tp_size": 1,
                },
            },
        )

    def _retain(self, host: str, rid: str, body: dict[str, Any]) -> dict[str, Any]:
        tokens = prompt_tokens_of(body) + self.d_generated_tokens
        params = {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": [list(range(10, 10 - (-tokens // (self.block_size or 4))))],
            "remote_engine_id": self.engine_id[host],
            "remote_request_id": f"chatcmpl-{rid}",
            "remote_host": "10.9.9.2",
            "remote_port": 5601,
            "tp_size": 1,
            "remote_num_tokens": tokens,
            "remote_blocks_expiry_time": 12345.0,
        }
        if self.d_fingerprints:
            params["agentkv_block_hashes"] = ["h0"]  # as our connector on decode publishes them
        if self.d_generation is not None:
            params["remote_registration_generation"] = self.d_generation
        self.retained[rid] = params
        return params

    def _decode(self, host: str, rid: str, path: str, body: dict[str, Any]) -> httpx.Response:
        reply = self.reply(body)
        params = self._retain(host, rid, body)
        usage = {"prompt_tokens": prompt_tokens_of(body), "completion_tokens": 3}
        chat = path == "/v1/chat/completions"
        if not body.get("stream"):
            message = {
                "role": "assistant",
                "content": reply.get("content"),
                "tool_calls": reply.get("tool_calls", []),
            }
            choice = {"index": 0, "finish_reason": reply.get("finish_reason", "stop"), "logprobs": None}
            choice.update({"message": message} if chat else {"text": reply.get("content")})
            out: dict[str, Any] = {
                "id": f"chatcmpl-{rid}",
                "object": "x",
                "choices": [choice],
                "usage": usage,
            }
            if self.d_params_in_body:
                out["kv_transfer_params"] = params
            return httpx.Response(200, json=out)
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=self._sse(rid, reply, usage, body, chat),
        )

    async def _sse(
        self, rid: str, reply: dict[str, Any], usage: dict[str, Any], body: dict[str, Any], chat: bool
    ) -> AsyncIterator[bytes]:
        def event(choice: dict[str, Any], **extra: Any) -> bytes:
            if self.d_params_in_stream and choice:  # pydantic exclude_unset: null was set explicitly
                extra["kv_transfer_params"] = self.retained[rid] if choice.get("finish_reason") else None
            return (
                b"data: "
                + json.dumps({"id": f"chatcmpl-{rid}", "choices": [choice], **extra}).encode()
                + b"\n\n"
            )

        chunks = []
        for word in (reply.get("content") or "").split(" "):
            delta = {"content": word + " "} if chat else None
            chunks.append(event({"index": 0, "delta": delta} if chat else {"index": 0, "text": word + " "}))
        for i, call in enumerate(reply.get("tool_calls", [])):
            args = call["function"]["arguments"]
            head = {
                "index": i,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"]},
            }
            chunks.append(event({"index": 0, "delta": {"tool_calls": [head]}}))
            for part in (args[: len(args) // 2], args[len(args) // 2 :]):
                chunks.append(
                    event(
                        {"index": 0, "delta": {"tool_calls": [{"index": i, "function": {"arguments": part}}]}}
                    )
                )
        chunks.append(event({"index": 0, "delta": {}, "finish_reason": reply.get("finish_reason", "stop")}))
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append(
                b"data: "
                + json.dumps({"id": f"chatcmpl-{rid}", "choices": [], "usage": usage}).encode()
                + b"\n\n"
            )
        chunks.append(b"data: [DONE]\n\n")
        for n, chunk in enumerate(chunks):
            if self.stream_break_after is not None and n == self.stream_break_after:
                raise httpx.ReadError("decode died")
            # Split mid-event: the router must reassemble events across network reads.
            yield chunk[:7]
            yield chunk[7:]
            if n == 0 and self.stream_gate is not None:
                await asyncio.wait_for(self.stream_gate.wait(), timeout=10)

    def _control(self, host: str, method: str, path: str, body: Any) -> httpx.Response:
        if host not in self.retention:
            raise httpx.ConnectError("connection refused")
        if path == "/agentkv/v1/info":
            return httpx.Response(
                200,
                json={
                    "engine_id": self.engine_id[host],
                    "registration_generation": self.d_generation,
                    "lease_s": 30.0,
                    "max_lease_s": 600.0,
                    "retained": 0,
                },
            )
        rid = path.split("/")[4]
        params = self.retained.get(rid)
        if params is None:
            return httpx.Response(404, json={"error": "unknown"})
        if method == "DELETE":
            self.released.append(rid)
            del self.retained[rid]
            return httpx.Response(200, json={"released": True})
        expires = 30.0
        if path.endswith("/renew"):
            expires = float(body["duration_s"])
            self.renewed.append((rid, expires))
        answer = {"request_id": rid, "kv_transfer_params": params, "expires_in_s": expires, "num_tokens": 9}
        return httpx.Response(200, json=answer)


@pytest.fixture
def engines() -> FakeEngines:
    return FakeEngines()


def settings(**overrides: Any) -> RouterSettings:
    values: dict[str, Any] = {
        "prefill": P_URLS,
        "decode": D_URLS,
        "health_interval_s": 0,
        "path_policy": "always-pd",
    }
    return RouterSettings(**{**values, **overrides})


@pytest.fixture
def make_client(engines: FakeEngines) -> Callable[..., httpx.AsyncClient]:
    """An httpx client talking to a router app (in-process) whose engines are the fakes."""

    def make(**overrides: Any) -> httpx.AsyncClient:
        store = overrides.pop("store", None)
        app = create_app(settings(**overrides), transport=httpx.MockTransport(engines.handle), store=store)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router.test")
        client.app = app  # type: ignore[attr-defined]
        return client

    return make


def store_of(client: httpx.AsyncClient) -> Any:
    return client.app.state.router.store  # type: ignore[attr-defined]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def redis_url() -> Any:
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is required in CI (apt-get install -y redis-server)")
        pytest.skip(
            "redis-server not installed; RedisStore tests need a real Redis (apt-get install redis-server)"
        )
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.02)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)
