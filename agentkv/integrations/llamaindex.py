"""LlamaIndex: ``AgentKVLLM``, an ``OpenAILike`` that carries an agentkv conversation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field, PrivateAttr

from agentkv._constants import DEFAULT_SESSION_HEADER
from agentkv.client import new_request_id, turn_headers
from agentkv.integrations._require import require
from agentkv.session import Session, new_conversation_id

require("llama_index.llms.openai_like", "llamaindex")

from llama_index.llms.openai_like import OpenAILike  # noqa: E402

__all__ = ["AgentKVLLM"]


class AgentKVLLM(OpenAILike):  # type: ignore[misc]
    conversation_id: str = Field(default_factory=new_conversation_id)
    session_header: str = DEFAULT_SESSION_HEADER
    _session: Session | None = PrivateAttr(default=None)

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

    def _with_identity(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        headers = turn_headers(
            self.conversation_id, session_header=self.session_header, request_id=new_request_id()
        )
        # additional_kwargs win over per-call kwargs in OpenAI._get_model_kwargs: merge theirs in too.
        extra = self.additional_kwargs or {}
        return {
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

    def _touch(self) -> None:
        if self._session is not None and not self._session.closed:
            self._session.touch()

    def chat(self, messages: Sequence[Any], **kwargs: Any) -> Any:
        response = super().chat(messages, **self._with_identity(kwargs))
        self._touch()
        return response

    def stream_chat(self, messages: Sequence[Any], **kwargs: Any) -> Any:
        yield from super().stream_chat(messages, **self._with_identity(kwargs))
        self._touch()

    async def achat(self, messages: Sequence[Any], **kwargs: Any) -> Any:
        response = await super().achat(messages, **self._with_identity(kwargs))
        self._touch()
        return response

    async def astream_chat(self, messages: Sequence[Any], **kwargs: Any) -> Any:
        stream = await super().astream_chat(messages, **self._with_identity(kwargs))

        async def relay() -> Any:
            async for chunk in stream:
                yield chunk
            self._touch()

        return relay()
