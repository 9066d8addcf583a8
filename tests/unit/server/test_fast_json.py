"""agentkv's request and response JSON through msgspec (`_fast_json`): the same values as `json.loads` and
starlette's `json.dumps`, their errors where msgspec would differ, and FastAPI + starlette (the real ones
vLLM's API server runs) serving through it."""

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
from starlette.responses import JSONResponse

from agentkv.server.engine.plugin import _fast_json
from agentkv.server.engine.plugin._fast_json import dumps, loads

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


def _starlette(value: Any) -> bytes:
    # starlette's own JSONResponse.render, spelled out: what `dumps` stands in for.
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        return any(_has_float(v) for v in value.values())
    return isinstance(value, list) and any(_has_float(v) for v in value)


@given(JSON)
def test_responses_encode_the_standard_librarys_values(value: Any) -> None:
    out = dumps(value)
    assert json.loads(out) == json.loads(_starlette(value))
    if not _has_float(value):
        assert out == _starlette(value)  # byte for byte; floats may be spelled differently (1e-7, 1e-07)


def test_responses_msgspec_would_encode_differently_get_the_standard_librarys_result_or_error() -> None:
    np = pytest.importorskip("numpy")
    ids = list(range(1000))
    assert dumps({"token_ids": ids, "t": 0.5}) == _starlette({"token_ids": ids, "t": 0.5})
    for bad in ({"logprob": float("-inf")}, {"ids": [1, 2, float("nan")]}):
        with pytest.raises(ValueError, match="Out of range float"):  # msgspec would write null
            dumps(bad)
    with pytest.raises(UnicodeEncodeError):
        dumps({"text": "a\ud800b"})
    with pytest.raises(TypeError):  # not JSON for the standard library; msgspec must not encode it either
        dumps({"ids": [1, np.int64(2)]})
    assert dumps({1: "a", "b": (1, None, True)}) == _starlette({1: "a", "b": (1, None, True)})
    assert dumps([2**70, -(2**70)]) == _starlette([2**70, -(2**70)])


async def test_fastapi_answers_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(JSONResponse, "render", JSONResponse.render)  # restored after the test
    monkeypatch.setattr(Request, "json", Request.json)
    assert _fast_json.install() and getattr(JSONResponse.render, "agentkv_wrapped", False)
    encoded: list[Any] = []
    real = _fast_json.dumps
    monkeypatch.setattr(_fast_json, "dumps", lambda content: encoded.append(content) or real(content))

    app = fastapi.FastAPI()

    @app.get("/explicit")
    async def explicit() -> JSONResponse:  # vLLM's render route answers this way
        return JSONResponse(content={"token_ids": list(range(1000)), "model": "m"})

    @app.get("/model")
    async def by_model() -> Body:
        return Body(token_ids=[1, 2, 3])

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.get("/explicit")
        assert r.status_code == 200 and r.json() == {"token_ids": list(range(1000)), "model": "m"}
        assert r.headers["content-length"] == str(len(r.content))
        r = await client.get("/model")
        assert r.status_code == 200 and r.json() == {"token_ids": [1, 2, 3]}
    # The explicit JSONResponse went through `dumps`; FastAPI serialises a returned model with pydantic's own
    # encoder, which never reaches JSONResponse.render.
    assert encoded == [{"token_ids": list(range(1000)), "model": "m"}]
