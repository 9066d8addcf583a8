"""Decode's in-flight count (what the load cap and the choosers balance on) is held for exactly the life
of each answer, whichever way the answer ends."""

from __future__ import annotations

import httpx

from .conftest import FakeEngines

CHAT = "/v1/chat/completions"
USER1 = [{"role": "user", "content": "list the files"}]


def outstanding(client: httpx.AsyncClient) -> dict[str, int]:
    router = client.app.state.router  # type: ignore[attr-defined]
    return {s.name: s.outstanding for pool in (router.services.prefill, router.services.decode) for s in pool}


async def test_inflight_counts_go_back_to_zero_after_json_streamed_and_broken_answers(
    engines: FakeEngines, make_client
) -> None:
    async with make_client() as client:
        body = {"model": "tiny", "messages": USER1}
        assert (await client.post(CHAT, json=body)).status_code == 200
        assert set(outstanding(client).values()) == {0}
        r = await client.post(CHAT, json={**body, "stream": True})
        assert r.status_code == 200 and "[DONE]" in r.text
        assert set(outstanding(client).values()) == {0}
        engines.stream_break_after = 2
        r = await client.post(CHAT, json={**body, "stream": True})
        assert "stream_interrupted" in r.text
        assert set(outstanding(client).values()) == {0}
        engines.down = {"d0.test", "d1.test"}
        assert (await client.post(CHAT, json=body)).status_code == 503
        assert set(outstanding(client).values()) == {0}
