"""Prometheus metrics, in a registry owned by one app (two apps in one process never share counters)."""

from __future__ import annotations

from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Children", "RouterMetrics"]

_M = TypeVar("_M", Counter, Gauge)

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Children(Generic[_M]):
    """The children of a one-label metric by value. `.labels()` validates and locks on every call; the
    hot path counts each turn a few times, so each child is resolved once."""

    def __init__(self, metric: _M, label: str) -> None:
        self._metric: _M = metric
        self._label = label
        self._children: dict[str, _M] = {}

    def __getitem__(self, value: str) -> _M:
        child = self._children.get(value)
        if child is None:
            child = self._children[value] = self._metric.labels(**{self._label: value})
        return child


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.turns = Counter("agentkv_turns", "Turns served, by path", ["path"], registry=r)
        self.reuse = Counter("agentkv_reuse", "Reuse outcome per turn", ["result"], registry=r)
        self.reused_tokens = Counter("agentkv_reused_tokens", "Prompt tokens not recomputed", registry=r)
        self.partial_reuse = Counter(
            "agentkv_partial_reuse",
            "Of the reusing turns, those whose prompt matched only some of decode's whole blocks (a dropped "
            "or rewritten answer, a cut tail, a regenerated turn): they reused those blocks",
            registry=r,
        )
        self.pulled_tokens = Counter(
            "agentkv_pulled_tokens", "Of those, prompt tokens prefill read from decode", registry=r
        )
        self.path_decisions = Counter(
            "agentkv_path_decisions", "Path chosen by the policy", ["path"], registry=r
        )
        self.prefill_busy = Counter(
            "agentkv_prefill_busy",
            "Turns prefilled on decode because every prefill had prefill_queue_cap P hops in flight",
            registry=r,
        )
        self.clients_left = Counter(
            "agentkv_clients_left",
            "Streamed turns whose client left mid-answer after decode had sent text: recorded for the next "
            "turn, which reuses what decode kept",
            registry=r,
        )
        self.host_tier_tokens = Counter(
            "agentkv_host_tier_tokens",
            "Of the reused tokens of turns served from what decode still caches, those its host KV tier "
            "restored (evicted from its HBM, kept by vLLM's OffloadingConnector)",
            registry=r,
        )
        self.host_tier_turns = Counter(
            "agentkv_host_tier_turns",
            "Turns whose reused KV decode restored in part from its host KV tier",
            registry=r,
        )
        self.host_tier_ttft_seconds = Histogram(
            "agentkv_host_tier_ttft_seconds",
            "Router receive to first decode byte of those turns (streamed ones): the restore is on this path",
            buckets=_BUCKETS,
            registry=r,
        )
        self.demotions = Children(
            Counter(
                "agentkv_demotions",
                "Conversations whose decode lease ended early because decode's host KV tier holds their "
                "blocks, by cause (tool_call: the SDK said a tool call started; idle: demote_idle_s passed; "
                "pressure: decode ended it to retain a newer turn under its cap, seen at a renewal)",
                ["cause"],
                registry=r,
            ),
            "cause",
        )
        self.lease_renewals = Counter("agentkv_lease_renewals", "Decode leases renewed", registry=r)
        self.lease_releases = Counter("agentkv_lease_releases", "Decode leases released", registry=r)
        self.backend_errors = Counter(
            "agentkv_backend_errors", "Errors talking to engines", ["role", "kind"], registry=r
        )
        self.kv_params_dropped = Counter(
            "agentkv_client_kv_params_dropped", "Client-supplied kv_transfer_params dropped", registry=r
        )
        self.prefill_seconds = Histogram(
            "agentkv_prefill_seconds", "Prefill hop duration", buckets=_BUCKETS, registry=r
        )
        self.render_seconds = Histogram(
            "agentkv_render_seconds",
            "Render of a turn on prefill's API server (token path: chat template + tokenizer, once per turn)",
            buckets=_BUCKETS,
            registry=r,
        )
        self.decode_seconds = Histogram(
            "agentkv_decode_seconds", "Decode hop duration (to the last byte)", buckets=_BUCKETS, registry=r
        )
        self.ttft_seconds = Histogram(
            "agentkv_ttft_seconds", "Router receive to first decode byte", buckets=_BUCKETS, registry=r
        )
        self.conversations = Gauge("agentkv_conversations", "Conversations tracked", registry=r)
        self.healthy_backends = Gauge("agentkv_healthy_backends", "Healthy backends", ["role"], registry=r)
        self.turns_by_path = Children(self.turns, "path")
        self.reuse_by_result = Children(self.reuse, "result")
        self.path_decisions_by_path = Children(self.path_decisions, "path")
        # Exported at zero from the start, so dashboards see every series before it first moves.
        for result in ("hit", "miss", "expired", "declined", "mismatch", "none", "local", "cached"):
            self.reuse_by_result[result]
        for path in ("pull", "recompute", "decode-local"):
            self.turns_by_path[path]
            self.path_decisions_by_path[path]

    def render(self) -> bytes:
        return generate_latest(self.registry)
