"""Responses that finish a turn's bookkeeping after the client has the last byte.

The store update, lease releases and the log line are the router's business, not the client's: they run
once the response is complete, while the conversation lock is still held, so the next turn of the same
conversation still sees them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.responses import Response, StreamingResponse

from ._backend import BackendState
from ._book import TurnBook
from ._errors import error_body
from ._hops import close_quietly
from ._services import RouterServices
from ._sse import EventSplitter, TurnOutput, stream_error
from ._store import ConversationRecord
from ._turn import Turn

__all__ = ["AfterwardsResponse", "Relay", "RelayResponse"]


class AfterwardsResponse(Response):
    """A whole JSON answer; `after` runs exactly once, when it was sent or the client left."""

    def __init__(
        self, content: bytes, *, headers: dict[str, str], after: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(content, media_type="application/json", headers=headers)
        self._after = after

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Shielded: a client hang-up cancels us, but the lock and the bookkeeping must still finish.
            await asyncio.shield(self._after())


class Relay:
    """Decode's stream on its way to the client. `close` runs exactly once, also when the client left
    before the body started (then the generator never runs)."""

    def __init__(
        self,
        *,
        services: RouterServices,
        book: TurnBook,
        turn: Turn,
        record: ConversationRecord | None,
        decode: BackendState,
        resp: httpx.Response,
        stack: contextlib.AsyncExitStack,
    ) -> None:
        self._sv, self._book = services, book
        self._turn, self._record, self._decode = turn, record, decode
        self._resp, self._stack = resp, stack
        self._output = TurnOutput(dialect=turn.dialect)
        self._ok = False
        self._client_left = False
        self._closed: asyncio.Task[None] | None = None
        self._splitter: EventSplitter | None = None

    async def events(self) -> AsyncIterator[bytes]:
        """Forward decode's events as they complete; never buffer the stream. A break after the first
        byte ends with one error event (and [DONE] in OpenAI's dialect), so clients never hang."""
        turn, timeouts = self._turn, self._sv.settings.timeouts
        splitter = self._splitter = EventSplitter(output=self._output)
        failure: str | None = None
        try:
            async for data in self._sv.hops.iter_stream(
                self._resp, first_s=timeouts.decode_first_byte_s, idle_s=timeouts.decode_idle_s
            ):
                if turn.ttft_ms is None:
                    turn.ttft_ms = (time.perf_counter() - turn.started) * 1000
                # Events that arrived in one read leave in one write: one send per read, not per event.
                if events := b"".join(splitter.feed(data)):
                    yield events
                if splitter.aborted:
                    break
            if events := b"".join(splitter.flush()):
                yield events
            self._ok = splitter.done
            if splitter.aborted:
                failure = "decode engine aborted the request"
                self._sv.metrics.backend_errors.labels(role="decode", kind="aborted").inc()
            elif not self._ok:
                failure = "decode stream ended early"
        except TimeoutError:
            failure = "decode engine stopped sending (idle timeout)"
            self._sv.metrics.backend_errors.labels(role="decode", kind="timeout").inc()
        except httpx.HTTPError:
            failure = "decode engine connection lost"
            self._sv.metrics.backend_errors.labels(role="decode", kind="stream").inc()
        except (GeneratorExit, asyncio.CancelledError):
            # The client left mid-answer (the server closes or cancels this generator at a `yield`).
            self._client_left = True
            raise
        if failure is not None:
            yield stream_error(error_body(502, failure, code="stream_interrupted"), self._output)

    async def close(self) -> None:
        # One cleanup task shared by every caller; shielded so a client hang-up cannot cut it short.
        if self._closed is None:
            self._closed = asyncio.ensure_future(self._cleanup())
        await asyncio.shield(self._closed)

    async def _cleanup(self) -> None:
        async with self._stack:
            self._turn.inflight.close()
            await close_quietly(self._resp)
            # Decode's [DONE] counts even if the client hung up right after receiving it (the SDK closes
            # the response at [DONE], which can cancel the generator before its loop ends).
            done = self._ok or (self._splitter is not None and self._splitter.done)
            left = not done and self._left_after_tokens()
            if left:
                self._sv.metrics.clients_left.inc()
            if done or left:
                # A client that left mid-answer left decode with the KV it computed: closing decode's stream
                # aborted the request, which agentkv's connector retains as it retains a stopped one, and
                # the next turn is checked against it on token ids like any other.
                new = await self._book.assess(self._turn, self._record, self._decode, self._output)
                await self._book.remember(self._turn, self._record, new)
            else:
                await self._book.failed(self._turn, self._record)

    def _left_after_tokens(self) -> bool:
        """The client left after decode had sent text, on the token path (the ids the next turn is checked
        on are the prompt's, never the answer the client may not have read whole)."""
        return self._client_left and self._turn.ttft_ms is not None and self._turn.prompt_ids is not None


class RelayResponse(StreamingResponse):
    """Streams `relay.events()`; the relay's bookkeeping runs after the last byte, never before it."""

    def __init__(self, relay: Relay, *, headers: dict[str, str]) -> None:
        super().__init__(relay.events(), media_type="text/event-stream", headers=headers)
        self._relay = relay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._relay.close()
