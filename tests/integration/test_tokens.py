"""Tokens between the router and the engines, on the real CPU cluster (1P1D, our connector).

The router renders each turn once (prefill's `/v1/chat/completions/render`), sends prefill the token ids
(`/inference/v1/generate` without detokenizing; `/v1/completions` with an id prompt before vLLM 0.32),
forwards them to decode in `kv_transfer_params.prompt_token_ids`, and checks reuse on token ids, which see
what the chat template renders beyond the messages (tools, kwargs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from agentkv._wire import PACKED_IDS_KEY, pack_ids
from agentkv.server.launch._cluster import Cluster

from ._cases import TOOLS, two_turns
from ._helpers import (
    HTTP_TIMEOUT_S,
    MODEL,
    RouterProc,
    assert_agrees_up_to_rounding,
    chat,
    conversation_script,
    metric,
    new_id,
    service_info,
)

FORWARDED = "agentkv_forwarded_ids_prompts_total"
CUT = "agentkv_cut_conversations_total"
ID_INTS = "agentkv_forwarded_id_ints_total"
ID_CHECKS = "agentkv_vllm_id_checks_total"
PREFILL_TOKENS = "agentkv_prefill_tokens_total"


def _render_ids(prefill_url: str, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
    r = httpx.post(
        f"{prefill_url}/v1/chat/completions/render",
        json={"model": MODEL, "messages": messages, **extra},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    ids = r.json()["token_ids"]
    assert isinstance(ids, list) and ids
    return ids


def _requests(prefill_url: str, handler: str) -> float:
    return metric(f"{prefill_url}/metrics", "http_requests_total", handler=handler)


def test_a_turn_is_rendered_once_and_prefill_takes_token_ids(
    cluster: Cluster, router: RouterProc, router_off: RouterProc
) -> None:
    p_url = cluster.prefills[0].spec.url
    script = conversation_script(31, 3)
    cid = new_id("tokens")
    hops = ("/inference/v1/generate", "/v1/completions", "/v1/chat/completions")
    before = {h: _requests(p_url, h) for h in hops}
    d_url = cluster.decodes[0].spec.url
    taken_before = metric(d_url, FORWARDED, form="packed")
    cut_before = metric(d_url, CUT)
    ints_before = {kind: metric(d_url, ID_INTS, kind=kind) for kind in ("reused", "made")}
    skipped_before = metric(d_url, ID_CHECKS, result="skipped")
    used_before = metric(d_url, PREFILL_TOKENS, result="used")
    history: list[dict[str, Any]] = []
    for i, msg in enumerate(script):
        history.append({"role": "user", "content": msg})
        on = chat(router.url, history, conversation_id=cid)
        off = chat(router_off.url, history, conversation_id=new_id("tokens-off"))
        assert float(on.headers["x-agentkv-render-ms"]) > 0
        assert on.headers["x-agentkv-reuse"] == ("miss" if i == 0 else "hit"), on.headers
        if i:  # this prefill caches nothing: every token not recomputed came from decode
            assert on.headers["x-agentkv-pulled-tokens"] == on.headers["x-agentkv-reused-tokens"], on.headers
        assert_agrees_up_to_rounding(on, off)
        history.append({"role": "assistant", "content": on.text})
    # Every prefill hop of both routers took the ids on vLLM's tokens-in route (the render is the turn's
    # only one); none sent prefill the messages to render again, or an id prompt it would detokenize.
    assert _requests(p_url, "/inference/v1/generate") - before["/inference/v1/generate"] == 2 * len(script)
    assert _requests(p_url, "/v1/chat/completions") == before["/v1/chat/completions"]
    assert _requests(p_url, "/v1/completions") == before["/v1/completions"]
    # Every decode hop ran the forwarded ids through agentkv's plugin (this cluster's setting), not a render,
    # and got them packed: decode's retention service says its plugin reads that form.
    assert metric(d_url, FORWARDED, form="packed") - taken_before == 2 * len(script)
    # ... with the conversation cut to its last message on every turn that had more than one (the answers
    # above agree with each other all the same), as decode's retention service allows.
    assert service_info(cluster.decodes[0].spec.service_url)["messages_cut"] is True
    assert metric(d_url, CUT) - cut_before == 2 * (len(script) - 1)
    # Each later turn's ids became vLLM's list with the ints of the turn before it reused (`IdLists`).
    ints = {kind: metric(d_url, ID_INTS, kind=kind) - n for kind, n in ints_before.items()}
    assert ints["reused"] > 0 < ints["made"], ints
    # vLLM's own vocabulary check skipped the list the plugin had checked on every decode hop, also where
    # decode started from prefill's token (a new list: those ids and that token).
    assert metric(d_url, PREFILL_TOKENS, result="used") > used_before
    assert metric(d_url, ID_CHECKS, result="skipped") - skipped_before == 2 * len(script)


def test_decode_computes_the_forwarded_ids_and_renders_nothing(cluster: Cluster) -> None:
    """Decode answers the ids it is given, not its messages: so it did not render and tokenize them.
    (Only the router forwards ids, and only those prefill rendered for the same body.)"""
    p_url, d_url = cluster.prefills[0].spec.url, cluster.decodes[0].spec.url
    real = [{"role": "user", "content": conversation_script(32, 1)[0]}]
    decoy = [{"role": "user", "content": "a different question altogether"}]
    ids = _render_ids(p_url, real)
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "logprobs": True}
    by_text = httpx.post(f"{d_url}/v1/chat/completions", json={**body, "messages": real}, timeout=120)
    taken = {form: metric(d_url, FORWARDED, form=form) for form in ("list", "packed")}
    answers = [by_text.json()]
    for params in ({"prompt_token_ids": ids}, {PACKED_IDS_KEY: pack_ids(ids)}):
        by_ids = httpx.post(
            f"{d_url}/v1/chat/completions",
            json={**body, "messages": decoy, "kv_transfer_params": params},
            timeout=120,
        )
        assert by_text.status_code == by_ids.status_code == 200, (by_text.text, by_ids.text)
        answers.append(by_ids.json())
    assert [a["usage"]["prompt_tokens"] for a in answers] == [len(ids)] * 3
    assert len({a["choices"][0]["message"]["content"] for a in answers}) == 1, answers
    # Taken by agentkv's plugin (this cluster runs it even on vLLM 0.32, which has its own), in either form,
    # which decode's retention service tells the router.
    assert {form: metric(d_url, FORWARDED, form=form) - n for form, n in taken.items()} == {
        "list": 1,
        "packed": 1,
    }
    info = service_info(cluster.decodes[0].spec.service_url)
    assert info["forwarded_ids"] is True and info["packed_ids"] is True


def test_the_render_answer_is_encoded_by_agentkvs_msgspec_path(cluster: Cluster) -> None:
    """The render answer carries the conversation's ids; the engines' plugin encodes vLLM's JSON answers
    with msgspec (`AGENTKV_FAST_JSON`). msgspec spells a float's exponent `1e-7` where the standard library
    writes `1e-07`, which shows the path taken; the values are the same."""
    p_url = cluster.prefills[0].spec.url
    messages = [{"role": "user", "content": conversation_script(33, 1)[0]}]
    r = httpx.post(
        f"{p_url}/v1/chat/completions/render",
        json={"model": MODEL, "messages": messages, "max_tokens": 1, "top_p": 1e-7},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert '"top_p":1e-7' in r.text, r.text[:300]
    answer = r.json()
    assert answer["sampling_params"]["top_p"] == 1e-7
    assert answer["token_ids"] == _render_ids(p_url, messages)


def test_forwarded_ids_that_are_not_ids_get_a_400_and_decode_serves_on(cluster: Cluster) -> None:
    """Only the router sends ids, but a decode's API server is reachable: malformed ones are the client's
    error, answered before the engine sees them."""
    d_url = cluster.decodes[0].spec.url
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}],
    }
    for bad in ([], [1, True, 2], [3, -1], [1, "2"], "1 2 3", [10**9]):
        r = httpx.post(
            f"{d_url}/v1/chat/completions",
            json={**body, "kv_transfer_params": {"prompt_token_ids": bad}},
            timeout=60,
        )
        assert r.status_code == 400, (bad, r.status_code, r.text)
        assert "prompt_token_ids" in r.json()["error"]["message"], r.text
    for packed in ("not base64!", pack_ids([1, 2])[:-3], pack_ids([10**9])):
        r = httpx.post(
            f"{d_url}/v1/chat/completions",
            json={**body, "kv_transfer_params": {PACKED_IDS_KEY: packed}},
            timeout=60,
        )
        assert r.status_code == 400, (packed, r.status_code, r.text)
        assert PACKED_IDS_KEY in r.json()["error"]["message"], r.text  # the key the client sent
    ok = httpx.post(f"{d_url}/v1/chat/completions", json=body, timeout=60)
    assert ok.status_code == 200, ok.text


def test_tools_added_or_template_kwargs_changed_never_reuse_the_old_prefix(
    router: RouterProc, router_off: RouterProc
) -> None:
    """Both change the top of the prompt (the messages stay an extension of the last turn's): decode's
    blocks hold KV of other tokens, and the router's token check refuses them before prefill is asked."""
    for extra, first_extra in (
        ({"tools": TOOLS}, None),
        ({"chat_template_kwargs": {"today": "Tuesday"}}, {"chat_template_kwargs": {"today": "Monday"}}),
    ):
        headers, (history, second) = two_turns(router.url, extra, first_extra=first_extra)
        assert headers["x-agentkv-reuse"] == "mismatch", (extra, headers)
        assert headers["x-agentkv-reused-tokens"] == "0"
        off = chat(router_off.url, history, conversation_id=new_id("tokens-off"), extra=extra)
        assert_agrees_up_to_rounding(second, off)
    # The same kwargs on both turns render the same top: reused.
    same = {"chat_template_kwargs": {"today": "Monday"}}
    headers, _ = two_turns(router.url, same, first_extra=same)
    assert headers["x-agentkv-reuse"] == "hit", headers


def test_completions_take_the_token_path_and_reuse(router: RouterProc, router_off: RouterProc) -> None:
    cid = new_id("tokens-cmpl")
    prompt = conversation_script(34, 1)[0]
    for i in range(3):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1}
        on = httpx.post(f"{router.url}/v1/completions", json=body, headers={"x-session-id": cid}, timeout=120)
        off = httpx.post(f"{router_off.url}/v1/completions", json=body, timeout=120)
        assert on.status_code == off.status_code == 200, (on.text, off.text)
        assert float(on.headers["x-agentkv-render-ms"]) > 0
        assert on.headers["x-agentkv-reuse"] == ("miss" if i == 0 else "hit"), on.headers
        got, ref = on.json()["choices"][0], off.json()["choices"][0]
        assert got["text"] == ref["text"]
        prompt += got["text"] + " tool result: " + conversation_script(35 + i, 2)[1]


def _post_turn(
    url: str, path: str, body: dict[str, Any], conversation_id: str | None
) -> tuple[dict[str, str], Any]:
    """One turn on an API with named events (Messages, Responses): headers and the JSON answer, or the
    stream's events, checked for that API's own grammar (no `[DONE]`) and for leaked kv params."""
    headers = {"x-session-id": conversation_id} if conversation_id else {}
    r = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert "[DONE]" not in r.text and "kv_transfer_params" not in r.text, r.text
    if not body.get("stream"):
        return dict(r.headers), r.json()
    events = []
    for block in r.text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}", block
        events.append(event)
    return dict(r.headers), events


def _message(
    url: str,
    messages: list[dict[str, Any]],
    *,
    conversation_id: str | None = None,
    stream: bool = False,
    **extra: Any,
) -> tuple[dict[str, str], str, list[dict[str, Any]]]:
    """One greedy turn on Anthropic's Messages API: headers, the answer's text and (streamed) the events."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0, "stream": stream}
    headers, answer = _post_turn(url, "/v1/messages", {**body, **extra}, conversation_id)
    if not stream:
        assert answer["type"] == "message", answer
        return headers, "".join(b["text"] for b in answer["content"] if b["type"] == "text"), []
    deltas = [e["delta"] for e in answer if e["type"] == "content_block_delta"]
    return headers, "".join(d["text"] for d in deltas if d["type"] == "text_delta"), answer


def test_messages_take_the_token_path_and_reuse(
    cluster: Cluster, router: RouterProc, router_off: RouterProc
) -> None:
    """Anthropic's Messages API through the router: rendered once on prefill (`/v1/messages/render`),
    prefilled from ids, reused on ids, answered (and streamed) in its own format, equal to reuse OFF."""
    p_url = cluster.prefills[0].spec.url
    before = _requests(p_url, "/v1/messages")
    script = conversation_script(36, 3)
    cid = new_id("messages")
    history: list[dict[str, Any]] = []
    for i, msg in enumerate(script):
        history.append({"role": "user", "content": [{"type": "text", "text": msg}]})
        stream = i == 1  # the next turn reuses what a streamed answer left on decode
        headers, text, events = _message(router.url, history, conversation_id=cid, stream=stream)
        _, ref, _ = _message(router_off.url, history, conversation_id=new_id("messages-off"))
        assert float(headers["x-agentkv-render-ms"]) > 0
        assert headers["x-agentkv-reuse"] == ("miss" if i == 0 else "hit"), headers
        assert int(headers["x-agentkv-reused-tokens"]) > (0 if i else -1)
        assert text == ref  # exact mode: the same tokens as a recompute
        if stream:
            assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
            assert events[-2]["delta"]["stop_reason"] in ("max_tokens", "end_turn"), events[-2]
        history.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
    # Prefill rendered each turn and took ids; it never served the Messages API itself.
    assert _requests(p_url, "/v1/messages") == before


def test_messages_with_another_system_prompt_never_reuse(router: RouterProc, router_off: RouterProc) -> None:
    """Anthropic's `system` is not a message: the template renders it at the top of the prompt, so a turn
    that changes it extends the messages but not the tokens decode holds."""
    cid = new_id("messages-system")
    script = conversation_script(37, 2)
    history: list[dict[str, Any]] = [{"role": "user", "content": script[0]}]
    _, first, _ = _message(router.url, history, conversation_id=cid, system="You answer briefly.")
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": script[1]}]
    headers, second, _ = _message(router.url, history, conversation_id=cid, system="You answer at length.")
    assert headers["x-agentkv-reuse"] == "mismatch", headers
    assert headers["x-agentkv-reused-tokens"] == "0"
    _, ref, _ = _message(router_off.url, history, system="You answer at length.")
    assert second == ref


def test_messages_without_max_tokens_are_refused_with_an_openai_error(router: RouterProc) -> None:
    r = httpx.post(
        f"{router.url}/v1/messages",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"


def test_messages_serve_a_short_suffix_on_decode(
    router_auto: RouterProc, router_off_inexact: RouterProc
) -> None:
    """The default router's decode-local path on the Messages API: decode computes the new tokens over what
    it holds, as vLLM's prefix cache would; the answer is the one decode's own prefix cache gives."""
    cid = new_id("messages-local")
    script = conversation_script(38, 2)
    history: list[dict[str, Any]] = [{"role": "user", "content": script[0]}]
    _, first, _ = _message(router_auto.url, history, conversation_id=cid)
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "ok"}]
    headers, second, events = _message(router_auto.url, history, conversation_id=cid, stream=True)
    assert (headers["x-agentkv-path"], headers["x-agentkv-reuse"]) == ("decode-local", "local"), headers
    # The stream's headers leave before decode's usage: they carry what decode holds of the prompt.
    assert int(headers["x-agentkv-reused-tokens"]) > 0, headers
    assert events[-1]["type"] == "message_stop"
    _, ref, _ = _message(router_off_inexact.url, history)
    assert second == ref


def _respond(
    url: str, items: list[dict[str, Any]], *, conversation_id: str | None = None, stream: bool = False
) -> tuple[dict[str, str], str, list[dict[str, Any]]]:
    """One greedy turn on OpenAI's Responses API: headers, the answer's text and (streamed) the events."""
    body = {"model": MODEL, "input": items, "max_output_tokens": 10, "temperature": 0, "stream": stream}
    headers, answer = _post_turn(url, "/v1/responses", body, conversation_id)
    if not stream:
        assert answer["object"] == "response", answer
        parts = [p for o in answer["output"] if o["type"] == "message" for p in o["content"]]
        return headers, "".join(p["text"] for p in parts if p["type"] == "output_text"), []
    return headers, "".join(e["delta"] for e in answer if e["type"] == "response.output_text.delta"), answer


def test_responses_take_the_token_path_and_reuse(router: RouterProc, router_off: RouterProc) -> None:
    """OpenAI's Responses API, stateless (the whole input each turn), through the router: rendered once,
    reused on ids, answered and streamed in its own format, equal to reuse OFF; `previous_response_id`,
    which needs one engine's memory, is refused before any engine is asked."""
    script = conversation_script(39, 3)
    cid = new_id("responses")
    items: list[dict[str, Any]] = []
    for i, msg in enumerate(script):
        items.append({"type": "message", "role": "user", "content": msg})
        stream = i == 1  # the next turn reuses what a streamed answer left on decode
        headers, text, events = _respond(router.url, items, conversation_id=cid, stream=stream)
        _, ref, _ = _respond(router_off.url, items, conversation_id=new_id("responses-off"))
        assert float(headers["x-agentkv-render-ms"]) > 0
        assert headers["x-agentkv-reuse"] == ("miss" if i == 0 else "hit"), headers
        assert text == ref  # exact mode: the same tokens as a recompute
        if stream:
            assert events[0]["type"] == "response.created"
            assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        items.append({"type": "message", "role": "assistant", "content": text})
    r = httpx.post(
        f"{router.url}/v1/responses",
        json={"model": MODEL, "input": "next", "previous_response_id": "resp_x"},
        headers={"x-session-id": cid},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text


def test_the_anthropic_and_openai_sdks_reuse_through_the_router(cluster: Cluster, router: RouterProc) -> None:
    """What coding agents and the OpenAI Agents SDK run on: the official clients (Anthropic's, and OpenAI's
    Responses API), each streaming its second turn, both reusing decode's KV."""
    import anthropic
    import openai

    script = conversation_script(40, 2)
    cid = new_id("sdk-anthropic")
    claude = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
    session = {"x-session-id": cid}
    messages: list[dict[str, Any]] = [{"role": "user", "content": script[0]}]
    greedy = {"temperature": 0}  # this SDK release has no temperature argument; vLLM takes the field
    raw = claude.messages.with_raw_response.create(
        model=MODEL, max_tokens=8, messages=messages, extra_headers=session, extra_body=greedy
    )
    first = raw.parse()
    assert raw.headers["x-agentkv-reuse"] == "miss" and first.stop_reason in ("max_tokens", "end_turn")
    messages += [
        {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": script[1]},
    ]
    with claude.messages.stream(
        model=MODEL, max_tokens=8, messages=messages, extra_headers=session, extra_body=greedy
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        assert stream.response.headers["x-agentkv-reuse"] == "hit"
    assert text and final.content[0].text == text and final.usage.output_tokens > 0
    # The token count clients size their context with, rendered by a prefill: the turn's prompt length.
    count = claude.messages.count_tokens(model=MODEL, messages=messages)
    assert count.input_tokens == len(_render_ids(cluster.prefills[0].spec.url, messages))

    cid = new_id("sdk-responses")
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    items: list[Any] = [{"role": "user", "content": script[0]}]
    raw_response = client.responses.with_raw_response.create(
        model=MODEL, input=items, max_output_tokens=8, temperature=0, extra_headers={"x-session-id": cid}
    )
    response = raw_response.parse()
    assert raw_response.headers["x-agentkv-reuse"] == "miss" and response.output_text
    items += [{"role": "assistant", "content": response.output_text}, {"role": "user", "content": script[1]}]
    with client.responses.with_streaming_response.create(
        model=MODEL,
        input=items,
        max_output_tokens=8,
        temperature=0,
        stream=True,
        extra_headers={"x-session-id": cid},
    ) as streamed:
        assert streamed.headers["x-agentkv-reuse"] == "hit"
        events = list(streamed.parse())
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == "".join(
        e.delta for e in events if e.type == "response.output_text.delta"
    )


def _tokenizer_cache(url: str) -> dict[str, float]:
    prompts = "agentkv_tokenizer_cache_prompts_total"
    return {
        **{r: metric(f"{url}/metrics", prompts, result=r) for r in ("hit", "miss", "mismatch")},
        "reused": metric(f"{url}/metrics", "agentkv_tokenizer_cache_tokens_total", kind="reused"),
    }


def test_a_turn_tokenizes_only_what_it_adds_to_the_conversation(cluster: Cluster, router: RouterProc) -> None:
    """agentkv's tokenizer cache in prefill's API server: the render of a turn reuses the ids of the previous
    turn's prompt up to its last added token. The suite runs it in verify mode, where every prompt is also
    tokenized whole and compared: every render of the whole suite counts as a mismatch if they differ."""
    p_url = cluster.prefills[0].spec.url
    before = _tokenizer_cache(p_url)
    history: list[dict[str, Any]] = [{"role": "user", "content": "List the files, then read them."}]
    turns: list[list[dict[str, Any]]] = []
    cid = new_id("tokcache")
    for i, result in enumerate(conversation_script(33, 4)):
        turn = chat(router.url, history, conversation_id=cid)
        turns.append(list(history))
        history += [
            {"role": "assistant", "content": turn.text},
            {"role": "user", "content": f"{i}: {result}"},
        ]
    after = _tokenizer_cache(p_url)
    prompts = [len(_render_ids(p_url, messages, add_generation_prompt=True)) for messages in turns]
    assert after["mismatch"] == before["mismatch"] == 0
    # One render per turn; every turn after the first extends a prompt this server tokenized.
    assert after["hit"] - before["hit"] >= len(prompts) - 1
    # Each of those reused all of the previous prompt but its generation prompt's few ids.
    assert after["reused"] - before["reused"] >= sum(n - 8 for n in prompts[:-1])


def test_answers_stream_the_text_of_their_ids_with_the_detokenizer_primed_by_the_prompt_tail(
    cluster: Cluster, router: RouterProc, model_dir: Path
) -> None:
    """The engines prime vLLM's incremental detokenizer with the prompt's last 128 ids (agentkv's plugin): on
    prompts far longer than that, streamed and whole answers must still be exactly the text of their ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    d_metrics = f"{cluster.decodes[0].spec.url}/metrics"
    history = [{"role": "user", "content": " ".join(conversation_script(34, 6))}]
    for stream in (False, True):
        primed = metric(d_metrics, "agentkv_detokenizer_tail_primes_total")
        turn = chat(router.url, history, conversation_id=new_id("prime"), max_tokens=48, stream=stream)
        assert len(_render_ids(cluster.prefills[0].spec.url, history, add_generation_prompt=True)) > 4 * 128
        # Decode streamed this answer through a detokenizer primed with the tail.
        assert metric(d_metrics, "agentkv_detokenizer_tail_primes_total") > primed, stream
        expected = tokenizer.decode(turn.ids, skip_special_tokens=True)
        # An answer cut by max_tokens inside a multi-byte character: vLLM's detokenizer withholds the
        # incomplete bytes, where the tokenizer's decode writes U+FFFD. Only that tail is excused.
        complete = expected.rstrip("\ufffd")
        assert turn.ids and turn.text in (expected, complete), (stream, turn.text[-20:], expected[-20:])
