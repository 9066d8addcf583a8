"""The conversation endpoints: look up, heartbeat (renew decode's lease) and forget a conversation."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from ._book import TurnBook
from ._errors import client_error
from ._services import RouterServices
from ._store import ConversationRecord

__all__ = ["Conversations"]

# Heartbeats race with turns of the same conversation; a few CAS retries settle it without a lock.
_CAS_ATTEMPTS = 3
# A beat that may demote waits this long for a running turn of its conversation to let go of the lock, then
# renews instead; one saying a tool call started waits for the bookkeeping of the turn that just ended (at
# most ~1 s: decode's answer to `retained/`), within the SDK's 5 s control timeout.
_DEMOTE_LOCK_WAIT_S = 0.1
_TOOL_BEAT_LOCK_WAIT_S = 2.0


class Conversations:
    def __init__(self, *, services: RouterServices, book: TurnBook) -> None:
        self._sv, self._book = services, book

    async def _get(self, key: str) -> ConversationRecord:
        record = await self._sv.store.get(key)
        if record is None:
            raise client_error(404, "conversation not found", code="conversation_not_found")
        return record

    async def lookup(self, key: str, conversation_id: str) -> dict[str, Any]:
        return self.view(conversation_id, await self._get(key))

    @staticmethod
    def view(conversation_id: str, record: ConversationRecord) -> dict[str, Any]:
        state, left = record.lease_view()
        kept = state in ("held", "fixed_ttl", "demoted")
        return {
            "conversation_id": conversation_id,
            "decode": record.decode,
            "retained_tokens": record.retained_tokens if kept else 0,
            # Where decode keeps them: its KV cache under the lease, or (demoted) its host KV tier, with
            # whatever of them its prefix cache has not yet evicted.
            "tier": ("host" if state == "demoted" else "hbm") if kept else None,
            "lease": {"state": state, "expires_in_s": round(left, 3), "renewable": state == "held"},
        }

    async def heartbeat(self, key: str, conversation_id: str, raw: bytes) -> dict[str, Any]:
        settings = self._sv.settings
        extend_s, tool_call = _beat_body(raw, settings.lease_s)
        extend_s = min(extend_s, settings.max_lease_s)
        if self._may_demote(tool_call=tool_call):
            # Under the conversation's lock: never under a running turn, which may be reading the blocks. A
            # tool-call beat is sent the moment a turn ends, while that turn's bookkeeping may still be
            # writing its record: it waits for it (a beat that overwrote it would cost the turn its blocks)
            # and then acts on the record the turn wrote.
            wait = _TOOL_BEAT_LOCK_WAIT_S if tool_call else _DEMOTE_LOCK_WAIT_S
            async with self._sv.store.lock(key, timeout=wait) as locked:
                if locked:
                    record = await self._get(key)
                    cause = self._demotion(record, tool_call=tool_call)
                    view = None if cause is None else await self._demote(key, conversation_id, record, cause)
                    return view or await self._renew(key, conversation_id, extend_s)
        return await self._renew(key, conversation_id, extend_s)

    async def _renew(self, key: str, conversation_id: str, extend_s: float) -> dict[str, Any]:
        for _ in range(_CAS_ATTEMPTS):
            record = await self._get(key)
            state, _left = record.lease_view()
            decode = self._sv.decode.get(record.decode)
            if state in ("demoted", "expired", "none") and decode is not None and decode.retention:
                # Nothing is leased (demoted, declined at the cap, run out), but the beat tells decode the
                # conversation is alive: its host tier then evicts this conversation's copy after those of
                # conversations that ended (`_host_policy`). Decode answers 409 or 404; the record stays.
                await self._sv.leases.renew(decode, record.request_id, extend_s)
                return self.view(conversation_id, record)
            if state != "held" or decode is None:
                return self.view(conversation_id, record)  # fixed_ttl: nothing to renew
            renewed = await self._sv.leases.renew(decode, record.request_id, extend_s)
            now = time.time()
            demoted = renewed is not None and renewed.get("demoted") is True
            if renewed is None:
                # Decode no longer holds the blocks (expired, read, or restarted).
                updated = dataclasses.replace(record, expires_at=now)
            elif demoted:
                # Decode demoted it to retain a newer turn under its cap: the blocks are in its host tier.
                updated = dataclasses.replace(record, lease_state="demoted", expires_at=now)
            else:
                self._sv.metrics.lease_renewals.inc()
                left = renewed.get("expires_in_s")
                updated = dataclasses.replace(
                    record, expires_at=now + (float(left) if isinstance(left, (int, float)) else extend_s)
                )
            if await self._sv.store.compare_and_set(key, updated, expected=record.version):
                if demoted:
                    self._sv.metrics.demotions["pressure"].inc()
                return self.view(conversation_id, updated)
        raise client_error(409, "conversation is busy; retry the heartbeat", code="conversation_busy")

    def _may_demote(self, *, tool_call: bool) -> bool:
        """Whether the settings let this beat demote at all (checked before taking the lock)."""
        s = self._sv.settings
        if s.exact or not s.reuse or s.path_policy == "always-pd":
            return False
        return (tool_call and s.demote_on_tool_call) or s.demote_idle_s > 0

    def _demotion(self, record: ConversationRecord, *, tool_call: bool) -> str | None:
        """Why this heartbeat, which `_may_demote`, should demote the conversation to decode's host tier, or
        None."""
        s = self._sv.settings
        if record.lease_view()[0] != "held":
            return None
        if tool_call and s.demote_on_tool_call:
            return "tool_call"
        ended = record.turn_ended_at
        if s.demote_idle_s > 0 and ended is not None and time.time() - ended >= s.demote_idle_s:
            return "idle"
        return None

    async def _demote(
        self, key: str, conversation_id: str, record: ConversationRecord, cause: str
    ) -> dict[str, Any] | None:
        """End decode's lease early where its host tier holds the blocks; the record (`record`, as the
        caller read it) then says `demoted` and the next turn runs decode-local over what decode still has
        (the router's `cached` path). None where decode refused (no tier, blocks not all in it): the lease
        is renewed instead. The caller holds the conversation's lock."""
        for attempt in range(_CAS_ATTEMPTS):
            if attempt:
                record = await self._get(key)
            decode = self._sv.decode.get(record.decode)
            if decode is None or record.lease_view()[0] != "held":
                return None
            if not await self._sv.leases.demote(decode, record.request_id):
                return None
            updated = dataclasses.replace(record, lease_state="demoted", expires_at=time.time())
            if await self._sv.store.compare_and_set(key, updated, expected=record.version):
                self._sv.metrics.demotions[cause].inc()
                return self.view(conversation_id, updated)
            # A beat without the lock renewed it meanwhile: decode's lease is gone all the same; write again.
        return None

    async def forget(self, key: str, conversation_id: str) -> dict[str, Any]:
        record = await self._sv.store.delete(key)
        if record is None:
            raise client_error(404, "conversation not found", code="conversation_not_found")
        return {"conversation_id": conversation_id, "released": await self._book.release(record)}


def _beat_body(raw: bytes, lease_s: float) -> tuple[float, bool]:
    """A heartbeat's (extend_s, tool_call): how long to extend the lease, and whether the client said a tool
    call just started. An empty body: the default lease, no tool call."""
    if not raw.strip():
        return lease_s, False
    try:
        body = json.loads(raw)
    except ValueError:
        raise client_error(400, "heartbeat body is not valid JSON") from None
    if not isinstance(body, dict):
        raise client_error(400, "heartbeat body must be a JSON object")
    value = body.get("extend_s", lease_s)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise client_error(400, "'extend_s' must be a positive number", param="extend_s")
    tool_call = body.get("tool_call", False)
    if not isinstance(tool_call, bool):
        raise client_error(400, "'tool_call' must be true or false", param="tool_call")
    return float(value), tool_call
