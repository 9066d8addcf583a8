"""Decode-side leases on retained blocks: an I/O-free table shared by the scheduler and the HTTP service.

vLLM pins a finished request's blocks on decode for a fixed ``decoder_kv_blocks_ttl`` (480 s) whether or not
another turn will come. We pin for a short lease instead; the router renews it while the conversation is
alive and releases it when the conversation closes. Deadlines are on the scheduler process's
``perf_counter`` clock because that is the clock vLLM ships with ``reqs_to_send`` and the one prefill's
clock offset (measured at handshake) refers to.

Thread model: the HTTP service thread only *reads* snapshots and *queues* operations; the scheduler thread
applies them in ``build_connector_meta`` (the only place vLLM lets us change deadlines safely).

Capacity: leases may hold at most ``capacity_blocks`` of decode's KV blocks. vLLM's fixed pin has no such
bound, so idle conversations can fill decode and make live requests wait for blocks. Here a retention that
does not fit is declined, and a lease once granted is kept until it is read, released or runs out. Evicting
the longest-retained lease to admit the new one was measured and lost (``python -m bench.retention``,
capped scenario, row "evict oldest": hit rate 0.33 vs 0.50): most new retentions belong to conversations
that never continue, while a lease that survived its heartbeats belongs to one that does. Never evicting
also means no lease can be freed under a NIXL read that prefill already started.

With a host KV tier the trade differs: a lease whose blocks the tier holds can end without losing them (its
next turn restores them from host memory), so the retention service demotes such leases to admit a new one
(``room_for`` names them; ``RetentionService.make_room``), never one a prefill asked after in the last
``spare_s`` (it may be reading it).

Room is counted in distinct blocks: a conversation's next turn served decode-local reuses the blocks its
previous turn's lease holds (vLLM's prefix cache hands it the same block ids), and until the router releases
that lease both cover them. Counting per lease charged those blocks twice and declined the newer turn's
retention once a conversation passed half the cap.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Container, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LeaseTable", "Retained", "match_request_id"]


def match_request_id(request_id: str, ids: Container[str], scan: Iterable[str]) -> str | None:
    """The id of ``ids`` that ``request_id`` names: itself, else the first of ``scan`` (``ids`` in the order
    to try) that contains it. vLLM turns the router's ``X-Request-Id`` into ``chatcmpl-<id>-<suffix>``."""
    if request_id in ids:
        return request_id
    return next((rid for rid in scan if request_id in rid), None)


@dataclass
class Retained:
    request_id: str
    params: dict[str, Any]
    deadline: float
    num_tokens: int
    block_ids: frozenset[Hashable] = frozenset()
    # When a prefill last asked whether the lease is still held before reading it (`lookup(reading=True)`).
    read_at: float = float("-inf")


@dataclass
class _Pending:
    renew: dict[str, float] = field(default_factory=dict)
    release: set[str] = field(default_factory=set)


class LeaseTable:
    def __init__(
        self,
        *,
        lease_s: float,
        max_lease_s: float,
        clock: Callable[[], float],
        capacity_blocks: int | None = None,
    ) -> None:
        if lease_s <= 0 or max_lease_s < lease_s:
            raise ValueError(f"need 0 < lease_s <= max_lease_s, got {lease_s}, {max_lease_s}")
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"need capacity_blocks >= 0, got {capacity_blocks}")
        self.lease_s = lease_s
        self.max_lease_s = max_lease_s
        self.capacity_blocks = capacity_blocks
        self._clock = clock
        self._lock = threading.Lock()
        self._retained: dict[str, Retained] = {}  # insertion order = retention order (oldest first)
        self._pending = _Pending()
        # How many counted leases hold each block, kept as leases come and go so that a retention's check
        # costs its own blocks, not a union over every lease (it runs on vLLM's scheduler thread).
        self._refs: dict[Hashable, int] = {}
        self._counted: set[str] = set()

    # --- scheduler thread ------------------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        params: dict[str, Any],
        num_tokens: int,
        *,
        block_ids: Collection[Hashable] = (),
    ) -> float:
        """Lease a finished request's blocks; returns its deadline, or 0.0 if the blocks no live lease holds
        yet do not fit under ``capacity_blocks`` (the caller then frees them at once)."""
        now = self._clock()
        blocks = frozenset(block_ids)
        with self._lock:
            if self.capacity_blocks is not None:
                self._settle(now)
                new = sum(1 for b in blocks if b not in self._refs)
                if len(self._refs) + new > self.capacity_blocks:
                    return 0.0
            self._uncount(request_id)  # a request id is leased once; never count a stale entry twice
            self._retained[request_id] = Retained(request_id, params, now + self.lease_s, num_tokens, blocks)
            self._count(request_id)
        return now + self.lease_s

    def _count(self, rid: str) -> None:
        for b in self._retained[rid].block_ids:
            self._refs[b] = self._refs.get(b, 0) + 1
        self._counted.add(rid)

    def _uncount(self, rid: str) -> None:
        if rid not in self._counted:
            return
        self._counted.discard(rid)
        r = self._retained.get(rid)
        for b in () if r is None else r.block_ids:
            left = self._refs[b] - 1
            if left:
                self._refs[b] = left
            else:
                del self._refs[b]

    def _settle(self, now: float) -> None:
        # Released or expired leases are on their way out (the workers free them): they hold no room.
        for rid in [rid for rid in self._counted if not self._live(rid, now)]:
            self._uncount(rid)

    def _live(self, rid: str, now: float) -> bool:
        r = self._retained.get(rid)
        return (
            r is not None
            and rid not in self._pending.release
            and self._pending.renew.get(rid, r.deadline) > now
        )

    def room_for(
        self, block_ids: Collection[Hashable], *, spare_s: float
    ) -> tuple[int, list[tuple[str, int]]]:
        """(blocks that a retention of ``block_ids`` is short of under ``capacity_blocks``, 0 where it fits;
        the live leases that could give them, soonest deadline first, each with the blocks no other lease
        holds). Leases a prefill asked after in the last ``spare_s`` are left out: it may be reading them."""
        now = self._clock()
        blocks = frozenset(block_ids)
        with self._lock:
            if self.capacity_blocks is None:
                return 0, []
            self._settle(now)
            short = len(self._refs) + sum(1 for b in blocks if b not in self._refs) - self.capacity_blocks
            if short <= 0:
                return 0, []
            live = [
                r for rid, r in self._retained.items() if rid in self._counted and now - r.read_at >= spare_s
            ]
            live.sort(key=lambda r: self._pending.renew.get(r.request_id, r.deadline))
            return short, [
                (r.request_id, sum(1 for b in r.block_ids if self._refs.get(b) == 1 and b not in blocks))
                for r in live
            ]

    def live_ids(self) -> list[str]:
        """The request ids of the live leases (any thread)."""
        now = self._clock()
        with self._lock:
            return [rid for rid in self._retained if self._live(rid, now)]

    def duration(self, duration_s: float | None) -> float:
        """How long a renewal asking for ``duration_s`` extends: the lease time where None, at most
        ``max_lease_s``."""
        return self.lease_s if duration_s is None else max(0.0, min(float(duration_s), self.max_lease_s))

    def clock(self) -> float:
        """The table's clock (the scheduler process's ``perf_counter``)."""
        return self._clock()

    def blocks_in_use(self) -> int:
        """Distinct KV blocks the live leases hold (any thread)."""
        with self._lock:
            self._settle(self._clock())
            return len(self._refs)

    def forget(self, request_id: str) -> None:
        """The blocks are gone (read by prefill, expired or released): stop advertising them."""
        with self._lock:
            self._uncount(request_id)
            self._retained.pop(request_id, None)

    def drain(self) -> dict[str, float]:
        """Deadline changes to hand to the workers (release = a deadline of now)."""
        now = self._clock()
        with self._lock:
            pending, self._pending = self._pending, _Pending()
            changes: dict[str, float] = {}
            for rid, deadline in pending.renew.items():
                if rid in self._retained:
                    self._retained[rid].deadline = deadline
                    changes[rid] = deadline
            for rid in pending.release:
                self._uncount(rid)
                if self._retained.pop(rid, None) is not None:
                    changes[rid] = now
            # Drop what expired on its own so lookups never return dead params.
            for rid in [r for r, v in self._retained.items() if v.deadline <= now]:
                self._uncount(rid)
                del self._retained[rid]
        return changes

    # --- service thread --------------------------------------------------------------------------------
    def resolve(self, request_id: str) -> str | None:
        """The leased request the router's ``request_id`` names (`match_request_id`)."""
        with self._lock:
            return match_request_id(request_id, self._retained, self._retained)

    def lookup(self, request_id: str, *, reading: bool = False) -> dict[str, Any] | None:
        """The lease's params and time left; ``reading``: a prefill asks before it reads the blocks."""
        rid = self.resolve(request_id)
        if rid is None:
            return None
        with self._lock:
            r = self._retained.get(rid)
            if r is None:
                return None
            pending = self._pending.renew.get(rid, r.deadline)
            remaining = pending - self._clock()
            if remaining <= 0 or rid in self._pending.release:
                return None
            if reading:
                r.read_at = self._clock()
            params = dict(r.params, remote_blocks_expiry_time=pending)
            return {
                "request_id": rid,
                "kv_transfer_params": params,
                "expires_in_s": round(remaining, 3),
                "num_tokens": r.num_tokens,
            }

    def renew(self, request_id: str, duration_s: float | None) -> dict[str, Any] | None:
        rid = self.resolve(request_id)
        if rid is None:
            return None
        d = self.duration(duration_s)
        with self._lock:
            r = self._retained.get(rid)
            if r is None or rid in self._pending.release:
                return None
            # A renewal only ever extends: prefill may already hold params promising the old deadline.
            current = self._pending.renew.get(rid, r.deadline)
            if current <= self._clock():
                return None  # ran out: the workers free it at their next step, whatever we queue now
            self._pending.renew[rid] = max(current, self._clock() + d)
        return self.lookup(rid)

    def release(self, request_id: str) -> bool:
        rid = self.resolve(request_id)
        if rid is None:
            return False
        with self._lock:
            self._pending.release.add(rid)
            self._pending.renew.pop(rid, None)
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._retained)
