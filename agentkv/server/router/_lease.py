"""Client for decode's retention service (docs/protocol.md section 2): info, retained lookup, leases."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import httpx

from agentkv._constants import service_headers

from ._backend import BackendState, Registration, block_size_of

__all__ = ["LeaseClient", "Retained"]

logger = logging.getLogger("agentkv.router")

Retained = dict[str, Any]  # the service's answer: request_id, kv_transfer_params, expires_in_s, num_tokens


# The first vLLM release whose decode takes forwarded prompt ids and whose generate route hands
# kv_transfer_params to the engine.
_TOKENS_IN = (0, 32)


# The longest decode's service may wait for a request to finish before answering a lookup (it answers as soon
# as the request has finished, retained or not); at most half the control-call timeout, so it answers in time.
_FINISH_WAIT_S = 1.0


class LeaseClient:
    """Talks to `control_url` of each decode. Every failure maps to None/False: leases are an
    optimisation, so a missing or broken service never fails a client's turn."""

    def __init__(
        self, *, client: httpx.AsyncClient, timeout_s: float, retries: int = 3, token: str | None = None
    ) -> None:
        self._client = client
        self._timeout = httpx.Timeout(timeout_s)
        self._retries = retries
        self._headers = service_headers(token)
        self._finish_wait_ms = int(min(_FINISH_WAIT_S, timeout_s / 2) * 1000)

    async def _call(self, method: str, url: str, json: Any = None) -> httpx.Response | None:
        try:
            return await self._client.request(
                method, url, json=json, headers=self._headers, timeout=self._timeout
            )
        except httpx.HTTPError:
            return None

    async def probe(self, decode: BackendState) -> bool:
        """Learn whether decode runs our service; remember its engine registration and lease length."""
        url = decode.backend.control_url
        resp = await self._call("GET", f"{url}/agentkv/v1/info") if url else None
        if resp is not None and resp.status_code == 401 and decode.retention is not False:
            # Treated as a decode without our service (no lease calls, no pulls in exact mode): safe, but
            # every turn recomputes, so say why (once, not every health round).
            logger.warning(
                "%s's retention service refused the router: set AGENTKV_SERVICE_TOKEN", decode.name
            )
        info = _json(resp) if resp is not None and resp.status_code == 200 else None
        decode.retention = info is not None
        decode.forwarded_ids = info is not None and info.get("forwarded_ids") is True
        decode.packed_ids = info is not None and info.get("packed_ids") is True
        decode.messages_cut = decode.packed_ids and info is not None and info.get("messages_cut") is True
        if info is not None:
            lease_s = info.get("lease_s")
            decode.lease_s = float(lease_s) if isinstance(lease_s, (int, float)) else None
            per_token = info.get("kv_bytes_per_token")
            decode.kv_bytes_per_token = float(per_token) if isinstance(per_token, (int, float)) else None
            engine_id = info.get("engine_id")
            if isinstance(engine_id, str):
                decode.saw_registration(
                    Registration(engine_id=engine_id, generation=info.get("registration_generation"))
                )
        return decode.retention

    async def learn_block_size(self, decode: BackendState) -> int | None:
        """Decode's KV block size from vLLM's own `/metrics`, remembered on its state."""
        if decode.block_size is None:
            resp = await self._call("GET", f"{decode.backend.url}/metrics")
            if resp is not None and resp.status_code == 200:
                decode.block_size = block_size_of(resp.text)
        return decode.block_size

    async def release_of(self, state: BackendState) -> tuple[int, int] | None:
        """The (major, minor) vLLM release an engine runs, from its `/version`, learned once per engine
        start. An answer without a usable version is remembered as (0, 0): no feature of a later release is
        assumed; no answer asks again next time."""
        if state.release is None:
            resp = await self._call("GET", f"{state.backend.url}/version")
            if resp is not None:
                data = _json(resp) if resp.status_code == 200 else None
                release = _release(data.get("version")) if data is not None else None
                state.release = release or (0, 0)
        return state.release

    async def _runs_tokens_in(self, state: BackendState) -> bool:
        release = await self.release_of(state)
        return release is not None and release >= _TOKENS_IN

    async def learn_takes_ids(self, decode: BackendState) -> bool:
        """Whether decode renders from forwarded `kv_transfer_params["prompt_token_ids"]` instead of the
        messages: vLLM >= 0.32, or an older one with agentkv's plugin taking them (its service says so); other
        decodes would only carry the ids along unused."""
        if decode.retention is None:
            await self.probe(decode)
        return decode.forwarded_ids or await self._runs_tokens_in(decode)

    async def learn_generates(self, prefill: BackendState) -> bool:
        """Whether prefill's `/inference/v1/generate` hands `kv_transfer_params` to its engine (vLLM >= 0.32;
        0.26 drops them), so the token path's prefill hop can skip detokenizing its one token; not once the
        route failed us (`BackendState.generates`)."""
        return prefill.generates is not False and await self._runs_tokens_in(prefill)

    async def retained(self, decode: BackendState, request_id: str) -> Retained | None:
        """What decode retained for our request. Decode's bookkeeping can trail the answer's last byte (by a
        scheduler step, or by the abort that follows a client's stop string): agentkv's service waits until
        the request has finished (`wait_ms`); a service that does not is asked again briefly."""
        url = f"{decode.backend.control_url}/agentkv/v1/retained/{request_id}?wait_ms={self._finish_wait_ms}"
        for attempt in range(self._retries):
            resp = await self._call("GET", url)
            if resp is not None and resp.status_code == 200:
                data = _json(resp)
                if data is not None and isinstance(data.get("kv_transfer_params"), dict):
                    return data
            if attempt + 1 < self._retries:
                await asyncio.sleep(0.02 * (attempt + 1))
        return None

    async def cached(self, decode: BackendState, request_id: str) -> tuple[int, int]:
        """(tokens of a finished request decode still has, of them those in its host KV tier) once its blocks
        are no longer leased (a declined retention, a lease run out); (0, 0) where decode cannot say."""
        url = f"{decode.backend.control_url}/agentkv/v1/cached/{request_id}"
        resp = await self._call("GET", url)
        data = (_json(resp) if resp is not None and resp.status_code == 200 else None) or {}
        n, host = _count(data.get("cached_tokens")), _count(data.get("host_tokens"))
        return n, min(host, n)

    async def renew(self, decode: BackendState, request_id: str, duration_s: float) -> Retained | None:
        """Decode's lease as renewed; None where it is gone. ``{"demoted": True}`` where decode itself ended
        it because its host KV tier holds the blocks (to retain a newer turn under its cap)."""
        url = f"{decode.backend.control_url}/agentkv/v1/leases/{request_id}/renew"
        resp = await self._call("POST", url, json={"duration_s": duration_s})
        if resp is not None and resp.status_code == 409 and (_json(resp) or {}).get("demoted") is True:
            return {"demoted": True}
        return _json(resp) if resp is not None and resp.status_code == 200 else None

    async def demote(self, decode: BackendState, request_id: str) -> Retained | None:
        """Ask decode to end a lease early because its host KV tier holds the blocks (its answer: demoted,
        host_tokens); None where it refused (no tier, or the tier lacks the blocks: the lease is kept) or
        could not be reached."""
        resp = await self._call("POST", f"{decode.backend.control_url}/agentkv/v1/leases/{request_id}/demote")
        data = _json(resp) if resp is not None and resp.status_code == 200 else None
        return data if data is not None and data.get("demoted") is True else None

    async def release(self, decode: BackendState, request_id: str) -> bool:
        resp = await self._call("DELETE", f"{decode.backend.control_url}/agentkv/v1/leases/{request_id}")
        return resp is not None and resp.status_code == 200


def _count(n: Any) -> int:
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def _release(version: Any) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string such as "0.32.0" or "0.32.0+cpu"."""
    if not isinstance(version, str):
        return None
    parts = version.split(".")
    if len(parts) < 2 or not parts[0].isdigit():
        return None
    minor = "".join(itertools.takewhile(str.isdigit, parts[1]))
    return (int(parts[0]), int(minor)) if minor else None


def _json(resp: httpx.Response) -> dict[str, Any] | None:
    try:
        data = resp.json()
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
