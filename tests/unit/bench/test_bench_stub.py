"""The stub backend speaks vLLM's API and the decode retention service (docs/protocol.md section 2)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from bench._fake_vllm import StubConfig
from bench._stub import StubApps, create_stub_apps

# The keys vLLM 0.32's NixlConnectorScheduler.request_finished returns (pull_scheduler.py).
VLLM_KV_KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 4}


def client(app: Any, base: str = "http://stub") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base)


def sse_chunks(text: str) -> list[Any]:
    events = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


async def test_prefill_returns_vllm_shaped_params_for_decode() -> None:
    apps = create_stub_apps(StubConfig(role="prefill", block_size=16))
    async with client(apps.api) as c:
        body = {**CHAT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        response = await c.post("/v1/chat/completions", json=body, headers={"x-request-id": "abc"})
    params = response.json()["kv_transfer_params"]
    assert set(params) == VLLM_KV_KEYS
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_request_id"].startswith("chatcmpl-abc-")
    assert params["remote_num_tokens"] == response.json()["usage"]["prompt_tokens"]
    assert len(params["remote_block_ids"][0]) == -(-params["remote_num_tokens"] // 16)
    assert response.json()["id"] == "chatcmpl-abc"


async def test_decode_retains_and_the_retention_service_renews_and_releases() -> None:
    apps = create_stub_apps(StubConfig(role="decode", lease=True, lease_s=30, max_lease_s=100))
    async with client(apps.api) as api, client(apps.retention) as svc:
        body = {**CHAT, "kv_transfer_params": {"do_remote_prefill": True}}
        answer = (await api.post("/v1/chat/completions", json=body, headers={"x-request-id": "r1"})).json()
        params = answer["kv_transfer_params"]
        assert set(params) >= VLLM_KV_KEYS and params["agentkv_block_hashes"]
        assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
        assert params["remote_num_tokens"] == answer["usage"]["total_tokens"] - 1

        info = (await svc.get("/agentkv/v1/info")).json()
        assert info["retained"] == 1 and info["lease_s"] == 30
        for rid in ("r1", "chatcmpl-r1", params["remote_request_id"]):
            found = await svc.get(f"/agentkv/v1/retained/{rid}")
            assert found.status_code == 200
            assert found.json()["kv_transfer_params"]["remote_request_id"] == params["remote_request_id"]
            assert 0 < found.json()["expires_in_s"] <= 30

        renewed = await svc.post("/agentkv/v1/leases/r1/renew", json={"duration_s": 1000})
        assert renewed.status_code == 200
        assert 90 < renewed.json()["expires_in_s"] <= 100  # bounded by max_lease_s
        expiry = renewed.json()["kv_transfer_params"]["remote_blocks_expiry_time"]
        assert expiry == pytest.approx(time.perf_counter() + 100, abs=5)

        assert (await svc.delete("/agentkv/v1/leases/r1")).json() == {"released": True}
        assert (await svc.delete("/agentkv/v1/leases/r1")).status_code == 404
        assert (await svc.get("/agentkv/v1/retained/r1")).status_code == 404
        assert (await svc.post("/agentkv/v1/leases/r1/renew", json={"duration_s": 5})).status_code == 404


async def test_expired_retention_is_gone() -> None:
    apps = create_stub_apps(StubConfig(role="decode", lease=True, lease_s=0.01))
    async with client(apps.api) as api, client(apps.retention) as svc:
        body = {**CHAT, "kv_transfer_params": {"do_remote_prefill": True}}
        await api.post("/v1/chat/completions", json=body, headers={"x-request-id": "r1"})
        time.sleep(0.02)
        assert (await svc.get("/agentkv/v1/retained/r1")).status_code == 404
    assert apps.state.counters["expired"] == 1


@pytest.mark.parametrize("stream_kv_params", [True, False])
async def test_decode_stream_carries_params_on_the_finishing_chunk_only_when_enabled(
    stream_kv_params: bool,
) -> None:
    apps = create_stub_apps(StubConfig(role="decode", stream_kv_params=stream_kv_params))
    body = {
        **CHAT,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": {"do_remote_prefill": True},
    }
    async with client(apps.api) as api:
        response = await api.post("/v1/chat/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(response.text)
    finishing = [chunk for chunk in chunks if chunk["choices"] and chunk["choices"][0]["finish_reason"]]
    assert len(finishing) == 1
    assert ("kv_transfer_params" in finishing[0]) is stream_kv_params
    assert sum("kv_transfer_params" in chunk for chunk in chunks) == int(stream_kv_params)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks if chunk["choices"])
    assert text == " t0 t1 t2 t3"
    assert apps.state.counters["retained"] == 1  # retained whether or not the stream shows it


async def test_plain_request_without_kv_params_is_not_retained() -> None:
    apps = create_stub_apps(StubConfig(role="decode"))
    async with client(apps.api) as api:
        answer = (
            await api.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
        ).json()
    assert answer["object"] == "text_completion" and answer["kv_transfer_params"] is None
    assert answer["choices"][0]["text"] == " t0 t1"
    assert apps.state.retained == {}


async def test_prefill_counts_pulls_and_declines_near_expiry() -> None:
    apps = create_stub_apps(StubConfig(role="prefill"))
    offer = {
        "do_remote_decode": True,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "D",
        "remote_num_tokens": 20,
    }
    async with client(apps.api) as api:
        fresh = {**offer, "remote_blocks_expiry_time": time.perf_counter() + 60}
        stale = {**offer, "remote_blocks_expiry_time": time.perf_counter() + 1}  # inside the 5 s margin
        await api.post("/v1/chat/completions", json={**CHAT, "kv_transfer_params": fresh})
        await api.post("/v1/chat/completions", json={**CHAT, "kv_transfer_params": stale})
    assert apps.state.counters["pulls"] == 1
    assert apps.state.counters["declined"] == 1


async def test_tools_get_a_tool_call_and_bad_json_a_400() -> None:
    apps = create_stub_apps(StubConfig(role="decode"))
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    async with client(apps.api) as api:
        answer = (await api.post("/v1/chat/completions", json={**CHAT, "tools": tools})).json()
        bad = await api.post("/v1/chat/completions", content=b"{not json")
        models = (await api.get("/v1/models")).json()
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    assert answer["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "search"
    assert bad.status_code == 400 and "error" in bad.json()
    assert models["data"][0]["id"] == "stub-model"


@pytest.mark.parametrize("stream", [False, True])
async def test_real_router_reuses_decode_kv_through_the_stub(stream: bool, dispatch: type) -> None:
    router = pytest.importorskip("agentkv.server.router")
    prefill = create_stub_apps(StubConfig(role="prefill"))
    decode: StubApps = create_stub_apps(StubConfig(role="decode", lease=True))
    transport = dispatch(
        {
            "p.test:8100": httpx.ASGITransport(app=prefill.api),
            "d.test:8200": httpx.ASGITransport(app=decode.api),
            "d.test:9200": httpx.ASGITransport(app=decode.retention),
        }
    )
    settings = router.RouterSettings(
        prefill=["http://p.test:8100"],
        decode=["http://d.test:8200"],
        health_interval_s=0,
        path_policy="always-pd",  # the pull path is the one that needs the stub's kv_transfer_params
    )
    app = router.create_app(settings, transport=transport)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s" * 2000}]
    reuse = []
    async with client(app, "http://router") as c:
        for turn in range(3):
            messages.append({"role": "user", "content": f"turn {turn} " + "u" * 400})
            body = {"model": "stub-model", "messages": messages, "max_tokens": 4, "stream": stream}
            response = await c.post("/v1/chat/completions", json=body, headers={"x-session-id": "conv-1"})
            assert response.status_code == 200, response.text
            assert "kv_transfer_params" not in response.text  # never leaked to clients
            reuse.append(response.headers.get("x-agentkv-reuse"))
            messages.append({"role": "assistant", "content": " t0 t1 t2 t3"})
    assert reuse[0] == "miss"
    assert reuse[1:] == ["hit", "hit"]
    assert prefill.state.counters["pulls"] == 2


@pytest.mark.parametrize("messages", [["a string"], [3, None, {"role": "user", "content": "hi"}], "text", 7])
def test_malformed_messages_do_not_crash_the_stub(messages: object) -> None:
    """The router passes ``messages`` on /v1/completions through unvalidated (the engine ignores them);
    a stub that crashed on them made the fuzz bench report the router's correct 502 as a router fault."""
    from bench._fake_vllm import count_prompt_tokens

    assert count_prompt_tokens({"prompt": "p", "messages": messages}, chars_per_token=4) >= 1
