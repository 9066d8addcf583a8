"""`kv_transfer_params` handling: what P and D are sent, and making sure none reaches a client."""

from __future__ import annotations

import json
from typing import Any

from agentkv._constants import BODY_ID_FIELDS

__all__ = [
    "KV_KEY",
    "PROMPT_IDS_KEY",
    "decode_body",
    "decode_local_body",
    "prefill_body",
    "prefill_params",
    "reusable_tokens",
    "strip_client_fields",
    "strip_kv_json",
    "with_prompt_ids",
]

KV_KEY = "kv_transfer_params"
PROMPT_IDS_KEY = "prompt_token_ids"
_KV_BYTES = KV_KEY.encode()

# What a P/D prefill request carries without reuse: P keeps its blocks for D to read.
_PREFILL_BASE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def strip_client_fields(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Drop the conversation-id fields and any client `kv_transfer_params` (a client must not steer
    NIXL reads). Returns the cleaned copy and whether kv params were dropped."""
    clean = {k: v for k, v in body.items() if k not in BODY_ID_FIELDS and k != KV_KEY}
    return clean, KV_KEY in body


def prefill_params(retained: dict[str, Any] | None) -> dict[str, Any]:
    """P's params. With decode's retained params merged in, P's scheduler sees `do_remote_decode` plus
    `remote_block_ids/engine_id/request_id/host/port` and pulls `remote_num_tokens` from decode."""
    params = dict(_PREFILL_BASE)
    if retained:
        # All of decode's keys travel: tp/pp sizes, the expiry P checks against, agentkv_block_hashes.
        params.update(retained)
        # Decode answers with do_remote_decode=True already; pin both flags so P acts as producer.
        params["do_remote_decode"] = True
        params["do_remote_prefill"] = False
    return params


def prefill_body(body: dict[str, Any], retained: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for key in ("stream_options", "min_tokens"):
        out.pop(key, None)
    out[KV_KEY] = prefill_params(retained)
    return out


def decode_body(
    body: dict[str, Any],
    prefill_kv: dict[str, Any] | None,
    *,
    cache_salt: str | None = None,
    prompt_ids: list[int] | None = None,
) -> dict[str, Any]:
    out = dict(body)
    if cache_salt is not None:
        # A salt no earlier request had: decode finds nothing in its own prefix cache and loads every prompt
        # token from prefill, never KV it computed itself (exact mode; a client's salt is kept on prefill).
        out["cache_salt"] = cache_salt
    # Without P's params (P not a producer) D prefills itself; asking it to retain still enables reuse.
    out[KV_KEY] = with_prompt_ids(dict(prefill_kv) if prefill_kv else {"agentkv_retain": True}, prompt_ids)
    return out


def decode_local_body(body: dict[str, Any], *, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    # A non-empty params dict makes a bidirectional decode retain its blocks when the request finishes.
    return {**body, KV_KEY: with_prompt_ids({"agentkv_retain": True}, prompt_ids)}


def with_prompt_ids(params: dict[str, Any], prompt_ids: list[int] | None) -> dict[str, Any]:
    """Forward the prompt's ids so decode skips rendering and tokenizing (vLLM >= 0.32). Only ever ids that
    prefill rendered for this same body: vLLM does not check them against the messages."""
    if prompt_ids is not None:
        params[PROMPT_IDS_KEY] = prompt_ids
    return params


def reusable_tokens(retained: dict[str, Any], prompt_tokens: int | None) -> int:
    """What P can pull: decode's computed tokens, bounded by the new prompt (as P's scheduler does)."""
    held = retained.get("remote_num_tokens")
    held = held if isinstance(held, int) and held > 0 else 0
    return min(held, prompt_tokens) if prompt_tokens is not None else held


def strip_kv_json(data: bytes) -> tuple[bytes, dict[str, Any] | None, Any]:
    """Remove `kv_transfer_params` from a JSON document. Returns (bytes to forward, the params, parsed).

    Only documents that mention the key are re-serialised, so ordinary chunks stream byte for byte."""
    if _KV_BYTES not in data:
        return data, None, None
    try:
        obj = json.loads(data)
    except ValueError:
        return data, None, None
    if not isinstance(obj, dict) or KV_KEY not in obj:
        return data, None, obj
    params = obj.pop(KV_KEY)
    return json.dumps(obj, separators=(",", ":")).encode(), params if isinstance(params, dict) else None, obj
