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
        return {
            "conversation_id": conversation_id,
            "decode": record.decode,
            "retained_tokens": record.retained_tokens if state in ("held", "fixed_ttl") else 0,
            "lease": {"state": state, "expires_in_s": round(left, 3), "renewable": state == "held"},
        }

    async def heartbeat(self, key: str, conversation_id: str, raw: bytes) -> dict[str, Any]:
        settings = self._sv.settings
        extend_s = settings.lease_s
        if raw.strip():
            try:
                body = json.loads(raw)
            except ValueError:
                raise client_error(400, "heartbeat body is not valid JSON") from None
            if not isinstance(body, dict):
                raise client_error(400, "heartbeat body must be a JSON object")
            value = body.get("extend_s", extend_s)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise client_error(400, "'extend_s' must be a positive number", param="extend_s")
            extend_s = float(value)
        extend_s = min(extend_s, settings.max_lease_s)
        for _ in range(_CAS_ATTEMPTS):
            record = await self._get(key)
            state, _left = record.lease_view()
            decode = self._sv.decode.get(record.decode)
            if state != "held" or decode is None:
                return self.view(conversation_id, record)  # fixed_ttl/expired/none: nothing to renew
            renewed = await self._sv.leases.renew(decode, record.request_id, extend_s)
            now = time.time()
            if renewed is None:
                # Decode no longer holds the blocks (expired, read, or restarted).
                updated = dataclasses.replace(record, expires_at=now)
            else:
                self._sv.metrics.lease_renewals.inc()
                left = renewed.get("expires_in_s")
                updated = dataclasses.replace(
                    record, expires_at=now + (float(left) if isinstance(left, (int, float)) else extend_s)
                )
            if await self._sv.store.compare_and_set(key, updated, expected=record.version):
                return self.view(conversation_id, updated)
        raise client_error(409, "conversation is busy; retry the heartbeat", code="conversation_busy")

    async def forget(self, key: str, conversation_id: str) -> dict[str, Any]:
        record = await self._sv.store.delete(key)
        if record is None:
            raise client_error(404, "conversation not found", code="conversation_not_found")
        return {"conversation_id": conversation_id, "released": await self._book.release(record)}
