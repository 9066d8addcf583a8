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
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CachedPrompts", "calling_scheduler", "pool_lookup"]

logger = logging.getLogger("agentkv.connector")

# (block hash) -> whether the pool caches it; None: no pool to ask.
Lookup = Callable[[Any], bool]


class CachedPrompts:
    """Block hashes of recent finished requests, at most ``max_blocks`` hashes in all (least recent first
    out), and the count of leading blocks still cached, through ``lookup`` once it is set."""

    def __init__(self, *, block_size: int, max_blocks: int) -> None:
        if block_size <= 0 or max_blocks < 0:
            raise ValueError(f"need block_size > 0 and max_blocks >= 0, got {block_size}, {max_blocks}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.lookup: Lookup | None = None
        self._lock = threading.Lock()
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
            self._kept[request_id] = hashes
            self._blocks += len(hashes)
            while self._blocks > self.max_blocks:
                _, dropped = self._kept.popitem(last=False)
                self._blocks -= len(dropped)

    def _find(self, request_id: str) -> tuple[Any, ...] | None:
        """vLLM turns the router's ``X-Request-Id`` into ``chatcmpl-<id>-<suffix>``: match by containment,
        newest first (as `LeaseTable.resolve` does)."""
        with self._lock:
            found = self._kept.get(request_id)
            if found is not None:
                return found
            for rid in reversed(self._kept):
                if request_id in rid:
                    return self._kept[rid]
        return None

    def cached_tokens(self, request_id: str) -> int | None:
        """Tokens of the request's leading whole blocks that the prefix cache still holds; None where the
        request is not remembered or there is no pool to ask."""
        hashes = self._find(request_id)
        lookup = self.lookup
        if hashes is None or lookup is None:
            return None
        n = 0
        try:
            for h in hashes:
                if not lookup(h):
                    break
                n += 1
        except Exception:  # a pool changing under the read: what was counted so far was cached
            logger.debug("prefix cache lookup failed", exc_info=True)
        return n * self.block_size

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)


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
