"""The hot path: bookkeeping after the last byte (lock still held), no retention round trip when the
answer carried decode's params, cached metric children, and quiet upstream logging."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from agentkv.server.router import create_app, run_router
from agentkv.server.router._metrics import RouterMetrics

from .conftest import FakeEngines, settings
from .test_turns import CHAT, USER1, sse_data

RETAINED = "/agentkv/v1/retained/"


def _client(engines: FakeEngines, log: list[str], on_complete: Any = None) -> httpx.AsyncClient:
    """A router whose engine calls and completed responses land in one ordered `log`."""

    async def engine(request: httpx.Request) -> httpx.Response:
        log.append(request.url.path)
        return await engines.handle(request)

    app = create_app(settings(), transport=httpx.MockTransport(engine))

    async def recorded(scope: Any, receive: Any, send: Any) -> None:
        async def send_and_log(message: dict[str, Any]) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log.append("response complete")
                if on_complete is not None:
                    on_complete()

        await app(scope, receive, send_and_log)

    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=recorded), base_url="http://router.test")
    client.app = app  # type: ignore[attr-defined]
    return client


async def test_stream_bookkeeping_runs_after_the_last_byte_and_holds_the_lock(engines: FakeEngines) -> None:
    # vLLM 0.32 streams carry no params, so the router asks decode's retention service: after the client
    # has [DONE], while a second turn of the same conversation already waits for the lock.
    engines.reply = lambda body: {"content": "one two"}
    log: list[str] = []
    second: list[asyncio.Task[httpx.Response]] = []
    follow_up = [*USER1, {"role": "assistant", "content": "one two"}, {"role": "user", "content": "more"}]

    def start_second_turn() -> None:
        if not second:
            body = {"model": "tiny", "messages": follow_up, "stream": True}
            second.append(asyncio.create_task(client.post(CHAT, json=body, headers={"x-session-id": "c1"})))

    async with _client(engines, log, start_second_turn) as client:
        body = {"model": "tiny", "messages": USER1, "stream": True}
        r = await client.post(CHAT, json=body, headers={"x-session-id": "c1"})
        r2 = await second[0]
    assert sse_data(r.text)[-1] == "[DONE]"
    first_done = log.index("response complete")
    lookups = [i for i, entry in enumerate(log) if entry.startswith(RETAINED)]
    assert lookups and lookups[0] > first_done
    # Without the lock held through the bookkeeping, the second turn would find nothing stored: a miss.
    assert r2.headers["x-agentkv-reuse"] == "hit"


async def test_json_answer_with_params_needs_no_retention_lookup(engines: FakeEngines) -> None:
    log: list[str] = []
    stored_at_completion: list[Any] = []

    def note_store() -> None:
        stored_at_completion.append(client.app.state.router.store._data.get("-/c1"))  # type: ignore[attr-defined]

    async with _client(engines, log, note_store) as client:
        r = await client.post(CHAT, json={"model": "tiny", "messages": USER1}, headers={"x-session-id": "c1"})
        record = await client.app.state.router.store.get("-/c1")  # type: ignore[attr-defined]
    assert not [entry for entry in log if entry.startswith(RETAINED)]
    # The lease our connector took at the last byte is the service's lease_s (30 s in the fake's /info).
    assert r.headers["x-agentkv-lease-expires-in"] == "30.0"
    assert stored_at_completion == [None]  # stored only after the client had the answer
    assert record is not None and record.lease_state == "held" and record.retained is not None


async def test_json_answer_without_params_still_asks_the_service(engines: FakeEngines) -> None:
    engines.d_params_in_body = False
    log: list[str] = []
    async with _client(engines, log) as client:
        r = await client.post(CHAT, json={"model": "tiny", "messages": USER1}, headers={"x-session-id": "c1"})
    lookups = [i for i, entry in enumerate(log) if entry.startswith(RETAINED)]
    # The lease header needs the answer, so here the lookup comes before the response.
    assert lookups and lookups[0] < log.index("response complete")
    assert float(r.headers["x-agentkv-lease-expires-in"]) > 0


def test_metric_children_are_resolved_once_and_count_in_their_series() -> None:
    metrics = RouterMetrics()
    child = metrics.turns_by_path["pull"]
    assert metrics.turns_by_path["pull"] is child
    child.inc()
    metrics.reuse_by_result["hit"].inc(2)
    text = metrics.render().decode()
    assert 'agentkv_turns_total{path="pull"} 1.0' in text
    assert 'agentkv_reuse_total{result="hit"} 2.0' in text
    assert 'agentkv_turns_total{path="recompute"} 0.0' in text  # exported before it first moves


@pytest.mark.parametrize(("level", "expected"), [("info", logging.WARNING), ("debug", logging.DEBUG)])
def test_run_router_silences_per_request_http_logs(monkeypatch, level: str, expected: int) -> None:
    import uvicorn

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append(kwargs))
    saved = {name: logging.getLogger(name).level for name in ("httpx", "httpcore")}
    try:
        run_router(settings(log_level=level))
        assert {logging.getLogger(n).level for n in saved} == {expected}
    finally:
        for name, old in saved.items():
            logging.getLogger(name).setLevel(old)
    assert calls[0]["loop"] == "auto" and calls[0]["http"] == "auto" and calls[0]["access_log"] is False


async def test_events_read_together_are_sent_together(engines: FakeEngines) -> None:
    engines.reply = lambda body: {"content": "a b c"}
    original = engines._sse

    async def one_read(*args: Any) -> Any:
        yield b"".join([part async for part in original(*args)])

    engines._sse = one_read  # type: ignore[method-assign]
    app = create_app(settings(), transport=httpx.MockTransport(engines.handle))
    bodies: list[bytes] = []

    async def recorded(scope: Any, receive: Any, send: Any) -> None:
        async def send_and_log(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                bodies.append(message["body"])
            await send(message)

        await app(scope, receive, send_and_log)

    transport = httpx.ASGITransport(app=recorded)
    async with httpx.AsyncClient(transport=transport, base_url="http://router.test") as client:
        body = {"model": "tiny", "messages": USER1, "stream": True}
        r = await client.post(CHAT, json=body, headers={"x-session-id": "c1"})
    assert len(bodies) == 1  # one decode read, one write to the client
    assert bodies[0] == r.content and sse_data(r.text)[-1] == "[DONE]"
