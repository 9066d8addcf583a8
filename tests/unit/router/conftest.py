"""Fake engines for the router's unit tests: one `httpx.MockTransport` stands in for every prefill, decode
and decode retention service (the one layer faked); the router itself runs for real.

Each engine is the benchmarks' stub vLLM (``bench._fake_vllm.StubState``), so the router's tests and its
benchmarks see one fake of vLLM's wire format; ``FakeEngines`` adds what tests script: failures, forced
answers, stalls and broken streams."""

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

from agentkv._constants import LEASE_PORT_OFFSET, PULLED_KEY
from agentkv.server.launch._launcher import free_port
from agentkv.server.router import RouterSettings, create_app
from bench._fake_vllm import Scripted, StubConfig, StubState

P_URLS = ["http://p0.test:8100", "http://p1.test:8100"]
D_URLS = ["http://d0.test:8200", "http://d1.test:8200"]
_RETAINED = "/agentkv/v1/retained/"
_LEASES = "/agentkv/v1/leases/"


def render_ids(body: dict[str, Any]) -> list[int]:
    """The fake renderer: a ChatML-like, prefix-stable id sequence. Tools and template kwargs render at the
    top (as real templates do); each message is `1, role, content..., 2`; the generation prompt is `1, 5`,
    which an assistant message's rendering starts with, so a turn's prompt is a prefix of the next one's."""
    top = [3, *(ord(c) % 200 + 10 for c in json.dumps([body.get("tools"), body.get("chat_template_kwargs")]))]
    if "messages" not in body:
        return [ord(c) % 200 + 10 for c in str(body.get("prompt"))]
    roles = {"system": 4, "assistant": 5, "user": 6, "tool": 7}
    ids = top
    for m in body["messages"]:
        content = m.get("content") or ""
        ids += [1, roles.get(m.get("role"), 8), *(ord(c) % 200 + 10 for c in str(content)), 2]
    return [*ids, 1, 5]


class FakeEngines:
    """Scripted vLLM servers. `seen` records every request as (host, method, path, json body, headers)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str, Any, httpx.Headers]] = []
        self.down: set[str] = set()  # hosts refusing connections
        self.retention = {"d0.test", "d1.test"}  # decodes running our retention service
        self.host_tier: set[str] = set()  # decodes whose host KV tier holds every block (demotions succeed)
        self.engine_id = {"p0.test": "P-ENGINE", "p1.test": "P-ENGINE", "d0.test": "D0-ENGINE"}
        self.engine_id["d1.test"] = "D1-ENGINE"
        self.reply: Callable[[dict[str, Any]], dict[str, Any]] = lambda body: {"content": "sure, done."}
        self.p_cached_tokens: int | None = None  # what P reports as prompt_tokens_details.cached_tokens
        self.p_pulled_tokens: int | None = None  # what our connector on P reports it read from decode
        self.d_generated_tokens = 3  # D holds prompt + this (a long answer may re-tokenize shorter)
        self.d_fingerprints = True  # D's params carry agentkv fingerprints (our connector); False: stock vLLM
        self.d_params_in_body = True  # vLLM returns kv_transfer_params on non-streaming answers
        self.stream_gate: asyncio.Event | None = None  # when set, D waits on it after its first token
        # vLLM >= 0.33 streams: "kv_transfer_params" on every chunk, null but on the finishing one; 0.32: none
        self.d_stream_params = False
        self.d_generation: int | None = None  # vLLM >= 0.33: remote_registration_generation in D's params
        self.stream_break_after: int | None = None  # D's stream dies after this many chunks
        self.status: dict[str, tuple[int, dict[str, Any]]] = {}  # host -> forced (status, json)
        self.released: list[str] = []
        self.demoted: list[str] = []
        # Leases decode demoted (asked, or by itself: `pressure_demote`): their renewals answer 409 demoted,
        # and a release of one ends its host copy's keep.
        self.demoted_ids: set[str] = set()
        self.renewed: list[tuple[str, float]] = []  # (request id, duration asked for)
        # D's KV block size as its /metrics reports it (None: a /metrics without vllm:cache_config_info);
        # D's retained block lists cover its tokens in blocks of this size.
        self.block_size: int | None = 4
        # vLLM's render and tokens-in routes (the router's token path); False: a server without them (404).
        self.renders = False
        self.version = "0.32.0"  # what GET /version reports
        self.d_forwarded_ids = False  # D's retention service reports agentkv's plugin taking forwarded ids
        self.d_packed_ids = False  # ... and reading them packed
        self.d_messages_cut = False  # ... and taking a chat body cut to its last message
        self.refuse_completions: set[str] = set()  # hosts whose completion routes refuse connections
        # Prefills refuse these routes with (status, message), e.g. the generate route refusing the token
        # path's body as another release's schema would; and the generate route may answer without
        # kv_transfer_params. Empty/False: vLLM 0.32's behaviour.
        self.prefill_refuses: dict[str, tuple[int, str]] = {}
        self.generate_drops_params = False
        self.engines = {
            host: StubState(
                config=StubConfig(
                    role="prefill" if host.startswith("p") else "decode",
                    model="tiny",
                    side_channel_host="10.9.9.1" if host.startswith("p") else "10.9.9.2",
                    side_channel_port=5600 if host.startswith("p") else 5601,
                )
            )
            for host in self.engine_id
        }

    @property
    def retained(self) -> dict[str, dict[str, Any]]:
        """What the decodes hold now: internal request id -> kv_transfer_params."""
        return {
            rid: held.kv_transfer_params
            for host, engine in self.engines.items()
            if host.startswith("d")
            for rid, held in engine.retained.items()
        }

    def drop_retained(self) -> None:
        """Every decode lets go of everything it holds (as after a restart)."""
        for host, engine in self.engines.items():
            if host.startswith("d"):
                for rid in list(engine.retained):
                    engine.release(rid)

    def pressure_demote(self) -> None:
        """Every decode demotes what it holds to its host tier by itself, as to retain a newer turn under its
        cap: the leases end, and their renewals answer 409 ``demoted``."""
        for host, engine in self.engines.items():
            if host.startswith("d"):
                for rid in list(engine.retained):
                    engine.release(rid)
                    self.demoted_ids.add(rid)

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
        if request.url.port == 8200 + LEASE_PORT_OFFSET:
            return self._control(host, request.method, path, body)
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics":
            info = f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto"}} 1.0\n'
            return httpx.Response(200, text="# vllm\n" + (info if self.block_size else ""))
        if path == "/version":
            return httpx.Response(200, json={"version": self.version})
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        if host in self.refuse_completions and path.startswith(("/v1/", "/inference/")):
            raise httpx.ConnectError("connection refused", request=request)
        if host in self.status:
            status, payload = self.status[host]
            return httpx.Response(status, json=payload)
        if host.startswith("p") and path in self.prefill_refuses:
            status, message = self.prefill_refuses[path]
            return httpx.Response(status, json={"error": {"message": message, "type": "BadRequestError"}})
        if path.startswith(("/v1/messages", "/v1/responses")):
            # These fakes speak only OpenAI's completions (the other dialects are tested on the real engine):
            # an engine without those routes.
            return httpx.Response(404, json={"detail": "Not Found"})
        if path.endswith("/render"):
            if not self.renders:
                return httpx.Response(404, json={"detail": "Not Found"})
            return self._render(path, body)
        return self._complete(host, request.headers["x-request-id"], path, body)

    def _render(self, path: str, body: dict[str, Any]) -> httpx.Response:
        rendered = {
            "request_id": "render-x",
            "token_ids": render_ids(body),
            "sampling_params": {"max_tokens": body.get("max_tokens"), "temperature": body.get("temperature")},
            "model": body.get("model"),
            "stream": False,
        }
        return httpx.Response(200, json=rendered if "chat" in path else [rendered])

    def _engine(self, host: str) -> StubState:
        engine = self.engines[host]
        engine.config.engine_id = self.engine_id[host]  # a test may "restart" an engine under a new id
        engine.config.block_size = self.block_size or 4
        engine.config.lease = self.d_fingerprints  # our connector: a lease and token fingerprints
        return engine

    def _complete(self, host: str, rid: str, path: str, body: dict[str, Any]) -> httpx.Response:
        scripted = None
        if host.startswith("d"):
            reply = self.reply(body)
            scripted = Scripted(
                text=reply.get("content"),
                tool_call=(reply.get("tool_calls") or [None])[0],
                finish_reason=reply.get("finish_reason", "stop"),
                held_beyond_prompt=self.d_generated_tokens,
            )
        completion = self._engine(host).complete(
            body, chat=path == "/v1/chat/completions", external_id=rid, scripted=scripted
        )
        if host.startswith("p"):
            completion.cached_tokens = self.p_cached_tokens
            if self.p_pulled_tokens is not None and completion.kv_transfer_params is not None:
                completion.kv_transfer_params[PULLED_KEY] = self.p_pulled_tokens
        elif self.d_generation is not None and completion.kv_transfer_params:
            # The same dict the retention service answers with: both carry the generation.
            completion.kv_transfer_params["remote_registration_generation"] = self.d_generation
        if not body.get("stream"):
            out = completion.body()
            if host.startswith("d") and not self.d_params_in_body:
                del out["kv_transfer_params"]
            if path == "/inference/v1/generate" and self.generate_drops_params:
                del out["kv_transfer_params"]
            return httpx.Response(200, json=out)
        if not (host.startswith("d") and self.d_stream_params):
            completion.kv_transfer_params = None  # vLLM 0.32 streams without them
        chunks = list(completion.chunks())
        if host.startswith("d") and self.d_stream_params:
            for chunk in chunks:  # pydantic's exclude_unset: the null was set explicitly on every chunk
                if chunk.get("choices"):
                    chunk.setdefault("kv_transfer_params", None)
        events = [b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks]
        # A chat stream opens with the assistant's role; its first token is the next event.
        first_token = 1 if completion.chat else 0
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=self._sse([*events, b"data: [DONE]\n\n"], first_token),
        )

    async def _sse(self, events: list[bytes], first_token: int) -> AsyncIterator[bytes]:
        for n, event in enumerate(events):
            if self.stream_break_after is not None and n == self.stream_break_after:
                raise httpx.ReadError("decode died")
            # Split mid-event: the router must reassemble events across network reads.
            yield event[:7]
            yield event[7:]
            if n == first_token and self.stream_gate is not None:
                await asyncio.wait_for(self.stream_gate.wait(), timeout=10)

    def _control(self, host: str, method: str, path: str, body: Any) -> httpx.Response:
        if host not in self.retention:
            raise httpx.ConnectError("connection refused")
        engine = self._engine(host)
        if path == "/agentkv/v1/info":
            info = engine.info()
            if self.d_generation is not None:
                info["registration_generation"] = self.d_generation
            if self.d_forwarded_ids:
                info["forwarded_ids"] = True
            if self.d_packed_ids:
                info["packed_ids"] = True
            if self.d_messages_cut:
                info["messages_cut"] = True
            return httpx.Response(200, json=info)
        now = time.perf_counter()
        if method == "GET" and path.startswith(_RETAINED):
            found = engine.find(path[len(_RETAINED) :])
        elif method == "POST" and path.endswith("/renew"):
            rid, duration = path[len(_LEASES) : -len("/renew")], float(body["duration_s"])
            self.renewed.append((rid, duration))
            found = engine.renew(rid, duration)
            if found is None and any(rid in held for held in self.demoted_ids):
                return httpx.Response(409, json={"demoted": True, "error": "demoted to the host KV tier"})
        elif method == "POST" and path.endswith("/demote"):
            rid = path[len(_LEASES) : -len("/demote")]
            if host not in self.host_tier:
                return httpx.Response(409, json={"demoted": False, "error": "decode has no host KV tier"})
            held = engine.find(rid)
            if held is None or not engine.release(rid):
                return httpx.Response(404, json={"demoted": False, "error": "unknown"})
            self.demoted.append(rid)
            self.demoted_ids.add(rid)
            return httpx.Response(200, json={"demoted": True, "host_tokens": held.view(now)["num_tokens"]})
        elif method == "DELETE" and path.startswith(_LEASES):
            rid = path[len(_LEASES) :]
            kept = next((held for held in self.demoted_ids if rid in held), None)
            if kept is not None:
                self.demoted_ids.discard(kept)
            if not engine.release(rid) and kept is None:
                return httpx.Response(404, json={"error": "unknown"})
            self.released.append(rid)
            return httpx.Response(200, json={"released": True})
        else:
            return httpx.Response(404, json={"error": f"no route {method} {path}"})
        if found is None:
            return httpx.Response(404, json={"error": "unknown"})
        return httpx.Response(200, json=found.view(now))


@pytest.fixture
def engines() -> FakeEngines:
    return FakeEngines()


def settings(**overrides: Any) -> RouterSettings:
    values: dict[str, Any] = {
        "prefill": P_URLS,
        "decode": D_URLS,
        "health_interval_s": 0,
        "path_policy": "always-pd",
        # The text path (engines without vLLM's render API); tests of the token path turn it on.
        "tokens": False,
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
    deadline = time.monotonic() + 60  # milliseconds, unless other processes starve the host
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
