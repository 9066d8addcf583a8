"""Tools for the agent loop: JSON schemas from type hints and docstrings, and their execution.

A tool is a plain function (sync or async) or a pydantic model class. Failures inside a tool become
a ``{"error": ...}`` tool message for the model to read; they never crash the loop. ``ToolError`` is
only raised when a tool cannot be *described* (bad signature, not a tool at all).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic_core
from openai.types.chat import ChatCompletionMessage
from pydantic import BaseModel, Field, create_model

from agentkv._exceptions import ToolError
from agentkv.session._stats import TurnStats

__all__ = ["RunResult", "Tool", "ToolLike", "Toolbox", "as_openai_tools"]

_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?)\s*:?\s*$")
_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Summary text and Google-style ``Args:`` descriptions."""
    summary: list[str] = []
    params: dict[str, str] = {}
    section, current = None, None
    for line in inspect.cleandoc(doc or "").splitlines():
        header = _SECTION.match(line)
        if header:
            section, current = header.group(1).lower(), None
            continue
        if section is None:
            summary.append(line)
        elif section in ("args", "arguments", "parameters"):
            match = _ARG_LINE.match(line)
            if match and not line.startswith((" " * 8, "\t\t")):
                current = match.group(1).lstrip("*")
                params[current] = match.group(3).strip()
            elif current and line.strip():
                params[current] = f"{params[current]} {line.strip()}".strip()
    return "\n".join(summary).strip(), params


@dataclass(frozen=True)
class Tool:
    """One callable tool: the name and schema the model sees, and how to run it."""

    name: str
    description: str
    arguments: type[BaseModel]
    fn: Callable[..., Any] | None = None  # None: a pydantic model tool, its "result" is the parsed model
    # OpenAI's ``strict``: the server must make the arguments match the schema. vLLM (>= 0.32 with a
    # structural-tag tool parser such as hermes) constrains only the call envelope unless a tool is strict,
    # so a weak model can write arguments that are not even an object.
    strict: bool = False

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None, strict: bool = False) -> Tool:
        summary, docs = _parse_docstring(fn.__doc__)
        try:
            hints = typing.get_type_hints(fn, include_extras=True)
            signature = inspect.signature(fn)
        except (NameError, TypeError, ValueError) as exc:
            raise ToolError(f"cannot describe tool {fn!r}: {exc}") from exc
        fields: dict[str, Any] = {}
        for param in signature.parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            annotation = hints.get(param.name, Any)
            default = ... if param.default is param.empty else param.default
            fields[param.name] = (annotation, Field(default, description=docs.get(param.name)))
        tool_name = name or fn.__name__
        model = create_model(f"{tool_name}_arguments", **fields)
        return cls(name=tool_name, description=summary, arguments=model, fn=fn, strict=strict)

    @classmethod
    def from_model(cls, model: type[BaseModel], *, name: str | None = None, strict: bool = False) -> Tool:
        summary, _ = _parse_docstring(model.__doc__)
        return cls(name=name or model.__name__, description=summary, arguments=model, strict=strict)

    def schema(self) -> dict[str, Any]:
        parameters = self.arguments.model_json_schema()
        function: dict[str, Any] = {"name": self.name, "parameters": parameters}
        if self.description:
            function["description"] = self.description
        if self.strict:
            function["strict"] = True
            parameters.setdefault("additionalProperties", False)  # strict schemas are closed (OpenAI rule)
        return {"type": "function", "function": function}

    def _bind(self, raw_arguments: str | None) -> BaseModel:
        return self.arguments.model_validate(json.loads(raw_arguments or "{}"))

    def _kwargs(self, parsed: BaseModel) -> dict[str, Any]:
        # Attributes, not model_dump(): nested pydantic arguments stay models, as annotated.
        return {name: getattr(parsed, name) for name in type(parsed).model_fields}

    def invoke(self, raw_arguments: str | None) -> Any:
        parsed = self._bind(raw_arguments)
        if self.fn is None:
            return parsed
        result = self.fn(**self._kwargs(parsed))
        return asyncio.run(result) if inspect.isawaitable(result) else result  # type: ignore[arg-type]

    async def ainvoke(self, raw_arguments: str | None) -> Any:
        parsed = self._bind(raw_arguments)
        if self.fn is None:
            return parsed
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(**self._kwargs(parsed))
        # Sync tools run in a thread so the event loop (and its heartbeat task) keeps running.
        result = await asyncio.to_thread(self.fn, **self._kwargs(parsed))
        return await result if inspect.isawaitable(result) else result


ToolLike = Callable[..., Any] | type[BaseModel] | Tool


def as_tool(obj: Any) -> Tool:
    if isinstance(obj, Tool):
        return obj
    if isinstance(obj, type) and issubclass(obj, BaseModel):
        return Tool.from_model(obj)
    if callable(obj):
        return Tool.from_function(obj)
    raise ToolError(f"not a tool: {obj!r} (expected a function, a pydantic model class or a Tool)")


def as_openai_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """For ``chat(tools=...)``: OpenAI tool dicts pass through, functions and models are described."""
    if not tools:
        return None
    return [dict(t) if isinstance(t, Mapping) else as_tool(t).schema() for t in tools]


def _tool_message(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _render(result: Any) -> str:
    if isinstance(result, str):
        return result
    return pydantic_core.to_json(result, fallback=str).decode()


def _error(exc: BaseException) -> str:
    return json.dumps({"error": f"{type(exc).__name__}: {exc}"})


class Toolbox:
    """The tools of one ``run()``; executes the tool calls of one assistant message."""

    def __init__(self, tools: Sequence[Any]) -> None:
        self.tools = {tool.name: tool for tool in map(as_tool, tools)}
        if not self.tools:
            raise ToolError("run() needs at least one tool")

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self.tools.values()]

    def _lookup(self, name: str) -> Tool:
        tool = self.tools.get(name)
        if tool is None:
            raise ToolError(f"unknown tool {name!r}; available: {sorted(self.tools)}")
        return tool

    def _run_one(self, call: Any) -> dict[str, Any]:
        try:
            content = _render(self._lookup(call.function.name).invoke(call.function.arguments))
        except Exception as exc:
            content = _error(exc)
        return _tool_message(call.id, content)

    async def _arun_one(self, call: Any) -> dict[str, Any]:
        try:
            result = await self._lookup(call.function.name).ainvoke(call.function.arguments)
            content = _render(result)
        except Exception as exc:
            content = _error(exc)
        return _tool_message(call.id, content)

    def execute(self, calls: Sequence[Any], *, parallel: bool) -> list[dict[str, Any]]:
        if not parallel or len(calls) < 2:
            return [self._run_one(call) for call in calls]
        with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="agentkv-tool") as pool:
            return list(pool.map(self._run_one, calls))

    async def aexecute(self, calls: Sequence[Any], *, parallel: bool) -> list[dict[str, Any]]:
        if not parallel:
            return [await self._arun_one(call) for call in calls]
        return list(await asyncio.gather(*(self._arun_one(call) for call in calls)))


@dataclass(frozen=True)
class RunResult:
    """The outcome of ``Session.run``."""

    message: ChatCompletionMessage
    steps: int
    stop_reason: Literal["answer", "max_steps"]
    turns: list[TurnStats] = field(default_factory=list)
    tool_messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def content(self) -> str | None:
        return self.message.content

    @property
    def completed(self) -> bool:
        return self.stop_reason == "answer"
