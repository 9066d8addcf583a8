"""The router's token path against fake engines: render once, tokens to prefill, ids to decode, reuse
checked on token ids; and `TokenPrefix`, the fingerprint of what decode holds."""

from __future__ import annotations

from array import array
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv._wire import (
    MESSAGES_CUT_KEY,
    PACKED_IDS_KEY,
    PREFILL_TOKEN_KEY,
    asked_logprobs,
    decode_body,
    pack_ids,
    prefill_logprobs,
    prefill_token,
    rendered_request,
    token_prefill,
    unpack_ids,
)
from agentkv.server.router._store import ConversationRecord
from agentkv.server.router._tokens import TokenPrefix

from .conftest import FakeEngines, render_ids, store_of

CHAT = "/v1/chat/completions"
RENDER = "/v1/chat/completions/render"
CMPL = "/v1/completions"
GENERATE = "/inference/v1/generate"
USER1 = [{"role": "user", "content": "list the files"}]
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]


async def chat(client: httpx.AsyncClient, messages: list[dict[str, Any]], **body: Any) -> httpx.Response:
    return await client.post(
        CHAT, json={"model": "tiny", "messages": messages, **body}, headers={"x-session-id": "c1"}
    )


def then(first: list[dict[str, Any]], r: httpx.Response) -> list[dict[str, Any]]:
    return [*first, r.json()["choices"][0]["message"], {"role": "tool", "content": "a.txt b.txt"}]


async def test_a_turn_is_rendered_once_prefill_takes_ids_and_decode_gets_them(
    engines: FakeEngines, make_client
) -> None:
    engines.renders = True
    async with make_client(tokens=True) as client:
        r1 = await chat(client, USER1, max_tokens=20)
        r2 = await chat(client, then(USER1, r1), max_tokens=20)
        record = await store_of(client).get("-/c1")
    assert r1.status_code == r2.status_code == 200
    assert float(r1.headers["x-agentkv-render-ms"]) >= 0
    assert (r1.headers["x-agentkv-reuse"], r2.headers["x-agentkv-reuse"]) == ("miss", "hit")
    renders = [b for b, _ in engines.requests("p", RENDER)]
    prefills = [b for b, _ in engines.requests("p", GENERATE)]
    assert len(renders) == len(prefills) == 2 and not engines.requests("p", CHAT)
    assert not engines.requests("p", CMPL)  # 0.32: the generate route, which keeps kv_transfer_params
    ids2 = render_ids(renders[1])
    assert prefills[1]["token_ids"] == ids2 and prefills[1]["model"] == "tiny"
    assert prefills[1]["sampling_params"]["max_tokens"] == 1 and prefills[1]["stream"] is False
    assert prefills[1]["sampling_params"]["detokenize"] is False  # its one token is thrown away
    assert prefills[1]["kv_transfer_params"]["remote_engine_id"] == "D0-ENGINE"  # decode's retained params
    assert prefills[0]["kv_transfer_params"]["remote_block_ids"] is None
    assert not engines.requests("d", RENDER)
    d_bodies = engines.completions("d")
    assert d_bodies[1]["kv_transfer_params"]["prompt_token_ids"] == ids2
    assert d_bodies[1]["kv_transfer_params"]["remote_engine_id"] == "P-ENGINE"
    assert d_bodies[1]["max_tokens"] == 20  # the client's body, not the prefill's
    assert "prompt_token_ids" not in r2.text
    assert record.tokens is not None and record.prefix is None  # the ids are the check now


async def test_decode_before_0_32_is_not_sent_ids_it_would_ignore(engines: FakeEngines, make_client) -> None:
    engines.renders, engines.version = True, "0.26.0"
    async with make_client(tokens=True) as client:
        r = await chat(client, USER1)
    assert r.status_code == 200
    [d_body] = engines.completions("d")
    assert "prompt_token_ids" not in d_body["kv_transfer_params"]
    # Prefill still takes tokens: an id prompt on /v1/completions (0.26's generate route drops the params).
    [p_body] = [b for b, _ in engines.requests("p", CMPL)]
    assert p_body["prompt"] == render_ids(engines.requests("p", RENDER)[0][0]) and p_body["max_tokens"] == 1
    assert not engines.requests("p", GENERATE)


async def test_decode_before_0_32_with_agentkvs_plugin_is_sent_the_ids(
    engines: FakeEngines, make_client
) -> None:
    """Its retention service says the API server takes them (`AGENTKV_FORWARDED_IDS`)."""
    engines.renders, engines.version, engines.d_forwarded_ids = True, "0.26.0", True
    async with make_client(tokens=True) as client:
        r = await chat(client, USER1)
    assert r.status_code == 200
    [d_body] = engines.completions("d")
    assert d_body["kv_transfer_params"]["prompt_token_ids"] == render_ids(engines.requests("p", RENDER)[0][0])


@pytest.mark.parametrize("version", ["0.26.0", "0.32.0"])
async def test_decode_whose_plugin_reads_packed_ids_is_sent_them_packed(
    engines: FakeEngines, make_client, version: str
) -> None:
    """One base64 string instead of a list of numbers, on every decode hop (P/D and decode-local); the
    messages still ride along, so a decode that read neither form would render them."""
    engines.renders, engines.version = True, version
    engines.d_forwarded_ids = engines.d_packed_ids = True
    async with make_client(tokens=True) as client:
        r1 = await chat(client, USER1, max_tokens=20)
        r2 = await chat(client, then(USER1, r1), max_tokens=20)
    assert r1.status_code == r2.status_code == 200
    renders = [b for b, _ in engines.requests("p", RENDER)]
    for body, render in zip(engines.completions("d"), renders, strict=True):
        params = body["kv_transfer_params"]
        assert "prompt_token_ids" not in params
        assert unpack_ids(params[PACKED_IDS_KEY]).tolist() == render_ids(render)
        assert body["messages"]


async def test_decode_that_takes_cut_messages_gets_the_last_one_beside_the_packed_ids(
    engines: FakeEngines, make_client
) -> None:
    """Decode validates every message it is sent and renders none of them: a decode whose plugin says it
    takes a cut body gets the last message (and the marker that makes it refuse to render it)."""
    engines.renders, engines.version = True, "0.26.0"
    engines.d_forwarded_ids = engines.d_packed_ids = engines.d_messages_cut = True
    async with make_client(tokens=True) as client:
        r1 = await chat(client, USER1, max_tokens=20)
        history = then(USER1, r1)
        r2 = await chat(client, history, max_tokens=20)
        r3 = await chat(client, [*history, {"role": "user", "content": "again"}], echo=True)
    assert r1.status_code == r2.status_code == r3.status_code == 200
    first, second, echoed = engines.completions("d")
    assert first["messages"] == USER1 and MESSAGES_CUT_KEY not in first["kv_transfer_params"]  # one message
    assert second["messages"] == history[-1:] and second["kv_transfer_params"][MESSAGES_CUT_KEY] is True
    assert unpack_ids(second["kv_transfer_params"][PACKED_IDS_KEY]).tolist() == render_ids(
        engines.requests("p", RENDER)[1][0]
    )
    # An echo is rendered from the messages on decode: the body goes whole.
    assert (
        len(echoed["messages"]) == len(history) + 1 and MESSAGES_CUT_KEY not in echoed["kv_transfer_params"]
    )


async def test_a_decode_without_the_capability_and_a_failover_decode_get_the_whole_conversation(
    engines: FakeEngines, make_client
) -> None:
    engines.renders, engines.version = True, "0.26.0"
    engines.d_forwarded_ids = engines.d_packed_ids = True  # packed, but no word on cut bodies
    history = [{"role": "system", "content": "be brief"}, *USER1]
    async with make_client(tokens=True) as client:
        assert (await chat(client, history)).status_code == 200
    [whole] = engines.completions("d")
    assert whole["messages"] == history and MESSAGES_CUT_KEY not in whole["kv_transfer_params"]

    engines.seen.clear()
    engines.d_messages_cut = True
    async with make_client(tokens=True, cut_messages=False) as client:  # the router's own setting
        assert (await chat(client, history)).status_code == 200
    [whole] = engines.completions("d")
    assert whole["messages"] == history and MESSAGES_CUT_KEY not in whole["kv_transfer_params"]

    engines.seen.clear()
    engines.refuse_completions.add("d0.test")  # its service answers; its hop fails to connect
    async with make_client(tokens=True) as client:
        r = await chat(client, history)
    assert r.status_code == 200
    hops = [
        (host, body) for host, _m, path, body, _h in engines.seen if host.startswith("d") and path == CHAT
    ]
    assert [host for host, _ in hops] == ["d0.test", "d1.test"]
    (_, cut), (_, failover) = hops
    assert cut["messages"] == history[-1:] and cut["kv_transfer_params"][MESSAGES_CUT_KEY] is True
    assert failover["messages"] == history and MESSAGES_CUT_KEY not in failover["kv_transfer_params"]


async def test_tools_added_is_a_mismatch_on_token_ids_where_messages_still_match(
    engines: FakeEngines, make_client
) -> None:
    """The messages extend the last turn's, but the tools render at the top of the prompt: decode's blocks
    hold KV of other tokens. The message guard cannot see it; the token check can."""
    engines.renders = True
    for tokens, verdict in ((True, "mismatch"), (False, "hit")):
        engines.seen.clear()
        async with make_client(tokens=tokens) as client:
            r1 = await chat(client, USER1)
            r2 = await chat(client, then(USER1, r1), tools=TOOLS)
        assert r2.headers["x-agentkv-reuse"] == verdict, tokens
        p_bodies = [b for path in (CHAT, GENERATE) for b, _ in engines.requests("p", path)]
        p_params = [b["kv_transfer_params"] for b in p_bodies]
        sent_retained = any(p.get("remote_engine_id") == "D0-ENGINE" for p in p_params)
        assert sent_retained is (verdict == "hit")


async def test_same_tools_on_both_turns_still_reuse(engines: FakeEngines, make_client) -> None:
    engines.renders = True
    async with make_client(tokens=True) as client:
        r1 = await chat(client, USER1, tools=TOOLS)
        r2 = await chat(client, then(USER1, r1), tools=TOOLS)
    assert r2.headers["x-agentkv-reuse"] == "hit"


async def test_a_conversation_is_rendered_and_prefilled_where_its_last_prompt_was_computed(
    engines: FakeEngines, make_client
) -> None:
    """Both prefills idle: turn 2's render and prefill go back to turn 1's prefill (its prefix and tokenizer
    caches hold the conversation), not to the one used least."""
    engines.renders = True
    async with make_client(tokens=True) as client:
        r1 = await chat(client, USER1)
        await chat(client, then(USER1, r1))
    hosts = [host for host, method, path, *_ in engines.seen if method == "POST" and host.startswith("p")]
    assert hosts == ["p0.test"] * 4, hosts  # render + prefill, twice


async def test_engines_without_the_render_api_are_served_text_and_not_asked_again(
    engines: FakeEngines, make_client
) -> None:
    async with make_client(tokens=True) as client:
        r1 = await chat(client, USER1)
        r2 = await chat(client, then(USER1, r1))
    assert r1.status_code == r2.status_code == 200
    assert "x-agentkv-render-ms" not in r1.headers
    assert r2.headers["x-agentkv-reuse"] == "hit"  # the message guard, as before
    # One refused render per prefill that was tried, then text only.
    assert len(engines.requests("p", RENDER)) == 2
    assert len(engines.requests("p", CHAT)) == 2
    assert not engines.requests("p", CMPL) and not engines.requests("p", GENERATE)


async def test_a_body_the_renderer_rejects_is_the_clients_400_and_stores_nothing(
    engines: FakeEngines, make_client
) -> None:
    engines.renders = True
    engines.status["p0.test"] = (400, {"error": {"message": "bad tool schema", "type": "BadRequestError"}})
    engines.status["p1.test"] = engines.status["p0.test"]
    async with make_client(tokens=True) as client:
        r = await chat(client, USER1, tools=[{"type": "function"}])
        record = await store_of(client).get("-/c1")
    assert r.status_code == 400 and "bad tool schema" in r.text
    assert record is None and not engines.completions("d")


def test_token_prefix_is_extended_only_by_the_same_ids_plus_more() -> None:
    prompt = list(range(100, 140))
    exact = TokenPrefix.of(prompt, offered=39, exact=True)
    loose = TokenPrefix.of(prompt, offered=39, exact=False)
    assert exact is not None and loose is not None and exact.held == loose.held == 39
    assert exact.extended_by([*prompt, 7]) and loose.extended_by([*prompt, 7])
    # A regenerate does not extend the prompt in exact mode (its whole blocks may still match, see
    # test_block_digests.py).
    assert not exact.extended_by(prompt) and loose.extended_by(prompt)
    edited = [*prompt, 7]
    edited[3] = 5
    assert not exact.extended_by(edited) and not loose.extended_by(edited)
    assert not loose.extended_by(prompt[:39])  # adds nothing
    assert TokenPrefix.of(prompt, offered=0, exact=True) is None
    assert TokenPrefix.of([2**33], offered=1, exact=False) is None
    # An offer beyond the prompt (decode's own tokens) is covered up to the prompt only.
    assert TokenPrefix.of(prompt, offered=90, exact=False).held == 40  # type: ignore[union-attr]


@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=60),
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20),
    st.data(),
)
def test_token_prefix_property(prompt: list[int], suffix: list[int], data: st.DataObject) -> None:
    held = TokenPrefix.of(prompt, offered=len(prompt), exact=True)
    assert held is not None and held.extended_by(prompt + suffix)
    i = data.draw(st.integers(0, len(prompt) - 1))
    changed = list(prompt)
    changed[i] = (changed[i] + 1) % 2**32
    assert not held.extended_by(changed + suffix)


@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=60),
    st.lists(st.integers(0, 2**32 - 1), max_size=20),
    st.integers(1, 80),
)
def test_a_turns_id_array_fingerprints_and_packs_as_its_list_does(
    prompt: list[int], suffix: list[int], offered: int
) -> None:
    """The router hashes and packs a turn's ids from their uint32 array; records written from the list (by
    another replica, or before) must still match, and decode must read the same ids."""
    ids = array("I", prompt)
    assert TokenPrefix.of(ids, offered=offered, exact=False) == TokenPrefix.of(
        prompt, offered=offered, exact=False
    )
    held = TokenPrefix.of(prompt, offered=offered, exact=False)
    assert held is not None
    longer = [*prompt, *suffix]
    assert held.extended_by(array("I", longer)) == held.extended_by(longer)
    assert pack_ids(ids) == pack_ids(prompt)
    assert unpack_ids(pack_ids(ids)).tolist() == prompt


def test_records_round_trip_the_token_fingerprint() -> None:
    held = TokenPrefix.of([1, 2, 3, 4], offered=3, exact=True)
    record = ConversationRecord(decode="d0", request_id="r", tokens=held, prefill="p1")
    assert ConversationRecord.from_json(record.to_json()) == record
    # Written before the fields existed:
    old = {k: v for k, v in record.to_json().items() if k not in ("tokens", "prefill")}
    assert ConversationRecord.from_json(old).tokens is None
    assert ConversationRecord.from_json(old).prefill is None


def test_token_prefill_asks_for_one_token_from_the_ids_on_either_route() -> None:
    answer = rendered_request(
        {"token_ids": [5, 6], "sampling_params": {"max_tokens": 50}, "stream": True, "cache_salt": "s1"}
    )
    assert answer is not None
    rendered, ids = answer
    assert list(ids) == [5, 6] and ids.typecode == "I"
    params = {"do_remote_decode": True}
    assert token_prefill(rendered, model="tiny", kv_params=params, generate=False) == (
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": [5, 6],
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
            "cache_salt": "s1",
        },
    )
    assert token_prefill(rendered, model="tiny", kv_params=params, generate=True) == (
        "/inference/v1/generate",
        {
            "model": "tiny",
            "token_ids": [5, 6],
            "sampling_params": {"max_tokens": 1, "temperature": 0, "detokenize": False},
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
            "cache_salt": "s1",
        },
    )
    assert rendered_request([rendered, rendered]) is None  # several prompts: the text path
    assert rendered_request({"token_ids": [1, -2], "sampling_params": {}}) is None
    assert rendered_request({"token_ids": [1, 2**32], "sampling_params": {}}) is None
    assert rendered_request({"token_ids": [1, 2.0], "sampling_params": {}}) is None
    assert rendered_request({"token_ids": [1, "2"], "sampling_params": {}}) is None
    assert rendered_request({"token_ids": [], "sampling_params": {}}) is None
    assert rendered_request({"token_ids": [1], "sampling_params": {}, "features": {"mm": 1}}) is None


async def test_a_decode_without_a_version_gets_no_ids_and_is_asked_once(
    engines: FakeEngines, make_client
) -> None:
    engines.renders, engines.version = True, "not-a-version"
    async with make_client(tokens=True) as client:
        r1 = await chat(client, USER1)
        await chat(client, then(USER1, r1))
    assert all("prompt_token_ids" not in b["kv_transfer_params"] for b in engines.completions("d"))
    assert len(engines.requests("d0", "/version")) == 1
    # Prefill asked once too, and an unknown release gets the route every release has.
    assert len(engines.requests("p0", "/version")) == 1 and len(engines.requests("p", CMPL)) == 2


def _prefill_routes(engines: FakeEngines) -> dict[str, list[str]]:
    """Each prefill's token-path hops in order."""
    routes: dict[str, list[str]] = {}
    for host, _m, path, _b, _h in engines.seen:
        if host.startswith("p") and path in (GENERATE, CMPL):
            routes.setdefault(host, []).append(path)
    return routes


async def test_a_prefill_whose_generate_route_refuses_the_body_is_sent_id_prompts_from_then_on(
    engines: FakeEngines, make_client
) -> None:
    """A release whose generate route takes other fields than 0.32's (400): the turn is served on the
    completions route at once, and later turns go there directly."""
    engines.renders = True
    engines.prefill_refuses[GENERATE] = (400, "extra fields not permitted")
    engines.down.add("p1.test")  # one prefill, so every turn meets the one that learned
    async with make_client(tokens=True) as client:
        r1 = await chat(client, USER1)
        r2 = await chat(client, then(USER1, r1))
    assert r1.status_code == r2.status_code == 200
    assert (r1.headers["x-agentkv-reuse"], r2.headers["x-agentkv-reuse"]) == ("miss", "hit")
    assert _prefill_routes(engines) == {
        "p0.test": [GENERATE, CMPL, CMPL]
    }  # failed over to nothing, remembered


async def test_a_client_error_on_both_routes_is_the_clients_and_keeps_the_generate_route(
    engines: FakeEngines, make_client
) -> None:
    """A prompt both routes refuse (400) is the client's error: nothing stored, and the generate route is not
    given up for it."""
    engines.renders = True
    engines.down.add("p1.test")
    for route in (GENERATE, CMPL):
        engines.prefill_refuses[route] = (400, "prompt too long")
    async with make_client(tokens=True) as client:
        r = await chat(client, USER1)
        record = await store_of(client).get("-/c1")
        assert r.status_code == 400 and "prompt too long" in r.text, r.text
        assert record is None and not engines.completions("d")
        assert _prefill_routes(engines) == {"p0.test": [GENERATE, CMPL]}
        engines.prefill_refuses.clear()
        engines.seen.clear()
        assert (await chat(client, USER1)).status_code == 200
    assert _prefill_routes(engines) == {"p0.test": [GENERATE]}


async def test_a_generate_answer_without_kv_params_sends_later_turns_to_completions(
    engines: FakeEngines, make_client
) -> None:
    engines.renders, engines.generate_drops_params = True, True
    engines.down.add("p1.test")
    async with make_client(tokens=True) as client:
        r1 = await chat(client, USER1)
        r2 = await chat(client, then(USER1, r1))
    assert r1.status_code == r2.status_code == 200
    assert _prefill_routes(engines) == {"p0.test": [GENERATE, CMPL]}


async def test_a_prefill_without_the_messages_render_keeps_rendering_chat(
    engines: FakeEngines, make_client
) -> None:
    """vLLM 0.26 renders chat but has no `/v1/messages/render`: refusing that route must not take the chat
    token path away from the prefill (what a prefill serves is remembered per render route)."""
    engines.renders = True
    async with make_client(tokens=True) as client:
        r0 = await client.post(
            "/v1/messages",
            json={"model": "tiny", "max_tokens": 4, "messages": USER1},
            headers={"x-session-id": "m1"},
        )
        r1 = await chat(client, USER1, max_tokens=20)
    assert r0.status_code < 500 and "x-agentkv-render-ms" not in r0.headers
    assert engines.requests("p", "/v1/messages/render")  # tried, refused (404)
    assert r1.status_code == 200 and "x-agentkv-render-ms" in r1.headers
    assert engines.requests("p", RENDER) and engines.requests("p", GENERATE)


def test_the_token_prefill_sampled_is_read_from_either_route_where_decode_may_start_from_it() -> None:
    def answer(choice: dict[str, Any]) -> dict[str, Any]:
        return {"choices": [{"index": 0, **choice}]}

    assert prefill_token(answer({"finish_reason": "length", "token_ids": [7]})) == 7
    completions = {"finish_reason": "length", "text": "x", "logprobs": {"tokens": ["token_id:9"]}}
    assert prefill_token(answer(completions)) == 9
    # A stop token ends the answer there: decode runs as vLLM ships.
    assert prefill_token(answer({"finish_reason": "stop", "token_ids": [2]})) is None
    for odd in ([], [7, 8], [True], [-1], ["7"]):
        assert prefill_token(answer({"finish_reason": "length", "token_ids": odd})) is None, odd
    for tokens in (["7"], ["token_id:x"], ["token_id:-1"], [], None):
        assert prefill_token(answer({"finish_reason": "length", "logprobs": {"tokens": tokens}})) is None
    assert prefill_token({"choices": []}) is None and prefill_token({}) is None


def test_decode_is_sent_prefills_token_only_beside_prefills_blocks() -> None:
    kv = {"remote_block_ids": [1], "do_remote_prefill": True}
    sent = decode_body({"model": "m"}, kv, prefill_token=7)
    assert sent["kv_transfer_params"][PREFILL_TOKEN_KEY] == 7 and PREFILL_TOKEN_KEY not in kv
    # No blocks from prefill: decode prefills the prompt itself and samples token 1 there.
    assert PREFILL_TOKEN_KEY not in decode_body({"model": "m"}, None, prefill_token=7)["kv_transfer_params"]
    assert PREFILL_TOKEN_KEY not in decode_body({"model": "m"}, kv)["kv_transfer_params"]


def test_the_logprobs_a_client_asks_are_asked_of_prefill_and_read_back_from_either_route() -> None:
    assert asked_logprobs({"logprobs": True, "top_logprobs": 3}, chat=True) == 3
    assert asked_logprobs({"logprobs": True}, chat=True) == 0
    assert asked_logprobs({"logprobs": False, "top_logprobs": 3}, chat=True) is None
    assert asked_logprobs({"logprobs": 2}, chat=False) == 2
    for odd in ({"logprobs": -1}, {"logprobs": True}, {}):
        assert asked_logprobs(odd, chat=False) is None, odd
    rendered = {"token_ids": [5, 6]}
    _, body = token_prefill(rendered, model="m", kv_params={}, generate=False, logprobs=2)
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True
    _, body = token_prefill(rendered, model="m", kv_params={}, generate=True, logprobs=2)
    assert body["sampling_params"]["logprobs"] == 2

    completions = {"top_logprobs": [{"token_id:9": -0.5, "token_id:3": -1.5}], "tokens": ["token_id:9"]}
    top = [[9, -0.5, 1], [3, -1.5, 2]]
    assert prefill_logprobs({"choices": [{"logprobs": completions}]}, 1) == {"k": 1, "top": top}
    generated = {
        "content": [
            {
                "token_id": 9,
                "logprob": -0.5,
                "rank": 1,
                "top_logprobs": [
                    {"token_id": 9, "logprob": -0.5, "rank": 1},
                    {"token_id": 3, "logprob": -1.5, "rank": 2},
                ],
            }
        ]
    }
    assert prefill_logprobs({"choices": [{"logprobs": generated}]}, 1) == {"k": 1, "top": top}
    for odd in (None, {}, {"top_logprobs": [{"9": -0.5}]}, {"top_logprobs": [{"token_id:9": "x"}]}):
        assert prefill_logprobs({"choices": [{"logprobs": odd}]}, 1) is None, odd
