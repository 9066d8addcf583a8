"""The HTTP surface: validation, auth and tenants, conversation endpoints, models/health/metrics, SDK."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx
import openai
import pytest

from .conftest import FakeEngines, store_of

CHAT = "/v1/chat/completions"
GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and "Traceback" not in r.text
    return body["error"]


BAD_REQUESTS = [
    pytest.param({"content": b"{not json"}, 400, id="malformed-json"),
    pytest.param({"content": b"[1, 2]"}, 400, id="not-an-object"),
    pytest.param({"json": {**GOOD, "messages": "hi"}}, 400, id="messages-not-list"),
    pytest.param({"json": {**GOOD, "messages": [{"content": "no role"}]}}, 400, id="message-without-role"),
    pytest.param({"json": {**GOOD, "stream": "yes"}}, 400, id="stream-not-bool"),
    pytest.param({"json": {**GOOD, "max_tokens": "10"}}, 400, id="max-tokens-string"),
    pytest.param({"json": {**GOOD, "max_tokens": True}}, 400, id="max-tokens-bool"),
    pytest.param({"json": {**GOOD, "max_tokens": 0}}, 400, id="max-tokens-zero"),
    pytest.param({"json": {**GOOD, "conversation_id": "x" * 129}, "headers": {}}, 400, id="huge-id"),
    pytest.param(
        {"json": {**GOOD, "session_id": "bad id with spaces"}, "headers": {}}, 400, id="bad-body-id"
    ),
    pytest.param({"json": GOOD, "headers": {"x-session-id": "a/b"}}, 400, id="bad-header-id"),
    pytest.param({"json": GOOD, "headers": {"x-session-id": "ok\n"}}, 400, id="id-with-newline"),
    pytest.param({"json": {**GOOD, "model": "no-such-model"}}, 404, id="unknown-model"),
    pytest.param({"content": b"{" + b" " * 2048 + b"}"}, 413, id="oversized-body"),
]


@pytest.mark.parametrize(("request_kwargs", "status"), BAD_REQUESTS)
async def test_bad_input_is_a_4xx_and_changes_nothing(
    engines: FakeEngines, make_client, request_kwargs: dict[str, Any], status: int
) -> None:
    async with make_client(max_body_bytes=1024) as client:
        ok = await client.post(CHAT, json=GOOD, headers={"x-session-id": "other"})
        assert ok.status_code == 200
        before = (await store_of(client).get("-/other"), len(engines.completions("")))
        headers = request_kwargs.pop("headers", {"x-session-id": "c1"})
        r = await client.post(CHAT, headers=headers, **request_kwargs)
        assert_openai_error(r, status)
        assert (await store_of(client).get("-/other"), len(engines.completions(""))) == before
        assert await store_of(client).get("-/c1") is None


async def test_client_kv_transfer_params_are_dropped_and_counted(engines: FakeEngines, make_client) -> None:
    evil = {"do_remote_decode": True, "remote_block_ids": [[0]], "remote_host": "attacker", "remote_port": 1}
    async with make_client() as client:
        r = await client.post(CHAT, json={**GOOD, "kv_transfer_params": evil})
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 200
    assert all("attacker" not in json.dumps(b) for b in engines.completions(""))
    assert "agentkv_client_kv_params_dropped_total 1.0" in metrics


async def test_api_keys_are_required_and_scope_conversations(engines: FakeEngines, make_client) -> None:
    async with make_client(api_keys=["key-a", "key-b"]) as client:
        assert_openai_error(await client.post(CHAT, json=GOOD), 401)
        assert_openai_error(await client.post(CHAT, json=GOOD, headers={"authorization": "Bearer nope"}), 401)
        assert_openai_error(await client.get("/v1/models"), 401)
        for key in ("key-a", "key-b"):
            r = await client.post(
                CHAT, json=GOOD, headers={"authorization": f"Bearer {key}", "x-session-id": "c1"}
            )
            assert r.status_code == 200
        a = await client.get("/v1/conversations/c1", headers={"authorization": "Bearer key-a"})
        store = store_of(client)
        keys = [k for k in store._data]
        assert a.status_code == 200
        # DELETE under key-b forgets only key-b's conversation.
        assert (
            await client.delete("/v1/conversations/c1", headers={"authorization": "Bearer key-b"})
        ).status_code == 200
        again = await client.get("/v1/conversations/c1", headers={"authorization": "Bearer key-a"})
    assert len(keys) == 2 and all(k.endswith("/c1") and not k.startswith("-") for k in keys)
    assert again.status_code == 200


async def test_api_keys_file(tmp_path, engines: FakeEngines, make_client) -> None:
    path = tmp_path / "keys"
    path.write_text("# comment\nfile-key\n")
    async with make_client(api_keys_file=path) as client:
        assert (
            await client.post(CHAT, json=GOOD, headers={"authorization": "Bearer file-key"})
        ).status_code == 200
        assert_openai_error(await client.post(CHAT, json=GOOD), 401)


async def test_lookup_heartbeat_delete_with_leases(engines: FakeEngines, make_client) -> None:
    async with make_client(max_lease_s=100) as client:
        assert_openai_error(await client.get("/v1/conversations/c1"), 404)
        await client.post(CHAT, json=GOOD, headers={"x-session-id": "c1"})
        look = (await client.get("/v1/conversations/c1")).json()
        assert look["decode"] == "d0" and look["lease"]["state"] == "held" and look["lease"]["renewable"]
        assert look["retained_tokens"] > 0
        hb = await client.post("/v1/conversations/c1/heartbeat", json={"extend_s": 5000})
        assert hb.status_code == 200 and hb.json()["lease"]["expires_in_s"] <= 100
        assert engines.renewed and engines.renewed[-1][1] == 100  # bounded by max_lease_s
        assert_openai_error(await client.post("/v1/conversations/c1/heartbeat", json={"extend_s": "x"}), 400)
        assert_openai_error(await client.post("/v1/conversations/c1/heartbeat", content=b"{"), 400)
        gone = await client.delete("/v1/conversations/c1")
        assert gone.json() == {"conversation_id": "c1", "released": True}
        assert_openai_error(await client.delete("/v1/conversations/c1"), 404)
        assert_openai_error(await client.get("/v1/conversations/bad%20id"), 400)
        metrics = (await client.get("/metrics")).text
    assert len(engines.released) == 1
    assert "agentkv_lease_renewals_total 1.0" in metrics and "agentkv_lease_releases_total 1.0" in metrics


async def test_heartbeat_on_stock_vllm_reports_fixed_ttl_countdown(engines: FakeEngines, make_client) -> None:
    engines.retention = set()
    async with make_client(vllm_fixed_ttl_s=480) as client:
        await client.post(CHAT, json=GOOD, headers={"x-session-id": "c1"})
        hb = (await client.post("/v1/conversations/c1/heartbeat")).json()
        released = (await client.delete("/v1/conversations/c1")).json()["released"]
    assert hb["lease"]["state"] == "fixed_ttl" and hb["lease"]["renewable"] is False
    assert 470 < hb["lease"]["expires_in_s"] <= 480
    assert not engines.renewed and released is False  # stock vLLM cannot release early


async def test_heartbeat_when_decode_lost_the_blocks_reports_expired(
    engines: FakeEngines, make_client
) -> None:
    async with make_client() as client:
        await client.post(CHAT, json=GOOD, headers={"x-session-id": "c1"})
        engines.drop_retained()
        hb = (await client.post("/v1/conversations/c1/heartbeat")).json()
        again = (await client.post("/v1/conversations/c1/heartbeat")).json()
    assert hb["lease"]["state"] == "expired" and again["lease"]["state"] == "expired"
    # Each beat still reaches decode: no lease to renew, but the conversation is alive, so decode's host tier
    # keeps its copy ahead of ended conversations'.
    assert len(engines.renewed) == 2


async def test_a_tool_call_demotes_the_conversation_where_decode_has_a_host_tier(
    engines: FakeEngines, make_client
) -> None:
    engines.host_tier = {"d0.test"}
    async with make_client(path_policy="auto") as client:
        await client.post(CHAT, json=GOOD, headers={"x-session-id": "c1"})
        rid = engines.requests("d0", CHAT)[0][1]["x-request-id"]
        hb = (await client.post("/v1/conversations/c1/heartbeat", json={"tool_call": True})).json()
        again = (await client.post("/v1/conversations/c1/heartbeat")).json()
        metrics = (await client.get("/metrics")).text
        released = (await client.delete("/v1/conversations/c1")).json()["released"]
    assert hb["lease"] == {"state": "demoted", "expires_in_s": 0.0, "renewable": False}
    assert hb["tier"] == "host" and hb["retained_tokens"] > 0
    assert engines.demoted == [rid]  # decode ended the lease
    # A later beat renews no lease but tells decode the conversation is alive (its host copy stays kept).
    assert engines.renewed == [(rid, 30.0)] and again["lease"]["state"] == "demoted"
    assert 'agentkv_demotions_total{cause="tool_call"} 1.0' in metrics
    # The release ends decode's keep of the host copy.
    assert released is True and engines.released == [rid] and not engines.demoted_ids


async def test_a_renewal_learns_that_decode_demoted_the_lease_itself(
    engines: FakeEngines, make_client
) -> None:
    """Decode ended the lease to retain a newer turn under its cap (its host tier holds the blocks): the next
    beat's renewal says so, and the record reads demoted (tier host), not merely expired."""
    async with make_client(path_policy="auto") as client:
        await client.post(CHAT, json=GOOD, headers={"x-session-id": "c1"})
        engines.pressure_demote()
        hb = (await client.post("/v1/conversations/c1/heartbeat")).json()
        metrics = (await client.get("/metrics")).text
    assert hb["lease"]["state"] == "demoted" and hb["tier"] == "host", hb
    assert 'agentkv_demotions_total{cause="pressure"} 1.0' in metrics
    assert not engines.demoted  # the router asked nothing: decode had done it


async def test_a_tool_call_beat_during_a_turns_bookkeeping_waits_for_the_record_the_turn_writes(
    engines: FakeEngines, make_client
) -> None:
    """The SDK beats the moment an answer that calls tools ends, while the router may still be writing that
    turn's record: the beat waits for the conversation's lock and demotes the turn's own lease, instead of
    renewing the previous one and making the turn's write lose (which would release the turn's blocks)."""
    engines.host_tier = {"d0.test"}
    async with make_client(path_policy="auto") as client:
        await client.post(CHAT, json=GOOD, headers={"x-session-id": "c1"})
        engines.stream_gate = asyncio.Event()
        before = len(engines.completions("d"))
        turn = asyncio.create_task(
            client.post(CHAT, json={**GOOD, "stream": True}, headers={"x-session-id": "c1"})
        )
        while len(engines.completions("d")) < before + 1:
            await asyncio.sleep(0)
        beat = asyncio.create_task(client.post("/v1/conversations/c1/heartbeat", json={"tool_call": True}))
        await asyncio.sleep(0.05)
        assert not beat.done()  # waiting for the running turn
        engines.stream_gate.set()
        await turn
        hb = (await beat).json()
        second = engines.requests("d0", CHAT)[-1][1]["x-request-id"]
    assert hb["lease"]["state"] == "demoted"
    assert engines.demoted == [second]  # the lease of the turn that just ended
    assert second not in engines.released


async def test_a_tool_call_renews_where_decode_has_no_host_tier(engines: FakeEngines, make_client) -> None:
    async with make_client() as client:
        await client.post(CHAT, json=GOOD, headers={"x-session-id": "c1"})
        hb = (await client.post("/v1/conversations/c1/heartbeat", json={"tool_call": True})).json()
    assert hb["lease"]["state"] == "held" and hb["tier"] == "hbm"
    assert len(engines.renewed) == 1 and not engines.demoted


@pytest.mark.parametrize(
    "settings",
    [{"exact": True}, {"demote_on_tool_call": False}, {"path_policy": "always-pd"}],
    ids=["exact", "off", "always-pd"],
)
async def test_no_demotion_in_exact_mode_or_when_turned_off(
    engines: FakeEngines, make_client, settings: dict[str, Any]
) -> None:
    engines.host_tier = {"d0.test"}
    async with make_client(**{"path_policy": "auto", **settings}) as client:
        await client.post(CHAT, json=GOOD, headers={"x-session-id": "c1"})
        hb = (await client.post("/v1/conversations/c1/heartbeat", json={"tool_call": True})).json()
    assert hb["lease"]["state"] == "held" and not engines.demoted


async def test_a_heartbeat_after_demote_idle_s_demotes(engines: FakeEngines, make_client) -> None:
    engines.host_tier = {"d0.test"}
    async with make_client(demote_idle_s=60, path_policy="auto") as client:
        await client.post(CHAT, json=GOOD, headers={"x-session-id": "c1"})
        assert (await client.post("/v1/conversations/c1/heartbeat")).json()["lease"]["state"] == "held"
        store = store_of(client)
        record = await store.get("-/c1")
        assert record is not None and record.turn_ended_at is not None
        # The turn ended a minute ago (the record's clock is the epoch's, set by the turn).
        idle = dataclasses.replace(record, turn_ended_at=record.turn_ended_at - 60)
        assert await store.compare_and_set("-/c1", idle, expected=record.version)
        hb = (await client.post("/v1/conversations/c1/heartbeat")).json()
        metrics = (await client.get("/metrics")).text
    assert hb["lease"]["state"] == "demoted" and len(engines.demoted) == 1
    assert 'agentkv_demotions_total{cause="idle"} 1.0' in metrics


async def test_a_heartbeat_with_a_bad_tool_call_is_a_400(engines: FakeEngines, make_client) -> None:
    async with make_client() as client:
        await client.post(CHAT, json=GOOD, headers={"x-session-id": "c1"})
        r = await client.post("/v1/conversations/c1/heartbeat", json={"tool_call": "yes"})
        assert_openai_error(r, 400)
        assert (await client.get("/v1/conversations/c1")).json()["lease"]["state"] == "held"


async def test_lru_eviction_releases_the_lease(engines: FakeEngines, make_client) -> None:
    async with make_client(max_conversations=1) as client:
        await client.post(CHAT, json=GOOD, headers={"x-session-id": "c1"})
        first_rid = engines.requests("d0", CHAT)[0][1]["x-request-id"]
        await client.post(CHAT, json=GOOD, headers={"x-session-id": "c2"})
        await client.app.state.router.book.drain()  # type: ignore[attr-defined]
        assert_openai_error(await client.get("/v1/conversations/c1"), 404)
        assert (await client.get("/v1/conversations/c2")).status_code == 200
    assert engines.released == [first_rid]


async def test_models_health_metrics(engines: FakeEngines, make_client) -> None:
    async with make_client() as client:
        models = (await client.get("/v1/models")).json()
        health = await client.get("/health")
        await client.post(CHAT, json=GOOD, headers={"x-session-id": "c1"})
        metrics = (await client.get("/metrics")).text
        engines.down |= {"d0.test", "d1.test"}
        await client.app.state.router.health.check_once()  # type: ignore[attr-defined]
        down = await client.get("/health")
        engines.down.clear()
        await client.app.state.router.health.check_once()  # type: ignore[attr-defined]
        back = (await client.get("/health")).json()
        nowhere = await client.get("/nowhere")
    assert models["data"][0]["id"] == "tiny"
    assert health.json() == {"status": "ok", "prefill": 2, "decode": 2}
    for name in (
        'agentkv_turns_total{path="recompute"} 1.0',
        'agentkv_reuse_total{result="miss"} 1.0',
        "agentkv_ttft_seconds_bucket",
        "agentkv_prefill_seconds_count 1.0",
        "agentkv_conversations 1.0",
        'agentkv_path_decisions_total{path="recompute"} 1.0',
        'agentkv_healthy_backends{role="decode"}',
    ):
        assert name in metrics
    assert down.status_code == 503 and down.json()["decode"] == 0
    assert back == {"status": "ok", "prefill": 2, "decode": 2}
    assert_openai_error(nowhere, 404)


async def test_completions_endpoint_prefix_guard_on_prompt_text(engines: FakeEngines, make_client) -> None:
    engines.reply = lambda body: {"content": "bar"}
    async with make_client() as client:
        r1 = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "foo "}, headers={"x-session-id": "c"}
        )
        text = r1.json()["choices"][0]["text"]
        r2 = await client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "foo " + text + " baz"},
            headers={"x-session-id": "c"},
        )
        r3 = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "FOO"}, headers={"x-session-id": "c"}
        )
    assert r1.status_code == 200 and text == "bar"
    assert r2.headers["x-agentkv-reuse"] == "hit"
    assert r3.headers["x-agentkv-reuse"] == "mismatch"


async def test_openai_sdk_against_the_router(engines: FakeEngines, make_client) -> None:
    call = {"id": "call_9", "type": "function", "function": {"name": "read", "arguments": '{"f": "a.txt"}'}}
    engines.reply = lambda body: {"content": None, "tool_calls": [call], "finish_reason": "tool_calls"}
    async with make_client() as client:
        sdk = openai.AsyncOpenAI(
            base_url="http://router.test/v1",
            api_key="unused",
            max_retries=0,
            http_client=httpx.AsyncClient(transport=client._transport),  # the in-process router
        )
        done = await sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "go"}], extra_headers={"x-session-id": "sdk"}
        )
        stream = await sdk.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "go"}],
            stream=True,
            extra_body={"prompt_cache_key": "sdk2"},
        )
        parts = [chunk async for chunk in stream]
        lookup = await client.get("/v1/conversations/sdk2")
    assert done.choices[0].finish_reason == "tool_calls"
    assert done.choices[0].message.tool_calls[0].function.arguments == '{"f": "a.txt"}'
    args = "".join(
        tc.function.arguments or "" for p in parts for c in p.choices for tc in (c.delta.tool_calls or [])
    )
    assert args == '{"f": "a.txt"}' and parts[-1].choices[0].finish_reason == "tool_calls"
    assert lookup.status_code == 200  # prompt_cache_key carried the conversation id
    assert all("prompt_cache_key" not in b for b in engines.completions(""))


async def test_completions_ignore_a_stray_messages_field(engines: FakeEngines, make_client) -> None:
    # Found by the fuzz test: the prompt-size and prefix code read `messages` whatever the endpoint.
    async with make_client() as client:
        r = await client.post("/v1/completions", json={"model": "tiny", "messages": None, "prompt": "hi"})
    assert r.status_code == 200, r.text


async def test_count_tokens_goes_to_a_prefill_and_keeps_nothing(engines: FakeEngines, make_client) -> None:
    """Anthropic's token count is a prefill's answer, passed through; bad bodies stop at the router."""
    async with make_client() as client:
        bad = await client.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": []})
        assert_openai_error(bad, 400)
        assert not engines.requests("p", "/v1/messages/count_tokens")
        # The fakes serve no Messages API: the engine's 404 reaches the client as an OpenAI error.
        r = await client.post(
            "/v1/messages/count_tokens",
            json={**GOOD, "conversation_id": "c9"},
            headers={"x-session-id": "c9"},
        )
        assert_openai_error(r, 404)
        sent = [b for b, _ in engines.requests("p", "/v1/messages/count_tokens")]
        assert sent == [GOOD]  # the id fields are the router's, not the engine's
        assert await store_of(client).get("-/c9") is None
