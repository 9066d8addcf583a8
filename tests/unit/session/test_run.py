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


def script(**options: object) -> ScriptedRouter:
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
        ],
        **options,  # type: ignore[arg-type]
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


def test_the_tool_loop_tells_the_router_when_tools_run(
    control: respx.MockRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before it runs the model's tool calls, the loop sends one heartbeat saying so (the router may then
    demote the conversation to decode's host tier); later beats of the gap do not repeat it."""
    beats = control.post(path__regex=r"/conversations/.+/heartbeat").respond(
        200, json={"conversation_id": "c", "lease": {"state": "held", "expires_in_s": 30, "renewable": True}}
    )
    router = script(control=control.handler)  # the beats ride the session's client
    session = Session(base_url=BASE, model="m", http_client=router.client(), heartbeat=True)
    sent: list[bool] = []

    def run_tool(city: str) -> str:
        """Population of a city."""
        session._heartbeat.run_once()  # the beat the thread would send as the tool starts
        sent.append(beats.call_count == 1)
        return lookup(city)

    run_tool.__name__ = "lookup"
    monkeypatch.setattr(session._heartbeat, "notify", lambda: None)  # no thread: beat by hand
    with session:
        session.run("Population of Porto?", tools=[run_tool], parallel_tools=False)
    assert sent[0] and beats.call_count == 1
    assert json.loads(beats.calls[0].request.content) == {"tool_call": True}


async def test_the_async_tool_loop_tells_the_router_when_tools_run(
    control: respx.MockRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    beats = control.post(path__regex=r"/conversations/.+/heartbeat").respond(
        200, json={"conversation_id": "c", "lease": {"state": "held", "expires_in_s": 30, "renewable": True}}
    )
    router = script(control=control.handler)
    session = AsyncSession(base_url=BASE, model="m", http_client=router.async_client(), heartbeat=True)
    monkeypatch.setattr(session._heartbeat, "notify", lambda: None)  # no task: beat by hand
    sent: list[bool] = []

    async def run_tool(city: str) -> str:
        """Population of a city."""
        await session._heartbeat.run_once()  # the beat the task would send as the tool starts
        sent.append(beats.call_count == 1)
        return lookup(city)

    run_tool.__name__ = "lookup"
    async with session:
        await session.run("Population of Porto?", tools=[run_tool], parallel_tools=False)
    assert sent[0] and beats.call_count == 1
    assert json.loads(beats.calls[0].request.content) == {"tool_call": True}
