"""A `ConversationStore` in Redis, shared by router replicas and surviving router restarts."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from . import _codec
from ._store import SWEEP_S, ConversationRecord, StoreUnavailableError, record_ttl_s

__all__ = ["RedisStore"]

# Compare-and-set in one round trip: replicas racing on a conversation cannot interleave inside it.
_CAS = """
local v = redis.call('HGET', KEYS[1], 'version')
if (v or '0') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'data', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisStore:
    """Keys `<prefix>conv:<tenant>/<conversation_id>` (a hash of version + JSON record), expiring at the
    lease expiry plus `ttl_margin_s`; conversations without retained blocks expire after `idle_ttl_s`.

    `<prefix>prefilling:<prefill>` is a sorted set of the P hops in flight on that prefill, scored by their
    deadline: a replica that dies mid-hop leaves an entry that stops counting when its deadline passes,
    so no count leaks and no replica has to heartbeat.

    `clock` is the router's epoch clock: records' TTLs, hops' deadlines and how old a count may be."""

    def __init__(
        self,
        *,
        url: str,
        prefix: str = "agentkv:",
        ttl_margin_s: float = 60.0,
        idle_ttl_s: float = 3600.0,
        lock_ttl_s: float = 600.0,
        client: Any = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        import redis.asyncio as redis_asyncio
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        # A restarted Redis leaves dead pooled connections: retry on a fresh one instead of failing a turn.
        self._redis: Any = client or redis_asyncio.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
        )
        self._prefix = prefix
        self._margin = ttl_margin_s
        self._idle = idle_ttl_s
        # A crashed replica's lock must not block a conversation forever; turns are shorter than this.
        self._lock_ttl_ms = int(lock_ttl_s * 1000)
        self._cas = self._redis.register_script(_CAS)
        self._unlock = self._redis.register_script(_UNLOCK)
        self._clock = clock
        self._counted: tuple[float, int] | None = None  # when, how many

    def _key(self, key: str) -> str:
        return f"{self._prefix}conv:{key}"

    async def get(self, key: str) -> ConversationRecord | None:
        with _unavailable():
            data = await self._redis.hget(self._key(key), "data")
        if data is None:
            return None
        return ConversationRecord.from_json(_codec.decode(data))

    async def compare_and_set(self, key: str, record: ConversationRecord, *, expected: int) -> bool:
        new = dataclasses.replace(record, version=expected + 1)
        ttl = record_ttl_s(new, now=self._clock(), margin_s=self._margin, idle_s=self._idle)
        with _unavailable():
            done = await self._cas(
                keys=[self._key(key)],
                args=[str(expected), str(expected + 1), _codec.encode(new.to_json()), max(math.ceil(ttl), 1)],
            )
        return bool(done)

    async def delete(self, key: str) -> ConversationRecord | None:
        with _unavailable():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hget(self._key(key), "data")
                pipe.delete(self._key(key))
                data, _ = await pipe.execute()
        return ConversationRecord.from_json(_codec.decode(data)) if data is not None else None

    @contextlib.asynccontextmanager
    async def lock(self, key: str, *, timeout: float) -> AsyncIterator[bool]:
        name = f"{self._prefix}lock:{key}"
        token = uuid.uuid4().hex
        deadline = time.monotonic() + timeout
        acquired = False
        delay = 0.005
        while True:
            with _unavailable():
                got = await self._redis.set(name, token, nx=True, px=self._lock_ttl_ms)
            if got:
                acquired = True
                break
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(delay * 2, 0.1)
        try:
            yield acquired
        finally:
            if acquired:
                # If Redis went away meanwhile the lock's TTL frees it; the turn itself already finished.
                with contextlib.suppress(StoreUnavailableError), _unavailable():
                    await self._unlock(keys=[name], args=[token])

    async def count(self) -> int:
        """The conversations under this prefix, counted at most once per `SWEEP_S`: counting is a SCAN of
        Redis's whole keyspace (a round trip per 1,000 keys), and `/metrics` asks on every scrape, so the
        gauge lags by at most that interval, as the memory store's does."""
        now = self._clock()
        if self._counted is not None and now - self._counted[0] < SWEEP_S:
            return self._counted[1]
        n = 0
        with _unavailable():
            async for _ in self._redis.scan_iter(match=f"{self._prefix}conv:*", count=1000):
                n += 1
        self._counted = (now, n)
        return n

    def _hops(self, prefill: str) -> str:
        return f"{self._prefix}prefilling:{prefill}"

    async def prefill_started(self, prefill: str, hop: str, *, until: float) -> None:
        now = self._clock()
        key = self._hops(prefill)
        with _unavailable():
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.zremrangebyscore(key, "-inf", now)  # what crashed replicas left behind
                pipe.zadd(key, {hop: until})
                # A prefill taken out of the configuration leaves no key behind.
                pipe.expire(key, max(math.ceil(until - now), 1) + 60)
                await pipe.execute()

    async def prefill_ended(self, prefill: str, hop: str) -> None:
        with _unavailable():
            await self._redis.zrem(self._hops(prefill), hop)

    async def prefilling(self, prefills: Sequence[str]) -> dict[str, int] | None:
        if not prefills:
            return {}
        now = self._clock()
        with _unavailable():
            async with self._redis.pipeline(transaction=False) as pipe:
                for prefill in prefills:
                    pipe.zcount(self._hops(prefill), f"({now}", "+inf")
                counts = await pipe.execute()
        return {prefill: int(n) for prefill, n in zip(prefills, counts, strict=True)}

    async def aclose(self) -> None:
        await self._redis.aclose()


@contextlib.contextmanager
def _unavailable() -> Iterator[None]:
    """Redis errors leave this module as one type the router knows how to degrade on."""
    from redis.exceptions import RedisError

    try:
        yield
    except RedisError as exc:
        raise StoreUnavailableError(f"conversation store unavailable: {exc}") from exc
