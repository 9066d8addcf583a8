import asyncio

import httpx

from agentkv.integrations import current_conversation, httpx_event_hooks, use_conversation


def echo(request: httpx.Request) -> httpx.Response:
    return httpx.Response(
        200, json={"id": request.headers.get("x-session-id"), "rid": request.headers.get("x-request-id")}
    )


def test_sync_hook_tags_requests_only_inside_the_block() -> None:
    client = httpx.Client(transport=httpx.MockTransport(echo), event_hooks=httpx_event_hooks())
    with use_conversation("conv-9") as conversation_id:
        assert current_conversation() == conversation_id == "conv-9"
        inside = client.get("http://x/").json()
    outside = client.get("http://x/").json()
    assert inside["id"] == "conv-9" and inside["rid"]
    assert outside == {"id": None, "rid": None}


async def test_concurrent_async_turns_do_not_mix() -> None:
    client = httpx.AsyncClient(
        transport=httpx.MockTransport(echo), event_hooks=httpx_event_hooks(asynchronous=True)
    )

    async def turn(conversation_id: str) -> str:
        with use_conversation(conversation_id):
            await asyncio.sleep(0)  # let the other task interleave
            return (await client.get("http://x/")).json()["id"]

    assert await asyncio.gather(*(turn(f"c{i}") for i in range(5))) == [f"c{i}" for i in range(5)]
