"""Request bodies parsed by msgspec instead of the standard library in vLLM's API server (part of agentkv's
vLLM plugin, `_vllm_plugin`; `AGENTKV_FAST_JSON`).

Every token-path hop hands vLLM the whole conversation's ids as a JSON list (the prefill hop's `token_ids`,
or decode's forwarded ids where they are not packed), and starlette's `Request.json`, which FastAPI and
vLLM's handlers call, parses it with `json.loads`: 10 ms for a 131k-id body on a 2-core CPU, 4.9 ms with
msgspec (which vLLM itself depends on). Same values out: msgspec decodes standard JSON to the same Python
objects (dicts keep the last of a duplicated key, integers of any size, correctly rounded floats); anything
it refuses (`NaN`, UTF-16 bodies, lone surrogates, malformed JSON) goes to `json.loads` as before, so what
the standard library accepts is still accepted and what it rejects still raises its `JSONDecodeError`
(FastAPI's 422).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from typing import Any

__all__ = ["install", "loads"]

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


async def _json(self: Any) -> Any:
    # starlette's own Request.json, with `loads` for `json.loads` (same cache attribute).
    if not hasattr(self, "_json"):
        body = await self.body()
        self._json = loads(body)
    return self._json


_json.agentkv_wrapped = True  # type: ignore[attr-defined]


def install() -> bool:
    """Parse request bodies with `loads` in this process's starlette; True when in place."""
    try:
        import msgspec  # noqa: F401
        from starlette.requests import Request
    except ImportError:
        logger.warning("AGENTKV_FAST_JSON: msgspec or starlette missing; request JSON stays json.loads")
        return False
    if getattr(Request.json, "agentkv_wrapped", False):
        return True
    if list(inspect.signature(Request.json).parameters) != ["self"]:
        logger.warning(
            "AGENTKV_FAST_JSON: this starlette's Request.json differs; request JSON stays json.loads"
        )
        return False
    Request.json = _json  # type: ignore[method-assign]
    return True
