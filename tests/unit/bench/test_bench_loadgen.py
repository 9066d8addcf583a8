"""The load generator's conversations, driven against in-process stubs."""

from __future__ import annotations

import httpx

from bench._fake_vllm import StubConfig
from bench._loadgen import LoadSpec, run_load
from bench._stub import create_stub_apps


async def test_direct_baseline_makes_both_hops_and_offers_decode_kv_on_later_turns(dispatch: type) -> None:
    prefill = create_stub_apps(StubConfig(role="prefill"))
    decode = create_stub_apps(StubConfig(role="decode", lease=True))
    transport = dispatch(
        {"p.test:80": httpx.ASGITransport(app=prefill.api), "d.test:80": httpx.ASGITransport(app=decode.api)}
    )
    spec = LoadSpec(
        target="direct",
        prefill_url="http://p.test",
        decode_url="http://d.test",
        conversations=3,
        turns=3,
        concurrency=2,
    )
    result = await run_load(spec, transport=transport)
    assert result.errors() == {}
    assert len(result.ok) == 9
    assert [t.reuse for t in sorted(result.ok, key=lambda t: t.turn)][:3] == ["miss"] * 3
    assert all(t.reuse == "hit" for t in result.ok if t.turn > 0)
    assert prefill.state.counters == {**prefill.state.counters, "requests": 9, "pulls": 6}
    assert decode.state.counters["requests"] == 9


async def test_a_failing_turn_ends_its_conversation_and_is_reported(dispatch: type) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "down"}})

    spec = LoadSpec(target="agentkv", url="http://r.test", conversations=2, turns=4, concurrency=1)
    result = await run_load(spec, transport=httpx.MockTransport(refuse))
    assert result.errors() == {"http 503": 2}
    assert [t.turn for t in result.turns] == [0, 0]
    assert result.throughput == 0.0
