"""End-to-end turns through the real router app against fake engines."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx

from agentkv._wire import OFFER_DECODED_KEY
from agentkv.server.router import RedisStore

from .conftest import FakeEngines, store_of

CHAT = "/v1/chat/completions"
USER1 = [{"role": "user", "content": "list the files"}]


async def chat(
    client: httpx.AsyncClient, messages: list[dict[str, Any]], cid: str | None = "c1", **body: Any
):
    headers = {"x-session-id": cid} if cid else {}
    return await client.post(CHAT, json={"model": "tiny", "messages": messages, **body}, headers=headers)


def next_messages(
    first: list[dict[str, Any]], answer: dict[str, Any], user: str = "and now?"
) -> list[dict[str, Any]]:
    return [*first, answer["choices"][0]["message"], {"role": "user", "content": user}]


def sse_data(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


async def test_first_turn_shapes_both_hops_and_hides_internal_params(
    engines: FakeEngines, make_client
) -> None:
    async with make_client() as client:
        r = await chat(
            client,
            USER1,
            conversation_id="ignored-because-header-wins",
            max_completion_tokens=50,
            stream_options={"include_usage": True},
        )
    assert r.status_code == 200
    assert "kv_transfer_params" not in r.text and "10.9.9" not in r.text
    assert r.headers["x-agentkv-reuse"] == "miss"
    assert r.headers["x-agentkv-path"] == "recompute"
    assert r.headers["x-agentkv-conversation-id"] == "c1"
    assert float(r.headers["x-agentkv-lease-expires-in"]) > 0
    [p_body] = engines.completions("p")
    assert p_body["max_tokens"] == 1 and p_body["max_completion_tokens"] == 1 and p_body["stream"] is False
    assert "stream_options" not in p_body and "conversation_id" not in p_body
    assert p_body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    [d_body] = engines.completions("d")
    assert d_body["kv_transfer_params"]["remote_engine_id"] == "P-ENGINE"  # exactly what P returned
    assert d_body["max_completion_tokens"] == 50 and "conversation_id" not in d_body
    p_rid = engines.requests("p", CHAT)[0][1]["x-request-id"]
    d_rid = engines.requests("d0", CHAT)[0][1]["x-request-id"]
    assert p_rid == d_rid and p_rid.startswith("agentkv-")


async def test_second_turn_sends_decodes_retained_params_to_prefill(
    engines: FakeEngines, make_client
) -> None:
    engines.d_fingerprints = False  # a stock decode, which only a non-exact router pulls from
    async with make_client(exact=False) as client:
        first = (await chat(client, USER1)).json()
        r = await chat(client, next_messages(USER1, first))
    assert r.headers["x-agentkv-reuse"] == "hit" and r.headers["x-agentkv-path"] == "pull"
    retained = next(iter(engines.retained.values()))
    p_params = engines.completions("p")[1]["kv_transfer_params"]
    for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size"):
        assert p_params[key] == retained[key]
    assert p_params["do_remote_decode"] is True and p_params["do_remote_prefill"] is False
    # The sticky decode served both turns.
    assert len(engines.requests("d0", CHAT)) == 2
    # This fake decode sends no token fingerprints (like stock vLLM): only turn 1's prompt may be pulled,
    # not the 3 generated tokens, which can re-tokenize differently when sent back as text; of the prompt,
    # its whole blocks (block size 4 from decode's /metrics), as vLLM's prefix cache would reuse it.
    prompt = retained["remote_num_tokens"] - 3
    whole = prompt - prompt % 4
    assert 0 < whole < prompt  # this fake's prompt ends inside a block
    assert p_params["remote_num_tokens"] == whole
    assert int(r.headers["x-agentkv-reused-tokens"]) == whole
    # ...and the block list ends where those tokens do: a stock prefill end-aligns the list, so a longer
    # one would be read shifted by a block.
    n_blocks = whole // 4
    assert len(retained["remote_block_ids"][0]) > n_blocks
    assert p_params["remote_block_ids"] == [retained["remote_block_ids"][0][:n_blocks]]


async def test_stock_decode_whose_prompt_fills_no_block_is_not_pulled(
    engines: FakeEngines, make_client
) -> None:
    # vLLM's prefix cache reuses whole blocks only: a 6-token prompt offers nothing with 8-token blocks.
    engines.d_fingerprints, engines.block_size = False, 8
    async with make_client(exact=False) as client:
        first = (await chat(client, USER1)).json()
        r = await chat(client, next_messages(USER1, first))
        assert r.status_code == 200
        assert r.headers["x-agentkv-reuse"] != "hit" and r.headers["x-agentkv-reused-tokens"] == "0"
        assert engines.completions("p")[1]["kv_transfer_params"]["remote_block_ids"] is None


async def test_stock_decode_of_unknown_block_size_is_not_pulled(engines: FakeEngines, make_client) -> None:
    # Without decode's block size the router cannot cut the offer's block list to the prompt: no reuse.
    engines.d_fingerprints, engines.block_size = False, None
    async with make_client(exact=False) as client:
        first = (await chat(client, USER1)).json()
        r = await chat(client, next_messages(USER1, first))
        assert r.headers["x-agentkv-reuse"] != "hit" and r.headers["x-agentkv-reused-tokens"] == "0"
        assert engines.completions("p")[1]["kv_transfer_params"]["remote_block_ids"] is None
        assert r.status_code == 200


async def test_exact_mode_keeps_decodes_own_prefix_cache_out(engines: FakeEngines, make_client) -> None:
    async with make_client(exact=True) as client:
        first = (await chat(client, USER1, cache_salt="tenant-a")).json()
        r = await chat(client, next_messages(USER1, first), cache_salt="tenant-a")
    assert r.headers["x-agentkv-reuse"] == "hit"
    # Decode gets a salt no earlier request had, so it loads every prompt token from prefill...
    salts = [b["cache_salt"] for b in engines.completions("d0")]
    assert len(set(salts)) == 2 and "tenant-a" not in salts
    # ... and is told to offer only the prompt's KV, which a prefill computed...
    assert [b["kv_transfer_params"][OFFER_DECODED_KEY] for b in engines.completions("d0")] == [False, False]
    # ... while prefill keeps the client's salt (its own prefix cache holds only prefill-computed KV).
    assert [b["cache_salt"] for b in engines.completions("p")] == ["tenant-a", "tenant-a"]


async def test_default_mode_lets_decode_use_and_offer_its_own_kv(engines: FakeEngines, make_client) -> None:
    # vLLM's prefix-cache semantics: decode serves what it holds from its own cache (no salt of ours; the
    # client's is kept, as a single vLLM server keeps it) and offers its answer's KV for the next pull.
    async with make_client() as client:
        first = (await chat(client, USER1, cache_salt="tenant-a")).json()
        r = await chat(client, next_messages(USER1, first), cache_salt="tenant-a")
    assert r.headers["x-agentkv-reuse"] == "hit"
    assert [b["cache_salt"] for b in engines.completions("d0")] == ["tenant-a", "tenant-a"]
    assert [b["kv_transfer_params"][OFFER_DECODED_KEY] for b in engines.completions("d0")] == [True, True]


async def test_exact_mode_pulls_nothing_from_a_stock_decode(engines: FakeEngines, make_client) -> None:
    engines.d_fingerprints = False  # stock vLLM offers its generated tokens' KV too, which it computed itself
    async with make_client(exact=True) as client:
        first = (await chat(client, USER1)).json()
        r = await chat(client, next_messages(USER1, first))
        assert r.headers["x-agentkv-reuse"] == "miss"
        assert engines.completions("p")[1]["kv_transfer_params"]["remote_block_ids"] is None
    async with make_client(exact=False) as client:
        first = (await chat(client, USER1, cid="c2")).json()
        r = await chat(client, next_messages(USER1, first), cid="c2")
        assert r.headers["x-agentkv-reuse"] == "hit"
        assert all("cache_salt" not in b for b in engines.completions("d")[-2:])


async def test_cached_tokens_from_prefill_decide_hit_or_declined(engines: FakeEngines, make_client) -> None:
    async with make_client() as client:
        first = (await chat(client, USER1)).json()
        engines.p_cached_tokens = 0
        r = await chat(client, next_messages(USER1, first))
        assert r.headers["x-agentkv-reuse"] == "declined"
        engines.p_cached_tokens = 17
        second_messages = next_messages(USER1, first)
        r2 = await chat(client, next_messages(second_messages, r.json()))
        assert r2.headers["x-agentkv-reuse"] == "hit" and r2.headers["x-agentkv-reused-tokens"] == "17"
        metrics = (await client.get("/metrics")).text
    assert 'agentkv_reuse_total{result="declined"} 1.0' in metrics


async def test_no_reuse_when_prefix_was_edited(engines: FakeEngines, make_client) -> None:
    async with make_client() as client:
        first = (await chat(client, USER1)).json()
        edited = next_messages(USER1, first)
        edited[0] = {"role": "user", "content": "list the files, please"}
        r = await chat(client, edited)
        metrics = (await client.get("/metrics")).text
    assert r.headers["x-agentkv-reuse"] == "mismatch" and r.headers["x-agentkv-path"] == "recompute"
    assert engines.completions("p")[1]["kv_transfer_params"]["remote_block_ids"] is None
    assert 'agentkv_reuse_total{result="mismatch"} 1.0' in metrics


async def test_edited_answer_still_reuses_the_prompt_only_when_exact(
    engines: FakeEngines, make_client
) -> None:
    # Exact offers hold the previous prompt's KV alone; a non-exact router also relies on the answer.
    for exact, verdict in ((True, "hit"), (False, "mismatch")):
        async with make_client(exact=exact) as client:
            first = (await chat(client, USER1, cid=f"c-{exact}")).json()
            edited = next_messages(USER1, first)
            edited[1] = {"role": "assistant", "content": "something decode never said"}
            r = await chat(client, edited, cid=f"c-{exact}")
        assert r.headers["x-agentkv-reuse"] == verdict, exact


async def test_round_tripped_assistant_message_still_matches(engines: FakeEngines, make_client) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "ls", "arguments": '{"path": ".", "all": true}'},
    }
    engines.reply = lambda body: {"content": None, "tool_calls": [call], "finish_reason": "tool_calls"}
    async with make_client() as client:
        first = (await chat(client, USER1)).json()
        assert first["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "ls"
        # An SDK re-serialises arguments and sends content "" instead of None: still the same prefix.
        echoed = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "ls", "arguments": '{"all":true,"path":"."}'},
                }
            ],
        }
        r = await chat(
            client, [*USER1, echoed, {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}]
        )
    assert r.headers["x-agentkv-reuse"] == "hit"


async def test_expired_retention_is_not_offered(engines: FakeEngines, make_client) -> None:
    async with make_client() as client:
        first = (await chat(client, USER1)).json()
        store = store_of(client)
        record = await store.get("-/c1")
        # Inside the safety margin counts as expired: P would decline the read anyway.
        await store.compare_and_set(
            "-/c1", dataclasses.replace(record, expires_at=time.time() + 1), expected=record.version
        )
        r = await chat(client, next_messages(USER1, first))
    assert r.headers["x-agentkv-reuse"] == "expired"
    assert engines.completions("p")[1]["kv_transfer_params"]["remote_block_ids"] is None


async def test_decode_restart_voids_old_blocks(engines: FakeEngines, make_client) -> None:
    async with make_client() as client:
        first = (await chat(client, USER1)).json()
        engines.engine_id["d0.test"] = "D0-ENGINE-RESTARTED"
        await client.app.state.router.health.check_once()  # type: ignore[attr-defined]
        r = await chat(client, next_messages(USER1, first))
    assert r.headers["x-agentkv-reuse"] == "expired"
    assert engines.completions("p")[1]["kv_transfer_params"]["remote_block_ids"] is None


async def test_a_decode_reregistration_voids_its_retained_blocks(engines: FakeEngines, make_client) -> None:
    # vLLM >= 0.33 counts NIXL re-registrations (e.g. after sleep) in remote_registration_generation, and
    # our connector's /info reports the same number: a higher one means what decode retained is gone.
    engines.d_generation = 1
    async with make_client() as client:
        first = (await chat(client, USER1)).json()
        engines.d_generation = 2
        await client.app.state.router.health.check_once()  # type: ignore[attr-defined]
        r = await chat(client, next_messages(USER1, first))
        assert r.headers["x-agentkv-reuse"] == "expired"
        assert engines.completions("p")[1]["kv_transfer_params"]["remote_block_ids"] is None
        # A turn retained under generation 2 is reused as usual.
        r2 = await chat(client, next_messages(next_messages(USER1, first), r.json()))
    assert r2.headers["x-agentkv-reuse"] == "hit"
    assert engines.completions("p")[2]["kv_transfer_params"]["remote_registration_generation"] == 2


async def test_vllm_033_stream_params_are_taken_from_the_stream(engines: FakeEngines, make_client) -> None:
    # vLLM >= 0.33's stream shape: "kv_transfer_params" on every chunk, null until the finishing chunk.
    # With our connector on decode the router needs no retention lookup, and P gets all decode returned.
    engines.d_stream_params = True
    engines.d_generation = 1
    engines.reply = lambda body: {"content": "one two"}
    async with make_client() as client:
        r = await chat(client, USER1, stream=True, stream_options={"include_usage": True})
        assert "kv_transfer_params" not in r.text and "remote_block_ids" not in r.text
        # After the role chunk a chat stream opens with, as vLLM's does.
        assert [json.loads(d)["choices"][0]["delta"]["content"] for d in sse_data(r.text)[1:3]] == [
            "one ",
            "two",
        ]
        answer = {"role": "assistant", "content": "one two"}
        r2 = await chat(client, [*USER1, answer, {"role": "user", "content": "more"}], stream=True)
    assert not [path for _h, _m, path, _b, _hd in engines.seen if "/agentkv/v1/retained/" in path]
    assert r2.headers["x-agentkv-reuse"] == "hit"
    sent = engines.completions("p")[1]["kv_transfer_params"]
    retained = engines.retained[next(iter(engines.retained))]
    assert {k: sent[k] for k in retained} == retained  # every key decode returned, generation included


async def test_reuse_off_never_sends_retained_params(engines: FakeEngines, make_client) -> None:
    async with make_client(reuse=False) as client:
        first = (await chat(client, USER1)).json()
        r = await chat(client, next_messages(USER1, first))
    assert r.headers["x-agentkv-path"] == "recompute"
    assert all(b["kv_transfer_params"]["remote_block_ids"] is None for b in engines.completions("p"))
    assert len(engines.completions("d")) == 2  # still P -> D
    # Nobody will come back for the blocks, so they were released at once.
    assert len(engines.released) == 2


async def test_no_conversation_id_serves_without_reuse_and_frees_blocks(
    engines: FakeEngines, make_client
) -> None:
    async with make_client() as client:
        r = await chat(client, USER1, cid=None)
    assert r.headers["x-agentkv-reuse"] == "none"
    assert "x-agentkv-conversation-id" not in r.headers
    assert len(engines.released) == 1


async def test_final_turn_frees_both_turns_blocks_and_forgets_the_conversation(
    engines: FakeEngines, make_client
) -> None:
    async with make_client() as client:
        first = (await chat(client, USER1)).json()
        assert engines.released == []
        messages = next_messages(USER1, first)
        r = await client.post(
            CHAT,
            json={"model": "tiny", "messages": messages},
            headers={"x-session-id": "c1", "x-agentkv-final-turn": "true"},
        )
        assert r.status_code == 200 and r.headers["x-agentkv-reuse"] == "hit"
        assert "x-agentkv-lease-expires-in" not in r.headers  # nothing is kept for a next turn
        assert await store_of(client).get("-/c1") is None
        assert (await client.get("/v1/conversations/c1")).status_code == 404
    # The pull freed the first turn's blocks on decode; the final turn's own blocks are released at once.
    assert len(engines.released) == 1


async def test_final_turn_without_a_pull_releases_the_previous_blocks_too(
    engines: FakeEngines, make_client
) -> None:
    async with make_client() as client:
        await chat(client, USER1)
        # An unrelated history on the same id: no pull, so decode still holds the first turn's blocks.
        other = [{"role": "user", "content": "something else entirely"}]
        r = await client.post(
            CHAT,
            json={"model": "tiny", "messages": other, "stream": True},
            headers={"x-session-id": "c1", "x-agentkv-final-turn": "1"},
        )
        assert r.status_code == 200 and r.headers["x-agentkv-reuse"] == "mismatch"
        assert await store_of(client).get("-/c1") is None
    assert len(engines.released) == 2


async def test_bad_final_turn_header_is_a_400_and_touches_nothing(engines: FakeEngines, make_client) -> None:
    async with make_client() as client:
        r = await client.post(
            CHAT,
            json={"model": "tiny", "messages": USER1},
            headers={"x-session-id": "c1", "x-agentkv-final-turn": "maybe"},
        )
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "x-agentkv-final-turn"
        assert await store_of(client).get("-/c1") is None
    assert engines.completions("p") == [] and engines.completions("d") == []


async def test_streaming_passthrough_then_retention_lookup(engines: FakeEngines, make_client) -> None:
    engines.reply = lambda body: {"content": "one two three"}
    async with make_client() as client:
        r = await chat(client, USER1, stream=True, stream_options={"include_usage": True})
        data = sse_data(r.text)
        assert r.headers["content-type"].startswith("text/event-stream")
        assert data[-1] == "[DONE]"
        words = [json.loads(d)["choices"][0]["delta"].get("content") for d in data[1:4]]  # after the role
        assert words == ["one ", "two ", "three"]
        # vLLM 0.32 streams carry no params: the router asked decode's retention service instead.
        lookups = [path for host, m, path, _b, _h in engines.seen if "/agentkv/v1/retained/" in path]
        assert lookups
        answer = {"role": "assistant", "content": "one two three"}
        r2 = await chat(client, [*USER1, answer, {"role": "user", "content": "more"}], stream=True)
    assert r2.headers["x-agentkv-reuse"] == "hit"
    retained = next(iter(engines.retained.values()))["remote_block_ids"]
    assert engines.completions("p")[1]["kv_transfer_params"]["remote_block_ids"] == retained


async def test_streamed_kv_params_are_stripped_but_learned(engines: FakeEngines, make_client) -> None:
    engines.retention = set()  # stock vLLM >= 0.33: params arrive in the last chunk
    engines.d_stream_params = True
    async with make_client() as client:
        r = await chat(client, USER1, stream=True)
        assert "kv_transfer_params" not in r.text and "remote_block_ids" not in r.text
        answer = {"role": "assistant", "content": "sure, done."}
        r2 = await chat(client, [*USER1, answer, {"role": "user", "content": "more"}])
        lookup = (await client.get("/v1/conversations/c1")).json()
    assert r2.headers["x-agentkv-reuse"] == "hit"
    assert lookup["lease"]["state"] == "fixed_ttl" and lookup["lease"]["renewable"] is False


async def test_stream_is_forwarded_before_decode_finishes(engines: FakeEngines, make_client) -> None:
    """Decode holds its second chunk until the client has seen the first: a buffering router deadlocks."""
    engines.reply = lambda body: {"content": "first second"}
    engines.stream_gate = asyncio.Event()
    async with make_client() as client:
        app = client.app  # type: ignore[attr-defined]
        received: list[bytes] = []

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                received.append(message.get("body", b""))
                if b"first" in b"".join(received):
                    engines.stream_gate.set()

        body = json.dumps({"model": "tiny", "messages": USER1, "stream": True}).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": CHAT,
            "raw_path": CHAT.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "client": ("t", 1),
            "server": ("r", 80),
            "state": {},
        }
        await asyncio.wait_for(app(scope, receive, send), timeout=20)
    assert b"data: [DONE]" in b"".join(received)


async def test_decode_dying_mid_stream_ends_with_error_event_and_done(
    engines: FakeEngines, make_client
) -> None:
    engines.reply = lambda body: {"content": "a b c d"}
    engines.stream_break_after = 2
    async with make_client() as client:
        r = await chat(client, USER1, stream=True)
        data = sse_data(r.text)
        lookup = await client.get("/v1/conversations/c1")
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "stream_interrupted"
    assert len(data) == 2 + 2  # two good chunks, the error, [DONE]
    assert lookup.status_code == 404  # an aborted turn retains nothing


async def test_a_stream_decode_aborted_ends_with_an_error_not_a_finished_answer(
    engines: FakeEngines, make_client
) -> None:
    async with make_client() as client:
        first = (await chat(client, USER1)).json()
        before = await store_of(client).get("-/c1")
        # vLLM on SIGTERM: the stream stops early with finish_reason "abort", then [DONE].
        engines.reply = lambda body: {"content": "half of", "finish_reason": "abort"}
        r = await chat(client, next_messages(USER1, first), stream=True)
        data = sse_data(r.text)
        after = await store_of(client).get("-/c1")
        metrics = (await client.get("/metrics")).text
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["message"] == "decode engine aborted the request"
    assert not any('"abort"' in d for d in data)  # the abort chunk itself never reaches the client
    assert len(data) == 1 + 2 + 2  # the role, the two words, the error, [DONE]
    # The pull consumed the old blocks and the cut-short answer is not remembered as the conversation's.
    assert after is not None and after.retained is None and after.prefix == before.prefix
    assert 'agentkv_backend_errors_total{kind="aborted",role="decode"} 1.0' in metrics


async def test_a_whole_answer_decode_aborted_is_a_502(engines: FakeEngines, make_client) -> None:
    engines.reply = lambda body: {"content": "half of", "finish_reason": "abort"}
    async with make_client() as client:
        r = await chat(client, USER1)
        lookup = await client.get("/v1/conversations/c1")
    assert r.status_code == 502
    assert r.json()["error"] == {
        "message": "decode engine aborted the request",
        "type": "bad_gateway",
        "param": None,
        "code": "upstream_error",
    }
    assert lookup.status_code == 404


async def test_a_conversation_goes_back_to_the_prefill_that_computed_it(
    engines: FakeEngines, make_client
) -> None:
    """Both prefills idle: the next turn goes to the one that computed the last prompt (vLLM's prefix cache
    there may still hold it), not to the one used least; a new conversation still spreads to the other."""
    async with make_client() as client:
        first = (await chat(client, USER1)).json()
        second = await chat(client, next_messages(USER1, first))
        await chat(client, USER1, cid="c2")
    assert second.headers["x-agentkv-reuse"] == "hit"
    prefills = [host for host, method, *_ in engines.seen if method == "POST" and host.startswith("p")]
    assert prefills == ["p0.test", "p0.test", "p1.test"]


async def test_prefill_down_fails_over_to_other_prefill(engines: FakeEngines, make_client) -> None:
    engines.down.add("p0.test")
    async with make_client(health_interval_s=5) as client:
        r = await chat(client, USER1)
        health = (await client.get("/health")).json()
    assert r.status_code == 200
    assert len(engines.completions("p1")) == 1
    assert health == {"status": "ok", "prefill": 1, "decode": 2}


async def test_decode_down_picks_another_decode_and_loses_reuse_once(
    engines: FakeEngines, make_client
) -> None:
    async with make_client(health_interval_s=5) as client:
        first = (await chat(client, USER1)).json()
        engines.down.add("d0.test")
        second = await chat(client, next_messages(USER1, first))
        third = await chat(client, next_messages(next_messages(USER1, first), second.json(), "again"))
        health = (await client.get("/health")).json()
    assert second.status_code == 200 and len(engines.completions("d1")) == 2
    assert health["decode"] == 1  # the failed connect took d0 out until a health check brings it back
    # The conversation moved to d1, which now holds its blocks.
    assert third.headers["x-agentkv-reuse"] == "hit"
    assert engines.completions("p")[2]["kv_transfer_params"]["remote_engine_id"] == "D1-ENGINE"


async def test_all_prefills_down_is_503(engines: FakeEngines, make_client) -> None:
    engines.down |= {"p0.test", "p1.test"}
    async with make_client() as client:
        r = await chat(client, USER1)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


async def test_engine_4xx_passes_through_sanitised_and_5xx_is_502(engines: FakeEngines, make_client) -> None:
    engines.status["p0.test"] = (
        400,
        {
            "error": {
                "message": "too long",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
                "remote_host": "10.9.9.1",
            }
        },
    )
    engines.status["p1.test"] = (400, engines.status["p0.test"][1])
    async with make_client() as client:
        r = await chat(client, USER1)
        assert r.status_code == 400
        assert r.json() == {
            "error": {"message": "too long", "type": "BadRequestError", "param": None, "code": 400}
        }
        engines.status = {
            "p0.test": (500, {"detail": "Traceback (most recent call last)"}),
            "p1.test": (500, {"detail": "boom"}),
        }
        r = await chat(client, USER1)
    assert r.status_code == 502 and "Traceback" not in r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


async def test_decode_local_path_skips_prefill(engines: FakeEngines, make_client) -> None:
    # Decode (with our connector) holds more than the next prompt: the reuse reported is capped by it.
    engines.d_generated_tokens = 10_000
    async with make_client(path_policy="always-local", exact=False) as client:
        cold = await chat(client, USER1)
        first = cold.json()
        r = await chat(client, next_messages(USER1, first))
    # The cold turn too: decode computes the whole prompt and retains it, reusing nothing.
    assert (cold.headers["x-agentkv-path"], cold.headers["x-agentkv-reuse"]) == ("decode-local", "miss")
    assert cold.headers["x-agentkv-reused-tokens"] == "0"
    assert r.headers["x-agentkv-path"] == "decode-local" and r.headers["x-agentkv-reuse"] == "local"
    assert 0 < int(r.headers["x-agentkv-reused-tokens"]) <= r.json()["usage"]["prompt_tokens"]
    assert engines.completions("p") == []
    assert engines.completions("d0")[1]["kv_transfer_params"] == {
        "agentkv_retain": True,
        OFFER_DECODED_KEY: True,
    }
    # The previous turn's blocks are superseded by this turn's: released, not left pinned.
    assert len(engines.released) == 1


async def test_concurrent_turns_of_one_conversation_are_serialised(engines: FakeEngines, make_client) -> None:
    engines.reply = lambda body: {"content": "x y"}
    engines.stream_gate = asyncio.Event()
    async with make_client() as client:
        first = asyncio.create_task(chat(client, USER1, stream=True))
        while not engines.completions("d"):
            await asyncio.sleep(0)
        second = asyncio.create_task(chat(client, USER1))
        for _ in range(50):
            await asyncio.sleep(0)
        # The second turn has not reached prefill while the first still streams.
        assert len(engines.completions("p")) == 1
        engines.stream_gate.set()
        await asyncio.gather(first, second)
    assert len(engines.completions("p")) == 2


async def test_decode_local_falls_back_to_prefill_when_sticky_decode_is_gone(
    engines: FakeEngines, make_client
) -> None:
    async with make_client(path_policy="always-local", exact=False) as client:
        first = (await chat(client, USER1)).json()
        engines.down.add("d0.test")
        r = await chat(client, next_messages(USER1, first))
    assert r.status_code == 200
    assert r.headers["x-agentkv-path"] == "recompute" and r.headers["x-agentkv-reuse"] == "miss"
    # The cold turn ran on d0 alone (always-local); the fallback is prefill's only turn.
    assert len(engines.completions("p")) == 1 and len(engines.completions("d1")) == 1


async def test_failed_pull_forgets_the_consumed_blocks(engines: FakeEngines, make_client) -> None:
    async with make_client() as client:
        first = (await chat(client, USER1)).json()
        engines.status = {"p0.test": (500, {}), "p1.test": (500, {})}
        r = await chat(client, next_messages(USER1, first))
        lookup = (await client.get("/v1/conversations/c1")).json()
    assert r.status_code == 502
    assert lookup["lease"]["state"] == "none"  # never offered to P a second time


async def test_lock_timeout_proceeds_without_reuse(engines: FakeEngines, make_client) -> None:
    async with make_client(conversation_lock_timeout_s=0) as client:
        first = (await chat(client, USER1)).json()
        async with store_of(client).lock("-/c1", timeout=1):
            r = await chat(client, next_messages(USER1, first))
    assert r.status_code == 200 and r.headers["x-agentkv-reuse"] == "miss"
    assert engines.completions("p")[1]["kv_transfer_params"]["remote_block_ids"] is None


async def test_decode_going_quiet_mid_stream_ends_the_stream(engines: FakeEngines, make_client) -> None:
    engines.reply = lambda body: {"content": "a b"}
    engines.stream_gate = asyncio.Event()  # never set: decode stalls after its first chunk
    async with make_client(timeouts={"decode_idle_s": 0.05}) as client:
        r = await chat(client, USER1, stream=True)
    data = sse_data(r.text)
    assert json.loads(data[1])["choices"][0]["delta"]["content"] == "a "  # after the role
    assert "idle" in json.loads(data[-2])["error"]["message"] and data[-1] == "[DONE]"


async def test_prefill_timeout_is_504(engines: FakeEngines, make_client) -> None:
    handle = engines.handle

    async def slow(request: httpx.Request) -> httpx.Response:
        if request.url.host.startswith("p") and request.url.path == CHAT:
            await asyncio.Event().wait()
        return await handle(request)

    engines.handle = slow  # type: ignore[method-assign]
    async with make_client(timeouts={"prefill_s": 0.05}) as client:
        r = await chat(client, USER1)
    assert r.status_code == 504 and r.json()["error"]["type"] == "gateway_timeout"


async def test_unreachable_store_serves_the_turn_without_reuse(engines: FakeEngines, make_client) -> None:
    from agentkv.server.router import MemoryStore
    from agentkv.server.router._store import StoreUnavailableError

    class DownStore(MemoryStore):
        async def get(self, key: str):  # type: ignore[no-untyped-def]
            raise StoreUnavailableError("redis is restarting")

    async with make_client(store=DownStore()) as client:
        r = await chat(client, USER1)
        assert r.status_code == 200  # a recompute, not an error
        assert r.headers["x-agentkv-reuse"] == "miss"
        lookup = await client.get("/v1/conversations/c1")
        assert lookup.status_code == 503 and lookup.json()["error"]["message"]


async def test_service_token_goes_to_every_lease_call_and_nowhere_else(
    engines: FakeEngines, make_client, monkeypatch
) -> None:
    monkeypatch.setenv("AGENTKV_SERVICE_TOKEN", "s3cret")  # the name the engines read it from
    engines.reply = lambda body: {"content": "a b"}
    async with make_client() as client:
        first = (await chat(client, USER1, stream=True)).text  # a stream: the router looks the lease up
        assert "[DONE]" in first
        await client.post("/v1/conversations/c1/heartbeat")
        await client.delete("/v1/conversations/c1")
    control = [(h, p) for host, _m, p, _b, h in engines.seen if ":9200" in str(h.get("host", ""))]
    assert {p.split("/")[3] for _h, p in control} >= {"info", "retained", "leases"}
    assert all(h.get("authorization") == "Bearer s3cret" for h, _p in control)
    hops = [h for host, _m, p, _b, h in engines.seen if p.startswith("/v1/")]
    assert hops and all("authorization" not in h for h in hops)


async def test_a_refused_token_makes_decode_look_stock_and_says_so_once(
    engines: FakeEngines, make_client, caplog
) -> None:
    real = engines._control

    def refuse(host: str, method: str, path: str, body: Any) -> httpx.Response:
        return (
            httpx.Response(401, json={"error": "unauthorized"})
            if host == "d0.test"
            else real(host, method, path, body)
        )

    engines._control = refuse  # type: ignore[method-assign]
    async with make_client() as client:
        router = client.app.state.router  # type: ignore[attr-defined]
        d0 = router.decode.get("d0")
        for _ in range(3):
            assert await router.leases.probe(d0) is False
    assert sum("set AGENTKV_SERVICE_TOKEN" in r.getMessage() for r in caplog.records) == 1


STALL = [{"role": "user", "content": "stall here"}]


class StalledPrefills:
    """Holds the prefill requests of conversations whose message says "stall" (on ``path`` only, when
    given). Made before the router's client, whose transport takes the engines' handler when it is built;
    ``async with stalls.holding(client)`` starts one such conversation per prefill, waits until both
    prefills hold one, and lets them go at the end."""

    def __init__(self, engines: FakeEngines, *, path: str | None = None) -> None:
        self.hosts: list[str] = []
        self._gate = asyncio.Event()
        handle = engines.handle

        async def stalled(request: httpx.Request) -> httpx.Response:
            on_path = path is None or request.url.path.endswith(path)
            if request.url.host.startswith("p") and on_path and b"stall" in request.content:
                self.hosts.append(request.url.host)
                await self._gate.wait()
            return await handle(request)

        engines.handle = stalled  # type: ignore[method-assign]

    @contextlib.asynccontextmanager
    async def holding(self, client: httpx.AsyncClient) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(chat(client, STALL, cid=f"s{i}")) for i in range(2)]
        while len(self.hosts) < 2:
            await asyncio.sleep(0.01)
        assert sorted(self.hosts) == ["p0.test", "p1.test"]
        try:
            yield
        finally:
            self._gate.set()
            await asyncio.gather(*tasks)


async def test_a_saturated_prefill_sends_a_cold_turn_to_decode(engines: FakeEngines, make_client) -> None:
    """Conditional disaggregation: with both prefills at the queue cap, a new conversation's first turn is
    prefilled on decode (no P hop) and retained there; once prefill drains, turns take P again."""
    stalls = StalledPrefills(engines)
    async with make_client(path_policy="auto", prefill_queue_cap=1, exact=False) as client:
        async with stalls.holding(client):
            busy = await chat(client, USER1, cid="c1")
        calm = await chat(client, USER1, cid="c2")
        metrics = (await client.get("/metrics")).text
    assert busy.status_code == 200
    assert (busy.headers["x-agentkv-path"], busy.headers["x-agentkv-reuse"]) == ("decode-local", "miss")
    assert busy.headers["x-agentkv-lease-expires-in"]  # decode retained the prompt it computed
    assert [c["messages"] for c in engines.completions("p")].count(USER1) == 1  # the calm turn's
    assert calm.headers["x-agentkv-path"] == "recompute"
    assert "agentkv_prefill_busy_total 1.0" in metrics


async def test_router_replicas_on_redis_share_the_prefill_load(
    engines: FakeEngines, make_client, redis_url: str
) -> None:
    """Replicas on one Redis see each other's P hops: with both prefills at the cap through replica A,
    replica B prefills a cold turn on decode; a replica on its own store (the counterfactual) does not, and
    once A's hops end B's turns take P again."""
    stalls = StalledPrefills(engines)
    prefix = f"test-{uuid.uuid4().hex}:"
    settings = {"path_policy": "auto", "prefill_queue_cap": 1, "exact": False}
    a = make_client(store=RedisStore(url=redis_url, prefix=prefix), **settings)
    b = make_client(store=RedisStore(url=redis_url, prefix=prefix), **settings)
    alone = make_client(**settings)
    async with a, b, alone:
        async with stalls.holding(a):
            busy = await chat(b, USER1, cid="c1")
            unaware = await chat(alone, USER1, cid="c1")
        calm = await chat(b, USER1, cid="c2")
        metrics = (await b.get("/metrics")).text
        left = await store_of(b).prefilling(["p0", "p1"])
    assert (busy.headers["x-agentkv-path"], unaware.headers["x-agentkv-path"]) == (
        "decode-local",
        "recompute",
    )
    assert calm.headers["x-agentkv-path"] == "recompute"
    assert "agentkv_prefill_busy_total 1.0" in metrics
    assert left == {"p0": 0, "p1": 0}


async def test_a_turn_cancelled_mid_prefill_leaves_no_shared_count(
    engines: FakeEngines, make_client, redis_url: str
) -> None:
    stalls = StalledPrefills(engines)
    store = RedisStore(url=redis_url, prefix=f"test-{uuid.uuid4().hex}:")
    async with make_client(store=store, path_policy="auto", prefill_queue_cap=1, exact=False) as client:
        turn = asyncio.create_task(chat(client, STALL, cid="s0"))
        while not stalls.hosts:
            await asyncio.sleep(0.01)
        assert sum((await store.prefilling(["p0", "p1"])).values()) == 1
        turn.cancel()  # the client went away while prefill computed
        with contextlib.suppress(asyncio.CancelledError):
            await turn
        # The entry is removed by a task of its own that outlives the cancelled turn: waited for (60 s is
        # a bound for a starved host; its deadline, counted on the same clock, is the prefill timeout).
        deadline = time.monotonic() + 60
        while sum((await store.prefilling(["p0", "p1"])).values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert await store.prefilling(["p0", "p1"]) == {"p0": 0, "p1": 0}


async def test_a_dead_replicas_prefill_hops_stop_counting_at_their_deadline(redis_url: str) -> None:
    now = [1_000.0]  # the store's epoch clock, moved by the test: no verdict rests on real time passing
    store = RedisStore(url=redis_url, prefix=f"test-{uuid.uuid4().hex}:", clock=lambda: now[0])
    try:
        await store.prefill_started("p0", "dead", until=now[0] + 0.3)
        await store.prefill_started("p0", "live", until=now[0] + 60)
        assert await store.prefilling(["p0", "p1"]) == {"p0": 2, "p1": 0}
        now[0] += 0.4
        assert await store.prefilling(["p0"]) == {"p0": 1}
        await store.prefill_ended("p0", "live")
        assert await store.prefilling(["p0"]) == {"p0": 0}
    finally:
        await store.aclose()


async def test_a_streamed_decode_local_turn_reports_what_decode_held(
    engines: FakeEngines, make_client
) -> None:
    """A stream's headers leave before decode's usage: they carry what decode holds of the prompt, as the
    JSON answer of the same turn does."""
    async with make_client(path_policy="always-local", exact=False) as client:
        answers = {}
        for cid, stream in (("c1", True), ("c2", False)):
            first = (await chat(client, USER1, cid=cid)).json()
            answers[cid] = await chat(client, next_messages(USER1, first), cid=cid, stream=stream)
    streamed, whole = answers["c1"], answers["c2"]
    assert (
        streamed.headers["x-agentkv-path"] == "decode-local"
        and streamed.headers["x-agentkv-reuse"] == "local"
    )
    assert (
        int(streamed.headers["x-agentkv-reused-tokens"]) == int(whole.headers["x-agentkv-reused-tokens"]) > 0
    )


async def test_renders_in_flight_do_not_make_a_prefill_busy(engines: FakeEngines, make_client) -> None:
    """Renders run on prefill's API server, not its engine: two stalled renders leave the cap unreached."""
    engines.renders = True
    stalls = StalledPrefills(engines, path="/render")
    settings = {"path_policy": "auto", "prefill_queue_cap": 1, "exact": False, "tokens": True}
    async with make_client(**settings) as client, stalls.holding(client):
        r = await chat(client, USER1, cid="c1")
    assert r.headers["x-agentkv-path"] == "recompute"
