import importlib.util

import pytest
import respx

from agentkv.client import ScriptedReply, ScriptedRouter, router_headers
from agentkv.session import Session

BASE = "http://router.test/v1"


@pytest.fixture
def session():  # type: ignore[no-untyped-def]
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        mock.delete(path__regex=r"/conversations/.+").respond(200, json={"released": True})
        s = Session(
            base_url=BASE,
            model="m",
            conversation_id="conv-lc",
            session_header="x-smg-routing-key",
            heartbeat=False,
        )
        yield s
        s.close()


@pytest.mark.skipif(importlib.util.find_spec("langchain_openai") is None, reason="langchain extra missing")
def test_langchain_adapter_sends_identity(session: Session) -> None:
    from agentkv.integrations.langchain import AgentKVChatOpenAI

    router = ScriptedRouter(
        [
            ScriptedReply.completion("hi", headers=router_headers(lease_expires_in_s=30)),
            ScriptedReply.stream(["a", "b"]),
        ]
    )
    llm = AgentKVChatOpenAI.from_session(
        session, http_client=router.client(), max_retries=0, extra_body={"top_k": 3}
    )

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    assert llm.bind_tools([add]).invoke("hello").content == "hi"
    assert "".join(str(c.content) for c in llm.stream("again")) == "ab"
    for request, body in zip(router.requests, router.bodies, strict=True):
        assert request.headers["x-smg-routing-key"] == "conv-lc"
        assert body["prompt_cache_key"] == "conv-lc" and body["top_k"] == 3
    assert router.bodies[0]["tools"][0]["function"]["name"] == "add"
    assert router.requests[0].headers["x-request-id"] != router.requests[1].headers["x-request-id"]


@pytest.mark.skipif(importlib.util.find_spec("langchain_openai") is None, reason="langchain extra missing")
def test_langchain_adapter_sends_the_body_chatopenai_sends() -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    from agentkv.integrations.langchain import AgentKVChatOpenAI

    history = [
        SystemMessage("be terse"),
        HumanMessage([{"type": "text", "text": "sum"}, {"type": "image_url", "image_url": {"url": "u"}}]),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1"}]),
        ToolMessage("3 é", tool_call_id="c1"),
    ]
    bodies = []
    for cls in (ChatOpenAI, AgentKVChatOpenAI):
        router = ScriptedRouter([ScriptedReply.completion("ok"), ScriptedReply.stream(["o", "k"])])
        llm = cls(
            model="m",
            base_url=BASE,
            api_key="k",
            http_client=router.client(),
            max_retries=0,
            stream_usage=True,
        )
        llm.invoke(history, max_tokens=5)
        "".join(str(c.content) for c in llm.stream(history))
        bodies.append([{k: v for k, v in b.items() if k != "prompt_cache_key"} for b in router.bodies])
    plain, ours = bodies
    assert ours == plain
    assert ours[0]["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "3 é"}


@pytest.mark.skipif(
    importlib.util.find_spec("llama_index.llms.openai_like") is None, reason="llamaindex extra missing"
)
async def test_llamaindex_adapter_sends_identity(session: Session) -> None:
    from llama_index.core.llms import ChatMessage

    from agentkv.integrations.llamaindex import AgentKVLLM

    router = ScriptedRouter(
        [
            ScriptedReply.completion("sync"),
            ScriptedReply.stream(["s", "t"]),
            ScriptedReply.completion("async"),
        ]
    )
    llm = AgentKVLLM.from_session(
        session, http_client=router.client(), async_http_client=router.async_client(), max_retries=0
    )
    assert llm.chat([ChatMessage(role="user", content="q")]).message.content == "sync"
    assert "".join(c.delta or "" for c in llm.stream_chat([ChatMessage(role="user", content="q")])) == "st"
    assert (await llm.achat([ChatMessage(role="user", content="q")])).message.content == "async"
    for request, body in zip(router.requests, router.bodies, strict=True):
        assert request.headers["x-smg-routing-key"] == "conv-lc"
        assert body["prompt_cache_key"] == "conv-lc"


@pytest.mark.skipif(
    importlib.util.find_spec("llama_index.llms.openai_like") is None, reason="llamaindex extra missing"
)
async def test_llamaindex_adapter_sends_the_body_openailike_sends() -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    from agentkv.integrations.llamaindex import AgentKVLLM

    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    history = [
        ChatMessage(role="system", content="be terse"),
        ChatMessage(role="user", content="sum"),
        ChatMessage(role="assistant", content=None, additional_kwargs={"tool_calls": [call]}),
        ChatMessage(role="tool", content="3 é", additional_kwargs={"tool_call_id": "c1"}),
    ]
    bodies = []
    for cls in (OpenAILike, AgentKVLLM):
        replies = [
            ScriptedReply.completion("ok"),
            ScriptedReply.stream(["o", "k"]),
            ScriptedReply.completion("a"),
        ]
        router = ScriptedRouter(replies)
        llm = cls(
            model="m",
            api_base=BASE,
            api_key="k",
            is_chat_model=True,
            http_client=router.client(),
            async_http_client=router.async_client(),
            max_retries=0,
        )
        llm.chat(history)
        "".join(c.delta or "" for c in llm.stream_chat(history))
        await llm.achat(history)
        ignored = ("prompt_cache_key", "stream_options")  # the adapter's own additions
        bodies.append([{k: v for k, v in b.items() if k not in ignored} for b in router.bodies])
    plain, ours = bodies
    assert ours == plain
    assert ours[0]["messages"][3]["content"] == "3 é"


def test_missing_extra_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from agentkv.integrations._require import require

    def fail(name: str) -> None:
        raise ImportError(name)

    monkeypatch.setattr(importlib, "import_module", fail)
    with pytest.raises(ImportError, match=r"pip install 'agentkv\[langchain\]'"):
        require("langchain_openai", "langchain")


@pytest.mark.skipif(importlib.util.find_spec("langchain_openai") is None, reason="langchain extra missing")
async def test_langchain_adapter_keeps_turn_stats_on_every_path(session: Session) -> None:
    from langchain_core.messages import HumanMessage

    from agentkv.integrations.langchain import AgentKVChatOpenAI

    def reply(kind: str, reuse: str, *, stream: bool) -> ScriptedReply:
        headers = router_headers(reuse=reuse, reused_tokens=7, path="pull")
        if stream:
            return ScriptedReply.stream([kind, "!"], usage=(20, 3), headers=headers)
        return ScriptedReply.completion(kind, usage=(20, 3), headers=headers)

    router = ScriptedRouter(
        [
            reply("invoke", "miss", stream=False),
            reply("stream", "hit", stream=True),
            reply("ainvoke", "hit", stream=False),
            reply("astream", "declined", stream=True),
        ]
    )
    llm = AgentKVChatOpenAI.from_session(
        session, http_client=router.client(), http_async_client=router.async_client(), max_retries=0
    )
    messages = [HumanMessage("q")]
    assert llm.invoke(messages).content == "invoke"
    assert "".join(str(c.content) for c in llm.stream(messages)) == "stream!"
    assert (await llm.ainvoke(messages)).content == "ainvoke"
    assert "".join([str(c.content) async for c in llm.astream(messages)]) == "astream!"

    assert [t.reuse for t in llm.turns] == ["miss", "hit", "hit", "declined"]
    assert [t.streamed for t in llm.turns] == [False, True, False, True]
    assert [t.index for t in llm.turns] == [1, 2, 3, 4]
    assert all(t.reused_tokens == 7 and t.path == "pull" for t in llm.turns)
    assert all(t.prompt_tokens == 20 and t.completion_tokens == 3 for t in llm.turns)
    assert [t.ttft_s is not None for t in llm.turns] == [False, True, False, True]
    assert llm.turns[0].since_previous_s is None and llm.turns[1].since_previous_s is not None
    # Each turn's stats name the request id that went out with it.
    assert [t.request_id for t in llm.turns] == [r.headers["x-request-id"] for r in router.requests]
    assert all(r.headers["x-smg-routing-key"] == "conv-lc" for r in router.requests)
    assert router.bodies[1]["stream_options"] == {"include_usage": True}
    table = llm.summary()
    assert "conversation conv-lc" in table and "declined" in table


@pytest.mark.skipif(
    importlib.util.find_spec("llama_index.llms.openai_like") is None, reason="llamaindex extra missing"
)
async def test_llamaindex_adapter_reads_router_headers_into_turn_stats(session: Session) -> None:
    from llama_index.core.llms import ChatMessage

    from agentkv.integrations.llamaindex import AgentKVLLM

    def headers(reuse: str) -> dict[str, str]:
        return router_headers(reuse=reuse, reused_tokens=5, path="pull", lease_expires_in_s=25)

    router = ScriptedRouter(
        [
            ScriptedReply.completion("sync", usage=(30, 4), headers=headers("miss")),
            ScriptedReply.stream(["s", "t"], usage=(31, 2), headers=headers("hit")),
            ScriptedReply.completion("async", usage=(32, 4), headers=headers("local")),
            ScriptedReply.stream(["a", "s"], usage=(33, 2), headers=headers("declined")),
        ]
    )
    llm = AgentKVLLM.from_session(
        session, http_client=router.client(), async_http_client=router.async_client(), max_retries=0
    )
    q = [ChatMessage(role="user", content="q")]
    assert llm.chat(q).message.content == "sync"
    assert "".join(c.delta or "" for c in llm.stream_chat(q)) == "st"
    assert (await llm.achat(q)).message.content == "async"
    assert "".join([c.delta or "" async for c in await llm.astream_chat(q)]) == "as"

    assert [t.reuse for t in llm.turns] == ["miss", "hit", "local", "declined"]
    assert [t.reused for t in llm.turns] == [False, True, True, False]
    assert all(t.reused_tokens == 5 and t.lease_expires_in_s == 25 for t in llm.turns)
    assert [t.prompt_tokens for t in llm.turns] == [30, 31, 32, 33]
    assert [t.streamed for t in llm.turns] == [False, True, False, True]
    assert [t.ttft_s is not None for t in llm.turns] == [False, True, False, True]
    assert [t.request_id for t in llm.turns] == [r.headers["x-request-id"] for r in router.requests]
    assert router.bodies[1]["stream_options"] == {"include_usage": True}
    assert "stream_options" not in router.bodies[0]
    assert "local" in llm.summary()


@pytest.mark.skipif(
    importlib.util.find_spec("llama_index.llms.openai_like") is None, reason="llamaindex extra missing"
)
async def test_llamaindex_header_capture_keeps_concurrent_conversations_apart() -> None:
    import asyncio

    import httpx
    from llama_index.core.llms import ChatMessage

    from agentkv.integrations.llamaindex import AgentKVLLM

    def answer(request: httpx.Request) -> httpx.Response:
        conversation = request.headers["x-session-id"]
        reply = ScriptedReply.stream(["x"] * 3, headers=router_headers(reuse=f"hit-{conversation}"))
        return reply.response()

    shared = httpx.AsyncClient(transport=httpx.MockTransport(answer))  # one client, as apps often share
    llms = [
        AgentKVLLM(
            model="m",
            api_base=BASE,
            api_key="k",
            is_chat_model=True,
            conversation_id=f"c{i}",
            async_http_client=shared,
            max_retries=0,
        )
        for i in range(4)
    ]

    async def turn(llm: AgentKVLLM) -> None:
        async for _ in await llm.astream_chat([ChatMessage(role="user", content="q")]):
            await asyncio.sleep(0)  # interleave the streams

    await asyncio.gather(*(turn(llm) for llm in llms))
    assert [llm.turns[0].reuse for llm in llms] == [f"hit-c{i}" for i in range(4)]
    assert len(shared.event_hooks["response"]) == 1  # the hook is added once, not per LLM


def test_header_hook_does_nothing_outside_a_capture() -> None:
    import httpx

    from agentkv.integrations._stats import add_header_hook, capture_headers

    client = add_header_hook(
        httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, headers={"x-a": "1"}))),
        asynchronous=False,
    )
    sink: dict[str, str] = {}
    client.get("http://x/")
    assert sink == {}
    with capture_headers(sink):
        client.get("http://x/")
    assert sink["x-a"] == "1"
    default = add_header_hook(None, asynchronous=False)  # the openai SDK's default client, plus the hook
    assert len(default.event_hooks["response"]) == 1
    default.close()


@pytest.mark.skipif(
    importlib.util.find_spec("llama_index.llms.openai_like") is None, reason="llamaindex extra missing"
)
def test_llamaindex_tool_calls_go_through_the_adapter(
    session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool
    from llama_index.core.tools.calling import call_tool_with_selection

    from agentkv.integrations.llamaindex import AgentKVLLM

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    router = ScriptedRouter(
        [
            ScriptedReply.completion(None, tool_calls=[("call-1", "add", '{"a": 2, "b": 3}')]),
            ScriptedReply.completion("five"),
        ]
    )
    llm = AgentKVLLM.from_session(
        session, http_client=router.client(), is_function_calling_model=True, max_retries=0
    )
    touched: list[bool] = []
    monkeypatch.setattr(
        session, "touch", lambda headers=None, *, tool_calls=False: touched.append(tool_calls)
    )
    tools = [FunctionTool.from_defaults(fn=add)]
    history = [ChatMessage(role="user", content="2+3?")]
    first = llm.chat_with_tools(tools, chat_history=list(history), tool_required=True)
    (call,) = llm.get_tool_calls_from_response(first, error_on_no_tool_call=False)
    output = call_tool_with_selection(call, tools)
    history += [
        first.message,
        ChatMessage(role="tool", content=str(output), additional_kwargs={"tool_call_id": call.tool_id}),
    ]
    answer = llm.chat_with_tools(tools, chat_history=list(history), tool_choice="none")
    assert str(output) == "5" and answer.message.content == "five"
    assert router.bodies[0]["tool_choice"] == "required" and router.bodies[1]["tool_choice"] == "none"
    assert router.bodies[1]["messages"][-1] == {"role": "tool", "content": "5", "tool_call_id": "call-1"}
    assert all(r.headers["x-smg-routing-key"] == "conv-lc" for r in router.requests)
    assert len(llm.turns) == 2
    assert touched == [True, False]  # the answer that called a tool tells the session tools run next


@pytest.mark.skipif(
    importlib.util.find_spec("llama_index.llms.openai_like") is None, reason="llamaindex extra missing"
)
def test_llamaindex_stream_stopped_early_records_no_turn(session: Session) -> None:
    from llama_index.core.llms import ChatMessage

    from agentkv.integrations.llamaindex import AgentKVLLM

    router = ScriptedRouter([ScriptedReply.stream(["a", "b", "c"]), ScriptedReply.completion("next")])
    llm = AgentKVLLM.from_session(session, http_client=router.client(), max_retries=0)
    stream = llm.stream_chat([ChatMessage(role="user", content="q")])
    next(stream)
    stream.close()  # the caller gave up: no stats for a turn that did not finish, and the client is free
    assert llm.turns == []
    assert llm.chat([ChatMessage(role="user", content="q")]).message.content == "next"
    assert [t.streamed for t in llm.turns] == [False]


@pytest.mark.skipif(importlib.util.find_spec("langchain_openai") is None, reason="langchain extra missing")
@pytest.mark.parametrize("stream", [False, True])
def test_langchain_tells_the_session_when_an_answer_calls_tools(
    session: Session, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    from agentkv.integrations.langchain import AgentKVChatOpenAI

    call = ("call-1", "add", '{"a": 2, "b": 3}')
    replies = (
        [
            ScriptedReply.stream([], tool_calls=[(0, "call-1", "add", ['{"a": 2,', ' "b": 3}'])]),
            ScriptedReply.stream(["five"]),
        ]
        if stream
        else [ScriptedReply.completion(None, tool_calls=[call]), ScriptedReply.completion("five")]
    )
    router = ScriptedRouter(replies)
    llm = AgentKVChatOpenAI.from_session(session, http_client=router.client(), max_retries=0)
    touched: list[bool] = []
    monkeypatch.setattr(
        session, "touch", lambda headers=None, *, tool_calls=False: touched.append(tool_calls)
    )
    for _ in range(2):
        if stream:
            list(llm.stream("2+3?"))
        else:
            llm.invoke("2+3?")
    assert touched == [True, False]
