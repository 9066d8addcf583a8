"""Property test of the HTTP surface: whatever a client sends, the answer is a valid completion or a
well-formed OpenAI error, never a 500, and another conversation's state never changes."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections import Counter
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv.server.router import create_app

from .conftest import FakeEngines
from .conftest import settings as router_settings

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
ids = st.one_of(
    st.text(alphabet="abc.:_-XYZ019", min_size=1, max_size=10),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=140),
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool", "system"]) | json_values},
        optional={"content": json_values, "tool_calls": json_values, "name": json_values},
    ),
    max_size=3,
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["tiny", "nope"]) | json_values,
        "messages": messages | json_values,
        "prompt": st.text(max_size=20) | json_values,
        "stream": st.booleans() | json_values,
        "max_tokens": st.integers(-2, 5) | json_values,
        "conversation_id": ids | json_values,
        "session_id": ids,
        "prompt_cache_key": ids,
        "kv_transfer_params": json_values,
        "stream_options": json_values,
    },
)
requests = st.tuples(
    st.sampled_from(
        [
            ("POST", "/v1/chat/completions"),
            ("POST", "/v1/completions"),
            ("GET", "/v1/conversations/{id}"),
            ("POST", "/v1/conversations/{id}/heartbeat"),
            ("DELETE", "/v1/conversations/{id}"),
            ("GET", "/v1/models"),
            ("PUT", "/v1/chat/completions"),
        ]
    ),
    st.one_of(
        bodies.map(lambda b: json.dumps(b).encode()),
        st.binary(max_size=64),
        st.binary(min_size=4000, max_size=6000),  # around the 4096-byte body limit: 413 or a parse error
    ),
    st.dictionaries(st.sampled_from(["x-session-id", "x-conversation-id", "authorization"]), ids, max_size=2),
    ids,
)

RAN = {"cases": 0}
STATUSES: Counter[int] = Counter()


def test_http_surface_fuzz(report: Any) -> None:
    engines = FakeEngines()
    app = create_app(router_settings(max_body_bytes=4096), transport=httpx.MockTransport(engines.handle))
    router = app.state.router
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router.test")
    sentinel_body = {"messages": [{"role": "user", "content": "keep me"}]}
    r = loop.run_until_complete(
        client.post("/v1/chat/completions", json=sentinel_body, headers={"x-session-id": "sentinel"})
    )
    assert r.status_code == 200
    sentinel = loop.run_until_complete(router.store.get("-/sentinel"))

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(requests)
    def case(request: tuple[Any, ...]) -> None:
        (method, path), content, headers, conversation_id = request
        if conversation_id == "sentinel":
            conversation_id = "not-the-sentinel"
        headers = {k: ("not-the-sentinel" if v == "sentinel" else v) for k, v in headers.items()}
        url = path.replace("{id}", urllib.parse.quote(conversation_id, safe="") or "x")
        try:
            if json.loads(content).get("conversation_id") == "sentinel":
                return
        except (ValueError, AttributeError):
            pass
        resp = loop.run_until_complete(client.request(method, url, content=content, headers=headers))
        RAN["cases"] += 1
        STATUSES[resp.status_code] += 1
        assert resp.status_code != 500 and resp.status_code < 502, resp.text
        if resp.status_code >= 400:
            body = resp.json()
            assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        elif resp.headers.get("content-type", "").startswith("text/event-stream"):
            assert resp.text.rstrip().endswith("data: [DONE]")
        assert "kv_transfer_params" not in resp.text or "kv_transfer_params" in content.decode(
            errors="replace"
        )
        assert loop.run_until_complete(router.store.get("-/sentinel")) == sentinel

    try:
        case()
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
        report(f"fuzzed the router's HTTP surface with {RAN['cases']} requests, statuses {dict(STATUSES)}")
    assert RAN["cases"] > 100
