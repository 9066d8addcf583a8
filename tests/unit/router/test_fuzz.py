"""Property test of the HTTP surface: whatever a client sends, the answer is a valid completion or a
well-formed OpenAI error, never a 5xx, and another conversation's state never changes. The cases and the
checks are bench/_http_cases.py's; ``python -m bench.fuzz`` runs tens of thousands of them over sockets."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from agentkv._constants import BODY_ID_FIELDS
from agentkv.server.router import create_app
from bench._http_cases import MAX_BODY_BYTES, SENTINEL, answer_problems, requests, touches_sentinel

from .conftest import FakeEngines
from .conftest import settings as router_settings

RAN = {"cases": 0}
STATUSES: Counter[int] = Counter()


def test_http_surface_fuzz(report: Any) -> None:
    engines = FakeEngines()
    app = create_app(
        router_settings(max_body_bytes=MAX_BODY_BYTES), transport=httpx.MockTransport(engines.handle)
    )
    router = app.state.router
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router.test")
    sentinel_body = {"messages": [{"role": "user", "content": "keep me"}]}
    r = loop.run_until_complete(
        client.post("/v1/chat/completions", json=sentinel_body, headers={"x-session-id": SENTINEL})
    )
    assert r.status_code == 200
    sentinel = loop.run_until_complete(router.store.get(f"-/{SENTINEL}"))

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(requests)
    def case(request: tuple[Any, ...]) -> None:
        (method, path), content, headers, conversation_id = request
        if touches_sentinel(content, headers, conversation_id):
            return
        url = path.replace("{id}", urllib.parse.quote(conversation_id, safe="") or "x")
        resp = loop.run_until_complete(client.request(method, url, content=content, headers=headers))
        RAN["cases"] += 1
        STATUSES[resp.status_code] += 1
        assert not answer_problems(resp.status_code, resp.headers.get("content-type", ""), resp.text, content)
        assert loop.run_until_complete(router.store.get(f"-/{SENTINEL}")) == sentinel

    try:
        case()
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
        report(f"fuzzed the router's HTTP surface with {RAN['cases']} requests, statuses {dict(STATUSES)}")
    assert RAN["cases"] > 100


@pytest.mark.parametrize("field", BODY_ID_FIELDS)
def test_a_case_naming_the_sentinel_in_any_body_id_field_is_skipped(field: str) -> None:
    """The router takes a conversation id from each of these fields; a case that names the sentinel in one
    of them would change it (hypothesis draws `SENTINEL`, a constant of the code, for any string)."""
    assert touches_sentinel(json.dumps({field: SENTINEL}).encode(), {}, "other")
    assert not touches_sentinel(json.dumps({field: "other"}).encode(), {}, "other")
    assert not touches_sentinel(b"\xff not json", {}, "other")
