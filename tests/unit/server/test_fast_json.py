"""agentkv's request JSON through msgspec (`_fast_json`): the same values as `json.loads`, its errors where
msgspec refuses a body, and FastAPI + starlette (the real ones vLLM's API server runs) serving through it."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel
from starlette.requests import Request

from agentkv.server import _fast_json
from agentkv.server._fast_json import loads

fastapi = pytest.importorskip("fastapi")  # vLLM's API server framework (installed with vLLM)

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30,
)


@given(JSON, st.booleans())
def test_values_equal_the_standard_librarys(value: Any, ascii_only: bool) -> None:
    body = json.dumps(value, ensure_ascii=ascii_only)
    assert loads(body.encode()) == json.loads(body.encode()) == loads(body)


def test_bodies_msgspec_refuses_get_json_loads_result_or_error() -> None:
    assert math.isnan(loads(b'{"a": NaN}')["a"])  # not JSON, but json.loads accepts it
    assert loads('{"a": [1, 2]}'.encode("utf-16")) == {"a": [1, 2]}  # json.loads detects the encoding
    assert loads(b'{"a": 1, "a": 2}') == {"a": 2}  # the last of a duplicated key, as json.loads
    with pytest.raises(json.JSONDecodeError):
        loads(b'{"a": ')


class Body(BaseModel):
    token_ids: list[int]


async def test_fastapi_parses_bodies_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Request, "json", Request.json)  # restored after the test
    assert _fast_json.install() and getattr(Request.json, "agentkv_wrapped", False)
    parsed: list[Any] = []
    monkeypatch.setattr(_fast_json, "loads", lambda body: parsed.append(body) or json.loads(body))

    app = fastapi.FastAPI()

    @app.post("/model")
    async def by_model(body: Body) -> dict[str, int]:
        return {"n": len(body.token_ids)}

    @app.post("/raw")
    async def by_request(request: Request) -> dict[str, int]:
        return {"n": len((await request.json())["token_ids"])}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        for path in ("/model", "/raw"):
            r = await client.post(path, json={"token_ids": list(range(1000))})
            assert r.status_code == 200 and r.json() == {"n": 1000}
        bad = await client.post(
            "/model", content=b'{"token_ids": [1,', headers={"content-type": "application/json"}
        )
        assert bad.status_code == 422  # FastAPI's answer to malformed JSON, as with json.loads
    assert len(parsed) == 3
