"""Request bodies parsed and JSON answers encoded by msgspec instead of the standard library in vLLM's API
server (part of agentkv's vLLM plugin, `agentkv.server.engine.plugin`; `AGENTKV_FAST_JSON`).

Every token-path hop hands vLLM the whole conversation's ids as a JSON list (the prefill hop's `token_ids`,
or decode's forwarded ids where they are not packed), and starlette's `Request.json`, which FastAPI and
vLLM's handlers call, parses it with `json.loads`: 10 ms for a 131k-id body on a 2-core CPU, 4.9 ms with
msgspec (which vLLM itself depends on). Same values out: msgspec decodes standard JSON to the same Python
objects (dicts keep the last of a duplicated key, integers of any size, correctly rounded floats); anything
it refuses (`NaN`, UTF-16 bodies, lone surrogates, malformed JSON) goes to `json.loads` as before, so what
the standard library accepts is still accepted and what it rejects still raises its `JSONDecodeError`
(FastAPI's 422).

Responses likewise: starlette's `JSONResponse.render` (every JSON answer of vLLM's API server, the token
path's render answer with the conversation's ids among them: `json.dumps` of a 131k-id answer ~20 ms, msgspec
under 1 ms) encodes with msgspec where the content holds only what the standard library encodes to the same
values: dicts with str keys, lists, tuples, str, int, bool, None and finite floats. msgspec would write a
non-finite float as `null` where starlette's `allow_nan=False` raises, and encodes types the standard library
refuses; such content, and anything msgspec fails on, goes to `json.dumps` as before. Floats may be spelled
differently (`1e-7` for `1e-07`), never valued differently.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
from array import array
from typing import Any

__all__ = ["dumps", "install", "loads"]

logger = logging.getLogger("vllm.agentkv.fast_json")


@functools.cache
def _decoder() -> Any:
    import msgspec

    return msgspec.json.Decoder()


def loads(body: bytes | str) -> Any:
    """`json.loads`, through msgspec where it decodes the body."""
    import msgspec

    try:
        return _decoder().decode(body)
    except msgspec.DecodeError:
        return json.loads(body)


@functools.cache
def _encoder() -> Any:
    import msgspec

    return msgspec.json.Encoder()


def _plain(value: Any) -> bool:
    """Whether msgspec encodes ``value`` to the values `json.dumps(allow_nan=False)` would."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is float:
        return math.isfinite(value)
    if kind is list or kind is tuple:
        try:
            # In C, for the id lists that make answers long: every item an integer. One that only has an
            # `__index__` (a numpy integer) passes here and makes msgspec raise, so `dumps` falls back.
            array("q", value)
            return True
        except (TypeError, OverflowError):
            return all(_plain(v) for v in value)
    if kind is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    return False


def dumps(content: Any) -> bytes:
    """starlette's `JSONResponse.render`, through msgspec where that encodes the same values."""
    if _plain(content):
        try:
            encoded: bytes = _encoder().encode(content)
            return encoded
        except (TypeError, ValueError, OverflowError):
            pass  # e.g. a lone surrogate: the standard library raises it below, as before
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def _render(self: Any, content: Any) -> bytes:
    return dumps(content)


_render.agentkv_wrapped = True  # type: ignore[attr-defined]


async def _json(self: Any) -> Any:
    # starlette's own Request.json, with `loads` for `json.loads` (same cache attribute).
    if not hasattr(self, "_json"):
        body = await self.body()
        self._json = loads(body)
    return self._json


_json.agentkv_wrapped = True  # type: ignore[attr-defined]


def install() -> bool:
    """Parse request bodies with `loads` and encode JSON responses with `dumps` in this process's starlette;
    True when both are in place."""
    try:
        import msgspec  # noqa: F401
        from starlette.requests import Request
        from starlette.responses import JSONResponse
    except ImportError:
        logger.warning("AGENTKV_FAST_JSON: msgspec or starlette missing; JSON stays the standard library's")
        return False
    parsed = _patch(Request, "json", _json, ["self"], "request JSON stays json.loads")
    encoded = _patch(JSONResponse, "render", _render, ["self", "content"], "responses stay json.dumps")
    return parsed and encoded


def _patch(owner: type, name: str, replacement: Any, parameters: list[str], otherwise: str) -> bool:
    """``replacement`` in place of ``owner.name`` where that still takes ``parameters``; True when ours."""
    current = getattr(owner, name)
    if getattr(current, "agentkv_wrapped", False):
        return True
    if list(inspect.signature(current).parameters) != parameters:
        logger.warning(
            "AGENTKV_FAST_JSON: this starlette's %s.%s differs; %s", owner.__name__, name, otherwise
        )
        return False
    setattr(owner, name, replacement)
    return True
