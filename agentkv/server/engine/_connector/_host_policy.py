"""The host KV tier's eviction order, by lease state: chunks of conversations that ended go first.

vLLM's host tier (its OffloadingConnector's ``CPUOffloadingManager``) evicts least recently used first over
every chunk it holds, knowing nothing of leases. An agent idle in a long tool call then loses its host copy
to whatever ran since, including conversations that ended (released, or whose lease ran out with no
heartbeat) and one-off requests. This policy keeps vLLM's LRU and its bookkeeping, and changes only which
chunks ``evict`` takes: first, least recently used first, those of no *kept* conversation; only where those
are too few, least recently used first over all (vLLM's own order). Kept are decode's live leases and the
conversations without a lease (demoted, declined at the cap, run out) that the router still beats for
(`RetentionService.kept_host_keys`).
The retention replay (``bench/_retention_tiers.py``) models this order: expired entries before live ones.

Loaded by vLLM's policy factory (0.32-0.34: ``eviction_policy`` and ``cache_policy_module_path`` in the
offloading connector's extra config, ``POLICY_NAME`` / ``POLICY_MODULE``); 0.26 has no factory, only a dict
of built-in policies, which ``register_builtin`` adds this one to (imported by our connector, which
MultiConnector builds before the offloading connector). The scheduler side of our connector and this policy
live in the same engine-core process: the connector hands the policy its kept keys through ``keep_with``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Collection, Container, Sequence
from typing import Any

from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

__all__ = [
    "POLICY_MODULE",
    "POLICY_NAME",
    "LeaseAwareLRUCachePolicy",
    "keep_with",
    "occupancy",
    "register_builtin",
]

logger = logging.getLogger("agentkv.connector")

POLICY_NAME = "LeaseAwareLRUCachePolicy"
POLICY_MODULE = "agentkv.server.engine._connector._host_policy"

# The offload keys of kept conversations, one collection per conversation; set by the connector once it
# has found the host tier (None: no lease state to order by, plain LRU).
KeptKeys = Callable[[], Sequence[Collection[Any]]]
_kept: KeptKeys | None = None
# The connector's counters: chunks evicted of conversations not kept (`host_evicted`) and of kept ones
# (`host_evicted_kept`: the live set is more than the tier holds).
_counts: dict[str, int] | None = None
# Bytes of KV one chunk holds (decode's bytes per token times the chunk's tokens), for `occupancy`.
_chunk_bytes: float | None = None


def keep_with(
    kept: KeptKeys | None, *, counts: dict[str, int] | None = None, chunk_bytes: float | None = None
) -> None:
    """Order this process's host-tier evictions by ``kept`` (None: vLLM's LRU alone); count them in
    ``counts``; ``chunk_bytes`` (bytes of KV in one chunk) lets `occupancy` say bytes too."""
    global _kept, _counts, _chunk_bytes
    _kept, _counts, _chunk_bytes = kept, counts, chunk_bytes


class _Either:
    """Membership in any of several collections, without building their union on every eviction."""

    def __init__(self, *parts: Container[Any]) -> None:
        self._parts = parts

    def __contains__(self, key: object) -> bool:
        return any(key in part for part in self._parts)


class LeaseAwareLRUCachePolicy(LRUCachePolicy):
    """vLLM's LRU policy, evicting chunks of no kept conversation before any of a kept one."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.agentkv_capacity = cache_capacity  # 0.26's base class keeps no copy
        _policies.add(self)

    def evict(self, n: int, protected: set[Any]) -> Any:
        kept = _kept_now()
        # vLLM's LRU skips protected keys and returns None (changing nothing) where it cannot take n.
        found = super().evict(n, _Either(protected, *kept)) if kept else None  # type: ignore[arg-type]
        if found is None:
            found = super().evict(n, protected)
        if found and _counts is not None:
            of_kept = sum(1 for key, _chunk in found if key in _Either(*kept)) if kept else 0
            _counts["host_evicted"] = _counts.get("host_evicted", 0) + len(found) - of_kept
            _counts["host_evicted_kept"] = _counts.get("host_evicted_kept", 0) + of_kept
        return found


# This process's policies, for `occupancy` (one per host tier; weak: vLLM owns them).
_policies: weakref.WeakSet[LeaseAwareLRUCachePolicy] = weakref.WeakSet()


def occupancy() -> dict[str, int] | None:
    """What this process's host tier holds now, in chunks: ``held``, ``kept`` (of those, chunks of kept
    conversations) and ``capacity``, and ``held_bytes`` where the chunk's size is known; None where no tier
    runs this policy (vLLM's LRU, or no tier)."""
    policies = list(_policies)
    if not policies:
        return None
    kept = _Either(*_kept_now())
    held = of_kept = capacity = 0
    for policy in policies:
        # vLLM 0.32+ name the policy's dict `chunks`, 0.26 `blocks`; list() copies it under the GIL while
        # the engine thread stores and evicts.
        keys = list(getattr(policy, "chunks", None) or getattr(policy, "blocks", None) or ())
        held += len(keys)
        of_kept += sum(1 for key in keys if key in kept)
        capacity += policy.agentkv_capacity
    out = {"held": held, "kept": of_kept, "capacity": capacity}
    if _chunk_bytes:
        out["held_bytes"] = round(held * _chunk_bytes)
    return out


def _kept_now() -> Sequence[Collection[Any]]:
    if _kept is None:
        return ()
    try:
        return _kept()
    except Exception:  # the order is a preference: never fail vLLM's store over it
        logger.debug("kept host keys unavailable", exc_info=True)
        return ()


def register_builtin() -> bool:
    """vLLM 0.26: add the policy to the manager's table of built-in policies (0.32+ load it by module path
    and have no such table). Whether it was added."""
    try:
        import vllm.v1.kv_offload.cpu.manager as manager
    except ImportError:
        return False
    table = getattr(manager, "_CACHE_POLICIES", None)
    if not isinstance(table, dict):
        return False
    table.setdefault(POLICY_NAME, LeaseAwareLRUCachePolicy)
    return True
