from typing import Any

import httpx
import openai
import pytest
import respx
from openai.types.chat import ChatCompletionMessage

from agentkv import APIStatusError, ConfigError, ConnectError
from agentkv.client import (
    ControlClient,
    Deadline,
    ScriptedReply,
    ScriptedRouter,
    Timeouts,
    Transport,
    first_model,
    turn_headers,
)

BASE = "http://router.test/v1"


def test_turn_headers() -> None:
    headers = turn_headers("c1", session_header="x-smg-routing-key", request_id="r1")
    assert headers == {"x-smg-routing-key": "c1", "x-request-id": "r1"}
    assert (
        turn_headers("c1", session_header="x-session-id", request_id="r", final=True)["x-agentkv-final-turn"]
        == "true"
    )


def test_per_read_timeout_never_exceeds_the_remaining_deadline() -> None:
    now = [0.0]
    deadline = Deadline(20.0, clock=lambda: now[0])
    now[0] = 15.0
    timeout = Timeouts(total=20.0, connect=10.0, read=300.0).for_attempt(deadline)
    assert timeout.read == pytest.approx(5.0)
    assert timeout.connect == pytest.approx(5.0)
    assert Timeouts.coerce(7.0).total == 7.0


@respx.mock
def test_control_plane_paths_and_auth() -> None:
    lease = {"conversation_id": "c1", "lease": {"state": "held", "expires_in_s": 29.0, "renewable": True}}
    beat = respx.post(f"{BASE}/conversations/c1/heartbeat").respond(200, json=lease)
    get = respx.get(f"{BASE}/conversations/c1").respond(200, json=lease)
    delete = respx.delete(f"{BASE}/conversations/c1").respond(200, json={"released": True})
    control = ControlClient(base_url=BASE, api_key="secret")
    assert control.heartbeat("c1") == lease
    assert control.lookup("c1") == lease
    assert control.release("c1") == {"released": True}
    assert beat.calls.last.request.headers["authorization"] == "Bearer secret"
    assert get.called and delete.called


@respx.mock
def test_control_plane_absent_endpoint_is_none() -> None:
    respx.post(f"{BASE}/conversations/c1/heartbeat").respond(404, json={"detail": "Not Found"})
    respx.delete(f"{BASE}/conversations/c1").respond(405)
    control = ControlClient(base_url=BASE)
    assert control.heartbeat("c1") is None
    assert control.release("c1") is None


@respx.mock
def test_control_plane_errors_are_mapped() -> None:
    respx.post(f"{BASE}/conversations/c1/heartbeat").respond(
        503, json={"error": {"message": "no decode", "type": "upstream_error"}}
    )
    respx.get(f"{BASE}/conversations/c1").mock(side_effect=httpx.ConnectError("refused"))
    control = ControlClient(base_url=BASE)
    with pytest.raises(APIStatusError) as info:
        control.heartbeat("c1")
    assert info.value.status_code == 503 and info.value.error_type == "upstream_error"
    with pytest.raises(ConnectError):
        control.lookup("c1")


@respx.mock
def test_first_model() -> None:
    route = respx.get(f"{BASE}/models")
    route.respond(200, json={"object": "list", "data": [{"id": "tiny"}, {"id": "other"}]})
    assert first_model(BASE) == "tiny"
    route.respond(200, json={"object": "list", "data": []})
    with pytest.raises(ConfigError):
        first_model(BASE)


def _sent_body(send: Any) -> dict[str, Any]:
    router = ScriptedRouter([ScriptedReply.completion("ok")])
    with router.client() as client:
        send(client)
    (body,) = router.bodies
    return body


def test_messages_sent_as_is_give_the_body_the_sdks_transform_gives() -> None:
    history = [
        {"role": "system", "content": "You are terse."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "u"}}],
        },
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "look it up",  # a key the SDK's types do not know
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "é 42"},
        dict(ChatCompletionMessage(role="assistant", content="from a reply")),  # pydantic values inside
    ]
    params = {
        "model": "tiny",
        "messages": history,
        "max_tokens": 8,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "extra_body": {"prompt_cache_key": "c1", "top_k": 5},
    }

    def sdk(client: httpx.Client) -> None:
        openai.OpenAI(base_url=BASE, api_key="k", http_client=client).chat.completions.create(
            **params, stream=False
        )

    def ours(client: httpx.Client) -> None:
        Transport(base_url=BASE, api_key="k", http_client=client).complete(params)

    assert _sent_body(ours) == _sent_body(sdk)
    assert _sent_body(ours)["messages"][3]["content"] == "é 42"
