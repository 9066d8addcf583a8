"""A fast stub vLLM backend (prefill or decode) plus the decode retention service, for benchmarks and tests.

    python -m bench._stub --role prefill --port 21100
    python -m bench._stub --role decode --port 21200 --lease          # retention service on 22200

The apps are bare ASGI callables (no routing framework) run by uvicorn with uvloop + httptools, so the
stub costs a few tens of microseconds per request and is never what a benchmark measures. The retention
service runs in the same process and event loop as the decode API, sharing its retained blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

from agentkv._constants import LEASE_PORT_OFFSET
from bench._fake_vllm import StubConfig, StubState, error_body

__all__ = ["StubApps", "create_stub_apps", "main", "run_stub"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_RETAINED = "/agentkv/v1/retained/"
_LEASES = "/agentkv/v1/leases/"
_REAP_INTERVAL_S = 1.0


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send_json(send: Send, status: int, value: Any) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _JSON})
    await send({"type": "http.response.body", "body": _dumps(value)})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


class _Lifespan:
    """Runs startup/shutdown hooks so the reaper and the retention server live and die with the API."""

    def __init__(
        self, *, on_startup: Callable[[], Awaitable[None]], on_shutdown: Callable[[], Awaitable[None]]
    ):
        self._on_startup = on_startup
        self._on_shutdown = on_shutdown

    async def __call__(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self._on_startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._on_shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


class StubApps:
    """The OpenAI-compatible API app and the retention-service app over one shared ``StubState``."""

    def __init__(self, *, config: StubConfig) -> None:
        self.state = StubState(config=config)
        # Started and stopped with the API's lifespan, in the same event loop (set by run_stub).
        self.retention_server: uvicorn.Server | None = None
        self._reaper: asyncio.Task[None] | None = None

    # --- OpenAI-compatible API ----------------------------------------------------------------------
    async def api(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _Lifespan(on_startup=self._startup, on_shutdown=self._shutdown)(receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            await self._complete(scope, receive, send, chat=path == "/v1/chat/completions")
        elif method == "GET" and path == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
        elif method == "GET" and path == "/v1/models":
            await _send_json(send, 200, self._models())
        elif method == "GET" and path == "/stub/stats":  # bench-only: counters, not part of vLLM's API
            await _send_json(send, 200, {**self.state.counters, "retained_now": len(self.state.retained)})
        else:
            await _send_json(
                send, 404, error_body(f"no route {method} {path}", status=404, error_type="NotFound")
            )

    def _models(self) -> dict[str, Any]:
        config = self.state.config
        model = {
            "id": config.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": config.model,
            "parent": None,
            "max_model_len": config.max_model_len,
        }
        return {"object": "list", "data": [model]}

    async def _complete(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        try:
            body = json.loads(await _read_body(receive))
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as exc:
            await _send_json(send, 400, error_body(f"invalid JSON body: {exc}", status=400))
            return
        config = self.state.config
        external_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
        completion = self.state.complete(body, chat=chat, external_id=external_id)
        if config.prefill_ms > 0:
            await asyncio.sleep(config.prefill_ms / 1000)
        if not body.get("stream"):
            await _send_json(send, 200, completion.body())
            return
        if not config.stream_kv_params:
            completion.kv_transfer_params = None  # vLLM <= 0.32 streams without them
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        events = [b"data: " + _dumps(chunk) + b"\n\n" for chunk in completion.chunks()]
        events.append(b"data: [DONE]\n\n")
        if config.token_ms <= 0:
            # No inter-token delay to honour: one write keeps the stub cheap (framing is unchanged).
            await send({"type": "http.response.body", "body": b"".join(events)})
            return
        for event in events[:-1]:
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await asyncio.sleep(config.token_ms / 1000)
        await send({"type": "http.response.body", "body": events[-1]})

    # --- retention service ------------------------------------------------------------------------
    async def retention(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        state = self.state
        state.counters["service_calls"] += 1
        if method == "GET" and path == "/agentkv/v1/info":
            await _send_json(send, 200, state.info())
            return
        now = time.perf_counter
        if method == "GET" and path.startswith(_RETAINED):
            found = state.find(path[len(_RETAINED) :])
            await self._answer(send, None if found is None else found.view(now()))
        elif method == "POST" and path.startswith(_LEASES) and path.endswith("/renew"):
            try:
                duration = float(json.loads(await _read_body(receive) or b"{}").get("duration_s", 0.0))
            except (ValueError, AttributeError, TypeError):
                await _send_json(send, 400, {"error": {"message": "body must be {'duration_s': float}"}})
                return
            found = state.renew(path[len(_LEASES) : -len("/renew")], duration)
            await self._answer(send, None if found is None else found.view(now()))
        elif method == "DELETE" and path.startswith(_LEASES):
            await self._answer(send, {"released": True} if state.release(path[len(_LEASES) :]) else None)
        else:
            await _send_json(send, 404, {"error": {"message": f"no route {method} {path}"}})

    @staticmethod
    async def _answer(send: Send, value: dict[str, Any] | None) -> None:
        if value is None:
            await _send_json(send, 404, {"error": {"message": "not retained"}})
        else:
            await _send_json(send, 200, value)

    # --- lifecycle --------------------------------------------------------------------------------
    async def _startup(self) -> None:
        self._reaper = asyncio.create_task(self._reap_forever())
        if self.retention_server is not None:
            # startup() without serve(): serve() would install a second set of signal handlers, and
            # serve() is what normally creates the (here disabled) lifespan.
            server = self.retention_server
            server.lifespan = server.config.lifespan_class(server.config)
            await server.startup()

    async def _shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self.retention_server is not None:
            await self.retention_server.shutdown()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(_REAP_INTERVAL_S)
            self.state.reap()


def create_stub_apps(config: StubConfig) -> StubApps:
    """Apps without servers (for in-process tests through ``httpx.ASGITransport``)."""
    return StubApps(config=config)


def _uvicorn_config(app: Any, *, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="auto",  # uvloop and httptools when installed (uvicorn[standard]): much faster
        http="auto",
        access_log=False,
        log_level="warning",
        lifespan="on" if port else "off",
        backlog=4096,
        interface="asgi3",
        proxy_headers=False,
    )


def run_stub(
    config: StubConfig, *, host: str = "127.0.0.1", port: int, retention_port: int | None = None
) -> None:
    """Serve until SIGINT/SIGTERM; with ``retention_port`` also serve the retention service there."""
    apps = StubApps(config=config)
    if retention_port is not None:
        retention_config = _uvicorn_config(apps.retention, host=host, port=retention_port)
        retention_config.lifespan = "off"
        retention_config.load()
        apps.retention_server = uvicorn.Server(retention_config)
    uvicorn.Server(_uvicorn_config(apps.api, host=host, port=port)).run()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench._stub", description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="stub-model")
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--prefill-ms", type=float, default=0.0, help="delay before the first byte")
    parser.add_argument("--token-ms", type=float, default=0.0, help="delay between streamed tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--ttl-s", type=float, default=480.0, help="fixed pin on decode without --lease")
    parser.add_argument(
        "--lease",
        action="store_true",
        help="decode: lease semantics + retention service on --retention-port (default port + 1000)",
    )
    parser.add_argument("--retention-port", type=int, default=None)
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--max-lease-s", type=float, default=600.0)
    parser.add_argument(
        "--no-stream-kv-params",
        action="store_true",
        help="behave like vLLM 0.32: no kv_transfer_params on streamed chunks",
    )
    parser.add_argument("--side-channel-port", type=int, default=5600)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    config = StubConfig(
        role=args.role,
        model=args.model,
        output_tokens=args.output_tokens,
        prefill_ms=args.prefill_ms,
        token_ms=args.token_ms,
        block_size=args.block_size,
        ttl_s=args.ttl_s,
        lease=args.lease,
        lease_s=args.lease_s,
        max_lease_s=args.max_lease_s,
        stream_kv_params=not args.no_stream_kv_params,
        side_channel_host=args.host,
        side_channel_port=args.side_channel_port,
    )
    retention_port = None
    if args.role == "decode" and (args.lease or args.retention_port is not None):
        retention_port = (
            args.retention_port if args.retention_port is not None else args.port + LEASE_PORT_OFFSET
        )
    run_stub(config, host=args.host, port=args.port, retention_port=retention_port)


if __name__ == "__main__":
    main()
