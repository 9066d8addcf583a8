"""LangChain: ``AgentKVChatOpenAI``, a ``ChatOpenAI`` that carries an agentkv conversation.

Every call sends the conversation header (and a fresh ``x-request-id``) and mirrors the id into
``prompt_cache_key``. Give it a ``Session`` (``from_session``) and that session's heartbeats keep
decode's lease alive between the agent's turns.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from pydantic import ConfigDict, Field, SecretStr

from agentkv._constants import DEFAULT_SESSION_HEADER
from agentkv.client import new_request_id, turn_headers
from agentkv.integrations._require import require
from agentkv.session import Session, new_conversation_id

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

    def _with_identity(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        headers = turn_headers(
            self.conversation_id, session_header=self.session_header, request_id=new_request_id()
        )
        # A per-call extra_body *replaces* the model-level one in ChatOpenAI: merge both by hand.
        body = {**(self.extra_body or {}), **(kwargs.get("extra_body") or {})}
        body["prompt_cache_key"] = self.conversation_id
        return {
            **kwargs,
            "extra_headers": {**(kwargs.get("extra_headers") or {}), **headers},
            "extra_body": body,
        }

    def _touch(self, headers: Mapping[str, str] | None) -> None:
        if self.agentkv_session is not None and not self.agentkv_session.closed:
            self.agentkv_session.touch(headers)

    @staticmethod
    def _headers_of(result: Any) -> Mapping[str, str] | None:
        generations = getattr(result, "generations", None) or [result]
        info = getattr(generations[0], "generation_info", None) or {}
        message = getattr(generations[0], "message", None)
        metadata = getattr(message, "response_metadata", None) or {}
        return info.get("headers") or metadata.get("headers")

    def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
        result = super()._generate(
            messages, stop=stop, run_manager=run_manager, **self._with_identity(kwargs)
        )
        self._touch(self._headers_of(result))
        return result

    async def _agenerate(
        self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any
    ) -> Any:
        result = await super()._agenerate(
            messages, stop=stop, run_manager=run_manager, **self._with_identity(kwargs)
        )
        self._touch(self._headers_of(result))
        return result

    def _stream(
        self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any
    ) -> Iterator[Any]:
        headers = None
        for chunk in super()._stream(
            messages, stop=stop, run_manager=run_manager, **self._with_identity(kwargs)
        ):
            headers = headers or self._headers_of(chunk)
            yield chunk
        self._touch(headers)

    async def _astream(
        self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        headers = None
        async for chunk in super()._astream(
            messages, stop=stop, run_manager=run_manager, **self._with_identity(kwargs)
        ):
            headers = headers or self._headers_of(chunk)
            yield chunk
        self._touch(headers)
