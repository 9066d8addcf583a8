"""``Session``: one conversation with an agentkv router (or any OpenAI-compatible server), sync."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx
from openai.types.chat import ChatCompletionMessage

from agentkv._constants import DEFAULT_IDLE_LIMIT_S, DEFAULT_SESSION_HEADER
from agentkv._exceptions import StreamInterruptedError, TransportError
from agentkv.client import ControlClient, RetryPolicy, Timeouts, Transport
from agentkv.session._core import BaseSession, Messages, SessionCore, ToolLoop
from agentkv.session._delta import Delta, MessageAssembler
from agentkv.session._heartbeat import HeartbeatThread
from agentkv.session._tools import RunResult

__all__ = ["Session", "resolve_api_key"]

log = logging.getLogger("agentkv.session")


def resolve_api_key(api_key: str | None) -> str | None:
    return api_key or os.environ.get("AGENTKV_API_KEY") or os.environ.get("OPENAI_API_KEY")


class Session(BaseSession):
    """A multi-turn conversation whose KV cache the router keeps on decode between turns.

    Every request carries the conversation id (header and ``prompt_cache_key``); between turns a
    heartbeat keeps decode's lease alive; ``close()`` releases it.
    """

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None = None,
        conversation_id: str | None = None,
        system: str | None = None,
        session_header: str = DEFAULT_SESSION_HEADER,
        heartbeat: bool = True,
        heartbeat_idle_limit_s: float = DEFAULT_IDLE_LIMIT_S,
        timeout: float | Timeouts | None = None,
        retry: RetryPolicy | None = None,
        http_client: Any = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        key = resolve_api_key(api_key)
        self.base_url = base_url
        self.api_key = key
        self._core = SessionCore(
            model=model,
            conversation_id=conversation_id,
            system=system,
            session_header=session_header,
            heartbeat=heartbeat,
            heartbeat_idle_limit_s=heartbeat_idle_limit_s,
            clock=clock,
        )
        self._clock = clock
        self._owns_http_client = http_client is None
        self._transport = Transport(
            base_url=base_url,
            api_key=key or "EMPTY",  # the openai SDK insists on a key; open servers ignore it
            timeout=timeout if timeout is not None else Timeouts(),
            retry=retry,
            http_client=http_client,
            clock=clock,
            sleep=sleep,
        )
        # The caller's client carries the heartbeats too (one pool); an httpx2 client (openai >= 3) does not.
        shared = http_client if isinstance(http_client, httpx.Client) else None
        self._control = ControlClient(base_url=base_url, api_key=key, http_client=shared)
        conversation = self._core.conversation_id
        control = self._control
        self._heartbeat = HeartbeatThread(
            scheduler=self._core.scheduler,
            beat=lambda tool_call: control.heartbeat(conversation, tool_call=tool_call),
            clock=clock,
        )
        # Stops the thread on garbage collection and at interpreter exit; holds no reference to self.
        self._finalizer = weakref.finalize(self, self._heartbeat.stop)

    # -- turns --------------------------------------------------------------------------------------
    def chat(
        self,
        message_or_messages: Messages,
        *,
        tools: Sequence[Any] | None = None,
        final: bool = False,
        **openai_params: Any,
    ) -> ChatCompletionMessage:
        """Send one turn; returns the assistant message (also appended to ``history``)."""
        turn = self._core.prepare(
            message_or_messages, tools=tools, stream=False, final=final, params=openai_params
        )
        try:
            reply = self._transport.complete(turn.params)
        except BaseException:
            self._core.fail()
            raise
        message = reply.value.choices[0].message
        self._core.finish(turn, message, headers=reply.headers, usage=reply.value.usage)
        self._heartbeat.notify()
        return message

    def stream(
        self,
        message_or_messages: Messages,
        *,
        tools: Sequence[Any] | None = None,
        final: bool = False,
        **openai_params: Any,
    ) -> Iterator[Delta]:
        """Send one turn and yield its deltas; the assembled message is appended at the end."""
        turn = self._core.prepare(
            message_or_messages, tools=tools, stream=True, final=final, params=openai_params
        )
        assembler = MessageAssembler()
        ttft_s: float | None = None
        try:
            reply = self._transport.open_stream(turn.params)
            try:
                # closing(): a caller that stops iterating early must not leave the response open.
                with contextlib.closing(self._transport.chunks(reply)) as chunks:
                    for chunk in chunks:
                        delta = assembler.add(chunk)
                        if delta is not None:
                            ttft_s = self._core.elapsed(turn) if ttft_s is None else ttft_s
                            yield delta
            except TransportError as exc:
                # Never replay: the server has produced (and the caller may have shown) part of it.
                raise StreamInterruptedError(str(exc), partial=assembler.partial()) from exc
        except BaseException:
            self._core.fail()
            raise
        self._core.finish(
            turn, assembler.message(), headers=reply.headers, usage=assembler.usage, ttft_s=ttft_s
        )
        self._heartbeat.notify()

    def run(
        self,
        prompt: Messages,
        *,
        tools: Sequence[Any],
        max_steps: int = 8,
        parallel_tools: bool = True,
        tool_choice: Any = None,
        force_tool_steps: int = 0,
        **openai_params: Any,
    ) -> RunResult:
        """Chat, execute the tool calls the model makes, repeat until it answers or ``max_steps``.

        ``force_tool_steps``: send ``tool_choice="required"`` on the first N steps.
        """
        loop = ToolLoop(
            self._core,
            prompt,
            tools=tools,
            max_steps=max_steps,
            tool_choice=tool_choice,
            force_tool_steps=force_tool_steps,
            openai_params=openai_params,
        )
        while (step := loop.next_step()) is not None:
            pending, params = step
            if calls := loop.answered(self.chat(pending, **params)):
                loop.tool_results(loop.toolbox.execute(calls, parallel=parallel_tools))
        return loop.result()

    def tool_call_started(self) -> None:
        """Say that tools are about to run: one heartbeat now tells the router, which may then move the
        conversation's KV from decode's HBM to its host tier while they run. A turn whose answer calls tools
        does this itself; call it where your harness runs tools the answer does not call as such (a ReAct
        text protocol). It returns at once (the heartbeat thread sends it)."""
        self._heartbeat.tool_call_started()

    # -- lifetime -----------------------------------------------------------------------------------
    def lease(self) -> dict[str, Any] | None:
        """The router's view of this conversation's lease (None: unknown to the server)."""
        return self._control.lookup(self.conversation_id)

    def close(self, *, release: bool = True) -> None:
        """Stop heartbeats and (by default) release decode's retained blocks now."""
        if self._core.closed:
            return
        self._core.closed = True
        self._finalizer()
        try:
            if release:
                self._control.release(self.conversation_id)
        except TransportError as exc:
            log.debug("release of %s failed: %s", self.conversation_id, exc)  # the lease expires anyway
        finally:
            self._control.close()
            if self._owns_http_client:
                self._transport.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
