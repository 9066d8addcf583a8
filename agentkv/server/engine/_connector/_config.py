"""Typed view of agentkv's keys in ``kv_connector_extra_config``.

vLLM reads its own keys with ``dict.get`` and no coercion (the string "false" is truthy); ours are coerced
and validated here so a typo fails the engine at start instead of silently changing behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentkv._wire import DECODE_TAIL_KEY, OFFER_DECODED_KEY

__all__ = ["ConnectorSettings", "decode_tail", "offers_decoded"]


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(value, int):
        return bool(value)
    raise ValueError(f"kv_connector_extra_config.{key} must be a boolean, got {value!r}")


@dataclass(frozen=True)
class ConnectorSettings:
    service_port: int | None = None  # retention service; None = no service (stock fixed TTL)
    service_host: str = "127.0.0.1"
    lease_s: float = 30.0
    max_lease_s: float = 600.0
    prefix_check: bool = True  # False reproduces upstream (trusts remote_num_tokens)
    require_fingerprints: bool = False  # refuse pulls whose params carry no block fingerprints
    # Also offer what decode computed itself (the last prompt token, the generated tokens): a few more
    # tokens reused per turn, but not bit-identical to a recompute (see _hashing.prefill_computed_tokens).
    # The default for requests that do not say (our router says on every decode hop: OFFER_DECODED_KEY).
    offer_decoded: bool = False
    progress_delay_us: int = 1000  # NIXL progress thread sleep; vLLM/NIXL hard-code 0 (a busy core)
    restore_affinity: bool = True
    # Longest idle wait while the engine only holds retained blocks (ends early when a request arrives;
    # 0 = off). Longer than the worker's spin window, so an engine holding blocks sits nearly idle.
    idle_sleep_max_ms: float = 1000.0
    cost_model: bool = True  # pull vs recompute from measured rates (static threshold as floor)
    # How long a worker spins on vLLM's shared-memory queue after each read before it sleeps (vLLM: 1 s).
    # None keeps vLLM's value; the launcher sets 0.1 s on CPU (see _queues.py).
    worker_busy_loop_s: float | None = None
    # Longest zmq wait of a queue reader before it re-checks the buffer: bounds a lost notification.
    queue_max_wait_ms: int = 50
    # Share of decode's KV blocks that leases may hold; a retention over it is declined, so idle
    # conversations never make live requests wait for blocks (vLLM's fixed pin has no bound).
    max_retained_fraction: float = 0.5
    max_retained_blocks: int | None = None  # an absolute cap as well (None: the fraction alone)
    # With a host KV tier beside us: a retention over the cap demotes soonest-expiring leases whose blocks the
    # tier holds (`RetentionService.make_room`) instead of being declined.
    demote_on_pressure: bool = True
    # Prompt tokens a decode computes itself after loading a prompt's KV from prefill. vLLM loads them all and
    # re-runs the last one alone to sample from it: a one-token step, which on GPUs replays decode's CUDA
    # graph and rounds unlike a prefill. 2 makes that step a (two-token) prefill; see
    # `_hashing.decode_loaded_tokens`. 1 = vLLM's own.
    decode_tail_tokens: int = 1
    # Prompt ids whose vLLM block hashes the engine core keeps, so that a turn extending an earlier prompt
    # hashes only its new blocks (`_block_hashes`; ~1 MB of ids a 127k-token conversation); 0 = vLLM hashes
    # every block of every request.
    block_hash_reuse_tokens: int = 1 << 20

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = extra or {}

        def get(key: str, default: Any) -> Any:
            return extra.get(f"agentkv_{key}", default)

        port = get("service_port", None)
        s = cls(
            service_port=None if port in (None, "", 0) else int(port),
            service_host=str(get("service_host", cls.service_host)),
            lease_s=float(get("lease_s", cls.lease_s)),
            max_lease_s=float(get("max_lease_s", cls.max_lease_s)),
            prefix_check=_bool(get("prefix_check", cls.prefix_check), "agentkv_prefix_check"),
            require_fingerprints=_bool(
                get("require_fingerprints", cls.require_fingerprints), "agentkv_require_fingerprints"
            ),
            offer_decoded=_bool(get("offer_decoded", cls.offer_decoded), "agentkv_offer_decoded"),
            progress_delay_us=int(get("progress_delay_us", cls.progress_delay_us)),
            restore_affinity=_bool(get("restore_affinity", cls.restore_affinity), "agentkv_restore_affinity"),
            idle_sleep_max_ms=float(get("idle_sleep_max_ms", cls.idle_sleep_max_ms)),
            cost_model=_bool(get("cost_model", cls.cost_model), "agentkv_cost_model"),
            queue_max_wait_ms=int(get("queue_max_wait_ms", cls.queue_max_wait_ms)),
            max_retained_fraction=float(get("max_retained_fraction", cls.max_retained_fraction)),
            demote_on_pressure=_bool(
                get("demote_on_pressure", cls.demote_on_pressure), "agentkv_demote_on_pressure"
            ),
            max_retained_blocks=None
            if get("max_retained_blocks", None) in (None, "")
            else int(get("max_retained_blocks", None)),
            worker_busy_loop_s=None
            if get("worker_busy_loop_s", None) in (None, "")
            else float(get("worker_busy_loop_s", None)),
            decode_tail_tokens=int(get("decode_tail_tokens", cls.decode_tail_tokens)),
            block_hash_reuse_tokens=int(get("block_hash_reuse_tokens", cls.block_hash_reuse_tokens)),
        )
        if s.lease_s <= 0 or s.max_lease_s < s.lease_s:
            raise ValueError("need 0 < agentkv_lease_s <= agentkv_max_lease_s")
        if s.decode_tail_tokens < 1:
            raise ValueError("agentkv_decode_tail_tokens must be >= 1 (1: vLLM's own)")
        if s.progress_delay_us < 0 or s.idle_sleep_max_ms < 0 or s.block_hash_reuse_tokens < 0:
            raise ValueError(
                "agentkv_progress_delay_us, agentkv_idle_sleep_max_ms and agentkv_block_hash_reuse_tokens "
                "must be >= 0"
            )
        if not 0 < s.max_retained_fraction <= 1 or (
            s.max_retained_blocks is not None and s.max_retained_blocks < 0
        ):
            raise ValueError(
                "need 0 < agentkv_max_retained_fraction <= 1 and agentkv_max_retained_blocks >= 0"
            )
        return s

    def retention_capacity(self, num_blocks: int) -> int:
        """Blocks leases may hold on a decode with ``num_blocks`` KV blocks."""
        cap = int(self.max_retained_fraction * num_blocks)
        return cap if self.max_retained_blocks is None else min(cap, self.max_retained_blocks)


def offers_decoded(params: dict[str, Any] | None, *, default: bool) -> bool:
    """Whether decode offers the KV it computed itself for this request: the router's per-request word
    (`OFFER_DECODED_KEY`, a real bool only) over the connector's configured default."""
    asked = (params or {}).get(OFFER_DECODED_KEY)
    return asked if isinstance(asked, bool) else default


def decode_tail(params: dict[str, Any] | None, *, default: int) -> int:
    """How many of the prompt's last tokens decode computes itself for this request: the request's word
    (`DECODE_TAIL_KEY`, a positive int only) over the connector's configured default."""
    asked = (params or {}).get(DECODE_TAIL_KEY)
    return asked if isinstance(asked, int) and not isinstance(asked, bool) and asked >= 1 else default
