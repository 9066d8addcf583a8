import respx

from agentkv.client import ScriptedReply, ScriptedRouter, router_headers
from agentkv.session import AsyncSession, Session

from .conftest import BASE

TIMING = {"ttft_s", "total_s", "since_previous_s", "request_id"}


def script() -> ScriptedRouter:
    return ScriptedRouter(
        [
            ScriptedReply.completion(
                "one", headers=router_headers(reuse="miss", path="recompute", lease_expires_in_s=30)
            ),
            ScriptedReply.stream(
                ["t", "wo"],
                tool_calls=[(0, "c", "f", ["{}"])],
                headers=router_headers(reuse="hit", reused_tokens=20),
            ),
            ScriptedReply.completion("three", headers=router_headers(reuse="local", path="decode-local")),
        ]
    )


async def test_sync_and_async_sessions_agree(control: respx.MockRouter) -> None:
    sync_router, async_router = script(), script()
    with Session(
        base_url=BASE, model="m", conversation_id="p", http_client=sync_router.client(), heartbeat=False
    ) as s:
        s.chat("a")
        sync_deltas = list(s.stream("b"))
        s.chat([{"role": "tool", "tool_call_id": "c", "content": "{}"}])
    async with AsyncSession(
        base_url=BASE,
        model="m",
        conversation_id="p",
        http_client=async_router.async_client(),
        heartbeat=False,
    ) as a:
        await a.chat("a")
        async_deltas = [d async for d in a.stream("b")]
        await a.chat([{"role": "tool", "tool_call_id": "c", "content": "{}"}])
    assert s.history == a.history
    assert sync_deltas == async_deltas
    assert [t.model_dump(exclude=TIMING) for t in s.turns] == [t.model_dump(exclude=TIMING) for t in a.turns]
    assert sync_router.bodies == async_router.bodies
