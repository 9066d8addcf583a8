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


def test_missing_extra_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from agentkv.integrations._require import require

    def fail(name: str) -> None:
        raise ImportError(name)

    monkeypatch.setattr(importlib, "import_module", fail)
    with pytest.raises(ImportError, match=r"pip install 'agentkv\[langchain\]'"):
        require("langchain_openai", "langchain")
