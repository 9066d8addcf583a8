"""Warm-up of a prefill/decode pair: both NIXL handshakes happen before a user's turn has to wait for them.

NIXL connects lazily. Decode's first read of prefill's blocks and prefill's first pull from decode each begin
with a handshake (agent metadata over the side channel, then the transport's connection): 40-58 ms on the
first pull on an H200, tens of seconds on a loaded 2-core machine. Two turns through the pair pay both:
turn 1 (prefill computes, decode reads from prefill) and turn 2, which extends turn 1 so that prefill pulls
what decode retained. The prompt is long enough to pass vLLM's ``kv_recompute_threshold``; a prefill whose
cost model has already learned its rates may still decline the pull, which the report shows.

Every hop carries a fresh ``cache_salt``: no other request can ever hit the warm-up's KV in a prefix cache
(this matters on stock engines, where a prefill may read shifted blocks from an uncut offer). Leases the
warm-up leaves on decode are released at the end.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from agentkv._constants import SERVICE_KEY, SERVICE_TOKEN_ENV, service_headers
from agentkv._exceptions import WarmUpError
from agentkv._wire import KV_KEY, decode_body, prefill_body
from agentkv.server.launch._versions import check_versions, engine_version

__all__ = ["WarmUpReport", "warm_up_pair"]

# ~2 tokens a word with common tokenizers: a few hundred tokens, well above vLLM's default recompute
# threshold (64) and any block size, and small enough for the shortest max_model_len worth serving.
_WORDS = 160


@dataclass(frozen=True, kw_only=True)
class WarmUpReport:
    prefill: str
    decode: str
    first_turn_ms: float  # turn 1, both hops: includes decode's first read of prefill's blocks
    pull_ms: float  # turn 2's prefill hop: includes prefill's first pull from decode
    pulled_tokens: int  # prompt tokens prefill read from decode on turn 2 (0: it computed them)
    released: int  # leases released on decode afterwards


def warm_up_pair(
    *, prefill_url: str, decode_url: str, client: httpx.Client | None = None, timeout_s: float = 600.0
) -> WarmUpReport:
    """Run the two warm-up turns through one prefill/decode pair; raises WarmUpError if a hop fails and
    EngineVersionError if the two run different vLLM releases or one agentkv does not support."""
    own = client is None
    http = client or httpx.Client(timeout=timeout_s)
    try:
        model = _model(http, prefill_url)
        # Before the first turn: a pair of different releases fails (or worse, does not) at the handshake.
        check_versions(
            {
                f"prefill {prefill_url}": engine_version(http, prefill_url),
                f"decode {decode_url}": engine_version(http, decode_url),
            }
        )
        words = " ".join(f"w{i}" for i in range(_WORDS))
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"agentkv warm-up: {words}"}]
        base = {"model": model, "messages": messages, "temperature": 0}
        started = time.perf_counter()
        retained, text, _ = _turn(http, prefill_url, decode_url, {**base, "max_tokens": 4}, retained=None)
        first_ms = (time.perf_counter() - started) * 1e3
        messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
        started = time.perf_counter()
        again, _, pulled = _turn(
            http, prefill_url, decode_url, {**base, "messages": messages, "max_tokens": 1}, retained=retained
        )
        pull_ms = (time.perf_counter() - started) * 1e3
        # Turn 1's lease is gone if prefill read it; release it anyway in case prefill declined the pull.
        released = sum(_release(http, params) for params in (retained, again))
        return WarmUpReport(
            prefill=prefill_url,
            decode=decode_url,
            first_turn_ms=round(first_ms, 1),
            pull_ms=round(pull_ms, 1),
            pulled_tokens=pulled,
            released=released,
        )
    finally:
        if own:
            http.close()


def _model(http: httpx.Client, prefill_url: str) -> str:
    resp = _call(http, "GET", f"{prefill_url}/v1/models", "prefill /v1/models")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise WarmUpError(f"warm-up: prefill {prefill_url} lists no model") from exc


def _turn(
    http: httpx.Client,
    prefill_url: str,
    decode_url: str,
    body: dict[str, Any],
    *,
    retained: dict[str, Any] | None,
) -> tuple[dict[str, Any] | None, str, int]:
    """P then D, the router's wire format. Returns decode's params, its text and the tokens P pulled."""
    salt = f"agentkv-warm-up-{uuid.uuid4().hex}"
    rid = f"warm-up-{uuid.uuid4().hex[:12]}"
    headers = {"X-Request-Id": rid}
    p_body = {**prefill_body(body, retained), "cache_salt": salt}
    p = _call(http, "POST", f"{prefill_url}/v1/chat/completions", "prefill hop", json=p_body, headers=headers)
    p_json = p.json()
    usage = p_json.get("usage") or {}
    pulled = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    d_body = decode_body(body, p_json.get(KV_KEY), cache_salt=salt)
    d = _call(http, "POST", f"{decode_url}/v1/chat/completions", "decode hop", json=d_body, headers=headers)
    d_json = d.json()
    text = str(((d_json.get("choices") or [{}])[0].get("message") or {}).get("content") or "")
    params = d_json.get(KV_KEY)
    return (params if isinstance(params, dict) else None), text, pulled


def _release(http: httpx.Client, params: dict[str, Any] | None) -> int:
    service, rid = (params or {}).get(SERVICE_KEY), (params or {}).get("remote_request_id")
    if not service or not rid:
        return 0  # a stock decode: its fixed TTL frees the blocks
    try:
        headers = service_headers(os.environ.get(SERVICE_TOKEN_ENV))
        return int(http.delete(f"{service}/agentkv/v1/leases/{rid}", headers=headers).status_code == 200)
    except httpx.HTTPError:
        return 0  # the lease runs out on its own; nothing is wrong with the pair


def _call(http: httpx.Client, method: str, url: str, hop: str, **kwargs: Any) -> httpx.Response:
    try:
        resp = http.request(method, url, **kwargs)
    except httpx.HTTPError as exc:
        raise WarmUpError(f"warm-up {hop} to {url} failed: {exc!r}") from exc
    if resp.status_code != 200:
        raise WarmUpError(f"warm-up {hop} to {url} answered {resp.status_code}: {resp.text[:300]}")
    return resp
