"""Assembling a streamed answer: text and tool-call fragments, keyed by tool-call index."""

from __future__ import annotations

from typing import Any

from openai.types.chat import ChatCompletionChunk, ChatCompletionMessage
from openai.types.completion_usage import CompletionUsage
from pydantic import BaseModel, ConfigDict

__all__ = ["Delta", "MessageAssembler", "ToolCallDelta", "message_to_history"]

# vLLM names the reasoning trace `reasoning_content` (older) or `reasoning` (newer).
_REASONING_FIELDS = ("reasoning_content", "reasoning")


class ToolCallDelta(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class Delta(BaseModel):
    """One streamed increment, as the caller sees it."""

    model_config = ConfigDict(frozen=True)

    content: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish_reason: str | None = None


def _reasoning_of(obj: Any) -> str | None:
    for name in _REASONING_FIELDS:
        value = getattr(obj, name, None)
        if isinstance(value, str) and value:
            return value
    return None


def message_to_history(message: ChatCompletionMessage) -> dict[str, Any]:
    """The assistant message as it is sent back next turn.

    The reasoning trace is kept: stripping it changes the prompt tokens, so decode's retained KV
    would no longer be a prefix of the next turn (vllm #43094) and reuse would be lost.
    """
    entry: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        entry["tool_calls"] = [call.model_dump(exclude_none=True) for call in message.tool_calls]
    reasoning = _reasoning_of(message)
    if reasoning is not None:
        entry["reasoning_content"] = reasoning
    return entry


class MessageAssembler:
    """Folds ``ChatCompletionChunk``s into one assistant message; I/O-free."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: CompletionUsage | None = None
        self.chunks = 0

    def add(self, chunk: ChatCompletionChunk) -> Delta | None:
        self.chunks += 1
        if chunk.usage is not None:
            self.usage = chunk.usage
        if not chunk.choices:
            return None  # the usage-only chunk at the end
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning = _reasoning_of(delta)
        calls = tuple(self._add_call(c) for c in delta.tool_calls or ())
        if delta.content:
            self._content.append(delta.content)
        if reasoning:
            self._reasoning.append(reasoning)
        if choice.finish_reason:
            self.finish_reason = choice.finish_reason
        if not (delta.content or reasoning or calls or choice.finish_reason):
            return None
        return Delta(
            content=delta.content or None,
            reasoning=reasoning,
            tool_calls=calls,
            finish_reason=choice.finish_reason,
        )

    def _add_call(self, fragment: Any) -> ToolCallDelta:
        # Fragments of one call share an index; id and name arrive once, arguments in pieces.
        slot = self._calls.setdefault(fragment.index, {"id": None, "name": None, "arguments": []})
        function = fragment.function
        name = function.name if function else None
        arguments = (function.arguments if function else None) or ""
        if fragment.id:
            slot["id"] = fragment.id
        if name:
            slot["name"] = name
        slot["arguments"].append(arguments)
        return ToolCallDelta(index=fragment.index, id=fragment.id, name=name, arguments=arguments)

    def message(self) -> ChatCompletionMessage:
        data: dict[str, Any] = {"role": "assistant", "content": "".join(self._content) or None}
        if self._calls:
            data["tool_calls"] = [
                {
                    "id": slot["id"] or f"call_{index}",
                    "type": "function",
                    "function": {"name": slot["name"] or "", "arguments": "".join(slot["arguments"])},
                }
                for index, slot in sorted(self._calls.items())
            ]
        if self._reasoning:
            data["reasoning_content"] = "".join(self._reasoning)
        return ChatCompletionMessage.model_validate(data)

    def partial(self) -> dict[str, Any]:
        """What arrived before a stream broke, in history form."""
        return message_to_history(self.message())
