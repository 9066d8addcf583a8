"""ConversationStore: the in-memory store and RedisStore against a real redis-server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

import pytest

from agentkv.server.router import ConversationRecord, MemoryStore, RedisStore
from agentkv.server.router._prefix import Prefix
from agentkv.server.router._tokens import TokenPrefix

RECORD = ConversationRecord(
    decode="d0",
    request_id="agentkv-1",
    retained={"remote_block_ids": [[1, 2]], "remote_engine_id": "E"},
    expires_at=time.time() + 30,
    lease_state="held",
    retained_tokens=12,
    prefix=Prefix(items=2, chars=40, digest="ab"),
    tokens=TokenPrefix(held=12, must_exceed=12, digest="cd"),
)


async def check_cas(store) -> None:
    assert await store.get("t/c") is None
    assert not await store.compare_and_set("t/c", RECORD, expected=1)  # absent is version 0
    assert await store.compare_and_set("t/c", RECORD, expected=0)
    stored = await store.get("t/c")
    assert stored == dataclasses.replace(RECORD, version=1)
    assert not await store.compare_and_set("t/c", RECORD, expected=0)  # stale writer loses
    assert await store.compare_and_set("t/c", dataclasses.replace(stored, decode="d1"), expected=1)
    assert (await store.get("t/c")).decode == "d1"
    assert await store.get("other-tenant/c") is None
    assert (await store.delete("t/c")).decode == "d1"
    assert await store.delete("t/c") is None


async def check_lock(store) -> None:
    order: list[str] = []
    async with store.lock("t/c", timeout=5) as got:
        assert got

        async def second() -> None:
            async with store.lock("t/c", timeout=5) as got2:
                order.append(f"second {got2}")

        task = asyncio.create_task(second())
        for _ in range(20):
            await asyncio.sleep(0)
        order.append("first done")
    await task
    assert order == ["first done", "second True"]
    async with store.lock("t/c", timeout=5), store.lock("t/c", timeout=0.01) as got:
        assert got is False  # bounded wait, then the caller proceeds without reuse


async def test_memory_store_cas_and_lock() -> None:
    store = MemoryStore()
    await check_cas(store)
    await check_lock(store)
    assert store._locks == {}  # idle conversations keep no lock objects


async def test_memory_store_lru_evicts_least_recent_and_tells_the_hook() -> None:
    evicted: list[str] = []
    store = MemoryStore(max_conversations=2, on_evict=lambda key, record: evicted.append(key))
    for key in ("a", "b"):
        await store.compare_and_set(key, RECORD, expected=0)
    await store.get("a")  # a is now the most recent
    await store.compare_and_set("c", RECORD, expected=0)
    assert evicted == ["b"] and await store.count() == 2


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def test_memory_store_records_expire_as_in_redis() -> None:
    """A lease's record lives to its expiry plus the margin, one without a lease for the idle TTL; expired
    records read as absent (a write expecting version 0 succeeds) and leave memory at the next sweep, read or
    not, so conversations that come and go do not fill the router with blocks no decode holds."""
    clock = Clock()
    store = MemoryStore(ttl_margin_s=60, idle_ttl_s=3_600, clock=clock)
    leased = dataclasses.replace(RECORD, expires_at=clock.now + 30)
    bare = dataclasses.replace(RECORD, expires_at=None, retained=None, lease_state="none")
    assert await store.compare_and_set("t/leased", leased, expected=0)
    assert await store.compare_and_set("t/bare", bare, expected=0)
    assert await store.compare_and_set("t/unread", leased, expected=0)
    clock.now += 89
    assert (await store.get("t/leased")) is not None  # 30 s lease + 60 s margin: still there
    clock.now += 2
    assert await store.get("t/leased") is None
    assert await store.delete("t/leased") is None
    assert await store.compare_and_set("t/leased", leased, expected=0)  # absent again: version 0
    assert (await store.get("t/bare")) is not None
    assert set(store._data) == {"t/leased", "t/bare"}  # the write swept the unread, expired one
    clock.now += 3_600
    assert await store.count() == 0
    assert len(store._data) == 0


async def test_memory_store_count_sweeps_at_most_every_interval() -> None:
    """`/metrics` reads the count on every scrape; it sweeps only when a sweep is due, so a scrape costs
    O(1) between sweeps and the gauge lags expiry by at most the sweep interval."""
    clock = Clock()
    store = MemoryStore(ttl_margin_s=0, clock=clock)
    assert await store.compare_and_set(
        "t/a", dataclasses.replace(RECORD, expires_at=clock.now + 5), expected=0
    )
    assert await store.compare_and_set(
        "t/b", dataclasses.replace(RECORD, expires_at=clock.now + 50), expected=0
    )
    assert await store.compare_and_set(
        "t/c", dataclasses.replace(RECORD, expires_at=clock.now + 5), expected=0
    )
    clock.now += 10
    assert await store.get("t/a") is None  # reads see the expiry at once
    assert await store.count() == 2  # "t/c" expired too, but no sweep is due yet
    clock.now += 25
    assert await store.count() == 1  # 35 s after the last sweep: this count swept "t/c"


async def test_memory_store_sweeps_while_writing() -> None:
    clock = Clock()
    store = MemoryStore(ttl_margin_s=0, clock=clock)
    for i in range(100):
        await store.compare_and_set(
            f"t/{i}", dataclasses.replace(RECORD, expires_at=clock.now + 1), expected=0
        )
    clock.now += 31  # past the records' deadlines and the sweep interval
    await store.compare_and_set("t/new", RECORD, expected=0)
    assert list(store._data) == ["t/new"]


@pytest.fixture
async def redis_store(redis_url: str):
    store = RedisStore(url=redis_url, prefix=f"test-{uuid.uuid4().hex}:")
    yield store
    await store.aclose()


async def test_redis_store_cas_and_lock(redis_store: RedisStore) -> None:
    await check_cas(redis_store)
    await check_lock(redis_store)


async def test_redis_store_reads_records_in_the_standard_librarys_json(redis_store: RedisStore) -> None:
    # A replica of an earlier release wrote `json.dumps` of the whole record: a rolling upgrade reads it.
    record = dataclasses.replace(RECORD, version=3)
    data = json.dumps(dataclasses.asdict(record))
    await redis_store._redis.hset(redis_store._key("t/old"), mapping={"version": "3", "data": data})
    assert await redis_store.get("t/old") == record
    assert await redis_store.compare_and_set("t/old", dataclasses.replace(record, decode="d1"), expected=3)
    assert await redis_store.get("t/old") == dataclasses.replace(record, decode="d1", version=4)


async def test_redis_survives_router_restart_and_scopes_by_prefix(redis_url: str) -> None:
    prefix = f"test-{uuid.uuid4().hex}:"
    first = RedisStore(url=redis_url, prefix=prefix)
    await first.compare_and_set("t/c", RECORD, expected=0)
    await first.aclose()
    again, elsewhere = RedisStore(url=redis_url, prefix=prefix), RedisStore(url=redis_url, prefix="other:")
    try:
        assert (await again.get("t/c")) == dataclasses.replace(RECORD, version=1)
        assert await elsewhere.get("t/c") is None
        assert await again.count() == 1
        ttl = await again._redis.ttl(f"{prefix}conv:t/c")
        assert 30 < ttl <= 30 + 60 + 1  # lease expiry plus margin
    finally:
        await again.aclose()
        await elsewhere.aclose()


async def test_redis_replicas_racing_on_one_conversation(redis_url: str) -> None:
    prefix = f"test-{uuid.uuid4().hex}:"
    a, b = RedisStore(url=redis_url, prefix=prefix), RedisStore(url=redis_url, prefix=prefix)
    try:
        results = await asyncio.gather(*(s.compare_and_set("t/c", RECORD, expected=0) for s in (a, b, a, b)))
        assert sorted(results) == [False, False, False, True]
    finally:
        await a.aclose()
        await b.aclose()


async def test_router_with_redis_store(redis_url: str, engines, make_client) -> None:
    store = RedisStore(url=redis_url, prefix=f"test-{uuid.uuid4().hex}:")
    async with make_client(store=store) as client:
        msgs = [{"role": "user", "content": "hi"}]
        first = (
            await client.post("/v1/chat/completions", json={"messages": msgs}, headers={"x-session-id": "c"})
        ).json()
        nxt = [*msgs, first["choices"][0]["message"], {"role": "user", "content": "more"}]
        r = await client.post("/v1/chat/completions", json={"messages": nxt}, headers={"x-session-id": "c"})
    assert r.headers["x-agentkv-reuse"] == "hit"


async def test_redis_store_counts_at_most_once_per_sweep_interval(redis_url: str) -> None:
    """`/metrics` reads the count on every scrape and counting SCANs Redis's whole keyspace: a count is
    reused until the sweep interval has passed (the gauge lags by at most that, as the memory store's)."""
    clock = Clock()
    store = RedisStore(url=redis_url, prefix=f"test-{uuid.uuid4().hex}:", clock=clock)
    try:
        await store.compare_and_set("t/a", RECORD, expected=0)
        assert await store.count() == 1
        await store.compare_and_set("t/b", RECORD, expected=0)
        clock.now += 10
        assert await store.count() == 1  # within the interval: the last count
        clock.now += 25
        assert await store.count() == 2
    finally:
        await store.aclose()
