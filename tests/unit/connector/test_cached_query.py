"""Decode's answer to "how much of this finished request does your prefix cache still hold"."""

from __future__ import annotations

import types
from typing import Any

import pytest

from agentkv.server.engine._connector._cached import CachedPrompts, calling_scheduler, pool_lookup
from agentkv.server.engine._connector._leases import LeaseTable
from agentkv.server.engine._connector._service import READ_SPARE_S, RetentionService

BLOCK = 4


def _tokens(cached: CachedPrompts, request_id: str) -> int | None:
    held = cached.cached_tokens(request_id)
    return None if held is None else held.tokens


def _service(cached: CachedPrompts | None) -> RetentionService:
    table = LeaseTable(lease_s=1, max_lease_s=1, clock=lambda: 0.0)
    return RetentionService(table=table, host="127.0.0.1", port=0, info=dict, cached=cached)


def test_counts_leading_cached_blocks_only() -> None:
    pool = {b"a", b"b", b"d"}
    cached = CachedPrompts(block_size=BLOCK, max_blocks=100)
    cached.lookup = pool.__contains__
    cached.keep("chatcmpl-r1-0", [b"a", b"b", b"c", b"d"])
    # "c" was evicted: "d" behind it cannot be reused by a prefix cache.
    assert _tokens(cached, "chatcmpl-r1-0") == 2 * BLOCK
    assert _tokens(cached, "r1") == 2 * BLOCK  # the router's id, as vLLM wraps it
    pool.clear()
    assert _tokens(cached, "r1") == 0
    assert cached.cached_tokens("r2") is None


def test_unknown_without_a_pool() -> None:
    cached = CachedPrompts(block_size=BLOCK, max_blocks=100)
    cached.keep("r1", [b"a"])
    assert cached.cached_tokens("r1") is None


def test_keeps_at_most_max_blocks_oldest_out() -> None:
    cached = CachedPrompts(block_size=BLOCK, max_blocks=5)
    cached.lookup = lambda h: True
    cached.keep("r1", [1, 2, 3])
    cached.keep("r2", [4, 5])
    assert _tokens(cached, "r1") == 3 * BLOCK
    cached.keep("r3", [6])  # 6 blocks: r1 goes
    assert cached.cached_tokens("r1") is None
    assert _tokens(cached, "r2") == 2 * BLOCK and _tokens(cached, "r3") == BLOCK
    cached.keep("r2", [4, 5, 7])  # kept again: replaced, not counted twice
    assert len(cached) == 2 and _tokens(cached, "r2") == 3 * BLOCK


def test_a_pinned_request_is_never_dropped_to_make_room() -> None:
    """A conversation decode keeps (live lease, or demoted while its router beats) may stay in the host tier
    past newer requests: its hashes must stay too, or neither the router's `cached` path nor the tier's
    eviction order could find it."""
    cached = CachedPrompts(block_size=BLOCK, max_blocks=5)
    cached.lookup = lambda h: True
    cached.pinned = lambda: {"r1"}
    cached.keep("r1", [1, 2, 3])
    cached.keep("r2", [4, 5])
    cached.keep("r3", [6])  # 6 blocks: r2 goes, the oldest one not pinned
    assert _tokens(cached, "r1") == 3 * BLOCK and cached.cached_tokens("r2") is None
    cached.keep("r4", [7, 8, 9])  # only pinned r1 is left to drop beside r3: over the bound, r1 stays
    assert _tokens(cached, "r1") == 3 * BLOCK and cached.cached_tokens("r3") is None
    assert _tokens(cached, "r4") == 3 * BLOCK


def test_a_lookup_that_fails_midway_reports_what_it_counted() -> None:
    def lookup(h: Any) -> bool:
        if h == 3:
            raise RuntimeError("dictionary changed size during iteration")
        return True

    cached = CachedPrompts(block_size=BLOCK, max_blocks=10)
    cached.lookup = lookup
    cached.keep("r1", [1, 2, 3, 4])
    assert _tokens(cached, "r1") == 2 * BLOCK


def test_service_route() -> None:
    cached = CachedPrompts(block_size=BLOCK, max_blocks=10)
    cached.lookup = lambda h: h != 2
    cached.keep("chatcmpl-r1-0", [1, 2])
    svc = _service(cached)
    assert svc.handle("GET", "/agentkv/v1/cached/r1", {}) == (
        200,
        {"request_id": "r1", "cached_tokens": BLOCK, "host_tokens": 0},
    )
    assert svc.handle("GET", "/agentkv/v1/cached/r9", {})[0] == 404
    assert _service(None).handle("GET", "/agentkv/v1/cached/r1", {})[0] == 404  # prefill: no such query


def test_past_the_pool_the_host_tier_counts_on_in_whole_chunks() -> None:
    # Blocks a..f; the pool kept a, b; the host tier holds chunks of 2 blocks keyed by their last block's
    # hash: (a,b) (c,d) but not (e,f).
    cached = CachedPrompts(block_size=BLOCK, max_blocks=100)
    cached.lookup = {b"a", b"b"}.__contains__
    cached.host_lookup = {b"b", b"d"}.__contains__
    cached.blocks_per_chunk = 2
    cached.keep("r1", [b"a", b"b", b"c", b"d", b"e", b"f"])
    held = cached.cached_tokens("r1")
    assert held is not None and (held.hbm_tokens, held.host_tokens) == (2 * BLOCK, 2 * BLOCK)
    # The pool kept only a: the host's first chunk (a,b) covers b, its second c, d.
    cached.lookup = {b"a"}.__contains__
    held = cached.cached_tokens("r1")
    assert held is not None and (held.hbm_tokens, held.host_tokens) == (BLOCK, 3 * BLOCK)
    # A chunk the host lacks ends the count: nothing after a gap is reusable by a prefix.
    cached.host_lookup = {b"d"}.__contains__
    held = cached.cached_tokens("r1")
    assert held is not None and (held.hbm_tokens, held.host_tokens) == (BLOCK, 0)
    svc = _service(cached)
    cached.host_lookup = {b"b", b"d"}.__contains__
    assert svc.handle("GET", "/agentkv/v1/cached/r1", {})[1] == {
        "request_id": "r1",
        "cached_tokens": 4 * BLOCK,
        "host_tokens": 3 * BLOCK,
    }


def test_finds_the_host_tier_beside_us_under_multiconnector() -> None:
    from vllm.v1.kv_offload.base import LookupResult, make_offload_key

    from agentkv.server.engine._connector._cached import host_lookup

    stored = {make_offload_key(b"h2", 0)}
    manager = types.SimpleNamespace(
        lookup=lambda key, ctx: LookupResult.HIT if key in stored else LookupResult.MISS
    )
    offload = types.SimpleNamespace(
        manager=manager,
        config=types.SimpleNamespace(
            kv_group_configs=[types.SimpleNamespace(group_idx=0, hashes_per_chunk=2)]
        ),
    )
    ours = types.SimpleNamespace()
    multi = types.SimpleNamespace(_connectors=[ours, types.SimpleNamespace(connector_scheduler=offload)])
    manager._num_chunks = 50
    found = host_lookup(types.SimpleNamespace(connector=multi))
    assert found is not None
    assert found.blocks_per_chunk == 2 and found.capacity_blocks == 100
    assert found.lookup(b"h2") and not found.lookup(b"h1")
    assert host_lookup(types.SimpleNamespace(connector=types.SimpleNamespace(_connectors=[ours]))) is None


def test_finds_the_scheduler_that_calls_and_its_pool() -> None:
    pool = types.SimpleNamespace(get_cached_block=lambda h, groups: [object()] if h == b"x" else None)
    scheduler = types.SimpleNamespace(kv_cache_manager=types.SimpleNamespace(block_pool=pool))

    class Fake:
        kv_cache_manager = scheduler.kv_cache_manager

        def finish(self) -> Any:
            return calling_scheduler()

    assert calling_scheduler() is None
    found = Fake().finish()
    assert isinstance(found, Fake)
    lookup = pool_lookup(found)
    assert lookup is not None and lookup(b"x") and not lookup(b"y")
    assert pool_lookup(types.SimpleNamespace()) is None


def test_real_block_pool_forgets_evicted_blocks() -> None:
    """vLLM's own pool: freed blocks stay cached until a new allocation takes them."""
    block_pool = pytest.importorskip("vllm.v1.core.block_pool")
    pool = block_pool.BlockPool(num_gpu_blocks=5, enable_caching=True, hash_block_size=BLOCK)
    hashes = [bytes([i]) * 32 for i in range(3)]
    request = types.SimpleNamespace(
        request_id="chatcmpl-r1-0", block_hashes=hashes, lora_request=None, mm_features=[]
    )
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 3, BLOCK, 0)
    scheduler = types.SimpleNamespace(kv_cache_manager=types.SimpleNamespace(block_pool=pool))
    cached = CachedPrompts(block_size=BLOCK, max_blocks=10)
    cached.lookup = pool_lookup(scheduler)
    cached.keep(request.request_id, hashes)
    assert _tokens(cached, "r1") == 3 * BLOCK
    pool.free_blocks(blocks)  # a declined retention: freed, still cached
    assert _tokens(cached, "r1") == 3 * BLOCK
    pool.get_new_blocks(pool.get_num_free_blocks())  # another request needs every free block
    assert _tokens(cached, "r1") == 0


def test_a_lease_is_demoted_only_where_the_host_tier_holds_its_blocks() -> None:
    """Blocks a..f (24 tokens) under a lease; the host tier stores chunks of 2 blocks. Demoting ends the
    lease (its blocks free, still in the pool) only where the host holds every chunk but at most the last."""
    table = LeaseTable(lease_s=10, max_lease_s=10, clock=lambda: 0.0)
    cached = CachedPrompts(block_size=BLOCK, max_blocks=100)
    cached.lookup = lambda h: True
    cached.blocks_per_chunk = 2
    cached.keep("chatcmpl-r1-0", [b"a", b"b", b"c", b"d", b"e", b"f"])
    stats: dict[str, int] = {}
    svc = RetentionService(table=table, host="127.0.0.1", port=0, info=dict, cached=cached, stats=stats)
    table.add("chatcmpl-r1-0", {}, 6 * BLOCK + 1, block_ids=range(7))
    demote = "/agentkv/v1/leases/r1/demote"

    status, body = svc.handle("POST", demote, {})
    assert status == 409 and "no host KV tier" in body["error"]  # no tier beside us
    cached.host_lookup = {b"b"}.__contains__  # only the first chunk stored
    status, body = svc.handle("POST", demote, {})
    assert (status, body["host_tokens"], body["num_tokens"]) == (409, 2 * BLOCK, 6 * BLOCK)
    assert table.lookup("r1") is not None and not stats  # refused: the lease holds on
    assert svc.handle("GET", "/agentkv/v1/info", {})[1]["host_tier"] is True

    cached.host_lookup = {b"b", b"d"}.__contains__  # all but the last chunk (its store may be in flight)
    assert svc.handle("POST", demote, {}) == (
        200,
        {"demoted": True, "host_tokens": 4 * BLOCK, "num_tokens": 6 * BLOCK},
    )
    assert table.lookup("r1") is None and stats == {"demotions": 1}
    assert svc.handle("POST", demote, {})[0] == 404  # nothing left to demote


def test_a_retention_over_the_cap_demotes_soonest_expiring_host_held_leases_never_one_being_read() -> None:
    """Cap 12 blocks; leases a (blocks 0-3), b (4-7), c (8-9), deadlines in that order. The host tier holds
    a's and b's blocks, not c's; a prefill just asked after a (its still-held check before a read)."""
    now = [0.0]
    table = LeaseTable(lease_s=100, max_lease_s=100, clock=lambda: now[0], capacity_blocks=12)
    cached = CachedPrompts(block_size=BLOCK, max_blocks=100)
    cached.lookup = lambda h: True
    stats: dict[str, int] = {}
    svc = RetentionService(table=table, host="127.0.0.1", port=0, info=dict, cached=cached, stats=stats)
    for i, (rid, blocks) in enumerate({"a": range(4), "b": range(4, 8), "c": range(8, 10)}.items()):
        now[0] = float(i)
        cached.keep(rid, [f"{rid}{k}".encode() for k in blocks])
        assert table.add(rid, {}, len(blocks) * BLOCK, block_ids=blocks)
    assert svc.make_room(range(10, 16)) == []  # no host tier yet: the retention is declined as before
    cached.host_lookup = lambda h: h[:1] in (b"a", b"b")
    now[0] = 3.0
    assert svc.handle("GET", "/agentkv/v1/retained/a?reading=1", {})[0] == 200

    # 10 + 6 blocks is 4 over the cap: b gives them; a, though it expires first, may be under a read.
    assert svc.make_room(range(10, 16)) == ["b"]
    assert table.lookup("b") is None and table.lookup("a") is not None and table.lookup("c") is not None
    assert stats == {"demotions": 1, "demotions_pressure": 1}
    assert table.add("new", {}, 6 * BLOCK, block_ids=range(10, 16))
    # The router's next renewal of b learns where its blocks went; an unknown lease is only gone.
    status, body = svc.handle("POST", "/agentkv/v1/leases/b/renew", {})
    assert (status, body["demoted"]) == (409, True)
    assert svc.handle("POST", "/agentkv/v1/leases/zz/renew", {})[0] == 404

    # 12 more blocks cannot be made room for (c is not in the host tier): nothing is demoted for them.
    assert svc.make_room(range(20, 32)) == []
    assert table.lookup("a") is not None and stats["demotions"] == 1

    # Once the read's spare time has passed, a is a candidate like any other.
    now[0] = 3.0 + READ_SPARE_S
    assert svc.make_room(range(20, 24)) == ["a"]
    assert stats == {"demotions": 2, "demotions_pressure": 2}
