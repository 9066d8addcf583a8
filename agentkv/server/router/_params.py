"""`kv_transfer_params` on the client side of the router: none comes in from a client, none goes out."""

from __future__ import annotations

import json
from typing import Any

from agentkv._constants import BODY_ID_FIELDS
from agentkv._wire import KV_KEY

__all__ = ["strip_client_fields", "strip_kv_json"]

_KV_BYTES = KV_KEY.encode()


def strip_client_fields(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Drop the conversation-id fields and any client `kv_transfer_params` (a client must not steer
    NIXL reads). Returns the cleaned copy and whether kv params were dropped."""
    clean = {k: v for k, v in body.items() if k not in BODY_ID_FIELDS and k != KV_KEY}
    return clean, KV_KEY in body


def strip_kv_json(data: bytes) -> tuple[bytes, dict[str, Any] | None, Any]:
    """Remove `kv_transfer_params` from a JSON document (top level, or in the `response` object a Responses
    API event embeds). Returns (bytes to forward, the params, parsed).

    Only documents that mention the key are re-serialised, so ordinary chunks stream byte for byte."""
    if _KV_BYTES not in data:
        return data, None, None
    try:
        obj = json.loads(data)
    except ValueError:
        return data, None, None
    if not isinstance(obj, dict):
        return data, None, obj
    # The Responses API's stream events carry them inside the response object they embed.
    holder = obj["response"] if isinstance(obj.get("response"), dict) else obj
    if KV_KEY not in holder:
        return data, None, obj
    params = holder.pop(KV_KEY)
    return json.dumps(obj, separators=(",", ":")).encode(), params if isinstance(params, dict) else None, obj
