"""Tiers under the lease: where each retained conversation's KV lives (HBM, pinned host memory, local disk).

An I/O-free placement model for the retention replay (``bench._retention_sim``). The lease (the real
``LeaseTable``) still decides *how long* a conversation is kept; this decides *where*:

* A retention enters HBM (the blocks decode just computed). Demotion moves a whole entry one tier down,
  making room there by demoting that tier's longest-idle entry further (a cascade). An entry never moves
  up: a hit reads it from wherever it is ("promotion on the next turn"), and the read ends the entry, as a
  prefill read ends decode's retained request today.
* Victims are chosen longest idle first (the replay frees expired leases before every placement, so expired
  entries always go before live ones), and never among entries a turn is reading.
* When a tier has no room and nothing can move down, the newcomer is refused (the connector's own rule for
  its HBM cap: a lease once granted is kept) or, with ``evict_when_full``, the longest-idle entry there is
  dropped.
* A copy takes ``bytes / bandwidth`` on its link, first come first served: ``h2d`` (host -> HBM restores),
  ``d2h`` (HBM -> host demotions; PCIe is full duplex, so the two directions do not queue on each other) and
  ``disk`` (every read and write of the disk tier, which share one device). A demoted entry counts in the
  lower tier from the moment it is demoted; the source tier's copy time is accounted separately
  (``copy_block_seconds``) rather than delaying placement.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KV_SHAPE_8B", "KvShape", "Tier", "TierLogEntry", "TierStore", "kv_bytes_per_block"]


@dataclass(frozen=True, kw_only=True)
class KvShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int


# Qwen3-8B / Llama-3-8B attention shape in bf16: the 8B shape of the figures.
KV_SHAPE_8B = KvShape(layers=36, kv_heads=8, head_dim=128, dtype_bytes=2)


def kv_bytes_per_block(shape: KvShape, block_size: int) -> int:
    """K and V bytes of ``block_size`` tokens, all layers (8B: 36 x 8 x 128 x 2 x 2 x 16 = 2,359,296)."""
    return shape.layers * shape.kv_heads * shape.head_dim * 2 * shape.dtype_bytes * block_size


@dataclass(frozen=True, kw_only=True)
class Tier:
    name: str
    capacity_blocks: int | None  # None: unbounded
    gbps: float = math.inf  # GB/s of a copy into or out of this tier (HBM: no copy)


@dataclass(frozen=True)
class TierLogEntry:
    time: float
    request_id: str
    action: str  # "admit", "demote", "evict", "read", "remove"
    source: int | None
    target: int | None


@dataclass
class _Placed:
    tier: int
    blocks: int
    idle_since: float
    entered: float  # when it came into its current tier
    reading: bool = False


@dataclass
class _TierStats:
    block_seconds: float = 0.0  # residency
    copy_block_seconds: float = 0.0  # held as the source of a demotion's copy
    peak_blocks: int = 0
    demotions_out: int = 0
    evictions: int = 0
    restores: int = 0
    restore_bytes: int = 0
    restore_seconds: list[float] = field(default_factory=list)  # link wait + copy, per restore


class TierStore:
    def __init__(
        self,
        *,
        tiers: Sequence[Tier],
        bytes_per_block: int,
        evict_when_full: bool = False,
        log: bool = False,
    ) -> None:
        if not tiers:
            raise ValueError("need at least one tier (HBM)")
        self.tiers = tuple(tiers)
        self.bytes_per_block = bytes_per_block
        self.evict_when_full = evict_when_full
        self.log: list[TierLogEntry] | None = [] if log else None
        self._entries: dict[str, _Placed] = {}
        self._used = [0] * len(self.tiers)
        self._stats = [_TierStats() for _ in self.tiers]
        # Per tier: (idle_since, seq, request id); entries that left the tier are skipped lazily.
        self._heaps: list[list[tuple[float, int, str]]] = [[] for _ in self.tiers]
        self._seq = 0
        self._link_free_at: dict[str, float] = {}

    # --- queries ---------------------------------------------------------------------------------------
    def tier_of(self, request_id: str) -> int | None:
        placed = self._entries.get(request_id)
        return None if placed is None else placed.tier

    def is_reading(self, request_id: str) -> bool:
        placed = self._entries.get(request_id)
        return placed is not None and placed.reading

    def used(self, tier: int) -> int:
        return self._used[tier]

    def total_used(self) -> int:
        return sum(self._used)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    # --- changes ---------------------------------------------------------------------------------------
    def admit(self, request_id: str, blocks: int, now: float, *, make_room: bool) -> tuple[bool, list[str]]:
        """Place a new retention in HBM; returns (placed, entries evicted to make room)."""
        evicted: list[str] = []
        if not self._fits(0, blocks) and not (make_room and self._make_room(0, blocks, now, evicted)):
            return False, evicted
        self._place(request_id, _Placed(tier=0, blocks=blocks, idle_since=now, entered=now), now)
        self._record(now, request_id, "admit", None, 0)
        return True, evicted

    def demote(self, request_id: str, now: float) -> bool:
        """Move an idle entry one tier down if the tiers below can take it without evicting anything."""
        placed = self._entries.get(request_id)
        if placed is None or placed.reading or placed.tier + 1 >= len(self.tiers):
            return False
        target = placed.tier + 1
        if not self._fits(target, placed.blocks) and not self._make_room(target, placed.blocks, now, None):
            return False
        self._move(request_id, target, now)
        return True

    def start_read(self, request_id: str, now: float) -> float:
        """A turn reads the entry: it can no longer move or be evicted. Returns seconds until the read ends
        (0 in HBM; else waiting for the link plus bytes / bandwidth)."""
        placed = self._entries[request_id]
        placed.reading = True
        self._record(now, request_id, "read", placed.tier, placed.tier)
        if placed.tier == 0:
            return 0.0
        nbytes = placed.blocks * self.bytes_per_block
        end = self._copy(self._restore_link(placed.tier), nbytes, self.tiers[placed.tier].gbps, now)
        stats = self._stats[placed.tier]
        stats.restores += 1
        stats.restore_bytes += nbytes
        stats.restore_seconds.append(end - now)
        return end - now

    def remove(self, request_id: str, end: float) -> None:
        """The entry is gone (read, released, expired or evicted by the caller): its blocks are free."""
        placed = self._entries.pop(request_id)
        self._leave(placed, end)
        self._record(end, request_id, "remove", placed.tier, None)

    # --- accounting ------------------------------------------------------------------------------------
    def summary(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for tier, stats in zip(self.tiers, self._stats, strict=True):
            restore_time = sum(stats.restore_seconds)
            out[tier.name] = {
                "capacity_blocks": tier.capacity_blocks,
                "block_seconds": stats.block_seconds,
                "copy_block_seconds": stats.copy_block_seconds,
                "peak_blocks": stats.peak_blocks,
                "peak_bytes": stats.peak_blocks * self.bytes_per_block,
                "demotions_out": stats.demotions_out,
                "evictions": stats.evictions,
                "restores": stats.restores,
                "restore_bytes": stats.restore_bytes,
                "restore_ms": [s * 1000 for s in stats.restore_seconds],
                # Bytes over wall time of the restores, link waits included.
                "restore_gbps": stats.restore_bytes / restore_time / 1e9 if restore_time > 0 else None,
            }
        return out

    def check(self) -> None:
        """Invariants (for tests): per-tier counts add up and no cap is exceeded."""
        used = [0] * len(self.tiers)
        for placed in self._entries.values():
            used[placed.tier] += placed.blocks
        assert used == self._used, (used, self._used)
        for tier, count in zip(self.tiers, used, strict=True):
            assert tier.capacity_blocks is None or count <= tier.capacity_blocks, (tier, count)

    # --- internals -------------------------------------------------------------------------------------
    def _fits(self, tier: int, blocks: int) -> bool:
        cap = self.tiers[tier].capacity_blocks
        return cap is None or self._used[tier] + blocks <= cap

    def _make_room(self, tier: int, blocks: int, now: float, evicted: list[str] | None) -> bool:
        """Demote (or, when allowed and ``evicted`` is a list, evict) the tier's longest-idle entries until
        ``blocks`` fit. Moves already made stay made if it fails."""
        cap = self.tiers[tier].capacity_blocks
        if cap is None:
            return True
        if blocks > cap:
            return False
        while self._used[tier] + blocks > cap:
            victim = self._longest_idle(tier)
            if victim is None:
                return False  # everything left here is being read
            size = self._entries[victim].blocks
            below = tier + 1
            if below < len(self.tiers) and (
                self._fits(below, size) or self._make_room(below, size, now, evicted)
            ):
                self._move(victim, below, now)
            elif evicted is not None and self.evict_when_full:
                placed = self._entries.pop(victim)
                self._leave(placed, now)
                self._stats[tier].evictions += 1
                self._record(now, victim, "evict", tier, None)
                evicted.append(victim)
            else:
                return False
        return True

    def _longest_idle(self, tier: int) -> str | None:
        heap = self._heaps[tier]
        skipped = []
        found = None
        while heap:
            _, _, request_id = heap[0]
            placed = self._entries.get(request_id)
            if placed is None or placed.tier != tier:
                heapq.heappop(heap)  # stale: gone, or moved down (entries never move up)
            elif placed.reading:
                skipped.append(heapq.heappop(heap))
            else:
                found = request_id
                break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def _place(self, request_id: str, placed: _Placed, now: float) -> None:
        self._entries[request_id] = placed
        self._used[placed.tier] += placed.blocks
        stats = self._stats[placed.tier]
        stats.peak_blocks = max(stats.peak_blocks, self._used[placed.tier])
        heapq.heappush(self._heaps[placed.tier], (placed.idle_since, self._seq, request_id))
        self._seq += 1

    def _leave(self, placed: _Placed, end: float) -> None:
        self._used[placed.tier] -= placed.blocks
        self._stats[placed.tier].block_seconds += placed.blocks * max(0.0, end - placed.entered)

    def _move(self, request_id: str, target: int, now: float) -> None:
        placed = self._entries.pop(request_id)
        assert not placed.reading, request_id  # _longest_idle and demote never pick one
        source = placed.tier
        self._leave(placed, now)
        nbytes = placed.blocks * self.bytes_per_block
        end = self._copy(self._demote_link(target), nbytes, self.tiers[target].gbps, now)
        self._stats[source].copy_block_seconds += placed.blocks * (end - now)
        self._stats[source].demotions_out += 1
        self._place(
            request_id,
            _Placed(tier=target, blocks=placed.blocks, idle_since=placed.idle_since, entered=now),
            now,
        )
        self._record(now, request_id, "demote", source, target)

    def _restore_link(self, tier: int) -> str:
        return "disk" if self.tiers[tier].name == "disk" else "h2d"

    def _demote_link(self, target: int) -> str:
        return "disk" if self.tiers[target].name == "disk" else "d2h"

    def _copy(self, link: str, nbytes: int, gbps: float, now: float) -> float:
        start = max(now, self._link_free_at.get(link, 0.0))
        end = start + (nbytes / (gbps * 1e9) if math.isfinite(gbps) else 0.0)
        self._link_free_at[link] = end
        return end

    def _record(
        self, time: float, request_id: str, action: str, source: int | None, target: int | None
    ) -> None:
        if self.log is not None:
            self.log.append(TierLogEntry(time, request_id, action, source, target))
