"""``ScriptedRouter``: a test double that answers like an agentkv router, from a script.

Hand ``router.transport()`` to ``httpx.Client`` / ``httpx.AsyncClient`` and that client to a
``Session(http_client=...)``: each request pops the next scripted reply and is recorded. Shipped
in the package (like ``httpx.MockTransport``) so every test suite can script the same server.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from agentkv._constants import (
    H_CONVERSATION_ID,
    H_LEASE_EXPIRES_IN,
    H_PATH,
    H_PULLED_TOKENS,
    H_REUSE,
    H_REUSED_TOKENS,
)

__all__ = ["ScriptedReply", "ScriptedRouter", "router_headers"]


def router_headers(
    *,
    reuse: str = "hit",
    reused_tokens: int = 0,
    path: str = "pull",
    lease_expires_in_s: float | None = None,
    conversation_id: str = "",
    pulled_tokens: int | None = None,
) -> dict[str, str]:
    headers = {H_REUSE: reuse, H_REUSED_TOKENS: str(reused_tokens), H_PATH: path}
    if pulled_tokens is not None:
        headers[H_PULLED_TOKENS] = str(pulled_tokens)
    if lease_expires_in_s is not None:
        headers[H_LEASE_EXPIRES_IN] = str(lease_expires_in_s)
    if conversation_id:
        headers[H_CONVERSATION_ID] = conversation_id
    return headers


class _Body(httpx.SyncByteStream, httpx.AsyncByteStream):
    """SSE bytes, optionally followed by a dropped connection."""

    def __init__(self, parts: list[bytes], *, break_after: int | None) -> None:
        self._parts = parts
        self._break_after = break_after

    def _items(self) -> Iterator[bytes]:
        for index, part in enumerate(self._parts):
            if self._break_after is not None and index >= self._break_after:
                raise httpx.ReadError("connection reset by peer")
            yield part

    def __iter__(self) -> Iterator[bytes]:
        yield from self._items()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self._items():
            yield part


def _chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-scripted",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "scripted",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def _usage(usage: tuple[int, int]) -> dict[str, int]:
    return {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}


@dataclass
class ScriptedReply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    json: Any = None
    events: list[Any] = field(default_factory=list)  # SSE data payloads (dicts), [DONE] is added
    break_after: int | None = None  # drop the connection after this many events

    @classmethod
    def completion(
        cls,
        content: str | None = "ok",
        *,
        tool_calls: Sequence[tuple[str, str, str]] = (),
        usage: tuple[int, int] = (10, 2),
        headers: Mapping[str, str] | None = None,
    ) -> ScriptedReply:
        """A non-streaming answer; ``tool_calls`` are ``(id, name, arguments_json)``."""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in tool_calls
            ]
        body = {
            "id": "chatcmpl-scripted",
            "object": "chat.completion",
            "created": 0,
            "model": "scripted",
            "choices": [
                {"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else "stop"}
            ],
            "usage": _usage(usage),
        }
        return cls(json=body, headers=dict(headers or {}))

    @classmethod
    def stream(
        cls,
        pieces: Sequence[str] = ("o", "k"),
        *,
        tool_calls: Sequence[tuple[int, str, str, Sequence[str]]] = (),
        usage: tuple[int, int] | None = (10, 2),
        headers: Mapping[str, str] | None = None,
        break_after: int | None = None,
        error: str | None = None,
    ) -> ScriptedReply:
        """A streamed answer; ``tool_calls`` are ``(index, id, name, argument_fragments)``.

        ``error`` ends the stream with an SSE error event (as the router does when a stream breaks).
        """
        events: list[Any] = [_chunk({"role": "assistant", "content": ""})]
        events += [_chunk({"content": piece}) for piece in pieces]
        for index, call_id, name, fragments in tool_calls:
            head = {"index": index, "id": call_id, "type": "function", "function": {"name": name}}
            events.append(_chunk({"tool_calls": [head]}))
            events += [
                _chunk({"tool_calls": [{"index": index, "function": {"arguments": f}}]}) for f in fragments
            ]
        if error is not None:
            events.append({"error": {"message": error, "type": "upstream_error", "param": None, "code": 502}})
            return cls(events=events, headers=dict(headers or {}), break_after=break_after)
        events.append(_chunk({}, "tool_calls" if tool_calls else "stop"))
        if usage is not None:
            events.append({**_chunk({}), "choices": [], "usage": _usage(usage)})
        return cls(events=events, headers=dict(headers or {}), break_after=break_after)

    @classmethod
    def error(
        cls, status: int, message: str = "scripted error", *, headers: Mapping[str, str] | None = None
    ) -> ScriptedReply:
        body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": status}}
        return cls(status=status, json=body, headers=dict(headers or {}))

    def response(self) -> httpx.Response:
        if not self.events:
            return httpx.Response(self.status, json=self.json, headers=self.headers)
        parts = [f"data: {json.dumps(e)}\n\n".encode() for e in self.events] + [b"data: [DONE]\n\n"]
        headers = {**self.headers, "content-type": "text/event-stream"}
        return httpx.Response(self.status, headers=headers, stream=_Body(parts, break_after=self.break_after))


def _no_control_plane(request: httpx.Request) -> httpx.Response:
    return httpx.Response(404, json={"detail": "Not Found"})


class ScriptedRouter:
    """Answers each model call with the next scripted reply and records what it was sent.

    A session sends its heartbeats and its release on the same client as its turns. Those control-plane
    calls (``/conversations/...``) are kept apart, in ``control_requests``, and answered by ``control``: by
    default a 404, as from a server without the endpoints, which a session takes in its stride."""

    def __init__(
        self,
        replies: Iterable[ScriptedReply | Exception] = (),
        *,
        control: Callable[[httpx.Request], httpx.Response] = _no_control_plane,
    ) -> None:
        self.replies: deque[ScriptedReply | Exception] = deque(replies)
        self.requests: list[httpx.Request] = []
        self.control_requests: list[httpx.Request] = []
        self.control = control

    def add(self, *replies: ScriptedReply | Exception) -> ScriptedRouter:
        self.replies.extend(replies)
        return self

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if "/conversations/" in request.url.path:
            self.control_requests.append(request)
            return self.control(request)
        self.requests.append(request)
        if not self.replies:
            raise AssertionError(f"unscripted request: {request.method} {request.url}")
        reply = self.replies.popleft()
        if isinstance(reply, Exception):
            raise reply  # e.g. httpx.ConnectError: nothing answered
        return reply.response()

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) if r.content else {} for r in self.requests]

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=self.transport())

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=self.transport())
