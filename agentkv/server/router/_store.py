"""What router replicas share: the `ConversationStore` protocol and the in-memory store.

A store holds conversations and, for conditional disaggregation, the P hops in flight on each prefill."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal, Protocol

from agentkv._exceptions import AgentKVError

from ._prefix import Prefix
from ._tokens import TokenPrefix

__all__ = [
    "SWEEP_S",
    "ConversationRecord",
    "ConversationStore",
    "EvictHook",
    "LeaseState",
    "MemoryStore",
    "StoreUnavailableError",
]

# "demoted": decode ended the lease early because its host KV tier holds the blocks (`Conversations`).
LeaseState = Literal["held", "fixed_ttl", "demoted", "none"]


class StoreUnavailableError(AgentKVError):
    """The shared store (Redis) cannot be reached. Turns are then served without reuse, never failed."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConversationRecord:
    """One conversation: the decode holding its retained blocks, decode's params for them, and the
    fingerprint the next turn must extend. `version` increases with every successful write."""

    decode: str
    request_id: str
    retained: dict[str, Any] | None = None
    expires_at: float | None = None  # epoch seconds (router clock), not decode's perf_counter
    lease_state: LeaseState = "none"
    retained_tokens: int = 0
    prefix: Prefix | None = None
    # The token ids decode holds (fingerprint), when the turn ran on the token path; checked before `prefix`.
    tokens: TokenPrefix | None = None
    # The prefill that last computed this conversation's prompt (its prefix cache may still hold it).
    prefill: str | None = None
    # When the turn that wrote this record ended (epoch seconds): how long the conversation has been idle.
    turn_ended_at: float | None = None
    version: int = 0

    def lease_view(self, now: float | None = None) -> tuple[str, float]:
        """(state, seconds left) as the conversation endpoints report them."""
        now = time.time() if now is None else now
        if not self.retained or self.lease_state == "none":
            return "none", 0.0
        if self.lease_state == "demoted":
            return "demoted", 0.0
        left = (self.expires_at or 0.0) - now
        return ("expired", 0.0) if left <= 0 else (self.lease_state, left)

    def to_json(self) -> dict[str, Any]:
        # Shallow: `dataclasses.asdict` copies decode's block list id by id (milliseconds per write at
        # 127k tokens).
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["prefix"] = self.prefix.to_json() if self.prefix else None
        data["tokens"] = self.tokens.to_json() if self.tokens else None
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ConversationRecord:
        return cls(
            **{
                **data,
                "prefix": Prefix.from_json(data.get("prefix")),
                "tokens": TokenPrefix.from_json(data.get("tokens")),
            }
        )


EvictHook = Callable[[str, ConversationRecord], None]


def record_ttl_s(record: ConversationRecord, *, now: float, margin_s: float, idle_s: float) -> float:
    """How long a store keeps a record: to its lease's expiry plus `margin_s` (a late turn still finds its
    decode and is told the blocks expired), or `idle_s` when it holds no lease (only stickiness is left)."""
    if record.expires_at is None:
        return idle_s
    return max(record.expires_at - now, 0.0) + margin_s


class ConversationStore(Protocol):
    """Async store keyed by `conversation_key(tenant, conversation_id)`.

    Writes are compare-and-set on `version` so two router replicas cannot clobber each other: a write
    succeeds only if the stored version still equals `expected` (0 = absent) and stores `expected + 1`."""

    async def get(self, key: str) -> ConversationRecord | None: ...

    async def compare_and_set(self, key: str, record: ConversationRecord, *, expected: int) -> bool: ...

    async def delete(self, key: str) -> ConversationRecord | None: ...

    def lock(self, key: str, *, timeout: float) -> contextlib.AbstractAsyncContextManager[bool]:
        """Serialise turns of one conversation; yields False if the wait timed out (proceed without reuse)."""
        ...

    async def count(self) -> int: ...

    async def prefill_started(self, prefill: str, hop: str, *, until: float) -> None:
        """A P hop (`hop`, unique per request and prefill) computes on `prefill` until it ends or, should
        this replica die first, until the epoch time `until` (the hop's own deadline) has passed."""
        ...

    async def prefill_ended(self, prefill: str, hop: str) -> None: ...

    async def prefilling(self, prefills: Sequence[str]) -> dict[str, int] | None:
        """P hops in flight per prefill across every replica sharing this store; None where the store is
        this replica's alone (its own counts, `BackendState.prefilling`, are then the whole picture)."""
        ...

    async def aclose(self) -> None: ...


# How often a store walks all its records (O(n)): a memory store for expired ones (~10 ms per 100k records),
# a Redis store to count them for the gauge.
SWEEP_S = 30.0


class MemoryStore:
    """LRU-bounded dict; O(1) per operation but a sweep every `SWEEP_S`. `on_evict` hears about
    conversations pushed out by the bound (the router releases their leases).

    Records expire as in Redis (`record_ttl_s`): a record of a 127k-token conversation holds decode's block
    list and fingerprints, ~0.4 MB, and kept to the count bound alone, agents that come and go would fill
    the router's memory with blocks no decode holds any more."""

    def __init__(
        self,
        *,
        max_conversations: int = 100_000,
        ttl_margin_s: float = 60.0,
        idle_ttl_s: float = 3600.0,
        on_evict: EvictHook | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._data: OrderedDict[str, tuple[ConversationRecord, float]] = OrderedDict()  # record, deadline
        self._max = max_conversations
        self._margin, self._idle = ttl_margin_s, idle_ttl_s
        self._clock = clock
        self._swept = clock()
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self.on_evict = on_evict

    def _live(self, key: str, now: float) -> ConversationRecord | None:
        entry = self._data.get(key)
        if entry is None:
            return None
        if entry[1] <= now:
            del self._data[key]
            return None
        return entry[0]

    def _sweep_if_due(self, now: float) -> None:
        if now - self._swept < SWEEP_S:
            return
        self._swept = now
        for key in [key for key, (_, deadline) in self._data.items() if deadline <= now]:
            del self._data[key]

    async def get(self, key: str) -> ConversationRecord | None:
        record = self._live(key, self._clock())
        if record is not None:
            self._data.move_to_end(key)
        return record

    async def compare_and_set(self, key: str, record: ConversationRecord, *, expected: int) -> bool:
        now = self._clock()
        current = self._live(key, now)
        if (current.version if current else 0) != expected:
            return False
        ttl = record_ttl_s(record, now=now, margin_s=self._margin, idle_s=self._idle)
        self._data[key] = (dataclasses.replace(record, version=expected + 1), now + ttl)
        self._data.move_to_end(key)
        self._sweep_if_due(now)
        while len(self._data) > self._max:
            old_key, (old, _) = self._data.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(old_key, old)
        return True

    async def delete(self, key: str) -> ConversationRecord | None:
        record = self._live(key, self._clock())
        self._data.pop(key, None)
        return record

    @contextlib.asynccontextmanager
    async def lock(self, key: str, *, timeout: float) -> AsyncIterator[bool]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        # Locks live only while someone holds or waits for them, so idle conversations cost nothing.
        self._locks[key] = (lock, users + 1)
        acquired = False
        try:
            try:
                async with asyncio.timeout(timeout):
                    await lock.acquire()
                acquired = True
            except TimeoutError:
                pass
            yield acquired
        finally:
            if acquired:
                lock.release()
            lock, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    async def count(self) -> int:
        # Read on every `/metrics` scrape: sweeping each time would make a scrape O(n), so the gauge may
        # still include records that expired since the last sweep (at most `SWEEP_S` ago).
        self._sweep_if_due(self._clock())
        return len(self._data)

    async def prefill_started(self, prefill: str, hop: str, *, until: float) -> None:
        return None

    async def prefill_ended(self, prefill: str, hop: str) -> None:
        return None

    async def prefilling(self, prefills: Sequence[str]) -> dict[str, int] | None:
        return None

    async def aclose(self) -> None:
        self._data.clear()
