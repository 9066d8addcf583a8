"""LlamaIndex: ``AgentKVLLM``, an ``OpenAILike`` that carries an agentkv conversation.

Every call sends the conversation header (and a fresh ``x-request-id``) and mirrors the id into
``prompt_cache_key``; ``from_session`` ties it to a ``Session`` whose heartbeats keep decode's lease alive.
Tool calling is LlamaIndex's own (``chat_with_tools`` / ``get_tool_calls_from_response``, agents): pass
``is_function_calling_model=True`` for a server that parses tool calls (``agentkv up`` does).
``turns`` holds a ``TurnStats`` per successful request and ``summary()`` renders them as
``Session.summary()`` does. LlamaIndex drops response headers, so the adapter reads the router's through a
response hook on the httpx client it hands to the openai SDK (its own, or the one you pass).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from pydantic import Field, PrivateAttr

from agentkv._constants import DEFAULT_SESSION_HEADER
from agentkv.client import messages_as_is, new_request_id, turn_headers
from agentkv.integrations._require import require
from agentkv.integrations._stats import TurnLog, add_header_hook, capture_headers
from agentkv.session import Session, TurnStats, new_conversation_id

require("llama_index.llms.openai_like", "llamaindex")

from llama_index.llms.openai_like import OpenAILike  # noqa: E402

__all__ = ["AgentKVLLM"]


class AgentKVLLM(OpenAILike):  # type: ignore[misc]
    conversation_id: str = Field(default_factory=new_conversation_id)
    session_header: str = DEFAULT_SESSION_HEADER
    _session: Session | None = PrivateAttr(default=None)
    _turn_log: TurnLog = PrivateAttr(default_factory=TurnLog)

    @classmethod
    def from_session(cls, session: Session, **kwargs: Any) -> AgentKVLLM:
        llm = cls(
            model=session.model,
            api_base=session.base_url,
            api_key=session.api_key or "EMPTY",
            conversation_id=session.conversation_id,
            session_header=session.session_header,
            is_chat_model=True,
            **kwargs,
        )
        llm._session = session
        return llm

    @property
    def turns(self) -> list[TurnStats]:
        """Per-request statistics of this LLM's successful calls, in order."""
        return self._turn_log.turns

    def summary(self) -> str:
        """``turns`` as a text table (the same table as ``Session.summary()``)."""
        return self._turn_log.summary(self.conversation_id)

    def _get_credential_kwargs(self, is_async: bool = False) -> dict[str, Any]:
        # Called when LlamaIndex builds its openai client: give that client our response-header hook.
        kwargs: dict[str, Any] = super()._get_credential_kwargs(is_async=is_async)
        kwargs["http_client"] = add_header_hook(kwargs.get("http_client"), asynchronous=is_async)
        return kwargs

    def _get_client(self) -> Any:
        return _send_messages_as_is(super()._get_client())

    def _get_aclient(self) -> Any:
        return _send_messages_as_is(super()._get_aclient())

    def _with_identity(
        self, kwargs: dict[str, Any], request_id: str, *, stream: bool = False
    ) -> dict[str, Any]:
        headers = turn_headers(
            self.conversation_id, session_header=self.session_header, request_id=request_id
        )
        # additional_kwargs win over per-call kwargs in OpenAI._get_model_kwargs: merge theirs in too.
        extra = self.additional_kwargs or {}
        out = {
            **kwargs,
            "extra_headers": {
                **(extra.get("extra_headers") or {}),
                **(kwargs.get("extra_headers") or {}),
                **headers,
            },
            "extra_body": {
                **(extra.get("extra_body") or {}),
                **(kwargs.get("extra_body") or {}),
                "prompt_cache_key": self.conversation_id,
            },
        }
        if stream and "stream_options" not in out and "stream_options" not in extra:
            out["stream_options"] = {"include_usage": True}  # token counts for ``turns``, as Session asks
        return out

    def _finish(
        self,
        request_id: str,
        started: float,
        headers: Mapping[str, str],
        response: Any,
        *,
        streamed: bool,
        ttft_s: float | None = None,
    ) -> None:
        usage = getattr(response, "additional_kwargs", None) or {}
        self._turn_log.record(
            request_id=request_id,
            started=started,
            streamed=streamed,
            headers=headers,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            ttft_s=ttft_s,
        )
        if self._session is not None and not self._session.closed:
            message = getattr(response, "message", None)
            calls = (getattr(message, "additional_kwargs", None) or {}).get("tool_calls")
            self._session.touch(headers, tool_calls=bool(calls))

    def chat(self, messages: Sequence[Any], **kwargs: Any) -> Any:
        rid, started = new_request_id(), self._turn_log.now()
        headers: dict[str, str] = {}
        with capture_headers(headers):
            response = super().chat(messages, **self._with_identity(kwargs, rid))
        self._finish(rid, started, headers, response, streamed=False)
        return response

    def stream_chat(self, messages: Sequence[Any], **kwargs: Any) -> Iterator[Any]:
        rid, started = new_request_id(), self._turn_log.now()
        headers: dict[str, str] = {}
        stream = super().stream_chat(messages, **self._with_identity(kwargs, rid, stream=True))
        ttft_s, last = None, None
        try:
            while True:
                # Capture only while the stream runs (the request starts at the first chunk), never while
                # the caller holds a chunk: its own requests between chunks are none of this turn's business.
                with capture_headers(headers):
                    try:
                        chunk = next(stream)
                    except StopIteration:
                        break
                ttft_s = _first_token(ttft_s, chunk, self._turn_log.now() - started)
                last = chunk
                yield chunk
        finally:
            # A caller that stops early must not leave the response open (as ``yield from`` ensured).
            getattr(stream, "close", lambda: None)()
        self._finish(rid, started, headers, last, streamed=True, ttft_s=ttft_s)

    async def achat(self, messages: Sequence[Any], **kwargs: Any) -> Any:
        rid, started = new_request_id(), self._turn_log.now()
        headers: dict[str, str] = {}
        with capture_headers(headers):
            response = await super().achat(messages, **self._with_identity(kwargs, rid))
        self._finish(rid, started, headers, response, streamed=False)
        return response

    async def astream_chat(self, messages: Sequence[Any], **kwargs: Any) -> Any:
        rid, started = new_request_id(), self._turn_log.now()
        headers: dict[str, str] = {}
        with capture_headers(headers):
            stream = await super().astream_chat(messages, **self._with_identity(kwargs, rid, stream=True))

        async def relay() -> AsyncIterator[Any]:
            ttft_s, last = None, None
            try:
                while True:
                    with capture_headers(headers):
                        try:
                            chunk = await stream.__anext__()
                        except StopAsyncIteration:
                            break
                    ttft_s = _first_token(ttft_s, chunk, self._turn_log.now() - started)
                    last = chunk
                    yield chunk
            finally:
                if hasattr(stream, "aclose"):
                    await stream.aclose()
            self._finish(rid, started, headers, last, streamed=True, ttft_s=ttft_s)

        return relay()


def _send_messages_as_is(client: Any) -> Any:
    """``client``, the openai client LlamaIndex made for this LLM, with its chat completions sending the
    messages past the SDK's per-message transform, as ``Session`` does (``agentkv.client.messages_as_is``).
    LlamaIndex hands the messages to ``create`` itself, so only this client's ``create`` is wrapped."""
    completions = client.chat.completions
    if getattr(completions, "_agentkv_messages_as_is", False):
        return client
    create = completions.create

    def send(*args: Any, **kwargs: Any) -> Any:  # sync or async: returns what ``create`` returns
        if "messages" in kwargs:
            kwargs.update(messages_as_is(kwargs["messages"], kwargs.get("extra_body")))
        return create(*args, **kwargs)

    completions.create = send
    completions._agentkv_messages_as_is = True
    return client


def _first_token(ttft_s: float | None, chunk: Any, elapsed: float) -> float | None:
    if ttft_s is not None:
        return ttft_s
    message = getattr(chunk, "message", None)
    has_call = bool((getattr(message, "additional_kwargs", None) or {}).get("tool_calls"))
    return elapsed if (getattr(chunk, "delta", None) or has_call) else None
