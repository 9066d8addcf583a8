"""HTTP to the router: completions through the official openai SDK, the control plane through httpx.

Completions go through ``openai`` with ``max_retries=0`` so that our retry layer (``_retry``) is the
only one; otherwise the SDK's own retries would multiply ours and could replay a request. The
control plane (``/v1/conversations/{conversation_id}``, ``/v1/models``) has its own small httpx
client so that a long stream can never starve heartbeats of connections.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import httpx
import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from agentkv._constants import H_FINAL_TURN
from agentkv._exceptions import ConfigError, ConnectError, TimeoutError_, TransportError
from agentkv.client._compat import http
from agentkv.client._retry import (
    Deadline,
    RetryPolicy,
    call_with_retry,
    call_with_retry_async,
    classify,
    status_error,
)

__all__ = [
    "AsyncControlClient",
    "AsyncTransport",
    "ControlClient",
    "Reply",
    "Timeouts",
    "Transport",
    "first_model",
    "messages_as_is",
    "new_request_id",
    "turn_headers",
]

S = TypeVar("S")
REQUEST_ID_HEADER = "x-request-id"
# Statuses that mean "this server has no conversation endpoint / does not know the id".
_ABSENT = frozenset({404, 405, 501})


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """``total`` bounds a whole turn (all attempts, whole stream); ``read`` bounds one socket read."""

    total: float | None = 600.0
    connect: float = 10.0
    read: float = 300.0

    @classmethod
    def coerce(cls, value: float | Timeouts | None) -> Timeouts:
        if isinstance(value, Timeouts):
            return value
        return cls(total=value)

    def for_attempt(self, deadline: Deadline) -> Any:
        left = deadline.remaining()
        read = self.read if left is None else max(0.001, min(self.read, left))
        connect = min(self.connect, read)
        return http.Timeout(read, connect=connect, pool=connect)


def new_request_id() -> str:
    return uuid.uuid4().hex


def turn_headers(
    conversation_id: str, *, session_header: str, request_id: str, final: bool = False
) -> dict[str, str]:
    headers = {session_header: conversation_id, REQUEST_ID_HEADER: request_id}
    if final:
        headers[H_FINAL_TURN] = "true"
    return headers


@dataclass(frozen=True)
class Reply(Generic[S]):
    """A parsed answer (a ``ChatCompletion`` or an open stream) plus the response headers."""

    value: S
    headers: Mapping[str, str]
    deadline: Deadline


class _TransportBase:
    def __init__(
        self,
        *,
        timeout: float | Timeouts | None,
        retry: RetryPolicy | None,
        clock: Callable[[], float],
    ) -> None:
        self.timeouts = Timeouts.coerce(timeout)
        self.retry = retry or RetryPolicy()
        self._clock = clock

    def _deadline(self) -> Deadline:
        return Deadline(self.timeouts.total, clock=self._clock)

    def _options(self, params: Mapping[str, Any], deadline: Deadline) -> dict[str, Any]:
        options = {**params, "timeout": self.timeouts.for_attempt(deadline)}
        if "messages" in options:
            options.update(messages_as_is(options["messages"], options.get("extra_body")))
        return options


def messages_as_is(messages: Any, extra_body: Mapping[str, Any] | None) -> dict[str, Any]:
    """``create`` arguments that send ``messages`` as given: through ``extra_body``, which the SDK merges
    into the request body unchanged, with an empty ``messages`` argument for it to replace.

    ``create`` walks every message through its TypedDict transform, which leaves JSON messages as they
    are (it drops omitted values and dumps pydantic objects, which its JSON encoder also does) but costs
    time per message: an agent's history is hundreds of messages (``python -m bench.client_body``)."""
    return {"messages": [], "extra_body": {**(extra_body or {}), "messages": messages}}


class Transport(_TransportBase):
    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        timeout: float | Timeouts | None = None,
        retry: RetryPolicy | None = None,
        http_client: Any = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(timeout=timeout, retry=retry, clock=clock)
        self._sleep = sleep
        # cast: openai 3.x types http_client as httpx2.Client but still accepts a legacy httpx one.
        self.openai = openai.OpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, http_client=cast(Any, http_client)
        )

    def _call(self, params: Mapping[str, Any]) -> tuple[Any, Deadline]:
        deadline = self._deadline()

        def send() -> Any:
            return self.openai.chat.completions.with_raw_response.create(**self._options(params, deadline))

        raw = call_with_retry(send, policy=self.retry, deadline=deadline, sleep=self._sleep)
        return raw, deadline

    def complete(self, params: Mapping[str, Any]) -> Reply[ChatCompletion]:
        raw, deadline = self._call({**params, "stream": False})
        return Reply(raw.parse(), raw.headers, deadline)

    def open_stream(self, params: Mapping[str, Any]) -> Reply[openai.Stream[ChatCompletionChunk]]:
        # Retries end here: once the status line arrived, a replay could duplicate work or output.
        raw, deadline = self._call({**params, "stream": True})
        return Reply(raw.parse(), raw.headers, deadline)

    def chunks(
        self, reply: Reply[openai.Stream[ChatCompletionChunk]]
    ) -> Generator[ChatCompletionChunk, None, None]:
        try:
            for chunk in reply.value:
                reply.deadline.check()
                yield chunk
        except TransportError:
            raise
        except Exception as exc:
            # Mid-stream, httpx/httpx2 errors and SSE `{"error": ...}` events surface here unwrapped.
            raise classify(exc).error from exc
        finally:
            reply.value.close()

    def close(self) -> None:
        self.openai.close()


class AsyncTransport(_TransportBase):
    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        timeout: float | Timeouts | None = None,
        retry: RetryPolicy | None = None,
        http_client: Any = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] | None = None,
    ) -> None:
        super().__init__(timeout=timeout, retry=retry, clock=clock)
        self._sleep = sleep
        self.openai = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, http_client=cast(Any, http_client)
        )

    async def _call(self, params: Mapping[str, Any]) -> tuple[Any, Deadline]:
        deadline = self._deadline()

        async def send() -> Any:
            return await self.openai.chat.completions.with_raw_response.create(
                **self._options(params, deadline)
            )

        extra = {} if self._sleep is None else {"sleep": self._sleep}
        raw = await call_with_retry_async(send, policy=self.retry, deadline=deadline, **extra)
        return raw, deadline

    async def complete(self, params: Mapping[str, Any]) -> Reply[ChatCompletion]:
        raw, deadline = await self._call({**params, "stream": False})
        return Reply(raw.parse(), raw.headers, deadline)

    async def open_stream(self, params: Mapping[str, Any]) -> Reply[openai.AsyncStream[ChatCompletionChunk]]:
        raw, deadline = await self._call({**params, "stream": True})
        return Reply(raw.parse(), raw.headers, deadline)

    async def chunks(
        self, reply: Reply[openai.AsyncStream[ChatCompletionChunk]]
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        try:
            async for chunk in reply.value:
                reply.deadline.check()
                yield chunk
        except TransportError:
            raise
        except Exception as exc:
            raise classify(exc).error from exc
        finally:
            await reply.value.close()

    async def close(self) -> None:
        await self.openai.close()


class _ControlBase:
    """What both control clients send: absolute URLs with the key and timeout on each request, so the client
    may be the caller's own (one connection pool for a session's turns and heartbeats, and for many
    sessions at once; building an httpx client costs ~20 ms, most of it its TLS context)."""

    def __init__(self, *, base_url: str, api_key: str | None, timeout: float) -> None:
        self._base = base_url.rstrip("/") + "/"
        self._request_options: dict[str, Any] = {
            "headers": {"authorization": f"Bearer {api_key}"} if api_key else {},
            "timeout": timeout,
        }

    def _conversation_url(self, conversation_id: str, suffix: str = "") -> str:
        return f"{self._base}conversations/{conversation_id}{suffix}"

    @staticmethod
    def _interpret(response: httpx.Response) -> dict[str, Any] | None:
        if response.status_code in _ABSENT:
            return None
        if response.status_code >= 400:
            try:
                body: Any = response.json()
            except ValueError:
                body = response.text
            raise status_error(response.status_code, body, response.headers, response.reason_phrase).error
        data = response.json()
        return data if isinstance(data, dict) else {}

    @staticmethod
    def _map(exc: httpx.HTTPError) -> TransportError:
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            return ConnectError(f"could not connect: {exc}")
        if isinstance(exc, httpx.TimeoutException):
            return TimeoutError_(f"timed out: {exc}")
        return TransportError(f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _model_ids(data: dict[str, Any] | None) -> list[str]:
        return [str(m["id"]) for m in (data or {}).get("data", []) if isinstance(m, dict) and "id" in m]


class ControlClient(_ControlBase):
    """Conversation lookup / heartbeat / release and model listing (sync)."""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 5.0,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__(base_url=base_url, api_key=api_key, timeout=timeout)
        self._owns_http = http_client is None
        self._http = http_client if http_client is not None else httpx.Client()

    def _send(self, method: str, url: str, **kwargs: Any) -> dict[str, Any] | None:
        try:
            response = self._http.request(method, url, **self._request_options, **kwargs)
        except httpx.HTTPError as exc:
            raise self._map(exc) from exc
        return self._interpret(response)

    def lookup(self, conversation_id: str) -> dict[str, Any] | None:
        return self._send("GET", self._conversation_url(conversation_id))

    def heartbeat(
        self, conversation_id: str, *, extend_s: float | None = None, tool_call: bool = False
    ) -> dict[str, Any] | None:
        """Renew decode's lease; ``tool_call``: the caller is about to run tools (the router may then move the
        conversation's KV to decode's host tier for the time they run)."""
        url = self._conversation_url(conversation_id, "/heartbeat")
        return self._send("POST", url, json=_beat_body(extend_s, tool_call))

    def release(self, conversation_id: str) -> dict[str, Any] | None:
        return self._send("DELETE", self._conversation_url(conversation_id))

    def models(self) -> list[str]:
        return self._model_ids(self._send("GET", f"{self._base}models"))

    def close(self) -> None:
        if self._owns_http:
            self._http.close()


class AsyncControlClient(_ControlBase):
    """Conversation lookup / heartbeat / release and model listing (async)."""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 5.0,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(base_url=base_url, api_key=api_key, timeout=timeout)
        self._owns_http = http_client is None
        self._http = http_client if http_client is not None else httpx.AsyncClient()

    async def _send(self, method: str, url: str, **kwargs: Any) -> dict[str, Any] | None:
        try:
            response = await self._http.request(method, url, **self._request_options, **kwargs)
        except httpx.HTTPError as exc:
            raise self._map(exc) from exc
        return self._interpret(response)

    async def lookup(self, conversation_id: str) -> dict[str, Any] | None:
        return await self._send("GET", self._conversation_url(conversation_id))

    async def heartbeat(
        self, conversation_id: str, *, extend_s: float | None = None, tool_call: bool = False
    ) -> dict[str, Any] | None:
        """As `ControlClient.heartbeat`."""
        url = self._conversation_url(conversation_id, "/heartbeat")
        return await self._send("POST", url, json=_beat_body(extend_s, tool_call))

    async def release(self, conversation_id: str) -> dict[str, Any] | None:
        return await self._send("DELETE", self._conversation_url(conversation_id))

    async def models(self) -> list[str]:
        return self._model_ids(await self._send("GET", f"{self._base}models"))

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()


def _beat_body(extend_s: float | None, tool_call: bool) -> dict[str, Any] | None:
    body: dict[str, Any] = {}
    if extend_s is not None:
        body["extend_s"] = extend_s
    if tool_call:
        body["tool_call"] = True
    return body or None


def first_model(base_url: str, *, api_key: str | None = None) -> str:
    """The first model ``GET /v1/models`` lists (the router asks its first healthy decode)."""
    control = ControlClient(base_url=base_url, api_key=api_key)
    try:
        models = control.models()
    finally:
        control.close()
    if not models:
        raise ConfigError(f"{base_url}/models lists no models; pass model= explicitly")
    return models[0]
