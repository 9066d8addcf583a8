"""Issue 3: the router on the real CPU cluster (1P1D), driven by the official openai SDK and raw HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from agentkv.server.launch._cluster import Cluster

from ._helpers import (
    MODEL,
    RouterProc,
    chat,
    conversation_script,
    conversation_state,
    metric,
    new_id,
    no_leases_left,
    router_turns,
    run_conversation,
    service_info,
    wait_turns_counted,
    wait_until,
)


def _sdk_conversation(url: str, conversation_id: str, script: list[str]) -> tuple[list[list[int]], list[str]]:
    """Stream each turn with the official SDK; return token ids per turn and the router's reuse header."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    history: list[dict[str, str]] = []
    all_ids, reuse = [], []
    for msg in script:
        history.append({"role": "user", "content": msg})
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=history,
            max_tokens=12,
            temperature=0,
            stream=True,
            logprobs=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
            extra_headers={"x-session-id": conversation_id},
            extra_body={"return_tokens_as_token_ids": True},
        )
        reuse.append(raw.headers.get("x-agentkv-reuse", ""))
        ids: list[int] = []
        text = ""
        for chunk in raw.parse():
            for ch in chunk.choices:
                text += ch.delta.content or ""
                ids += (
                    [int(t.token.split(":")[1]) for t in (ch.logprobs.content or [])] if ch.logprobs else []
                )
        history.append({"role": "assistant", "content": text})
        all_ids.append(ids)
    return all_ids, reuse


def test_four_turns_streamed_by_openai_sdk_reuse_decode_kv(
    cluster: Cluster, router: RouterProc, router_off: RouterProc
) -> None:
    ps = cluster.prefills[0].spec.service_url
    assert ps
    script = conversation_script(11, 4)
    p_url = cluster.prefills[0].spec.url

    def counters() -> tuple[float, float, float, float, float]:
        return (
            metric(router.url, "agentkv_reuse_total", result="hit"),
            metric(router.url, "agentkv_reused_tokens_total"),
            metric(router.url, "agentkv_pulled_tokens_total"),
            float(service_info(ps)["stats"]["tokens_pulled"]),
            # vLLM's own count of prompt tokens prefill took over NIXL instead of computing.
            metric(p_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
        )

    turns0, before = router_turns(router.url), counters()
    on_ids, on_reuse = _sdk_conversation(router.url, new_id("sdk"), script)
    # The router counts a streamed turn after its last byte, which the SDK may read first.
    wait_turns_counted(router.url, turns0, len(script))
    hits, reused_router, pulled_router, pulled, external = (
        a - b for a, b in zip(counters(), before, strict=True)
    )
    off_ids, off_reuse = _sdk_conversation(router_off.url, new_id("sdk-off"), script)
    assert on_reuse == ["miss", "hit", "hit", "hit"], on_reuse
    assert hits == 3  # the router counted three reuses ...
    assert pulled > 0  # ... prefill's connector pulled decode's tokens ...
    # ... and they agree on how many: what the router reported (prefill's cached_tokens, and what our
    # connector said it read from decode), what our connector pulled and what vLLM's prefill counted as
    # external KV are one number (this prefill has no prefix cache of its own).
    assert reused_router == pulled_router == pulled == external, (
        reused_router,
        pulled_router,
        pulled,
        external,
    )
    assert all(r != "hit" for r in off_reuse)
    assert on_ids == off_ids and all(len(t) == 12 for t in on_ids)


def test_client_supplied_kv_transfer_params_are_ignored(cluster: Cluster, router: RouterProc) -> None:
    ps = cluster.prefills[0].spec.service_url
    assert ps
    offered0 = service_info(ps)["stats"]["tokens_offered"]
    dropped0 = metric(router.url, "agentkv_client_kv_params_dropped_total")
    evil = {
        "do_remote_decode": True,
        "remote_block_ids": [[0, 1, 2]],
        "remote_engine_id": "x",
        "remote_request_id": "someone-else",
        "remote_host": "127.0.0.1",
        "remote_port": 5700,
        "remote_num_tokens": 384,
    }
    messages = [{"role": "user", "content": conversation_script(12, 1)[0]}]
    turn = chat(router.url, messages, conversation_id=new_id(), extra={"kv_transfer_params": evil})
    assert len(turn.ids) == 12
    assert (
        "kv_transfer_params"
        not in httpx.post(
            f"{router.url}/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 2, "kv_transfer_params": evil},
            timeout=120,
        ).json()
    )
    assert metric(router.url, "agentkv_client_kv_params_dropped_total") - dropped0 == 2
    assert service_info(ps)["stats"]["tokens_offered"] == offered0  # prefill never saw the forged offer


def test_releasing_a_conversation_frees_decode_blocks(cluster: Cluster, router: RouterProc) -> None:
    d = cluster.decodes[0].spec
    assert d.service_url
    no_leases_left(d.service_url)
    cid = new_id("release")
    run_conversation(router.url, conversation_script(13, 1), conversation_id=cid)
    state = conversation_state(router.url, cid)
    assert state["lease"]["state"] == "held" and state["retained_tokens"] > 0
    assert service_info(d.service_url)["retained"] == 1  # this conversation's lease, and no other
    usage_before = metric(d.url, "vllm:kv_cache_usage_perc")
    assert usage_before > 0
    r = httpx.delete(f"{router.url}/v1/conversations/{cid}", timeout=5)
    assert r.status_code == 200 and r.json()["released"] is True
    # Decode frees the blocks at its next step.
    wait_until(
        lambda: metric(d.url, "vllm:kv_cache_usage_perc") < usage_before,
        timeout_s=60,
        what=lambda: "decode's KV cache usage did not drop after the release",
    )
    assert service_info(d.service_url)["retained"] == 0
    assert httpx.get(f"{router.url}/v1/conversations/{cid}", timeout=5).status_code == 404


def test_retention_service_refuses_calls_without_the_token(cluster: Cluster) -> None:
    # The suite runs every engine with AGENTKV_SERVICE_TOKEN (conftest), so every reuse hit in it also shows
    # that prefill's still-held check and the router send the token: refused, a pull would not happen.
    for spec in (cluster.decodes[0].spec, cluster.prefills[0].spec):
        assert spec.service_url
        assert httpx.get(f"{spec.service_url}/agentkv/v1/info", timeout=5).status_code == 401
        wrong = {"authorization": "Bearer not-the-token"}
        assert (
            httpx.delete(f"{spec.service_url}/agentkv/v1/leases/x", headers=wrong, timeout=5).status_code
            == 401
        )
        assert httpx.get(f"{spec.service_url}/metrics", timeout=5).status_code == 200  # scrapes need none
        assert service_info(spec.service_url)["engine_id"]


def test_final_turn_reuses_then_frees_decode_blocks_at_once(
    cluster: Cluster, router: RouterProc, router_off: RouterProc
) -> None:
    d = cluster.decodes[0].spec
    assert d.service_url
    no_leases_left(d.service_url)
    cid = new_id("final")
    script = conversation_script(17, 2)
    h: list[dict[str, object]] = [{"role": "user", "content": script[0]}]
    first = chat(router.url, h, conversation_id=cid)
    assert service_info(d.service_url)["retained"] == 1
    conversation_state(router.url, cid)  # the first turn is booked: its record holds the lease
    h += [{"role": "assistant", "content": first.text}, {"role": "user", "content": script[1]}]
    releases0 = metric(router.url, "agentkv_lease_releases_total")
    last = chat(router.url, h, conversation_id=cid, headers={"x-agentkv-final-turn": "true"})
    # The final turn itself still pulls the previous turn's KV and answers as a recompute does.
    assert last.headers.get("x-agentkv-reuse") == "hit"
    assert last.ids == chat(router_off.url, h).ids
    assert "x-agentkv-lease-expires-in" not in last.headers
    # P's read freed the first turn's blocks; the final turn's own are released by the router (decode held
    # no other lease, so only this one can count), not left to run out after 14 s.
    wait_until(
        lambda: metric(router.url, "agentkv_lease_releases_total") - releases0 >= 1,
        timeout_s=60,
        what=lambda: "the router did not release the final turn's blocks",
    )
    assert metric(router.url, "agentkv_lease_releases_total") - releases0 == 1
    wait_until(
        lambda: service_info(d.service_url)["retained"] == 0,
        timeout_s=60,
        what=lambda: "decode still holds the final turn's blocks",
    )
    assert httpx.get(f"{router.url}/v1/conversations/{cid}", timeout=5).status_code == 404


@pytest.mark.parametrize(
    ("kwargs", "status"),
    [
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400),
        ({"json": {"model": MODEL, "messages": "hello"}}, 400),
        ({"json": {"model": MODEL, "messages": [], "max_tokens": "many"}}, 400),
        (
            {
                "json": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                "headers": {"x-session-id": "x" * 5000},
            },
            400,
        ),
        ({"json": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}}, 404),
        (
            {
                "content": b'{"model": "tiny", "messages": [], "pad": "' + b"x" * (9 * 1024 * 1024) + b'"}',
                "headers": {"content-type": "application/json"},
            },
            413,
        ),
    ],
)
def test_bad_input_gets_openai_error_and_changes_nothing(
    router: RouterProc, kwargs: dict, status: int
) -> None:  # type: ignore[type-arg]
    # "Changes nothing", read on what only this request could change: its own conversation is not recorded,
    # and no turn ran (turns run only when a client sends one, and this module's tests run one at a time).
    # The tracked-conversations gauge is not read: the store's expiry sweep moves it at any time.
    cid = new_id("bad-input")
    turns = metric(router.url, "agentkv_turns_total")
    headers = {"x-session-id": cid, **kwargs.pop("headers", {})}
    r = httpx.post(f"{router.url}/v1/chat/completions", headers=headers, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in r.text
    assert {"message", "type", "param", "code"} <= set(err)
    assert httpx.get(f"{router.url}/v1/conversations/{cid}", timeout=5).status_code == 404
    assert metric(router.url, "agentkv_turns_total") == turns


def _complete(url: str, prompt: str, *, cid: str | None, stream: bool) -> tuple[str, str]:
    """One greedy /v1/completions turn through a router; (text, x-agentkv-reuse)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": stream}
    headers = {"x-session-id": cid} if cid else {}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        assert "kv_transfer_params" not in r.text
        return r.json()["choices"][0]["text"], r.headers.get("x-agentkv-reuse", "")
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                assert "kv_transfer_params" not in line
                text += "".join(c.get("text") or "" for c in json.loads(line[6:]).get("choices", []))
        return text, r.headers.get("x-agentkv-reuse", "")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_completions_endpoint_reuses_decode_kv_with_the_same_answers(
    router: RouterProc, router_off: RouterProc, stream: bool
) -> None:
    """Legacy /v1/completions through the router: P then D, reuse on later turns, the same text as OFF."""
    script = conversation_script(40 + int(stream), 3)
    cid = new_id("cmpl")
    prompt, on, off, reuse = "", [], [], []
    for msg in script:
        prompt += msg + "\n"
        text, verdict = _complete(router.url, prompt, cid=cid, stream=stream)
        on.append(text)
        off.append(_complete(router_off.url, prompt, cid=None, stream=stream)[0])
        reuse.append(verdict)
        prompt += text + "\n"
    assert on == off and all(on)
    assert reuse[0] == "miss" and "hit" in reuse[1:], reuse
