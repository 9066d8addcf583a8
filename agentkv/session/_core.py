"""The I/O-free heart of ``Session`` and ``AsyncSession``: history, request building, statistics.

Both twins call ``prepare`` before sending and ``finish`` (or ``fail``) after, so history, headers,
lease bookkeeping and ``TurnStats`` are identical whichever twin is used. A turn changes history
only when it succeeds: a failed or abandoned turn can simply be retried.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from openai.types.chat import ChatCompletionMessage
from openai.types.completion_usage import CompletionUsage

from agentkv._constants import CONVERSATION_ID_PATTERN
from agentkv._exceptions import ConfigError, SessionClosedError
from agentkv.client import new_request_id, turn_headers
from agentkv.session._delta import message_to_history
from agentkv.session._heartbeat import HeartbeatScheduler
from agentkv.session._stats import RouterHeaders, TurnStats, render_summary
from agentkv.session._tools import RunResult, Toolbox, as_openai_tools

__all__ = ["BaseSession", "Messages", "PreparedTurn", "SessionCore", "ToolLoop", "new_conversation_id"]

Messages = str | Mapping[str, Any] | Sequence[Mapping[str, Any]]
_VALID_ID = re.compile(CONVERSATION_ID_PATTERN)


def new_conversation_id() -> str:
    """An unguessable id: with API keys off, knowing an id is enough to touch its lease."""
    return "akv-" + secrets.token_urlsafe(24)  # its alphabet is within the protocol's id charset


def _checked_id(conversation_id: str | None) -> str:
    if conversation_id is None:
        return new_conversation_id()
    if not _VALID_ID.fullmatch(conversation_id):  # fullmatch: `$` alone lets a trailing newline in
        raise ConfigError(f"conversation_id must match {CONVERSATION_ID_PATTERN}, got {conversation_id!r}")
    return conversation_id


def _as_messages(messages: Messages) -> list[dict[str, Any]]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if isinstance(messages, Mapping):
        return [dict(messages)]
    return [dict(m) for m in messages]


@dataclass(frozen=True)
class PreparedTurn:
    new_messages: list[dict[str, Any]]
    params: dict[str, Any]  # keyword arguments for openai's chat.completions.create
    request_id: str
    started: float
    streamed: bool
    final: bool = False  # sent with x-agentkv-final-turn: the router kept nothing to heartbeat for


class SessionCore:
    def __init__(
        self,
        *,
        model: str,
        conversation_id: str | None,
        system: str | None,
        session_header: str,
        heartbeat: bool,
        heartbeat_idle_limit_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.conversation_id = _checked_id(conversation_id)
        self.session_header = session_header
        self.history: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        self.turns: list[TurnStats] = []
        self.scheduler = HeartbeatScheduler(idle_limit_s=heartbeat_idle_limit_s, enabled=heartbeat)
        self.closed = False
        self._clock = clock
        self._last_turn_end: float | None = None

    def identity_headers(self, *, final: bool = False) -> dict[str, str]:
        """The headers of one request of this conversation (fresh ``x-request-id`` each call)."""
        return turn_headers(
            self.conversation_id, session_header=self.session_header, request_id=new_request_id(), final=final
        )

    def prepare(
        self,
        messages: Messages,
        *,
        tools: Sequence[Any] | None,
        stream: bool,
        final: bool,
        params: Mapping[str, Any],
    ) -> PreparedTurn:
        if self.closed:
            raise SessionClosedError(f"session {self.conversation_id} is closed")
        new = _as_messages(messages)
        options = dict(params)
        headers = {**(options.pop("extra_headers", None) or {}), **self.identity_headers(final=final)}
        # The header is the primary carrier; prompt_cache_key reaches servers behind proxies that
        # drop unknown headers, and OpenAI itself accepts the field.
        body = {**(options.pop("extra_body", None) or {}), "prompt_cache_key": self.conversation_id}
        request: dict[str, Any] = {
            "model": self.model,
            "messages": [*self.history, *new],
            **options,
            "extra_headers": headers,
            "extra_body": body,
        }
        openai_tools = as_openai_tools(tools)
        if openai_tools:
            request["tools"] = openai_tools
        if stream:
            request["stream_options"] = {**(options.get("stream_options") or {}), "include_usage": True}
        self.scheduler.turn_started()
        return PreparedTurn(new, request, headers["x-request-id"], self._clock(), stream, final)

    def finish(
        self,
        turn: PreparedTurn,
        message: ChatCompletionMessage,
        *,
        headers: Mapping[str, str],
        usage: CompletionUsage | None,
        ttft_s: float | None = None,
    ) -> TurnStats:
        now = self._clock()
        router = RouterHeaders.parse(headers)
        stats = TurnStats.build(
            router=router,
            lease_expired_before=self.scheduler.take_expired(),
            index=len(self.turns) + 1,
            request_id=turn.request_id,
            streamed=turn.streamed,
            ttft_s=ttft_s,
            total_s=now - turn.started,
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
            since_previous_s=None if self._last_turn_end is None else turn.started - self._last_turn_end,
        )
        self.history.extend(turn.new_messages)
        self.history.append(message_to_history(message))
        self.turns.append(stats)
        self._last_turn_end = now
        self.scheduler.turn_finished(
            now,
            lease_expires_in_s=router.lease_expires_in_s,
            from_agentkv=router.from_agentkv,
            final=turn.final,
            # An answer that calls tools: the caller runs them next (the heartbeat says so at once).
            tool_calls=bool(message.tool_calls),
        )
        return stats

    def touch(self, headers: Mapping[str, str] | None, *, tool_calls: bool = False) -> None:
        """A turn of this conversation went through another client (an adapter); ``tool_calls``: its answer
        called tools."""
        router = RouterHeaders.parse(headers or {})
        now = self._clock()
        self._last_turn_end = now
        self.scheduler.turn_finished(
            now,
            lease_expires_in_s=router.lease_expires_in_s,
            from_agentkv=router.from_agentkv,
            tool_calls=tool_calls,
        )

    def fail(self) -> None:
        self.scheduler.turn_failed()

    def elapsed(self, turn: PreparedTurn) -> float:
        return self._clock() - turn.started

    def summary(self) -> str:
        return render_summary(self.turns, title=f"conversation {self.conversation_id}")


class BaseSession:
    """What ``Session`` and ``AsyncSession`` share without I/O: identity, history, statistics."""

    _core: SessionCore
    _heartbeat: Any  # HeartbeatThread | HeartbeatTask: both have notify()

    @property
    def conversation_id(self) -> str:
        return self._core.conversation_id

    @property
    def model(self) -> str:
        return self._core.model

    @property
    def session_header(self) -> str:
        return self._core.session_header

    @property
    def history(self) -> list[dict[str, Any]]:
        return self._core.history

    @property
    def turns(self) -> list[TurnStats]:
        return self._core.turns

    @property
    def closed(self) -> bool:
        return self._core.closed

    def identity_headers(self) -> dict[str, str]:
        """Headers that tie a request made elsewhere (an adapter, a raw client) to this conversation."""
        return self._core.identity_headers()

    def touch(self, response_headers: Mapping[str, str] | None = None, *, tool_calls: bool = False) -> None:
        """Record a turn sent by another client (an adapter): restarts the idle clock and re-plans
        heartbeats from the lease the response reported; ``tool_calls``: the answer called tools, which the
        next heartbeat tells the router (it may demote the conversation to decode's host tier meanwhile)."""
        self._core.touch(response_headers, tool_calls=tool_calls)
        self._heartbeat.notify()

    def summary(self) -> str:
        """Per-turn statistics as a text table."""
        return self._core.summary()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.conversation_id} turns={len(self.turns)} closed={self.closed}>"


class ToolLoop:
    """What ``run()`` decides between requests, shared by ``Session`` and ``AsyncSession``; they only
    send the chat requests and execute the tools (sync or async).

        loop = ToolLoop(core, prompt, tools=..., ...)
        while (step := loop.next_step()) is not None:
            message = chat(*step)
            if (calls := loop.answered(message)):
                loop.tool_results(execute(loop.toolbox, calls))
        return loop.result()
    """

    def __init__(
        self,
        core: SessionCore,
        prompt: Messages,
        *,
        tools: Sequence[Any],
        max_steps: int,
        tool_choice: Any,
        force_tool_steps: int,
        openai_params: dict[str, Any],
    ) -> None:
        self.toolbox = Toolbox(tools)
        if max_steps < 1:
            raise ConfigError(f"max_steps must be at least 1, got {max_steps}")
        self._core = core
        self._max_steps = max_steps
        self._tool_choice = tool_choice
        self._force_tool_steps = force_tool_steps
        self._params = openai_params
        self._first_turn = len(core.turns)
        self._pending: Messages = prompt
        self._results: list[dict[str, Any]] = []
        self._step = 0
        self._message: ChatCompletionMessage | None = None
        self._tool_messages: list[dict[str, Any]] = []

    def next_step(self) -> tuple[Messages, dict[str, Any]] | None:
        """The messages and chat parameters of the next request, or None when the loop is over."""
        done = self._message is not None and not self._message.tool_calls
        if done or self._step >= self._max_steps:
            return None
        self._step += 1
        # "required" on the first steps: random-weight models (and some real ones) never call by themselves.
        choice = "required" if self._step <= self._force_tool_steps else self._tool_choice
        params = {"tools": self.toolbox.schemas(), **({} if choice is None else {"tool_choice": choice})}
        return self._pending, {**params, **self._params}

    def answered(self, message: ChatCompletionMessage) -> list[Any]:
        """Record the model's message; the tool calls to execute (empty: it answered)."""
        self._message = message
        return list(message.tool_calls or [])

    def tool_results(self, messages: list[dict[str, Any]]) -> None:
        self._pending = self._results = messages
        self._tool_messages.extend(messages)

    def result(self) -> RunResult:
        assert self._message is not None, "result() before the first answer"
        out_of_steps = bool(self._message.tool_calls)
        if out_of_steps:
            # Tool results answered but never sent: keep the history valid for the next turn.
            self._core.history.extend(self._results)
        return RunResult(
            message=self._message,
            steps=self._step,
            stop_reason="max_steps" if out_of_steps else "answer",
            turns=self._core.turns[self._first_turn :],
            tool_messages=self._tool_messages,
        )
