"""Issue 4: the SDK against the real router and engines: heartbeats hold the decode lease across slow tools,
closing a session frees decode blocks, and the LangChain (sync and async) / LlamaIndex adapters carry the
conversation."""

from __future__ import annotations

import time
from typing import Literal

import httpx

from agentkv import Session, Tool
from agentkv.server.launch._cluster import Cluster

from ._clusters import LEASE_S
from ._helpers import (
    MODEL,
    RouterProc,
    conversation_script,
    conversation_state,
    metric,
    no_leases_left,
    router_turns,
    service_info,
    wait_turns_counted,
    wait_until,
)

TOOL_SLEEP_S = LEASE_S + 3  # every tool outlives the decode lease


def lookup(table: Literal["orders", "users"]) -> str:
    """Look up the slow database.

    Args:
        table: which table
    """
    # An enum keeps the forced tool-call JSON short: the random-weight model would otherwise write
    # digits until max_tokens and the call would never parse.
    time.sleep(TOOL_SLEEP_S)
    return f"{table}: 42 rows"


def _agent(router: RouterProc, *, heartbeat: bool, steps: int) -> list[str]:
    with Session(base_url=f"{router.url}/v1", model=MODEL, heartbeat=heartbeat) as s:
        s.run(
            conversation_script(400 + steps, 1)[0],
            # strict: vLLM then constrains the arguments to the schema, and one call per step (no parallel
            # calls) ends the forced call where the schema does; otherwise the random model rambles on.
            tools=[Tool.from_function(lookup, strict=True)],
            parallel_tool_calls=False,
            max_steps=steps + 1,
            force_tool_steps=steps,
            tool_choice="none",
            max_tokens=64,
            temperature=0,
        )
        assert len(s.turns) == steps + 1
        return [t.reuse for t in s.turns]


def test_heartbeats_keep_decode_kv_alive_through_slow_tools(router: RouterProc) -> None:
    # Two tools in a row, each outliving the lease: the lease is renewed through both.
    reuse = _agent(router, heartbeat=True, steps=2)
    assert reuse[0] == "miss"
    assert reuse[1:] == ["hit"] * 2, reuse


def test_without_heartbeats_slow_tools_lose_the_kv(router: RouterProc) -> None:
    reuse = _agent(router, heartbeat=False, steps=1)
    assert reuse[0] == "miss"
    assert "hit" not in reuse[1:], reuse


def test_closing_the_session_frees_decode_blocks(cluster: Cluster, router: RouterProc) -> None:
    ds = cluster.decodes[0].spec.service_url
    assert ds
    no_leases_left(ds)  # so that decode's count is this session's alone
    s = Session(base_url=f"{router.url}/v1", model=MODEL)
    s.chat(conversation_script(410, 1)[0], max_tokens=8, temperature=0)
    assert service_info(ds)["retained"] == 1
    conversation_state(router.url, s.conversation_id)  # booked after the answer reached the session
    s.close()
    wait_until(
        lambda: service_info(ds)["retained"] == 0,
        timeout_s=60,
        what=lambda: "decode still holds the closed session's blocks",
    )
    assert httpx.get(f"{router.url}/v1/conversations/{s.conversation_id}", timeout=5).status_code == 404


def test_langchain_adapter_carries_the_conversation(router: RouterProc) -> None:
    from langchain_core.messages import AIMessage, HumanMessage

    from agentkv.integrations.langchain import AgentKVChatOpenAI

    turns0, hits0 = router_turns(router.url), metric(router.url, "agentkv_reuse_total", result="hit")
    with Session(base_url=f"{router.url}/v1", model=MODEL) as s:
        llm = AgentKVChatOpenAI.from_session(s, max_tokens=8, temperature=0)
        script = conversation_script(420, 2)
        history = [HumanMessage(script[0])]
        first = llm.invoke(history)
        history += [AIMessage(str(first.content)), HumanMessage(script[1])]
        chunks = list(llm.stream(history))
        assert chunks
        state = httpx.get(f"{router.url}/v1/conversations/{s.conversation_id}", timeout=5).json()
        assert state["retained_tokens"] > 0
    wait_turns_counted(router.url, turns0, 2)  # a streamed turn is counted after its last byte
    assert metric(router.url, "agentkv_reuse_total", result="hit") == hits0 + 1
    assert [t.reuse for t in llm.turns] == ["miss", "hit"]  # the router's headers reach the adapter's stats


async def test_langchain_adapter_async_paths_carry_the_conversation(
    router: RouterProc, router_off: RouterProc
) -> None:
    from langchain_core.messages import AIMessage, HumanMessage

    from agentkv.integrations.langchain import AgentKVChatOpenAI

    turns0, hits0 = router_turns(router.url), metric(router.url, "agentkv_reuse_total", result="hit")
    with Session(base_url=f"{router.url}/v1", model=MODEL) as s:
        llm = AgentKVChatOpenAI.from_session(s, max_tokens=8, temperature=0)
        script = conversation_script(440, 2)
        history = [HumanMessage(script[0])]
        first = await llm.ainvoke(history)
        history += [AIMessage(str(first.content)), HumanMessage(script[1])]
        streamed = "".join([str(c.content) async for c in llm.astream(history)])
        assert streamed
        state = httpx.get(f"{router.url}/v1/conversations/{s.conversation_id}", timeout=5).json()
        assert state["retained_tokens"] > 0
    wait_turns_counted(router.url, turns0, 2)  # a streamed turn is counted after its last byte
    assert metric(router.url, "agentkv_reuse_total", result="hit") == hits0 + 1
    assert [t.reuse for t in llm.turns] == ["miss", "hit"]
    assert llm.turns[1].streamed and llm.turns[1].ttft_s is not None
    # The streamed turn ran on KV pulled from decode; the same history recomputed (reuse OFF), not streamed,
    # gives the same greedy answer.
    baseline = AgentKVChatOpenAI(
        model=MODEL, base_url=f"{router_off.url}/v1", api_key="EMPTY", max_tokens=8, temperature=0
    )
    assert str((await baseline.ainvoke(history)).content) == streamed


def test_llamaindex_adapter_carries_the_conversation(router: RouterProc) -> None:
    from llama_index.core.llms import ChatMessage

    from agentkv.integrations.llamaindex import AgentKVLLM

    hits0 = metric(router.url, "agentkv_reuse_total", result="hit")
    with Session(base_url=f"{router.url}/v1", model=MODEL) as s:
        llm = AgentKVLLM.from_session(s, max_tokens=8, temperature=0)
        script = conversation_script(430, 2)
        history = [ChatMessage(role="user", content=script[0])]
        first = llm.chat(history)
        history += [first.message, ChatMessage(role="user", content=script[1])]
        assert llm.chat(history).message.content is not None
        assert httpx.get(f"{router.url}/v1/conversations/{s.conversation_id}", timeout=5).status_code == 200
    assert metric(router.url, "agentkv_reuse_total", result="hit") == hits0 + 1
    assert [t.reuse for t in llm.turns] == ["miss", "hit"]  # read through the adapter's response hook
