"""How much of a finished request's tokens decode's prefix cache still holds.

A retention declined at the cap (or a lease that ran out) frees a request's blocks, but vLLM keeps freed
blocks in its prefix cache until it needs the room: the next turn, sent to that decode, reuses them as one
vLLM server with its prefix cache would. The router can only choose that path if it knows they are still
there, so decode remembers the block hashes of its recent finished requests (vLLM's own, as the request
carried them) and answers, for one of them, how many leading blocks its block pool still caches.

The answer is read from the service thread while the scheduler thread changes the pool: a dict lookup per
block, so at worst a block is reported cached a moment before it is evicted (or the other way round). It is
a hint for the router's path choice, never for correctness: decode's prefix cache matches blocks by the hash
of their tokens, whatever the router believed.

Where decode runs vLLM's host tier beside us (OffloadingConnector through MultiConnector,
``kv_offload_bytes``), blocks evicted from the pool may still be in host memory, from where vLLM restores
them for a decode-local turn: past the pool's leading blocks, the count goes on through the host tier's
own lookup (its manager's ``lookup``, a read of its policy's dict, as the pool's is).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from agentkv.server.engine._connector._leases import match_request_id

__all__ = ["Cached", "CachedPrompts", "HostTier", "calling_scheduler", "host_lookup", "pool_lookup"]

logger = logging.getLogger("agentkv.connector")

# (block hash) -> whether the pool caches it; None: no pool to ask.
Lookup = Callable[[Any], bool]


@dataclass(frozen=True)
class Cached:
    """Tokens of a request's leading whole blocks decode still has: in its KV cache (``hbm_tokens``), then,
    evicted from it, in the host tier (``host_tokens``)."""

    hbm_tokens: int
    host_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.hbm_tokens + self.host_tokens


class CachedPrompts:
    """Block hashes of recent finished requests, at most ``max_blocks`` hashes in all (least recent first
    out), and the count of leading blocks still cached, through ``lookup`` once it is set."""

    def __init__(self, *, block_size: int, max_blocks: int) -> None:
        if block_size <= 0 or max_blocks < 0:
            raise ValueError(f"need block_size > 0 and max_blocks >= 0, got {block_size}, {max_blocks}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.lookup: Lookup | None = None
        # The host tier's lookup, and how many of our blocks one of its chunks holds (its key is the hash of
        # the chunk's last block, as vLLM's offloading scheduler makes it).
        self.host_lookup: Lookup | None = None
        # The host tier's key of a chunk, by the hash of its last block (`host_keys`).
        self.host_key: Callable[[Any], Any] | None = None
        self.blocks_per_chunk = 1
        self._lock = threading.Lock()
        self._host_keys: dict[str, frozenset[Any]] = {}  # by request id, made once per kept hash list
        # Requests never dropped to make room (the conversations decode keeps: their blocks stay in the host
        # tier past newer requests', and the router's `cached` path needs their hashes to find them).
        self.pinned: Callable[[], Collection[str]] | None = None
        self._kept: OrderedDict[str, tuple[Any, ...]] = OrderedDict()
        self._blocks = 0

    def keep(self, request_id: str, block_hashes: Sequence[Any]) -> None:
        """Remember a finished request's block hashes (a copy: vLLM may change the request's list)."""
        hashes = tuple(block_hashes)[: self.max_blocks]
        if not hashes:
            return
        with self._lock:
            old = self._kept.pop(request_id, None)
            self._blocks -= len(old) if old else 0
            self._host_keys.pop(request_id, None)
            self._kept[request_id] = hashes
            self._blocks += len(hashes)
            if self._blocks <= self.max_blocks:
                return
        # Asked only when something must go, and outside our lock (it takes the lease table's). Only the
        # scheduler thread keeps requests, so nothing else is added meanwhile.
        pinned = self.pinned() if self.pinned is not None else ()
        with self._lock:
            for rid in list(self._kept):  # least recent first
                if self._blocks <= self.max_blocks:
                    break
                if rid in pinned or rid == request_id:
                    continue  # the bound may be passed by kept conversations, never at their cost
                self._blocks -= len(self._kept.pop(rid))
                self._host_keys.pop(rid, None)

    def _find(self, request_id: str) -> tuple[Any, ...] | None:
        """The hashes of the request the router's ``request_id`` names, newest first (`match_request_id`)."""
        with self._lock:
            rid = match_request_id(request_id, self._kept, reversed(self._kept))
            return None if rid is None else self._kept[rid]

    def cached_tokens(self, request_id: str) -> Cached | None:
        """The request's leading whole blocks decode still has (``Cached``); None where the request is not
        remembered or there is no pool to ask."""
        hashes = self._find(request_id)
        lookup = self.lookup
        if hashes is None or lookup is None:
            return None
        n = _leading(hashes, lookup, step=1)
        host = self.host_lookup
        f = self.blocks_per_chunk
        # The host tier holds whole chunks: from the first chunk boundary at or below the pool's count.
        start = n // f * f
        extra = 0 if host is None else max(_leading(hashes[start:], host, step=f) - (n - start), 0)
        return Cached(n * self.block_size, extra * self.block_size)

    def host_tokens(self, request_id: str) -> int | None:
        """Tokens of the request's leading whole chunks the host tier holds, wherever the pool holds them too
        (a leased request's blocks are all in the pool; their host copies are what a demotion leaves); None
        where the request is not remembered or decode has no host tier."""
        hashes = self._find(request_id)
        host = self.host_lookup
        if hashes is None or host is None:
            return None
        return _leading(hashes, host, step=self.blocks_per_chunk) * self.block_size

    def host_keys(self, request_id: str) -> frozenset[Any]:
        """The host tier's keys of the request's whole chunks (empty where the request is not remembered or
        decode has no host tier): what `_host_policy` spares while the request's conversation is kept.
        ``request_id`` is vLLM's own (exact, as the offload manager sees it)."""
        key = self.host_key
        if key is None:
            return frozenset()
        with self._lock:
            made = self._host_keys.get(request_id)
            hashes = self._kept.get(request_id)
        if made is not None or hashes is None:
            return made or frozenset()
        f = self.blocks_per_chunk
        made = frozenset(key(hashes[i]) for i in range(f - 1, len(hashes), f))
        with self._lock:
            if self._kept.get(request_id) is hashes:
                self._host_keys[request_id] = made
        return made

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)


def _leading(hashes: Sequence[Any], lookup: Lookup, *, step: int) -> int:
    """Blocks of ``hashes`` from the start that ``lookup`` finds, ``step`` at a time (each step asked by its
    last block's hash)."""
    n = 0
    try:
        while n + step <= len(hashes) and lookup(hashes[n + step - 1]):
            n += step
    except Exception:  # a pool changing under the read: what was counted so far was cached
        logger.debug("prefix cache lookup failed", exc_info=True)
    return n


def calling_scheduler() -> Any:
    """vLLM's scheduler, found on the call stack (its ``_connector_finished`` calls the connector that calls
    us): the object with a ``kv_cache_manager``; None where there is none."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if getattr(owner, "kv_cache_manager", None) is not None:
            return owner
        frame = frame.f_back
    return None


def pool_lookup(scheduler: Any) -> Lookup | None:
    """A lookup of block hashes in the block pool of vLLM's scheduler ``scheduler``, for the first KV cache
    group (the only one where one block size describes every layer, the case we count); None where that
    scheduler has no pool with ``get_cached_block`` (another vLLM layout; 0.26-0.34 all have
    ``Scheduler.kv_cache_manager.block_pool.get_cached_block(block_hash, kv_cache_group_ids)``)."""
    manager = getattr(scheduler, "kv_cache_manager", None)
    pool = getattr(manager, "block_pool", None)
    get = getattr(pool, "get_cached_block", None)
    if get is None:
        return None

    def lookup(block_hash: Any) -> bool:
        return bool(get(block_hash, [0]))

    return lookup


@dataclass(frozen=True)
class HostTier:
    """vLLM's host KV tier as ``CachedPrompts`` asks it: a lookup of block hashes, how many of our blocks
    one of its chunks holds, and how many of our blocks it holds at most."""

    lookup: Lookup
    blocks_per_chunk: int
    capacity_blocks: int
    key: Callable[[Any], Any]  # a chunk's key in the tier, by the hash of its last block


def host_lookup(scheduler: Any) -> HostTier | None:
    """The host tier of vLLM's OffloadingConnector beside ours under MultiConnector on ``scheduler`` (its
    first KV cache group); None where there is none. 0.26-0.34 all have
    ``OffloadingConnector.connector_scheduler.manager.lookup(key, req_context)`` with
    ``make_offload_key(block_hash, group_idx)`` and ``ReqContext(req_id=...)``."""
    connector = getattr(scheduler, "connector", None)
    for sub in [connector, *getattr(connector, "_connectors", ())]:
        offload = getattr(sub, "connector_scheduler", None)
        manager = getattr(offload, "manager", None)
        groups = getattr(getattr(offload, "config", None), "kv_group_configs", None)
        if manager is None or not hasattr(manager, "lookup") or not groups:
            continue
        return _host_tier(manager, groups[0])
    return None


def _host_tier(manager: Any, group: Any) -> HostTier | None:
    try:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    except ImportError:
        return None
    context = ReqContext(req_id="agentkv-cached-query")
    group_idx = int(group.group_idx)

    def key(block_hash: Any) -> Any:
        return make_offload_key(block_hash, group_idx)

    def lookup(block_hash: Any) -> bool:
        return bool(manager.lookup(key(block_hash), context) == LookupResult.HIT)

    per_chunk = max(int(group.hashes_per_chunk), 1)
    # Its capacity in chunks: the manager's count (0.32+ `_num_chunks`, 0.26 `_num_blocks`).
    chunks = getattr(manager, "_num_chunks", None) or getattr(manager, "_num_blocks", None) or 0
    return HostTier(
        lookup=lookup, blocks_per_chunk=per_chunk, capacity_blocks=int(chunks) * per_chunk, key=key
    )
