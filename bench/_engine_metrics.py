"""Engines' Prometheus metrics over time: KV occupancy, retained share, preemptions, queue time.

``EngineWatch`` polls every engine's ``/metrics`` (vLLM's API server) and, where it has one, our connector's
retention service ``/metrics`` (``agentkv.server.engine._connector._service``) from a background thread.
Parsing
and the per-step digest are pure (``parse``, ``digest``) and unit-tested on fixed text.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["VLLM", "Endpoint", "EngineWatch", "Sample", "digest", "parse"]

# vLLM's names (the same in 0.26 and 0.32; Prometheus adds _total to counters); values summed over labels.
VLLM = {
    "kv_usage": "vllm:kv_cache_usage_perc",  # a fraction, 1.0 = full, despite the name
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "preemptions": "vllm:num_preemptions_total",
    "queue_s": "vllm:request_queue_time_seconds_sum",
    "queue_n": "vllm:request_queue_time_seconds_count",
}
CONNECTOR = {
    "retained_blocks": "agentkv_connector_retained_blocks",
    "retained_requests": "agentkv_connector_retained_requests",
    "retained": "agentkv_connector_retained_total",
    "not_retained": "agentkv_connector_not_retained_total",
    "pulls": "agentkv_connector_pulls_total",
    "recomputes": "agentkv_connector_recomputes_total",
    "refused_released": "agentkv_connector_refused_released_total",
}
_BLOCKS_INFO = "vllm:cache_config_info"  # its num_gpu_blocks label is the engine's KV size in blocks
_COUNTERS = ("preemptions", "queue_s", "queue_n", "retained", "not_retained", "pulls", "recomputes")


def parse(text: str, names: Mapping[str, str]) -> dict[str, float]:
    """``{key: value}`` for each of ``names`` (key -> metric name) in a Prometheus text exposition, summed
    over label sets; ``num_gpu_blocks`` too when the text has vLLM's cache-config info."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {name: key for key, name in names.items()}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                key = wanted[sample.name]
                out[key] = out.get(key, 0.0) + float(sample.value)
            elif sample.name == _BLOCKS_INFO and "num_gpu_blocks" in sample.labels:
                with contextlib.suppress(ValueError):
                    out["num_gpu_blocks"] = float(sample.labels["num_gpu_blocks"])
    return out


def _scrape(url: str, names: Mapping[str, str]) -> dict[str, float]:
    """One engine's metrics, or nothing when it does not answer with them (a missed sample, not an error:
    an engine busy with a long prefill may miss a poll)."""
    try:
        response = httpx.get(f"{url}/metrics", timeout=5)
        return parse(response.text, names) if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    role: str  # "prefill", "decode" or "single"
    url: str  # the engine's API server
    service_url: str | None = None  # our connector's retention service, if the engine has one


@dataclass(frozen=True, kw_only=True)
class Sample:
    t_s: float  # since the watch started
    values: dict[str, dict[str, float]]  # role -> key -> value


@dataclass(kw_only=True)
class EngineWatch:
    """``with EngineWatch(endpoints=...) as watch:`` samples every ``interval_s``; ``snapshot()`` now."""

    endpoints: Sequence[Endpoint]
    interval_s: float = 1.0
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _t0: float = field(default_factory=time.monotonic, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def now(self) -> float:
        return time.monotonic() - self._t0

    def snapshot(self) -> Sample:
        values: dict[str, dict[str, float]] = {}
        for endpoint in self.endpoints:
            got: dict[str, float] = {}
            got.update(_scrape(endpoint.url, VLLM))
            if endpoint.service_url is not None:
                got.update(_scrape(endpoint.service_url, CONNECTOR))
            values[endpoint.role] = got
        sample = Sample(t_s=round(self.now(), 3), values=values)
        with self._lock:
            self.samples.append(sample)
        return sample

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.snapshot()

    def __enter__(self) -> EngineWatch:
        self.snapshot()
        self._thread = threading.Thread(target=self._run, name="engine-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def between(self, start_s: float, end_s: float) -> list[Sample]:
        with self._lock:
            return [s for s in self.samples if start_s <= s.t_s <= end_s]


def _retained_share(values: Mapping[str, float]) -> float | None:
    blocks = values.get("num_gpu_blocks")
    if not blocks or "retained_blocks" not in values:
        return None
    return values["retained_blocks"] / blocks


def digest(samples: Sequence[Sample]) -> dict[str, dict[str, Any]]:
    """Per role over a step: peak and mean KV occupancy and retained share, peak running/waiting, and the
    counters' increase (preemptions, declined retentions, pulls, ...) with the mean engine queue time."""
    out: dict[str, dict[str, Any]] = {}
    if not samples:
        return out
    first, last = samples[0].values, samples[-1].values
    for role in last:
        series = [s.values.get(role, {}) for s in samples]
        entry: dict[str, Any] = {}
        for key in ("kv_usage", "running", "waiting", "retained_blocks"):
            vals = [v[key] for v in series if key in v]
            if vals:
                entry[f"{key}_max"] = round(max(vals), 4)
                entry[f"{key}_mean"] = round(sum(vals) / len(vals), 4)
        shares = [x for x in (_retained_share(v) for v in series) if x is not None]
        if shares:
            entry["retained_share_max"] = round(max(shares), 4)
            entry["retained_share_mean"] = round(sum(shares) / len(shares), 4)
        for key in _COUNTERS:
            if key in last[role] and key in first.get(role, {}):
                entry[f"{key}_delta"] = round(last[role][key] - first[role][key], 4)
        n = entry.get("queue_n_delta")
        entry["queue_ms_mean"] = round(entry["queue_s_delta"] / n * 1e3, 2) if n else None
        if "num_gpu_blocks" in last[role]:
            entry["num_gpu_blocks"] = int(last[role]["num_gpu_blocks"])
        out[role] = entry
    return out


def series(samples: Sequence[Sample], role: str) -> dict[str, list[float | None]]:
    """Time series for the occupancy plot: t, KV usage and retained share of one role."""
    values = [s.values.get(role, {}) for s in samples]
    return {
        "t_s": [s.t_s for s in samples],
        "kv_usage": [v.get("kv_usage") for v in values],
        "retained_share": [_retained_share(v) for v in values],
    }
