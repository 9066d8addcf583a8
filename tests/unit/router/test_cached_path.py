"""The path of a turn whose decode retains nothing reusable but still caches the conversation's blocks."""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import httpx
import pytest

from agentkv.server.router import Backend, CostModel, choose_path
from agentkv.server.router._backend import BackendState
from agentkv.server.router._lease import LeaseClient
from agentkv.server.router._policy import PathDecision

from .conftest import FakeEngines, store_of

CONTEXT = 100_000


def _decide(model: CostModel, *, cached: int, new: int = 512, load: int = 0, **kw: object) -> PathDecision:
    args: dict[str, object] = {
        "policy": "auto",
        "reuse_ok": False,
        "new_tokens": new,
        "decode_outstanding": load,
        "local_max_tokens": 4096,
        "model": model,
        "cached_tokens": cached,
    }
    args.update(kw)
    return choose_path(**args)  # type: ignore[arg-type]


def _trained() -> CostModel:
    """Lines of one H100-like shape: a P/D turn costs 40 ms plus 0.1 ms a computed token; decode-local
    20 ms plus 0.1 ms a token plus 1 us a token of context."""
    model = CostModel()
    for n, c in [(256, 10_000), (512, 50_000), (1024, 100_000), (2048, 20_000)]:
        model.pd.observe(n, 40 + 0.1 * n, context=c)
        model.local.observe(n, 20 + 0.1 * n + 0.001 * c, context=c)
    return model


def test_nothing_cached_recomputes() -> None:
    assert _decide(_trained(), cached=0).path == "recompute"


def test_a_cached_conversation_goes_decode_local() -> None:
    decision = _decide(_trained(), cached=CONTEXT)
    assert decision.path == "decode-local"
    assert f"decode caches ~{CONTEXT}" in decision.reason


def test_learning_goes_local_on_an_idle_decode_or_over_a_long_cached_prefix() -> None:
    assert _decide(CostModel(), cached=CONTEXT).path == "decode-local"
    # Busy: local where the cached prefix is >= 8 suffixes (a recompute costs that many), else recompute.
    assert _decide(CostModel(), cached=CONTEXT, load=1).path == "decode-local"
    assert _decide(CostModel(), cached=8 * 512, load=1).path == "decode-local"
    assert _decide(CostModel(), cached=8 * 512 - 1, load=1).path == "recompute"


def test_the_restore_from_the_host_tier_is_priced() -> None:
    # Local ~(20 + 51 + 100) ms against a recompute ~10 s: a restore of 9 s still goes local, one of 11 s not.
    assert _decide(_trained(), cached=CONTEXT, restore_ms=9_000).path == "decode-local"
    decision = _decide(_trained(), cached=CONTEXT, restore_ms=11_000)
    assert decision.path == "recompute" and "restore ~11000.0" in decision.reason


def test_a_suffix_over_the_local_cap_recomputes_unless_the_cached_prefix_is_many_times_longer() -> None:
    assert _decide(_trained(), cached=CONTEXT, new=5000, local_max_tokens=4096).path == "decode-local"
    assert _decide(_trained(), cached=8 * 5000 - 1, new=5000, local_max_tokens=4096).path == "recompute"
    learning = _decide(CostModel(), cached=8 * 5000, new=5000, local_max_tokens=4096, load=2)
    assert learning.path == "decode-local"


def test_a_loaded_decode_recomputes_where_that_is_cheaper() -> None:
    # Local: (20 + 51 + 100) ms x (1 + load) against a recompute of 100,512 tokens, ~10 s: local even at 50.
    assert _decide(_trained(), cached=CONTEXT, load=50).path == "decode-local"
    # A short cached prefix: recompute ~(40 + 0.1 x 612) ms against local ~(20 + 51) ms x 10.
    assert _decide(_trained(), cached=100, load=9).path == "recompute"


@pytest.mark.parametrize(
    ("kw", "path"), [({"exact": True}, "recompute"), ({"policy": "always-pd"}, "recompute")]
)
def test_exact_and_always_pd_never_use_decodes_cache(kw: dict[str, object], path: str) -> None:
    assert _decide(_trained(), cached=CONTEXT, **kw).path == path


def test_prefill_busy_still_goes_local() -> None:
    decision = _decide(CostModel(), cached=CONTEXT, load=3, prefill_outstanding=4, prefill_queue_cap=2)
    assert decision.path == "decode-local" and decision.prefill_busy


async def test_lease_client_reads_decodes_answer() -> None:
    answers = {
        "/agentkv/v1/cached/r1": httpx.Response(200, json={"request_id": "r1", "cached_tokens": 4096}),
        "/agentkv/v1/cached/r2": httpx.Response(404, json={"error": "no"}),
        "/agentkv/v1/cached/r3": httpx.Response(200, json={"cached_tokens": "many"}),
        "/agentkv/v1/cached/r4": httpx.Response(200, json={"cached_tokens": True}),
        "/agentkv/v1/cached/r6": httpx.Response(200, json={"cached_tokens": 4096, "host_tokens": 3072}),
        # A host count above the whole is decode's mistake: never more than what it has.
        "/agentkv/v1/cached/r7": httpx.Response(200, json={"cached_tokens": 1024, "host_tokens": 3072}),
    }

    def handler(request: httpx.Request) -> httpx.Response:
        return answers.get(request.url.path, httpx.Response(500))

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        leases = LeaseClient(client=client, timeout_s=1.0)
        decode = BackendState(
            backend=Backend(name="d0", role="decode", url="http://d0:8200", control_url="http://d0:8201")
        )
        assert await leases.cached(decode, "r1") == (4096, 0)
        assert await leases.cached(decode, "r6") == (4096, 3072)
        assert await leases.cached(decode, "r7") == (1024, 1024)
        for rid in ("r2", "r3", "r4", "r5"):
            assert await leases.cached(decode, rid) == (0, 0)


CHAT = "/v1/chat/completions"
USER1 = [{"role": "user", "content": "list the files"}]


async def _chat(client: httpx.AsyncClient, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": "tiny", "messages": messages}
    return await client.post(CHAT, json=body, headers={"x-session-id": "c1"})


@pytest.mark.parametrize(("cached", "host"), [(4096, 0), (4096, 3072), (0, 0)])
async def test_a_declined_retentions_next_turn_uses_what_decode_caches(
    engines: FakeEngines,
    make_client: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    cached: int,
    host: int,
) -> None:
    asked: list[str] = []
    control = engines._control

    def with_cached(name: str, method: str, path: str, body: Any) -> httpx.Response:
        if method == "GET" and path.startswith("/agentkv/v1/cached/"):
            asked.append(path.rsplit("/", 1)[1])
            return httpx.Response(200, json={"cached_tokens": cached, "host_tokens": host})
        return control(name, method, path, body)

    monkeypatch.setattr(engines, "_control", with_cached)
    async with make_client(path_policy="auto") as client:
        first = (await _chat(client, USER1)).json()
        store = store_of(client)
        record = await store.get("-/c1")
        # What the router keeps of a turn whose retention decode declined at its cap: no offer.
        declined = dataclasses.replace(
            record, retained=None, expires_at=None, lease_state="none", retained_tokens=0, tokens=None
        )
        assert await store.compare_and_set("-/c1", declined, expected=record.version)
        prefills = len(engines.completions("p"))
        second = [*USER1, first["choices"][0]["message"], {"role": "user", "content": "and now?"}]
        with caplog.at_level(logging.INFO, logger="agentkv.router"):
            r = await _chat(client, second)
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 200 and asked == [record.request_id]
    # The turn's log line says what decode had, whichever path the turn took: (cached, of it in the host).
    had = re.findall(r"decode_had=(\d+)/(\d+)", caplog.text)
    assert len(had) == 1 and (int(had[0][0]) > 0) == bool(cached) and (int(had[0][1]) > 0) == bool(host)
    if cached:
        assert r.headers["x-agentkv-path"] == "decode-local"
        assert r.headers["x-agentkv-reuse"] == "cached"
        assert len(engines.completions("p")) == prefills  # no P hop
        assert 'agentkv_reuse_total{result="cached"} 1.0' in metrics
        # Where some of it comes back from decode's host tier, the turn and the counter say so.
        assert r.headers["x-agentkv-tier"] == ("host" if host else "hbm")
        assert f"agentkv_host_tier_tokens_total {float(host)}" in metrics
        assert f"agentkv_host_tier_turns_total {float(bool(host))}" in metrics
    else:
        assert "x-agentkv-tier" not in r.headers
        assert r.headers["x-agentkv-path"] == "recompute"
        assert r.headers["x-agentkv-reuse"] == "miss"
        assert len(engines.completions("p")) == prefills + 1


async def test_a_turn_that_does_not_extend_the_last_asks_nothing(
    engines: FakeEngines, make_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []
    control = engines._control

    def with_cached(host: str, method: str, path: str, body: Any) -> httpx.Response:
        if path.startswith("/agentkv/v1/cached/"):
            asked.append(path)
        return control(host, method, path, body)

    monkeypatch.setattr(engines, "_control", with_cached)
    async with make_client(path_policy="auto") as client:
        await _chat(client, USER1)
        store = store_of(client)
        record = await store.get("-/c1")
        declined = dataclasses.replace(
            record, retained=None, expires_at=None, lease_state="none", tokens=None
        )
        assert await store.compare_and_set("-/c1", declined, expected=record.version)
        r = await _chat(client, [{"role": "user", "content": "something else entirely"}])
    assert r.headers["x-agentkv-path"] == "recompute" and asked == []


def _decode_caches(engines: FakeEngines, monkeypatch: pytest.MonkeyPatch, *, tokens: int, host: int) -> None:
    """Decode's `cached/` answers: `tokens` of any request still cached, `host` of them in its host tier."""
    control = engines._control

    def with_cached(name: str, method: str, path: str, body: Any) -> httpx.Response:
        if method == "GET" and path.startswith("/agentkv/v1/cached/"):
            return httpx.Response(200, json={"cached_tokens": tokens, "host_tokens": host})
        return control(name, method, path, body)

    monkeypatch.setattr(engines, "_control", with_cached)


async def test_a_demoted_conversations_next_turn_goes_decode_local_over_the_host_tier(
    engines: FakeEngines, make_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _decode_caches(engines, monkeypatch, tokens=4096, host=4096)
    engines.host_tier = {"d0.test"}
    async with make_client(path_policy="auto") as client:
        first = (await _chat(client, USER1)).json()
        beat = await client.post("/v1/conversations/c1/heartbeat", json={"tool_call": True})
        assert beat.json()["lease"]["state"] == "demoted"
        prefills = len(engines.completions("p"))
        r = await _chat(client, [*USER1, first["choices"][0]["message"], {"role": "user", "content": "42"}])
    assert (r.headers["x-agentkv-path"], r.headers["x-agentkv-reuse"]) == ("decode-local", "cached")
    assert r.headers["x-agentkv-tier"] == "host"
    assert len(engines.completions("p")) == prefills  # no P hop, no pull of the released lease


async def test_the_probe_learns_decodes_kv_bytes_per_token() -> None:
    info = {"engine_id": "D", "kv_bytes_per_token": 147456}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=info)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        leases = LeaseClient(client=client, timeout_s=1.0)
        decode = BackendState(
            backend=Backend(name="d0", role="decode", url="http://d0:8200", control_url="http://d0:8201")
        )
        assert await leases.probe(decode) and decode.kv_bytes_per_token == 147456
        info["kv_bytes_per_token"] = None  # a decode that does not know (or an older agentkv)
        assert await leases.probe(decode) and decode.kv_bytes_per_token is None


async def test_a_demoted_conversations_prompt_that_matches_some_blocks_uses_those(
    engines: FakeEngines, make_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the token path, a demoted conversation's next prompt that drops the last answer (a format-error
    retry) still shares whole blocks with what decode had: the turn goes decode-local over those, counted up
    to the last whole block the router proves equal, not over decode's whole count."""
    from .test_block_digests import USER1 as ASK
    from .test_block_digests import render_ids, whole_matching_blocks

    _decode_caches(engines, monkeypatch, tokens=10_000, host=10_000)
    engines.renders = True
    engines.host_tier = {"d0.test"}
    retry = [*ASK, {"role": "user", "content": "format error: answer with one command"}]
    async with make_client(tokens=True, path_policy="auto") as client:
        await _chat(client, ASK)
        assert (await client.post("/v1/conversations/c1/heartbeat", json={"tool_call": True})).json()[
            "lease"
        ]["state"] == "demoted"
        r = await _chat(client, retry)
    first, second = (render_ids(b) for b, _ in engines.requests("p", "/v1/chat/completions/render"))
    want = whole_matching_blocks(first, second, 4)
    assert 0 < want < len(first)
    assert (r.headers["x-agentkv-path"], r.headers["x-agentkv-reuse"]) == ("decode-local", "cached")
    assert int(r.headers["x-agentkv-reused-tokens"]) == want and r.headers["x-agentkv-tier"] == "host"
