import json

import httpx
import pytest
import respx

from agentkv import SessionClosedError, StreamInterruptedError
from agentkv.client import ScriptedReply, ScriptedRouter, router_headers
from agentkv.session import AsyncSession, Session

from .conftest import BASE, FakeClock


def make(router: ScriptedRouter, **options: object) -> Session:
    return Session(
        base_url=BASE,
        model="m",
        http_client=router.client(),
        **{"heartbeat": False, **options},  # type: ignore[arg-type]
    )


def test_every_request_carries_the_conversation_id(control: respx.MockRouter) -> None:
    router = ScriptedRouter(
        [ScriptedReply.completion("a"), ScriptedReply.stream(["b"]), ScriptedReply.completion("c")]
    )
    with make(router, conversation_id="conv-1", session_header="x-smg-routing-key") as session:
        session.chat("one")
        list(session.stream("two"))
        session.chat("three", extra_headers={"x-trace": "t"})
    for request, body in zip(router.requests, router.bodies, strict=True):
        assert request.headers["x-smg-routing-key"] == "conv-1"
        assert body["prompt_cache_key"] == "conv-1"
    request_ids = {r.headers["x-request-id"] for r in router.requests}
    assert len(request_ids) == 3
    assert router.requests[2].headers["x-trace"] == "t"
    assert router.bodies[1]["stream_options"] == {"include_usage": True}


def test_chat_returns_message_and_grows_history(control: respx.MockRouter) -> None:
    router = ScriptedRouter([ScriptedReply.completion("hello"), ScriptedReply.completion("again")])
    with make(router, system="sys") as session:
        assert session.chat("hi").content == "hello"
        session.chat([{"role": "user", "content": "more"}])
    assert router.bodies[1]["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    assert session.history[-1] == {"role": "assistant", "content": "again"}


def test_stats_come_from_router_headers(control: respx.MockRouter) -> None:
    router = ScriptedRouter(
        [
            ScriptedReply.completion(
                headers=router_headers(reuse="miss", path="recompute", lease_expires_in_s=30)
            ),
            ScriptedReply.stream(["x"], usage=(50, 1), headers=router_headers(reuse="hit", reused_tokens=48)),
        ]
    )
    with make(router) as session:
        session.chat("one")
        list(session.stream("two"))
    first, second = session.turns
    assert (first.reuse, first.reused, first.path, first.lease_expires_in_s, first.ttft_s) == (
        "miss",
        False,
        "recompute",
        30.0,
        None,
    )
    assert (second.reuse, second.reused, second.reused_tokens, second.prompt_tokens) == ("hit", True, 48, 50)
    assert second.streamed and second.ttft_s is not None
    assert "hit" in session.summary()


def test_plain_openai_server_means_unknown_reuse(control: respx.MockRouter) -> None:
    router = ScriptedRouter([ScriptedReply.completion("a")])
    with make(router) as session:
        session.chat("hi")
    assert (session.turns[0].reuse, session.turns[0].reused, session.turns[0].path) == (
        "unknown",
        False,
        None,
    )


def test_stream_assembles_text_and_tool_calls(control: respx.MockRouter) -> None:
    router = ScriptedRouter(
        [ScriptedReply.stream(["Look", "ing"], tool_calls=[(0, "c0", "calc", ['{"e": ', '"1+1"}'])])]
    )
    with make(router) as session:
        deltas = list(session.stream("compute"))
    assert "".join(d.content or "" for d in deltas) == "Looking"
    assert session.history[-1] == {
        "role": "assistant",
        "content": "Looking",
        "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "calc", "arguments": '{"e": "1+1"}'}}
        ],
    }


@pytest.mark.parametrize(
    "reply",
    [
        ScriptedReply.stream(["a", "b", "c"], break_after=3),
        ScriptedReply.stream(["a", "b"], error="decode died"),
    ],
    ids=["dropped-connection", "sse-error-event"],
)
def test_broken_stream_raises_with_partial_and_keeps_history(
    control: respx.MockRouter, reply: ScriptedReply
) -> None:
    router = ScriptedRouter([reply, ScriptedReply.completion("retry by hand")])
    with make(router) as session:
        with pytest.raises(StreamInterruptedError) as info:
            list(session.stream("hi"))
        assert info.value.partial["content"].startswith("a")
        assert session.history == [] and session.turns == []
        assert len(router.requests) == 1  # never replayed
        session.chat("hi")  # the session is still usable
    assert [m["role"] for m in session.history] == ["user", "assistant"]


def test_closed_session_refuses_turns(control: respx.MockRouter) -> None:
    session = make(ScriptedRouter())
    session.close()
    with pytest.raises(SessionClosedError):
        session.chat("hi")
    with pytest.raises(SessionClosedError):
        list(session.stream("hi"))


def test_close_releases_the_conversation(control: respx.MockRouter) -> None:
    router = ScriptedRouter(control=control.handler)  # the release rides the session's own client
    session = make(router, conversation_id="conv-close")
    session.close()
    session.close()  # idempotent
    assert [c.request.url.path for c in control.calls] == ["/v1/conversations/conv-close"]
    assert len(router.control_requests) == 1 and not router.requests


def test_close_without_release(control: respx.MockRouter) -> None:
    router = ScriptedRouter(control=control.handler)
    make(router).close(release=False)
    assert not control.calls and not router.control_requests


@pytest.mark.parametrize("answer", [httpx.Response(404), httpx.Response(405), httpx.ConnectError("down")])
def test_close_tolerates_servers_without_the_endpoint(answer: object) -> None:
    with respx.mock(base_url=BASE) as mock:
        route = mock.delete(path__regex=r"/conversations/.+")
        if isinstance(answer, Exception):
            route.mock(side_effect=answer)
        else:
            route.mock(return_value=answer)
        make(ScriptedRouter(control=mock.handler)).close()
        assert route.called


def test_expired_lease_seen_by_heartbeat_is_recorded_on_the_next_turn(
    control: respx.MockRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    control.post(path__regex=r"/conversations/.+/heartbeat").respond(
        200,
        json={"conversation_id": "c", "lease": {"state": "expired", "expires_in_s": 0, "renewable": False}},
    )
    router = ScriptedRouter(
        [
            ScriptedReply.completion(headers=router_headers(reuse="miss", lease_expires_in_s=30)),
            ScriptedReply.completion(headers=router_headers(reuse="miss", path="recompute")),
        ],
        control=control.handler,
    )
    session = make(router, heartbeat=True, clock=clock)
    monkeypatch.setattr(session._heartbeat, "notify", lambda: None)  # no thread: beat by hand
    session.chat("one")
    clock.advance(10.0)
    session._heartbeat.run_once()
    session.chat("two")
    session.close()
    assert [t.lease_expired for t in session.turns] == [False, True]
    assert json.loads(router.requests[1].content)["messages"][0] == {"role": "user", "content": "one"}


def test_final_turn_sends_the_header_and_plans_no_heartbeat(
    control: respx.MockRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    router = ScriptedRouter(
        [
            ScriptedReply.completion(headers=router_headers(reuse="miss", lease_expires_in_s=30)),
            ScriptedReply.completion(headers=router_headers(reuse="hit")),
        ]
    )
    session = make(router, heartbeat=True, clock=FakeClock())
    monkeypatch.setattr(session._heartbeat, "notify", lambda: None)  # no thread: ask the scheduler
    session.chat("one")
    assert "x-agentkv-final-turn" not in router.requests[0].headers
    assert session._core.scheduler.due_in(0.0) is not None
    session.chat("two", final=True)
    assert router.requests[1].headers["x-agentkv-final-turn"] == "true"
    assert session._core.scheduler.due_in(0.0) is None
    session.close()


async def test_sessions_on_one_client_send_everything_through_it_and_leave_it_open() -> None:
    """Many agents share one client: each session's turns, heartbeats and release go through it (no client
    and pool of its own per session), and closing a session does not close it."""

    def lease(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(200, json={"released": True})
        return httpx.Response(200, json={"lease": {"state": "held", "expires_in_s": 30.0, "renewable": True}})

    router = ScriptedRouter([ScriptedReply.completion(), ScriptedReply.completion()], control=lease)
    async with httpx.AsyncClient(transport=router.transport()) as shared:
        sessions = [
            AsyncSession(base_url=BASE, model="m", http_client=shared, heartbeat=False) for _ in range(2)
        ]
        for session in sessions:
            await session.chat("hi")
            assert await session.lease() is not None
            await session.aclose()
        assert not shared.is_closed
    paths = [(r.method, r.url.path.rsplit("/", 1)[0]) for r in router.control_requests]
    assert paths == [("GET", "/v1/conversations"), ("DELETE", "/v1/conversations")] * 2
    assert len(router.requests) == 2


def test_a_session_on_one_client_heartbeats_through_it() -> None:
    clock = FakeClock()
    beats: list[str] = []

    def lease(request: httpx.Request) -> httpx.Response:
        beats.append(request.url.path)
        return httpx.Response(200, json={"lease": {"state": "held", "expires_in_s": 30.0, "renewable": True}})

    router = ScriptedRouter(
        [ScriptedReply.completion(headers=router_headers(reuse="miss", lease_expires_in_s=30))], control=lease
    )
    with httpx.Client(transport=router.transport()) as shared:
        session = Session(base_url=BASE, model="m", http_client=shared, clock=clock)
        session._heartbeat.notify = lambda: None  # type: ignore[method-assign]  # no thread: beat by hand
        session.chat("one")
        clock.advance(10.0)
        session._heartbeat.run_once()
        session.close()
        assert not shared.is_closed
    assert beats[0].endswith("/heartbeat") and beats[-1] == f"/v1/conversations/{session.conversation_id}"
