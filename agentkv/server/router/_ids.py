"""Conversation ids, tenants and request validation: everything checked before any state is touched."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from agentkv._constants import ALT_SESSION_HEADERS, BODY_ID_FIELDS, CONVERSATION_ID_PATTERN, H_FINAL_TURN

from ._errors import client_error

__all__ = [
    "CHECKED_FIELDS",
    "Endpoint",
    "conversation_key",
    "extract_conversation_id",
    "final_turn",
    "new_request_id",
    "parse_body",
    "tenant_of",
    "validate_conversation_id",
]

Endpoint = Literal["chat", "completions", "messages", "responses", "count"]

_ID_RE = re.compile(CONVERSATION_ID_PATTERN)
_NO_TENANT = "-"


def new_request_id() -> str:
    """The id the router sends to P and D as X-Request-Id (and the retention service looks up)."""
    return f"agentkv-{uuid.uuid4().hex}"


def extract_conversation_id(
    headers: Mapping[str, str], body: dict[str, Any], *, session_header: str
) -> str | None:
    """First match wins: session header, x-conversation-id, then the body fields. Invalid ids are a 400."""
    for name in (session_header, *ALT_SESSION_HEADERS):
        if name in headers:
            return validate_conversation_id(headers[name], name)
    for field in BODY_ID_FIELDS:
        if field in body and body[field] is not None:
            return validate_conversation_id(body[field], field)
    return None


_TRUE, _FALSE = frozenset({"true", "1", "yes"}), frozenset({"false", "0", "no", ""})


def final_turn(headers: Mapping[str, str]) -> bool:
    """Whether the client says this is the conversation's last turn (nothing of it will be reused)."""
    value = headers.get(H_FINAL_TURN, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    # A typo must not silently keep (or drop) decode memory: say what the header accepts.
    raise client_error(400, f"invalid {H_FINAL_TURN} header: expected true or false", param=H_FINAL_TURN)


def validate_conversation_id(value: Any, where: str) -> str:
    # fullmatch, not match: `$` would accept a trailing newline.
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise client_error(
            400,
            f"invalid conversation id in {where}: expected 1-128 characters of [A-Za-z0-9._:-]",
            param=where,
            code="invalid_conversation_id",
        )
    return value


def tenant_of(authorization: str | None, api_keys: frozenset[str]) -> str:
    """The tenant a request belongs to: a hash of its API key, or one shared tenant without keys."""
    if not api_keys:
        return _NO_TENANT
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    # Compare against every key so the time taken does not depend on which one matched.
    ok = False
    for key in api_keys:
        ok |= hmac.compare_digest(token.encode(), key.encode())
    if scheme.lower() != "bearer" or not token or not ok:
        raise client_error(401, "missing or invalid API key", code="invalid_api_key")
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def conversation_key(tenant: str, conversation_id: str) -> str:
    # '/' cannot appear in a valid conversation id, so the pair is unambiguous.
    return f"{tenant}/{conversation_id}"


def _not_json(constant: str) -> Any:
    raise ValueError(constant)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


_decoder = msgspec.json.Decoder(float_hook=_finite)


def _loads(raw: bytes) -> Any:
    """The body as the standard library reads it, through msgspec where msgspec reads it (an agent's
    131k-token conversation: 0.34 instead of 0.77 ms, `bench.hop_codec`; the hooked standard parser also
    pauses for tens of ms now and then). What msgspec refuses (a byte-order mark, a lone surrogate escape, a
    non-finite number, malformed JSON) is read, or refused, as before."""
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError:
        # NaN and Infinity are not JSON (Python's parser accepts them, and 1e999 as infinity; the hops'
        # encoder would write them as null).
        return json.loads(raw, parse_constant=_not_json, parse_float=_finite)


_MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# Every top-level field `parse_body` type-checks on some endpoint; others pass to the engine as they are.
CHECKED_FIELDS = frozenset(
    {
        "messages",
        "prompt",
        "input",
        "previous_response_id",
        "background",
        "tools",
        "model",
        "stream",
        "stream_options",
        *_MAX_TOKENS_FIELDS,
    }
)


def parse_body(raw: bytes, endpoint: Endpoint) -> dict[str, Any]:
    """Decode and type-check the fields the router relies on; the engine validates the rest."""
    try:
        body = _loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise client_error(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise client_error(400, "request body must be a JSON object")
    if endpoint in ("chat", "messages", "count"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise client_error(400, "'messages' must be a non-empty array", param="messages")
        for msg in messages:
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise client_error(
                    400, "each message must be an object with a string 'role'", param="messages"
                )
        # Anthropic's API requires max_tokens, and so does vLLM's implementation of it.
        if endpoint == "messages" and "max_tokens" not in body:
            raise client_error(400, "'max_tokens' is required", param="max_tokens")
    elif endpoint == "responses":
        _check_responses(body)
    else:
        prompt = body.get("prompt")
        if not _is_prompt(prompt):
            raise client_error(400, "'prompt' must be a string or an array of strings/tokens", param="prompt")
    if "model" in body and body["model"] is not None and not isinstance(body["model"], str):
        raise client_error(400, "'model' must be a string", param="model")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise client_error(400, "'stream' must be a boolean", param="stream")
    for field in _MAX_TOKENS_FIELDS:
        value = body.get(field)
        if value is not None and (type(value) is not int or value < 1):
            raise client_error(400, f"'{field}' must be a positive integer", param=field)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise client_error(400, "'stream_options' must be an object", param="stream_options")
    return body


def _check_responses(body: dict[str, Any]) -> None:
    """The Responses API as a stateless P/D turn. Each turn may run on other engines, and vLLM keeps a
    response's state in the memory of the one engine that answered it, so what needs that state is refused:
    the client sends the whole input every turn (as with chat), agentkv keeps the KV."""
    inp = body.get("input")
    if not (isinstance(inp, str) and inp) and not (isinstance(inp, list) and inp):
        raise client_error(400, "'input' must be a non-empty string or array", param="input")
    if body.get("previous_response_id") is not None:
        raise client_error(
            400,
            "previous_response_id is not supported through agentkv: send the whole conversation as 'input'",
            param="previous_response_id",
        )
    if body.get("background"):
        raise client_error(400, "background responses are not supported through agentkv", param="background")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise client_error(400, "'tools' must be an array", param="tools")
    for tool in tools or []:
        # Built-in and MCP tools make vLLM run sub-requests that would reuse this turn's transfer.
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise client_error(
                400, "only tools of type 'function' are supported through agentkv", param="tools"
            )


def _is_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    if all(isinstance(p, str) for p in prompt):
        return True
    if all(type(p) is int for p in prompt):
        return True
    return all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompt)
