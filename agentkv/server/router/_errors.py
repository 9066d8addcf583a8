"""OpenAI-style error bodies. Every error the router answers goes through here, so none leaks internals."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

from agentkv._exceptions import APIStatusError

__all__ = [
    "client_error",
    "error_body",
    "error_response",
    "sanitise_upstream_error",
]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}
# Upstream messages are echoed to clients; bound them so a chatty engine cannot bloat responses.
_MAX_MESSAGE = 2000


def error_body(status: int, message: str, *, param: str | None = None, code: Any = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def client_error(status: int, message: str, *, param: str | None = None, code: Any = None) -> APIStatusError:
    """The exception request handling raises; `error_response` turns it into the HTTP answer."""
    body = error_body(status, message, param=param, code=code)
    return APIStatusError(message, status_code=status, error_type=body["error"]["type"], body=body)


def error_response(exc: APIStatusError, headers: dict[str, str] | None = None) -> JSONResponse:
    body = exc.body if isinstance(exc.body, dict) else error_body(exc.status_code, str(exc))
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def sanitise_upstream_error(status: int, content: bytes) -> APIStatusError:
    """An engine's 4xx passes through with its message, re-built so nothing but the OpenAI fields leaves."""
    message, kind, param, code = f"upstream error {status}", None, None, None
    try:
        data = json.loads(content)
    except ValueError:
        data = None
    err = data.get("error", data) if isinstance(data, dict) else None
    if isinstance(err, dict):
        if isinstance(err.get("message"), str):
            message = err["message"][:_MAX_MESSAGE]
        kind = err.get("type") if isinstance(err.get("type"), str) else None
        param = err.get("param") if isinstance(err.get("param"), str) else None
        code = err.get("code") if isinstance(err.get("code"), (str, int)) else None
    body = error_body(status, message, param=param, code=code)
    if kind:
        body["error"]["type"] = kind
    return APIStatusError(message, status_code=status, error_type=body["error"]["type"], body=body)
