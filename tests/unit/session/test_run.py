import json

import pytest
import respx

from agentkv import ConfigError
from agentkv.client import ScriptedReply, ScriptedRouter, router_headers
from agentkv.session import AsyncSession, Session

from .conftest import BASE


def lookup(city: str) -> str:
    """Population of a city."""
    if city == "Atlantis":
        raise KeyError(city)
    return f"{city}: 1000"


def script() -> ScriptedRouter:
    return ScriptedRouter(
        [
            ScriptedReply.completion(
                None,
                tool_calls=[("c1", "lookup", '{"city": "Porto"}'), ("c2", "lookup", '{"city": "Atlantis"}')],
                headers=router_headers(reuse="miss", path="recompute", lease_expires_in_s=30),
            ),
            ScriptedReply.completion(
                "Porto has 1000.", headers=router_headers(reuse="hit", reused_tokens=64)
            ),
        ]
    )


def check(result, router: ScriptedRouter, history: list) -> None:  # type: ignore[no-untyped-def]
    assert result.completed and result.steps == 2 and result.content == "Porto has 1000."
    assert [t.reuse for t in result.turns] == ["miss", "hit"]
    tool_messages = [m for m in history if m["role"] == "tool"]
    assert tool_messages[0] == {"role": "tool", "tool_call_id": "c1", "content": "Porto: 1000"}
    assert json.loads(tool_messages[1]["content"])["error"].startswith("KeyError")
    second = router.bodies[1]
    assert second["messages"][-2:] == tool_messages  # results were sent back, in call order
    assert second["tools"][0]["function"]["name"] == "lookup"


def test_tool_loop(control: respx.MockRouter) -> None:
    router = script()
    with Session(base_url=BASE, model="m", http_client=router.client(), heartbeat=False) as session:
        result = session.run("Population of Porto?", tools=[lookup])
    check(result, router, session.history)


async def test_tool_loop_async(control: respx.MockRouter) -> None:
    router = script()
    async with AsyncSession(
        base_url=BASE, model="m", http_client=router.async_client(), heartbeat=False
    ) as session:
        result = await session.run("Population of Porto?", tools=[lookup])
    check(result, router, session.history)


def test_max_steps_keeps_history_valid(control: respx.MockRouter) -> None:
    calls = ScriptedReply.completion(None, tool_calls=[("c1", "lookup", '{"city": "Porto"}')])
    router = ScriptedRouter([calls, calls])
    with Session(base_url=BASE, model="m", http_client=router.client(), heartbeat=False) as session:
        result = session.run("loop", tools=[lookup], max_steps=2)
        assert result.stop_reason == "max_steps" and not result.completed
        assert session.history[-1]["role"] == "tool"  # every tool call has its answer
        with pytest.raises(ConfigError):
            session.run("x", tools=[lookup], max_steps=0)


def test_forced_tool_steps_then_tool_choice(control: respx.MockRouter) -> None:
    calls = ScriptedReply.completion(None, tool_calls=[("c1", "lookup", '{"city": "Porto"}')])
    router = ScriptedRouter([calls, calls, ScriptedReply.completion("done")])
    with Session(base_url=BASE, model="m", http_client=router.client(), heartbeat=False) as session:
        session.run("go", tools=[lookup], force_tool_steps=2, tool_choice="none")
    assert [b.get("tool_choice") for b in router.bodies] == ["required", "required", "none"]
