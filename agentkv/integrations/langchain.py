"""LangChain: ``AgentKVChatOpenAI``, a ``ChatOpenAI`` that carries an agentkv conversation.

Every call sends the conversation header (and a fresh ``x-request-id``) and mirrors the id into
``prompt_cache_key``. Give it a ``Session`` (``from_session``) and that session's heartbeats keep
decode's lease alive between the agent's turns. ``turns`` holds a ``TurnStats`` per successful request
(reuse verdict, path, tokens, timing, from the router's response headers) and ``summary()`` renders
them as ``Session.summary()`` does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from pydantic import ConfigDict, Field, PrivateAttr, SecretStr

from agentkv._constants import DEFAULT_SESSION_HEADER
from agentkv.client import messages_as_is, new_request_id, turn_headers
from agentkv.integrations._require import require
from agentkv.integrations._stats import TurnLog
from agentkv.session import Session, TurnStats, new_conversation_id

require("langchain_openai", "langchain")

from langchain_openai import ChatOpenAI  # noqa: E402

__all__ = ["AgentKVChatOpenAI"]


class AgentKVChatOpenAI(ChatOpenAI):  # type: ignore[misc]
    model_config = ConfigDict(arbitrary_types_allowed=True)

    conversation_id: str = Field(default_factory=new_conversation_id)
    session_header: str = DEFAULT_SESSION_HEADER
    # Optional: a Session whose heartbeats (and idle clock) should follow this model's turns.
    agentkv_session: Session | None = Field(default=None, exclude=True)
    include_response_headers: bool = True  # so the lease the router reports reaches the session
    stream_usage: bool | None = True  # token counts of streamed turns, for ``turns`` (as Session asks)
    _turn_log: TurnLog = PrivateAttr(default_factory=TurnLog)

    @classmethod
    def from_session(cls, session: Session, **kwargs: Any) -> AgentKVChatOpenAI:
        return cls(
            model=session.model,
            base_url=session.base_url,
            api_key=SecretStr(session.api_key or "EMPTY"),
            conversation_id=session.conversation_id,
            session_header=session.session_header,
            agentkv_session=session,
            **kwargs,
        )

    @property
    def turns(self) -> list[TurnStats]:
        """Per-request statistics of this model's successful calls, in order."""
        return self._turn_log.turns

    def summary(self) -> str:
        """``turns`` as a text table (the same table as ``Session.summary()``)."""
        return self._turn_log.summary(self.conversation_id)

    def _with_identity(self, kwargs: dict[str, Any], request_id: str) -> dict[str, Any]:
        headers = turn_headers(
            self.conversation_id, session_header=self.session_header, request_id=request_id
        )
        # A per-call extra_body *replaces* the model-level one in ChatOpenAI: merge both by hand.
        body = {**(self.extra_body or {}), **(kwargs.get("extra_body") or {})}
        body["prompt_cache_key"] = self.conversation_id
        return {
            **kwargs,
            "extra_headers": {**(kwargs.get("extra_headers") or {}), **headers},
            "extra_body": body,
        }

    def _get_request_payload(self, input_: Any, *, stop: Any = None, **kwargs: Any) -> dict[str, Any]:
        payload: dict[str, Any] = super()._get_request_payload(input_, stop=stop, **kwargs)
        # Chat completions send the converted messages past the SDK's per-message transform (as `Session`
        # does); structured output goes through the SDK's `parse`, which reads them, so it keeps them.
        if "messages" in payload and "response_format" not in payload:
            payload.update(messages_as_is(payload["messages"], payload.get("extra_body")))
        return payload

    def _touch(self, headers: Mapping[str, str] | None, *, tool_calls: bool) -> None:
        if self.agentkv_session is not None and not self.agentkv_session.closed:
            self.agentkv_session.touch(headers, tool_calls=tool_calls)

    def _finish(
        self,
        request_id: str,
        started: float,
        *,
        headers: Mapping[str, str] | None,
        usage: Mapping[str, Any] | None,
        streamed: bool,
        ttft_s: float | None = None,
        tool_calls: bool = False,
    ) -> None:
        self._turn_log.record(
            request_id=request_id,
            started=started,
            streamed=streamed,
            headers=headers,
            prompt_tokens=(usage or {}).get("input_tokens"),
            completion_tokens=(usage or {}).get("output_tokens"),
            ttft_s=ttft_s,
        )
        self._touch(headers, tool_calls=tool_calls)

    def _finish_result(self, request_id: str, started: float, result: Any) -> None:
        self._finish(
            request_id,
            started,
            headers=self._headers_of(result),
            usage=self._usage_of(result),
            streamed=False,
            tool_calls=self._calls_tools(result),
        )

    def _finish_stream(self, request_id: str, started: float, stream: _StreamStats) -> None:
        self._finish(
            request_id,
            started,
            headers=stream.headers,
            usage=stream.usage,
            streamed=True,
            ttft_s=stream.ttft_s,
            tool_calls=stream.tool_calls,
        )

    @staticmethod
    def _headers_of(result: Any) -> Mapping[str, str] | None:
        generations = getattr(result, "generations", None) or [result]
        info = getattr(generations[0], "generation_info", None) or {}
        message = getattr(generations[0], "message", None)
        metadata = getattr(message, "response_metadata", None) or {}
        return info.get("headers") or metadata.get("headers")

    @staticmethod
    def _calls_tools(result: Any) -> bool:
        generations = getattr(result, "generations", None) or [result]
        return bool(getattr(getattr(generations[0], "message", None), "tool_calls", None))

    @staticmethod
    def _usage_of(result: Any) -> Mapping[str, Any] | None:
        generations = getattr(result, "generations", None) or [result]
        return getattr(getattr(generations[0], "message", None), "usage_metadata", None)

    def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
        rid, started = new_request_id(), self._turn_log.now()
        result = super()._generate(
            messages, stop=stop, run_manager=run_manager, **self._with_identity(kwargs, rid)
        )
        self._finish_result(rid, started, result)
        return result

    async def _agenerate(
        self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any
    ) -> Any:
        rid, started = new_request_id(), self._turn_log.now()
        result = await super()._agenerate(
            messages, stop=stop, run_manager=run_manager, **self._with_identity(kwargs, rid)
        )
        self._finish_result(rid, started, result)
        return result

    def _stream(
        self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any
    ) -> Iterator[Any]:
        rid, started = new_request_id(), self._turn_log.now()
        stream = _StreamStats(self._turn_log.now, started)
        for chunk in super()._stream(
            messages, stop=stop, run_manager=run_manager, **self._with_identity(kwargs, rid)
        ):
            stream.add(chunk)
            yield chunk
        self._finish_stream(rid, started, stream)

    async def _astream(
        self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        rid, started = new_request_id(), self._turn_log.now()
        stream = _StreamStats(self._turn_log.now, started)
        async for chunk in super()._astream(
            messages, stop=stop, run_manager=run_manager, **self._with_identity(kwargs, rid)
        ):
            stream.add(chunk)
            yield chunk
        self._finish_stream(rid, started, stream)


class _StreamStats:
    """What a streamed turn's chunks tell: the headers (first chunk), usage (last), time to first token."""

    def __init__(self, now: Any, started: float) -> None:
        self._now = now
        self._started = started
        self.headers: Mapping[str, str] | None = None
        self.usage: Mapping[str, Any] | None = None
        self.ttft_s: float | None = None
        self.tool_calls = False

    def add(self, chunk: Any) -> None:
        self.headers = self.headers or AgentKVChatOpenAI._headers_of(chunk)
        self.usage = AgentKVChatOpenAI._usage_of(chunk) or self.usage
        calls = getattr(getattr(chunk, "message", None), "tool_call_chunks", None)
        self.tool_calls = self.tool_calls or bool(calls)
        if self.ttft_s is None and (str(chunk.text or "") or calls):
            self.ttft_s = self._now() - self._started
