"""One HTTP hop to an engine, with failover across backends of a role and uniform error mapping."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx

from agentkv._exceptions import APIStatusError

from . import _codec
from ._backend import BackendState
from ._errors import client_error, sanitise_upstream_error
from ._metrics import RouterMetrics

__all__ = ["Hops", "close_quietly", "is_connect_failure", "with_failover"]

_CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def is_connect_failure(exc: BaseException) -> bool:
    """Nothing reached the engine, so another backend of the role may be tried safely."""
    return isinstance(exc, _CONNECT_FAILURES)


class Hops:
    """Requests go straight to the transport: the client's auth, redirect, cookie and URL-merging layers
    cost more per hop than the rest of the hop, and engines use none of them."""

    def __init__(
        self, *, transport: httpx.AsyncBaseTransport, metrics: RouterMetrics, connect_s: float
    ) -> None:
        self._transport = transport
        self._metrics = metrics
        self._connect_s = connect_s

    def _request(
        self, state: BackendState, path: str, body: dict[str, Any], request_id: str, read_s: float | None
    ) -> httpx.Request:
        c = self._connect_s
        return httpx.Request(
            "POST",
            f"{state.backend.url}{path}",
            content=_codec.encode(body),
            headers={"content-type": "application/json", "x-request-id": request_id},
            extensions={"timeout": {"connect": c, "read": read_s, "write": c, "pool": c}},
        )

    async def post_json(
        self, state: BackendState, path: str, body: dict[str, Any], request_id: str, *, total_s: float
    ) -> dict[str, Any]:
        """A non-streaming request answered by one JSON object; any failure becomes an APIStatusError
        except connect failures, which propagate for failover."""
        data = await self.post(state, path, body, request_id, total_s=total_s)
        if not isinstance(data, dict):
            self._metrics.backend_errors.labels(role=state.backend.role, kind="protocol").inc()
            raise client_error(
                502, f"{state.backend.role} engine returned a malformed response", code="upstream_error"
            )
        return data

    async def post(
        self, state: BackendState, path: str, body: dict[str, Any], request_id: str, *, total_s: float
    ) -> Any:
        """`post_json` for any JSON answer (None when it is not JSON)."""
        role = state.backend.role
        with state.inflight(), self._mapped_errors(role):
            async with asyncio.timeout(total_s):
                resp = await self._transport.handle_async_request(
                    self._request(state, path, body, request_id, total_s)
                )
                try:
                    await resp.aread()
                finally:
                    await resp.aclose()
        self.check_status(role, resp.status_code, resp.content)
        try:
            return _codec.decode(resp.content)
        except ValueError:
            return None

    @contextlib.contextmanager
    def _mapped_errors(self, role: str) -> Iterator[None]:
        """Connect failures propagate (the caller fails over); the rest become OpenAI-style errors."""
        try:
            yield
        except _CONNECT_FAILURES:
            self._metrics.backend_errors.labels(role=role, kind="connect").inc()
            raise
        except (TimeoutError, httpx.TimeoutException):
            self._metrics.backend_errors.labels(role=role, kind="timeout").inc()
            raise client_error(504, f"{role} engine timed out", code="upstream_timeout") from None
        except httpx.HTTPError:
            self._metrics.backend_errors.labels(role=role, kind="protocol").inc()
            raise client_error(502, f"{role} engine connection failed", code="upstream_error") from None

    async def open_stream(
        self, state: BackendState, path: str, body: dict[str, Any], request_id: str, *, first_byte_s: float
    ) -> httpx.Response:
        """Send and wait for response headers; the caller reads (and must close) the body."""
        role = state.backend.role
        request = self._request(state, path, body, request_id, None)
        with self._mapped_errors(role):
            async with asyncio.timeout(first_byte_s):
                resp = await self._transport.handle_async_request(request)
        if resp.status_code != 200:
            try:
                content = await resp.aread()
            except httpx.HTTPError:
                content = b""
            finally:
                await resp.aclose()
            self.check_status(role, resp.status_code, content)
        return resp

    async def iter_stream(
        self, resp: httpx.Response, *, first_s: float, idle_s: float
    ) -> AsyncIterator[bytes]:
        """Body bytes as they arrive. Engines send stream headers at once, so the first token gets its
        own deadline; after it, TimeoutError when decode goes quiet for `idle_s`."""
        chunks = resp.aiter_raw()
        deadline = first_s
        while True:
            try:
                async with asyncio.timeout(deadline):
                    data = await anext(chunks)
            except StopAsyncIteration:
                return
            deadline = idle_s
            yield data

    def check_status(self, role: str, status: int, content: bytes) -> None:
        if status < 400:
            return
        if status < 500:
            self._metrics.backend_errors.labels(role=role, kind="4xx").inc()
            raise sanitise_upstream_error(status, content)
        self._metrics.backend_errors.labels(role=role, kind="5xx").inc()
        raise client_error(502, f"{role} engine error (HTTP {status})", code="upstream_error")


async def with_failover(
    choose: Callable[[frozenset[str]], BackendState | None],
    attempt: Callable[[BackendState], Awaitable[Any]],
    *,
    role: str,
    mark_down: bool = True,
) -> tuple[BackendState, Any]:
    """Try backends until one accepts the connection. Only connect failures fail over: once a request
    reached an engine, repeating it elsewhere could run it twice."""
    tried: set[str] = set()
    while True:
        state = choose(frozenset(tried))
        if state is None:
            raise client_error(503, f"no healthy {role} engine available", code="no_backend")
        try:
            return state, await attempt(state)
        except APIStatusError:
            raise
        except Exception as exc:
            if not is_connect_failure(exc):
                raise
            tried.add(state.name)
            if mark_down:
                state.healthy = False  # the health checker brings it back once /health answers


async def close_quietly(resp: httpx.Response) -> None:
    with contextlib.suppress(Exception):
        await resp.aclose()
