"""Decode starts from the token prefill sampled (`agentkv.server.engine.plugin._prefill_token`), on the real
CPU cluster.

A greedy P/D turn through the router then computes what one server computes: prefill computes the prompt and
samples token 1, decode loads exactly that KV and computes token 1 in its first step. The one server here
is the cluster's prefill engine asked directly (same model and settings, its own prefill and decode steps).
The suite's other P/D turns (which ask logprobs) run through the handoff too; these compare with one server
directly and read decode's counter of which path each hop took.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from agentkv.server.launch._cluster import Cluster
from agentkv.server.router._backend import block_size_of

from ._helpers import HTTP_TIMEOUT_S, MODEL, RouterProc, conversation_script, metric, new_id

USED = "agentkv_prefill_tokens_total"


def _choices(
    url: str, messages: list[dict[str, Any]], *, stream: bool, cid: str | None, **extra: Any
) -> list[dict[str, Any]]:
    """A greedy chat answer's choices: the one choice, or every streamed chunk's."""
    body = {"model": MODEL, "messages": messages, "temperature": 0, "stream": stream, **extra}
    headers = {"x-session-id": cid} if cid else {}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200, r.text
        return list(r.json()["choices"])
    choices: list[dict[str, Any]] = []
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=HTTP_TIMEOUT_S
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices += json.loads(line[6:]).get("choices") or []
    return choices


def _answer(
    url: str, messages: list[dict[str, Any]], *, stream: bool, cid: str | None = None, **extra: Any
) -> tuple[list[int], str]:
    """A greedy chat answer without logprobs: its token ids (`return_token_ids`) and text."""
    ids: list[int] = []
    text = ""
    for choice in _choices(
        url, messages, stream=stream, cid=cid, max_tokens=16, return_token_ids=True, **extra
    ):
        ids += choice.get("token_ids") or []
        text += (choice.get("delta") or choice.get("message") or {}).get("content") or ""
    return ids, text


def _counts(d_url: str) -> dict[str, float]:
    results = ("used", "logprobs", "whole blocks", "sampling", "text")
    return {r: metric(d_url, USED, result=r) for r in results}


def _delta(d_url: str, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in _counts(d_url).items() if v != before[k]}


def test_a_pd_turn_answers_as_one_server_streamed_or_not(cluster: Cluster, router: RouterProc) -> None:
    """Three turns of one conversation through the router, each answered as the prefill engine answers the
    same history alone, token for token and character for character; decode started from prefill's token
    on the turns that went through prefill."""
    p_url, d_url = cluster.prefills[0].spec.url, cluster.decodes[0].spec.url
    for stream in (False, True):
        cid = new_id("prefill-token")
        history: list[dict[str, Any]] = []
        before = _counts(d_url)
        for content in conversation_script(41 + stream, 3):
            history.append({"role": "user", "content": content})
            ids, text = _answer(router.url, history, stream=stream, cid=cid)
            alone_ids, alone_text = _answer(p_url, history, stream=stream)
            assert (ids, text) == (alone_ids, alone_text), (stream, len(history))
            history.append({"role": "assistant", "content": text})
        # The first turn went P then D from prefill's token; reuse turns may run on decode alone.
        assert _delta(d_url, before).get("used", 0) >= 1, (stream, _delta(d_url, before))


def test_a_whole_blocks_prompt_and_a_prompt_logprobs_turn_run_as_vllm_ships(
    cluster: Cluster, router: RouterProc
) -> None:
    """Where decode cannot start from prefill's token it runs vLLM's own path and answers as before: a prompt
    of whole blocks (decode would need one block more than prefill hands on; vLLM's NIXL worker would stop
    the engine) and a turn asking for the prompt's logprobs."""
    p_url, d_url = cluster.prefills[0].spec.url, cluster.decodes[0].spec.url
    block = block_size_of(httpx.get(f"{d_url}/metrics", timeout=10).text)
    assert block is not None
    words = conversation_script(43, 1)[0].split()
    messages: list[dict[str, Any]] = []
    for n in range(len(words), 0, -1):  # drop words until the rendered prompt fills whole blocks
        messages = [{"role": "user", "content": " ".join(words[:n])}]
        r = httpx.post(
            f"{p_url}/v1/chat/completions/render",
            json={"model": MODEL, "messages": messages, "add_generation_prompt": True},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        if len(r.json()["token_ids"]) % block == 0:
            break
    else:
        raise AssertionError("no prefix of the script renders to whole blocks")
    before = _counts(d_url)
    ids, text = _answer(router.url, messages, stream=False, cid=new_id("whole-blocks"))
    assert (ids, text) == _answer(p_url, messages, stream=False)
    assert _delta(d_url, before) == {"whole blocks": 1}

    # Prompt logprobs: decode would have to give the prompt's last token's, which it no longer computes.
    messages = [{"role": "user", "content": conversation_script(44, 1)[0]}]
    before = _counts(d_url)
    ids, text = _answer(router.url, messages, stream=False, cid=new_id("prompt-logprobs"), prompt_logprobs=1)
    assert (ids, text) == _answer(p_url, messages, stream=False, prompt_logprobs=1)
    assert _delta(d_url, before) == {"logprobs": 1}
    # The engine is still up and starts from prefill's token again.
    before = _counts(d_url)
    messages = [{"role": "user", "content": conversation_script(45, 1)[0]}]
    assert _answer(router.url, messages, stream=True, cid=new_id("after")) == _answer(
        p_url, messages, stream=True
    )
    assert _delta(d_url, before) == {"used": 1}


def test_an_answers_logprobs_are_one_servers_token_one_from_prefill(
    cluster: Cluster, router: RouterProc
) -> None:
    """A turn asking for logprobs starts from prefill's token too: token 1's logprobs (and top logprobs) are
    the ones prefill computed, as one server computes them, and the rest decode's; all equal the prefill
    engine's own answer, streamed and not."""
    p_url, d_url = cluster.prefills[0].spec.url, cluster.decodes[0].spec.url
    messages = [{"role": "user", "content": conversation_script(46, 1)[0]}]
    asked: dict[str, Any] = {"logprobs": True, "top_logprobs": 3, "return_tokens_as_token_ids": False}
    for stream in (False, True):
        before = _counts(d_url)
        got = _logprobs(router.url, messages, stream=stream, cid=new_id("logprobs"), **asked)
        assert got == _logprobs(p_url, messages, stream=stream, **asked), stream
        assert got and len(got[0]["top_logprobs"]) == 3
        assert _delta(d_url, before) == {"used": 1}, stream


def _logprobs(
    url: str, messages: list[dict[str, Any]], *, stream: bool, cid: str | None = None, **extra: Any
) -> list[Any]:
    """A greedy answer's logprobs content (each token's text, logprob, bytes and top logprobs)."""
    content: list[Any] = []
    for choice in _choices(url, messages, stream=stream, cid=cid, max_tokens=8, **extra):
        content += (choice.get("logprobs") or {}).get("content") or []
    return content
