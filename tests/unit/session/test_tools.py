import asyncio
import json
import threading
from types import SimpleNamespace

import pytest
from pydantic import BaseModel

from agentkv import ToolError
from agentkv.session import Tool
from agentkv.session._tools import Toolbox


def add(a: int, b: int = 2) -> int:
    """Add two numbers.

    Args:
        a: the first number.
        b: the second number,
            defaulting to two.
    """
    return a + b


class Answer(BaseModel):
    """The final answer."""

    text: str


def call(name: str, arguments: object, id: str = "c1") -> SimpleNamespace:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return SimpleNamespace(id=id, function=SimpleNamespace(name=name, arguments=raw))


def test_schema_from_type_hints_and_docstring() -> None:
    schema = Tool.from_function(add).schema()["function"]
    assert schema["name"] == "add" and schema["description"] == "Add two numbers."
    props = schema["parameters"]["properties"]
    assert props["a"]["type"] == "integer" and props["a"]["description"] == "the first number."
    assert props["b"]["description"] == "the second number, defaulting to two."
    assert schema["parameters"]["required"] == ["a"]


def test_schema_from_pydantic_model() -> None:
    tool = Tool.from_model(Answer)
    assert tool.schema()["function"]["parameters"]["properties"]["text"]["type"] == "string"
    assert tool.invoke('{"text": "42"}') == Answer(text="42")


def test_strict_tools_are_closed_schemas_and_plain_ones_are_not() -> None:
    plain = Tool.from_function(add).schema()["function"]
    assert "strict" not in plain and "additionalProperties" not in plain["parameters"]
    for tool in (Tool.from_function(add, strict=True), Tool.from_model(Answer, strict=True)):
        function = tool.schema()["function"]
        assert function["strict"] is True
        assert function["parameters"]["additionalProperties"] is False


def test_not_a_tool() -> None:
    with pytest.raises(ToolError):
        Toolbox([42])


def test_results_and_failures_become_tool_messages() -> None:
    def boom() -> None:
        raise RuntimeError("disk on fire")

    box = Toolbox([add, boom])
    messages = box.execute(
        [
            call("add", {"a": 1}, "1"),
            call("boom", {}, "2"),
            call("nope", {}, "3"),
            call("add", "{not json", "4"),
        ],
        parallel=False,
    )
    assert messages[0] == {"role": "tool", "tool_call_id": "1", "content": "3"}
    assert json.loads(messages[1]["content"]) == {"error": "RuntimeError: disk on fire"}
    assert "unknown tool" in json.loads(messages[2]["content"])["error"]
    assert "error" in json.loads(messages[3]["content"])


def test_parallel_sync_tools_run_in_threads() -> None:
    barrier = threading.Barrier(2, timeout=10)

    def meet(tag: str) -> str:
        barrier.wait()  # only passes if both calls run at the same time
        return tag

    messages = Toolbox([meet]).execute(
        [call("meet", {"tag": "x"}, "1"), call("meet", {"tag": "y"}, "2")], parallel=True
    )
    assert [m["content"] for m in messages] == ["x", "y"]


async def test_parallel_async_tools_are_gathered() -> None:
    arrived: list[str] = []
    both = asyncio.Event()

    async def meet(tag: str) -> str:
        arrived.append(tag)
        if len(arrived) == 2:
            both.set()
        await asyncio.wait_for(both.wait(), 10)
        return tag

    box = Toolbox([meet, add])
    messages = await box.aexecute(
        [call("meet", {"tag": "x"}, "1"), call("meet", {"tag": "y"}, "2"), call("add", {"a": 2}, "3")],
        parallel=True,
    )
    assert [m["content"] for m in messages] == ["x", "y", "4"]


def test_async_tool_in_sync_box() -> None:
    async def double(n: int) -> int:
        return 2 * n

    assert Toolbox([double]).execute([call("double", {"n": 4})], parallel=False)[0]["content"] == "8"
