"""Discrete-event replay of decode-side KV retention: heartbeat lease vs vLLM's fixed TTL pin.

What is real and what is simulated (also in bench/README.md):

* Real: the lease policy object, ``agentkv.server.engine._connector._leases.LeaseTable`` (the table decode's
  scheduler and retention service share), driven through ``add``/``renew``/``release``/``drain``/
  ``lookup``/``forget`` exactly as the connector does, on a virtual clock injected through its ``clock``.
* Modelled: vLLM's fixed pin (``decoder_kv_blocks_ttl``: a deadline of finish + TTL, never renewed, no
  release API) in ``FixedTTL``; prefill's rule that it declines a pull within 5 s of decode's expiry;
  service time (prefill of the uncached tokens at ``prefill_us_per_token`` + ``output_length`` x ``itl_ms``).
* Synthesised: conversations (grouped from the trace's ``hash_ids``), which agents vanish and when,
  which conversations get long tool gaps, heartbeats every ``lease_s / 3`` while an agent is alive and
  idle for less than ``heartbeat_idle_limit_s`` (the SDK's rule).
* Time is virtual: a run replays the trace's ~17 minutes (plus the tail of retention) in a second or two.
* Tiers (policy ``tiered``, ``TierConfig``): the same uncapped LeaseTable decides how long a conversation is
  kept, ``bench._retention_tiers`` where (HBM, pinned host memory, disk); restores cost bytes / bandwidth
  on a first-come-first-served link and are added to the turn's modelled TTFT (restore + prefill of the
  tokens not reused).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentkv._constants import DEFAULT_IDLE_LIMIT_S, DEFAULT_LEASE_S, DEFAULT_MAX_LEASE_S, VLLM_FIXED_TTL_S
from bench._common import summarize
from bench._fake_vllm import DECLINE_MARGIN_S
from bench._retention_tiers import KV_SHAPE_8B, KvShape, Tier, TierStore, kv_bytes_per_block
from bench._trace import Conversation

__all__ = [
    "FixedTTL",
    "HeartbeatLease",
    "Policy",
    "Scenario",
    "ScriptedTurn",
    "TierConfig",
    "bounds",
    "replay",
    "script_scenario",
]


class Policy(Protocol):
    name: str

    def add(self, request_id: str, num_tokens: int, num_blocks: int, in_use: int) -> float: ...
    def heartbeat(self, request_id: str) -> float | None: ...
    def close(self, request_id: str) -> bool: ...
    def remaining(self, request_id: str) -> float | None: ...
    def read(self, request_id: str) -> None: ...


class FixedTTL:
    """vLLM's decode pin: finish + TTL, not renewable, not releasable; one prefill read frees it."""

    def __init__(self, *, ttl_s: float, clock: Callable[[], float], capacity_blocks: int | None) -> None:
        self.name = f"fixed TTL {ttl_s:g}s"
        self._ttl_s = ttl_s
        self._capacity = capacity_blocks
        self._clock = clock
        self._deadlines: dict[str, float] = {}

    def add(self, request_id: str, num_tokens: int, num_blocks: int, in_use: int) -> float:
        if self._capacity is not None and in_use + num_blocks > self._capacity:
            return 0.0  # a full decode cannot pin more: it frees the new request's blocks
        self._deadlines[request_id] = self._clock() + self._ttl_s
        return self._deadlines[request_id]

    def heartbeat(self, request_id: str) -> float | None:
        return None  # nothing to renew: stock vLLM has no decode-side lease

    def close(self, request_id: str) -> bool:
        return False  # and no way to release early

    def remaining(self, request_id: str) -> float | None:
        deadline = self._deadlines.get(request_id)
        if deadline is None or deadline <= self._clock():
            return None
        return deadline - self._clock()

    def read(self, request_id: str) -> None:
        self._deadlines.pop(request_id, None)


class HeartbeatLease:
    """The real ``LeaseTable``, operated the way the connector's scheduler and service operate it."""

    def __init__(
        self, *, lease_s: float, max_lease_s: float, clock: Callable[[], float], capacity_blocks: int | None
    ) -> None:
        from agentkv.server.engine._connector._leases import LeaseTable

        self.name = f"heartbeat lease {lease_s:g}s"
        self._lease_s = lease_s
        self._clock = clock
        self.table = LeaseTable(
            lease_s=lease_s, max_lease_s=max_lease_s, clock=clock, capacity_blocks=capacity_blocks
        )
        self._next_block = 0  # every retention its own blocks: the replay shares none between turns

    def add(self, request_id: str, num_tokens: int, num_blocks: int, in_use: int) -> float:
        # The table keeps its own count of retained blocks and applies its own cap (``in_use`` unused).
        params = {"remote_request_id": request_id}
        first, self._next_block = self._next_block, self._next_block + num_blocks
        return float(
            self.table.add(request_id, params, num_tokens, block_ids=range(first, first + num_blocks))
        )

    def heartbeat(self, request_id: str) -> float | None:
        answer = self.table.renew(request_id, self._lease_s)
        self.table.drain()  # the scheduler applies queued renewals at its next step
        if answer is None:
            return None
        return self._clock() + float(answer["expires_in_s"])

    def close(self, request_id: str) -> bool:
        released = self.table.release(request_id)
        self.table.drain()
        return bool(released)

    def remaining(self, request_id: str) -> float | None:
        answer = self.table.lookup(request_id)
        return None if answer is None else float(answer["expires_in_s"])

    def read(self, request_id: str) -> None:
        self.table.forget(request_id)


@dataclass(kw_only=True)
class Scenario:
    seed: int = 0
    vanish_fraction: float = 0.3  # agents that disappear mid-conversation (no close, no heartbeats)
    long_gap_fraction: float = 0.2  # conversations whose tool gaps are drawn long
    long_gap_s: tuple[float, float] = (1.5 * DEFAULT_LEASE_S, 1.5 * VLLM_FIXED_TTL_S)
    lease_s: float = DEFAULT_LEASE_S
    max_lease_s: float = DEFAULT_MAX_LEASE_S
    ttl_s: float = VLLM_FIXED_TTL_S
    block_size: int = 16
    prefill_us_per_token: float = 19.0  # Qwen3-8B on an H200 (docs: landscape.md)
    itl_ms: float = 20.0
    capacity_blocks: int | None = None  # decode KV blocks available for retention; None = unbounded
    # The SDK stops heartbeating once an agent has been idle this long (Session's heartbeat_idle_limit_s);
    # its lease then runs out within lease_s. None: heartbeat for as long as the agent lives.
    heartbeat_idle_limit_s: float | None = DEFAULT_IDLE_LIMIT_S
    tiers: TierConfig | None = None  # policy "tiered" only


@dataclass(kw_only=True)
class ScriptedTurn:
    input_length: int
    output_length: int
    gap_s: float  # think/tool time after the previous turn finished (first turn: absolute arrival)


@dataclass(kw_only=True)
class ScriptedConversation:
    turns: list[ScriptedTurn]
    vanishes: bool  # True: the agent disappears after its last scripted turn; False: it closes


def script_scenario(conversations: list[Conversation], scenario: Scenario) -> list[ScriptedConversation]:
    """Turn grouped trace conversations into scripts: gaps, long tool gaps, vanishing agents (seeded)."""
    rng = random.Random(scenario.seed)
    scripts = []
    for conversation in conversations:
        requests = conversation.requests
        vanishes = rng.random() < scenario.vanish_fraction
        last = rng.randrange(len(requests)) if vanishes else len(requests) - 1
        long_gaps = rng.random() < scenario.long_gap_fraction
        turns = []
        for index, request in enumerate(requests[: last + 1]):
            if index == 0:
                gap = request.timestamp_s
            elif long_gaps:
                gap = rng.uniform(*scenario.long_gap_s)
            else:
                # The trace's own inter-arrival time stands for the tool/think gap.
                gap = max(0.0, request.timestamp_s - requests[index - 1].timestamp_s)
            turns.append(
                ScriptedTurn(
                    input_length=request.input_length, output_length=request.output_length, gap_s=gap
                )
            )
        scripts.append(ScriptedConversation(turns=turns, vanishes=vanishes))
    return scripts


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """Tiers under the lease (policy ``tiered``): HBM (``Scenario.capacity_blocks``), pinned host memory,
    local disk. Placement, demotion and restores: ``bench._retention_tiers``."""

    host_blocks: int = 0  # 0: no host tier
    disk_blocks: int | None = 0  # 0: no disk tier; None: unbounded
    # When an entry moves down from HBM: "pressure" (to make room for a new retention: lazily, by eviction
    # order), "idle" (idle for ``idle_s`` in HBM) and/or "tool" (the SDK says a tool call started; the trace
    # has no tool marks, so every gap after a turn is taken as tool time).
    demote_on: frozenset[str] = frozenset({"pressure", "idle", "tool"})
    idle_s: float = 10.0
    # False: a retention with no room in any tier is refused (the connector's rule for its HBM cap).
    evict_when_full: bool = False
    # Host -> HBM, measured on an H100 host (PCIe Gen5 x16); HBM -> host assumed equal.
    host_gbps: float = 55.5
    disk_gbps: float = 6.0  # assumed (one NVMe), not measured
    kv_shape: KvShape = KV_SHAPE_8B  # bytes per block follow from it and Scenario.block_size

    def tiers(self, hbm_blocks: int | None) -> list[Tier]:
        tiers = [Tier(name="hbm", capacity_blocks=hbm_blocks)]
        if self.host_blocks:
            tiers.append(Tier(name="host", capacity_blocks=self.host_blocks, gbps=self.host_gbps))
        if self.disk_blocks != 0:
            tiers.append(Tier(name="disk", capacity_blocks=self.disk_blocks, gbps=self.disk_gbps))
        return tiers


_DEMOTE_TRIGGERS = frozenset({"pressure", "idle", "tool"})


@dataclass
class _Entry:
    start: float
    tokens: int
    blocks: int
    deadline: float
    reading: bool = False  # a turn is restoring it from a lower tier: kept until the read ends


@dataclass
class _Stats:
    block_seconds: float = 0.0
    continuation_turns: int = 0
    hits: int = 0
    reused_tokens: int = 0
    prompt_tokens: int = 0
    refused: int = 0
    evicted: int = 0
    released: int = 0
    expired: int = 0
    read: int = 0
    heartbeats: int = 0
    peak_blocks: int = 0
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (time, retained blocks)
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    # Why a later turn missed: its previous turn was never retained (no room), its retention had expired
    # (or was within prefill's decline margin of expiry), or it was evicted from the last tier.
    misses: dict[str, int] = field(default_factory=lambda: {"never_retained": 0, "expired": 0, "evicted": 0})
    ttft_s: list[float] = field(default_factory=list)  # every turn
    ttft_continuation_s: list[float] = field(default_factory=list)  # turns after the first
    tier_timeline: list[tuple[float, ...]] = field(default_factory=list)  # (time, blocks per tier...)
    # Restores that took longer than recomputing the reused tokens would have (per-token prefill model).
    slow_restores: int = 0


def _retained_size(spec: ScriptedTurn, scenario: Scenario) -> tuple[int, int]:
    """Tokens and blocks decode retains after a turn: vLLM's ``num_computed_tokens`` (prompt + output - 1)."""
    tokens = spec.input_length + spec.output_length - 1
    return tokens, math.ceil(tokens / scenario.block_size)


def replay(
    scripts: list[ScriptedConversation],
    scenario: Scenario,
    policy_name: str,
    *,
    audit: Callable[[str, float, TierStore], None] | None = None,
) -> dict[str, Any]:
    """Replay every script against one policy; returns block-seconds, hit rate and counters.

    Policies: ``fixed`` (vLLM's pin), ``lease`` (the LeaseTable with its own cap), ``lease-evict`` and
    ``tiered`` (the uncapped LeaseTable decides how long, ``scenario.tiers`` where). ``audit`` is called
    after every event with the tier store (which then keeps a log of every placement change).
    """
    now = 0.0

    def clock() -> float:
        return now

    policy: Policy
    # "lease-evict": the alternative to the connector's cap that was measured and not shipped; the table runs
    # uncapped and the replay evicts the longest-retained leases (releasing them) to admit each new one.
    evict = policy_name == "lease-evict"
    tiered = policy_name == "tiered"
    config = scenario.tiers if tiered else None
    if tiered and config is None:
        raise ValueError("policy 'tiered' needs scenario.tiers")
    if config is not None and not config.demote_on <= _DEMOTE_TRIGGERS:
        raise ValueError(
            f"demote_on must be within {sorted(_DEMOTE_TRIGGERS)}, got {sorted(config.demote_on)}"
        )
    if policy_name in ("lease", "lease-evict", "tiered"):
        policy = HeartbeatLease(
            lease_s=scenario.lease_s,
            max_lease_s=scenario.max_lease_s,
            clock=clock,
            capacity_blocks=None if evict or tiered else scenario.capacity_blocks,
        )
        if evict:
            policy.name += ", evict oldest"
    else:
        policy = FixedTTL(ttl_s=scenario.ttl_s, clock=clock, capacity_blocks=scenario.capacity_blocks)
    if config is not None:
        store = TierStore(
            tiers=config.tiers(scenario.capacity_blocks),
            bytes_per_block=kv_bytes_per_block(config.kv_shape, scenario.block_size),
            evict_when_full=config.evict_when_full,
            log=audit is not None,
        )
        policy.name += ", tiers " + "+".join(t.name for t in store.tiers)
    else:
        # The other policies apply their own cap; the store only accounts their (HBM) block-seconds.
        store = TierStore(
            tiers=[Tier(name="hbm", capacity_blocks=None)],
            bytes_per_block=kv_bytes_per_block(KV_SHAPE_8B, scenario.block_size),
            log=audit is not None,
        )
    demote_on = config.demote_on if config is not None else frozenset()
    idle_s = config.idle_s if config is not None else 0.0
    stats = _Stats(hits_by_tier={tier.name: 0 for tier in store.tiers})
    live: dict[str, _Entry] = {}
    retained_of: dict[int, str] = {}  # conversation -> request id decode holds for it
    idle_since: dict[int, float] = {}  # conversation -> when its last turn finished
    evicted_ids: set[str] = set()
    reading_of: dict[int, str] = {}  # conversation -> request id its current turn is restoring
    events: list[tuple[float, int, str, int, int]] = []  # (time, seq, kind, conversation, turn)
    seq = 0

    def push(at: float, kind: str, conversation: int, turn: int) -> None:
        nonlocal seq
        heapq.heappush(events, (at, seq, kind, conversation, turn))
        seq += 1

    def settle(request_id: str, end: float, counter: str) -> None:
        entry = live.pop(request_id)
        # A read holds its blocks until it ends, whatever the lease says; anything else ends at its deadline.
        until = end if entry.reading else min(end, entry.deadline)
        stats.block_seconds += entry.blocks * max(0.0, until - entry.start)
        if request_id in store:
            store.remove(request_id, max(until, entry.start))
        setattr(stats, counter, getattr(stats, counter) + 1)

    def sweep() -> int:
        # Expired leases go first: they free their blocks in every tier before anything is demoted or refused.
        for request_id in [rid for rid, entry in live.items() if entry.deadline <= now and not entry.reading]:
            settle(request_id, now, "expired")
        return sum(entry.blocks for entry in live.values())

    for index, script in enumerate(scripts):
        push(script.turns[0].gap_s, "arrive", index, 0)
    heartbeat_s = scenario.lease_s / 3
    while events:
        now, _, kind, conversation, turn = heapq.heappop(events)
        script = scripts[conversation]
        request_id = retained_of.get(conversation)
        if kind == "heartbeat":
            # A chain of heartbeats belongs to one turn's retention; it stops when the next turn starts.
            limit = scenario.heartbeat_idle_limit_s
            if limit is not None and now - idle_since[conversation] >= limit:
                pass  # the SDK gave up on an agent idle this long: the lease runs out on its own
            elif request_id == f"c{conversation}t{turn}" and request_id in live:
                deadline = policy.heartbeat(request_id)
                stats.heartbeats += 1
                if deadline is not None:
                    live[request_id].deadline = deadline
                    push(now + heartbeat_s, "heartbeat", conversation, turn)
        elif kind == "arrive":
            spec = script.turns[turn]
            reused = 0
            wait = 0.0
            if turn > 0:
                stats.continuation_turns += 1
                remaining = None if request_id is None else policy.remaining(request_id)
                if request_id is not None and remaining is not None and remaining > DECLINE_MARGIN_S:
                    stats.hits += 1
                    reused = min(live[request_id].tokens, spec.input_length)
                    tier = store.tier_of(request_id)
                    assert tier is not None, request_id
                    stats.hits_by_tier[store.tiers[tier].name] += 1
                    # Promotion on the next turn: the read restores the blocks from their tier first.
                    wait = store.start_read(request_id, now)
                    if wait > reused * scenario.prefill_us_per_token / 1e6:
                        stats.slow_restores += 1
                elif request_id is None:
                    stats.misses["never_retained"] += 1
                elif request_id in evicted_ids:
                    stats.misses["evicted"] += 1
                else:
                    stats.misses["expired"] += 1
                if request_id is not None and request_id in live and remaining is not None:
                    policy.read(request_id)  # one read (or a recompute notification) frees D's request
                    if wait > 0:
                        live[request_id].reading = True
                        reading_of[conversation] = request_id
                        push(now + wait, "read-done", conversation, turn)
                    else:
                        settle(request_id, now, "read")
                retained_of.pop(conversation, None)
            stats.prompt_tokens += spec.input_length
            stats.reused_tokens += reused
            # Modelled TTFT: the restore (link wait + copy), then prefill of the tokens not reused.
            ttft = wait + (spec.input_length - reused) * scenario.prefill_us_per_token / 1e6
            stats.ttft_s.append(ttft)
            if turn > 0:
                stats.ttft_continuation_s.append(ttft)
            # Summed before it is added to the clock: the same float as the replay without tiers computes.
            service = ttft + spec.output_length * scenario.itl_ms / 1000
            push(now + service, "finish", conversation, turn)
        elif kind == "read-done":
            settle(reading_of.pop(conversation), now, "read")
        elif kind == "finish":
            spec = script.turns[turn]
            tokens, blocks = _retained_size(spec, scenario)
            in_use = sweep()
            new_id = f"c{conversation}t{turn}"
            if evict and scenario.capacity_blocks is not None and blocks <= scenario.capacity_blocks:
                for victim in list(live):  # insertion order: the longest-retained first
                    if in_use + blocks <= scenario.capacity_blocks:
                        break
                    policy.close(victim)
                    in_use -= live[victim].blocks
                    evicted_ids.add(victim)
                    settle(victim, now, "evicted")
            if tiered:
                placed, victims = store.admit(new_id, blocks, now, make_room="pressure" in demote_on)
                for victim in victims:  # evict_when_full: dropped from the last tier, its lease released
                    policy.close(victim)
                    in_use -= live[victim].blocks
                    evicted_ids.add(victim)
                    settle(victim, now, "evicted")
                deadline = policy.add(new_id, tokens, blocks, in_use) if placed else 0.0
            else:
                deadline = policy.add(new_id, tokens, blocks, in_use)
                if deadline:
                    store.admit(new_id, blocks, now, make_room=False)
            last_turn = turn == len(script.turns) - 1
            if not deadline:
                stats.refused += 1  # no room: decode frees the blocks instead of retaining them
            else:
                live[new_id] = _Entry(start=now, tokens=tokens, blocks=blocks, deadline=deadline)
                retained_of[conversation] = new_id
                stats.peak_blocks = max(stats.peak_blocks, in_use + blocks)
                stats.timeline.append((now, in_use + blocks))
                # A closing agent's last turn starts no tool call; every other turn (a vanishing agent's last
                # included: it vanishes during its tool call) is followed by tool time.
                if "tool" in demote_on and not (last_turn and not script.vanishes):
                    store.demote(new_id, now)
                if "idle" in demote_on:
                    push(now + idle_s, "idle", conversation, turn)
                stats.tier_timeline.append((now, *(store.used(t) for t in range(len(store.tiers)))))
            idle_since[conversation] = now
            if not last_turn:
                push(now + script.turns[turn + 1].gap_s, "arrive", conversation, turn + 1)
                if conversation in retained_of:
                    push(now + heartbeat_s, "heartbeat", conversation, turn)
            elif not script.vanishes:
                push(now, "close", conversation, turn)
            # else: a vanished agent sends nothing more; its retention runs out on its own.
        elif kind == "idle":
            idle_id = f"c{conversation}t{turn}"
            if idle_id in live and store.tier_of(idle_id) == 0:
                sweep()
                if idle_id in live:
                    store.demote(idle_id, now)
        elif kind == "close" and request_id is not None and request_id in live:
            if policy.close(request_id):
                settle(request_id, now, "released")
            retained_of.pop(conversation, None)
        if audit is not None:
            audit(kind, now, store)
    now = math.inf
    for request_id in list(live):
        settle(request_id, live[request_id].deadline, "expired")
    tiers: dict[str, dict[str, Any]] = store.summary()
    for per_tier in tiers.values():
        per_tier["restore_ms"] = summarize(per_tier["restore_ms"])
    return {
        "policy": policy.name,
        "block_seconds": stats.block_seconds,
        "hit_rate": stats.hits / stats.continuation_turns if stats.continuation_turns else None,
        "hits": stats.hits,
        "continuation_turns": stats.continuation_turns,
        "reused_token_fraction": stats.reused_tokens / stats.prompt_tokens if stats.prompt_tokens else None,
        "refused": stats.refused,
        "evicted": stats.evicted,
        "released": stats.released,
        "expired": stats.expired,
        "read": stats.read,
        "heartbeats": stats.heartbeats,
        "peak_blocks": stats.peak_blocks,
        "hits_by_tier": stats.hits_by_tier,
        "slow_restores": stats.slow_restores,
        "misses": stats.misses,
        "ttft_s": summarize(stats.ttft_s),
        "ttft_continuation_s": summarize(stats.ttft_continuation_s),
        "tiers": tiers,
        "timeline": stats.timeline,
        "tier_timeline": stats.tier_timeline,
    }


def bounds(scripts: list[ScriptedConversation], scenario: Scenario) -> dict[str, dict[str, Any]]:
    """The least block-seconds any policy can hold while hitting every turn the fixed pin hits.

    Computed from the scripts, not replayed: a turn that finishes is followed by its next turn ``gap_s``
    later, and the fixed pin hits it when ``gap_s < ttl - DECLINE_MARGIN_S`` (the same rule as ``replay``).
    Ignores ``capacity_blocks`` (an unbounded decode). Two bounds:

    * ``ideal window``: an online policy (it cannot see when the next turn will come) that keeps each turn
      until the next one or until the fixed pin's window has passed, and learns at no cost the moment an
      agent closes or vanishes. Holding any less loses a hit the fixed pin gets, for a gap it cannot
      foresee. (A policy could match the fixed pin's hit *rate* for less by dropping large contexts
      early and keeping small ones longer, but that trades away the reused tokens the hits are for.) With
      heartbeats stopping at the same window, the lease differs from it only by the lease it pays for
      each vanished agent and the heartbeat granularity at the window's edge.
    * ``hindsight``: knows every gap in advance, so it holds only across gaps that will hit. No policy
      without foresight reaches it; it says how much of the remaining cost is the unknowable future.
    """
    window = scenario.ttl_s - DECLINE_MARGIN_S
    ideal = hindsight = 0.0
    hits = continuation_turns = 0
    for script in scripts:
        for index, spec in enumerate(script.turns[:-1]):
            _, blocks = _retained_size(spec, scenario)
            gap = script.turns[index + 1].gap_s
            continuation_turns += 1
            ideal += blocks * min(gap, window)
            if gap < window:
                hits += 1
                hindsight += blocks * gap
    hit_rate = hits / continuation_turns if continuation_turns else None
    return {
        "ideal window": {"policy": "ideal window (bound)", "block_seconds": ideal, "hit_rate": hit_rate},
        "hindsight": {"policy": "hindsight (bound)", "block_seconds": hindsight, "hit_rate": hit_rate},
    }
