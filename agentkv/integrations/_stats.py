"""Per-turn statistics for requests an adapter sends, like ``Session.turns`` for the session's own.

A framework adapter makes its requests through the framework's client, so ``Session.touch`` only sees
that a turn happened. ``TurnLog`` builds the same ``TurnStats`` from the router's response headers and
the usage the framework reports; ``capture_headers`` gets those headers out of frameworks that drop
them (LlamaIndex) through an httpx response hook and a context variable, so concurrent turns of other
conversations (threads or asyncio tasks) never write into each other's capture.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from agentkv.session._stats import RouterHeaders, TurnStats, render_summary

__all__ = ["TurnLog", "add_header_hook", "capture_headers"]


class TurnLog:
    """The ``TurnStats`` of one adapter's successful requests, in order."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.turns: list[TurnStats] = []
        self._clock = clock
        self._lock = threading.Lock()  # LangChain's batch() runs calls of one model in threads
        self._last_end: float | None = None

    def now(self) -> float:
        return self._clock()

    def record(
        self,
        *,
        request_id: str,
        started: float,
        streamed: bool,
        headers: Mapping[str, str] | None,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        ttft_s: float | None = None,
    ) -> TurnStats:
        now = self._clock()
        with self._lock:
            stats = TurnStats.build(
                router=RouterHeaders.parse(headers or {}),
                lease_expired_before=False,  # the session's heartbeats see that; the router says "expired"
                index=len(self.turns) + 1,
                request_id=request_id,
                streamed=streamed,
                ttft_s=ttft_s,
                total_s=now - started,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                since_previous_s=None if self._last_end is None else started - self._last_end,
            )
            self.turns.append(stats)
            self._last_end = now
        return stats

    def summary(self, conversation_id: str) -> str:
        return render_summary(self.turns, title=f"conversation {conversation_id}")


_sink: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "agentkv_response_headers", default=None
)


@contextlib.contextmanager
def capture_headers(sink: dict[str, str]) -> Iterator[dict[str, str]]:
    """Responses received in this context (by a client with ``add_header_hook``) fill ``sink``."""
    token = _sink.set(sink)
    try:
        yield sink
    finally:
        _sink.reset(token)


def _capture(response: Any) -> None:
    sink = _sink.get()
    if sink is not None:
        sink.clear()  # a retried request: the answer that counts is the last one
        sink.update(dict(response.headers))  # httpx lower-cases the names


async def _acapture(response: Any) -> None:
    _capture(response)


def add_header_hook(client: Any, *, asynchronous: bool) -> Any:
    """``client`` (an httpx ``Client``/``AsyncClient``, or None for the openai SDK's default one) with
    the capture hook among its response hooks. Outside ``capture_headers`` the hook does nothing, so
    adding it to a client shared with other code is harmless."""
    if client is None:
        import openai

        factory = openai.DefaultAsyncHttpxClient if asynchronous else openai.DefaultHttpxClient
        return factory(event_hooks={"response": [_acapture if asynchronous else _capture]})
    hook = _acapture if asynchronous else _capture
    hooks = {name: list(items) for name, items in client.event_hooks.items()}
    if hook not in hooks.setdefault("response", []):
        hooks["response"].append(hook)
        client.event_hooks = hooks
    return client
