"""Scheduler-side extensions (runs in vLLM's engine-core process, on prefill and on decode).

Decode: retained blocks get a short lease (``LeaseTable``) instead of the fixed ``decoder_kv_blocks_ttl``,
advertised with token-exact block fingerprints through the retention service. Prefill: before a pull, the
remote params are trimmed to the longest whole-block prefix whose fingerprints match this prompt, so a
history that was edited, regenerated or stripped costs a recompute instead of a wrong answer. Both: the
engine does not spin while it merely holds blocks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from agentkv._constants import FINGERPRINTS_KEY, PULLED_KEY, SERVICE_KEY, SERVICE_TOKEN_ENV
from agentkv._wire import RETAIN_KEY, cut_offer, prefix_cache_tokens, pullable_tokens
from agentkv.server.engine._connector._block_hashes import install as install_hash_reuse
from agentkv.server.engine._connector._cached import (
    CachedPrompts,
    calling_scheduler,
    host_lookup,
    pool_lookup,
)
from agentkv.server.engine._connector._config import ConnectorSettings, decode_tail, offers_decoded
from agentkv.server.engine._connector._cost import PullCostModel
from agentkv.server.engine._connector._hashing import (
    ChainCache,
    decode_loaded_tokens,
    parse_chain,
    prefill_computed_tokens,
    tail_fingerprint,
    verified_tokens,
)
from agentkv.server.engine._connector._held import HeldCheck
from agentkv.server.engine._connector._host_policy import keep_with, register_builtin
from agentkv.server.engine._connector._leases import LeaseTable
from agentkv.server.engine._connector._queues import tune_queue_readers
from agentkv.server.engine._connector._service import COUNTERS, RetentionService
from agentkv.server.engine._connector._vllm import NixlPullConnectorScheduler
from agentkv.server.engine.plugin import forwarded_ids_mode
from agentkv.server.engine.plugin._forwarded_ids import takes_cut_messages, takes_packed_ids

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["AgentKVScheduler"]

logger = logging.getLogger("agentkv.connector")
TAIL = "agentkv_tail_hash"
_BLIND_SLEEP_MAX_S = 0.02


def _engine_input_queue() -> queue.Queue[Any] | Literal[False]:
    """vLLM's engine-core input queue, found on the call stack (``EngineCoreProc.step`` calls the scheduler
    that calls us); False where there is none (an engine run in-process, or another vLLM layout)."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        q = getattr(owner, "input_queue", None)
        if isinstance(q, queue.Queue):
            return q
        frame = frame.f_back  # type: ignore[assignment]
    logger.info(
        "agentkv: no engine input queue found; idle back-off capped at %.0f ms", _BLIND_SLEEP_MAX_S * 1e3
    )
    return False


def _wait_for_input(q: queue.Queue[Any] | Literal[False], timeout: float) -> None:
    """Sleep up to ``timeout``, returning early once a request is queued (without taking it)."""
    if q is False:
        time.sleep(timeout)
        return
    with q.not_empty:
        if not q.queue:
            q.not_empty.wait(timeout)


class AgentKVScheduler(NixlPullConnectorScheduler):
    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.agentkv = ConnectorSettings.from_extra(ktc.kv_connector_extra_config)
        self.is_decode = ktc.kv_role == "kv_consumer"
        hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
        self._model_type: str | None = getattr(hf_config, "model_type", None)
        self.leases: LeaseTable | None = None
        # One key per exported counter (docs and Prometheus names live beside them in _service).
        self.stats: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.cost = PullCostModel(
            static_threshold=self.kv_recompute_threshold, enabled=self.agentkv.cost_model
        )
        self.cost.bytes_per_token = _kv_bytes_per_token(kv_cache_config, self.block_size)
        # Decode leaves the prompt's last tokens to compute only where one block size describes every layer.
        self._leaves_tail = self.is_decode and len(kv_cache_config.kv_cache_groups) == 1
        # The engine core reads its worker's answers through a queue reader too: bound its waits.
        tune_queue_readers(busy_loop_s=None, max_wait_ms=self.agentkv.queue_max_wait_ms)
        self._awaiting: set[str] = set()  # KV loads in flight, either direction: never wait while one is
        self._last_step: tuple[float, int, float] | None = None
        # Prefill: tokens each request in flight is reading from decode (reported when it finishes).
        self._pulled: dict[str, int] = {}
        # Fingerprint chains of earlier turns, so a turn hashes only its new blocks (both roles).
        self._chains = ChainCache()
        # vLLM's own block hashes likewise: its engine core builds its hasher after this scheduler.
        self._hash_reuse = install_hash_reuse(max_tokens=self.agentkv.block_hash_reuse_tokens)
        self._idle_sleep = 0.0
        self._input_queue: queue.Queue[Any] | Literal[False] | None = None  # None: not looked up yet
        if self.is_decode and self.is_bidirectional_kv_xfer_enabled and self.agentkv.service_port:
            self.leases = LeaseTable(
                lease_s=self.agentkv.lease_s,
                max_lease_s=self.agentkv.max_lease_s,
                clock=time.perf_counter,
                capacity_blocks=self.agentkv.retention_capacity(int(kv_cache_config.num_blocks)),
            )
        # Decode: block hashes of its finished requests, so the router can ask how much of a conversation
        # its prefix cache still holds once no lease does (declined at the cap, or run out). As many blocks
        # as decode has: more could not be cached at once. One KV cache group only: vLLM's hashes are then
        # at our block size.
        self.cached: CachedPrompts | None = None
        if self.is_decode and len(kv_cache_config.kv_cache_groups) == 1:
            self.cached = CachedPrompts(
                block_size=self.block_size, max_blocks=int(kv_cache_config.num_blocks)
            )
        self._pool_searched = False
        if self.is_decode:
            # vLLM 0.26 builds its host tier's policy from a table of built-ins (0.32+ import it by module
            # path): ours must be in it before the offloading connector, built after us, asks.
            register_builtin()
        self.service: RetentionService | None = None
        # One secret for this engine's own service and for the still-held calls it makes to decodes.
        token = os.environ.get(SERVICE_TOKEN_ENV) or None
        self._still_held = HeldCheck(token=token)
        if self.agentkv.service_port:
            self.service = RetentionService(
                # `is not None`, not `or`: an empty LeaseTable is falsy (it has __len__).
                table=self.leases
                if self.leases is not None
                else LeaseTable(lease_s=1, max_lease_s=1, clock=time.perf_counter),
                host=self.agentkv.service_host,
                port=self.agentkv.service_port,
                info=self._info,
                token=token,
                cached=self.cached,
                stats=self.stats,
            )
            self.service.start()

    def _info(self) -> dict[str, Any]:
        import vllm

        forwarded = forwarded_ids_mode()
        return {
            "engine_id": self.engine_id,
            "role": "decode" if self.is_decode else "prefill",
            "leases": self.leases is not None,
            "lease_s": self.agentkv.lease_s,
            "max_lease_s": self.agentkv.max_lease_s,
            "retention_capacity_blocks": None if self.leases is None else self.leases.capacity_blocks,
            "fixed_ttl_s": None if self.leases else self.decoder_kv_blocks_ttl,
            "block_size": self.block_size,
            # What a token's KV weighs across layers: the router prices a restore from the host tier by it.
            "kv_bytes_per_token": self.cost.bytes_per_token,
            "prefix_check": self.agentkv.prefix_check,
            "stats": self._stats(),
            "cost_model": self.cost.snapshot(),
            "vllm_version": vllm.__version__,
            # The API server next to this engine takes the router's forwarded prompt ids (the same plugin
            # settings reach every process vLLM starts).
            "forwarded_ids": forwarded is not None,
            # ... and agentkv's own wrapper there reads them packed as well (`agentkv._wire.pack_ids`).
            "packed_ids": takes_packed_ids(forwarded),
            # ... and may be sent a chat body cut to its last message (`agentkv._wire.cut_messages`).
            "messages_cut": takes_cut_messages(forwarded, model_type=self._model_type),
            # vLLM >= 0.33 counts this engine's NIXL re-registrations (its params carry the same number as
            # remote_registration_generation): blocks offered under an older one are gone.
            "registration_generation": getattr(self, "_registration_generation", None),
        }

    def _stats(self) -> dict[str, int]:
        stats = dict(self.stats)
        if self._hash_reuse is not None:  # counted where vLLM hashes (its input thread), read here
            stats["block_hashes_computed"] = self._hash_reuse.computed
            stats["block_hashes_reused"] = self._hash_reuse.reused
        return stats

    # --- prefill: verify and trim what decode offers ------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        offered = params and params.get("do_remote_decode") and params.get("remote_block_ids")
        if params and offered and "_agentkv_checked" not in params:
            params["_agentkv_checked"] = True
            self._check_offer(request, params, num_computed_tokens)
        count, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if is_async and params and params.get("do_remote_prefill"):
            count = decode_loaded_tokens(
                num_prompt_tokens=request.num_prompt_tokens,
                num_computed=num_computed_tokens,
                count=count,
                block_size=self.block_size,
                tail=self._tail(params),
            )
        if is_async:
            # Either direction (decode loading prefill's KV, prefill pulling decode's): the engine must keep
            # stepping promptly until the load lands, so no idle wait while one is pending.
            self._awaiting.add(request.request_id)
        return count, is_async

    def _tail(self, params: dict[str, Any] | None) -> int:
        """The prompt tokens this decode leaves itself to compute for a request (1: vLLM's own)."""
        return decode_tail(params, default=self.agentkv.decode_tail_tokens) if self._leaves_tail else 1

    def _check_offer(self, request: Request, params: dict[str, Any], num_computed: int) -> None:
        offered = min(int(params.get("remote_num_tokens") or 0), request.num_prompt_tokens)
        self.stats["tokens_offered"] += offered
        verified = offered
        refused = ""  # why the offer was cut, for the log line
        theirs = params.get(FINGERPRINTS_KEY)
        if self.agentkv.prefix_check and not self._still_held(params):
            verified, refused = 0, "released"
            self.stats["refused_released"] += 1
        elif self.agentkv.prefix_check:
            if theirs is None:
                if self.agentkv.require_fingerprints:
                    verified, refused = 0, "unverified"
                    self.stats["refused_unverified"] += 1
            else:
                prompt = request.prompt_token_ids or []
                chain = parse_chain(theirs)
                verified = 0
                if chain is not None:
                    ours = self._chain(request, prompt, offered)
                    verified = verified_tokens(
                        prompt, self.block_size, offered, chain, params.get(TAIL), ours=ours
                    )
                if verified < offered:
                    refused = "mismatch"
                    self.stats["tokens_trimmed"] += offered - verified
                    self.stats["refused_mismatch"] += 1
        pull_tokens = verified - num_computed
        self.cost.last_estimate = None  # logged below: never a previous offer's
        pull = pull_tokens > 0 and self.cost.should_pull(
            pull_tokens=pull_tokens,
            new_tokens=request.num_prompt_tokens - max(verified, num_computed),
            context=request.num_prompt_tokens,
        )
        # Never a step of a handful of tokens (a regenerate offered its whole prompt, router guard off).
        allowed = (
            pullable_tokens(request.num_prompt_tokens, verified, self.block_size, whole=False) if pull else 0
        )
        # Cut even when every offered token is pulled: a stock decode's list runs on over its generated
        # tokens, and a router may have trimmed the tokens only.
        params.update(cut_offer(params, allowed, self.block_size))
        self.stats["pulls" if pull else "recomputes"] += 1
        pulled = self._pulled[request.request_id] = max(0, allowed - num_computed)
        self.stats["tokens_pulled"] += pulled
        self.stats["tokens_refused"] += offered - allowed
        logger.info(
            "agentkv pull decision request=%s prompt=%d offered=%d verified=%d local_hit=%d pull=%s "
            "estimate=%s refused=%s",
            request.request_id,
            request.num_prompt_tokens,
            offered,
            verified,
            num_computed,
            pull,
            self.cost.last_estimate,
            refused or "-",
        )

    def _chain(self, request: Request, token_ids: Any, num_tokens: int) -> bytes:
        """Our chain of the full blocks among a request's first ``num_tokens`` tokens, starting from the
        longest chain an earlier turn left that vLLM's block hashes of this request name."""
        keys: Any = getattr(request, "block_hashes", None)
        # vLLM hashes at its hash block size: usable only where that is ours (one KV cache group, no DCP),
        # which the count of hashes over the request's tokens shows.
        n = request.num_tokens
        if keys is None or len(token_ids) != n or len(keys) != n // self.block_size:
            keys = None
        cache = self._chains
        hashed, reused = cache.hashed_blocks, cache.reused_blocks
        num_blocks = min(num_tokens, len(token_ids)) // self.block_size
        chain = cache.chain(token_ids, self.block_size, num_blocks, keys)
        self.stats["fingerprint_blocks_hashed"] += cache.hashed_blocks - hashed
        self.stats["fingerprint_blocks_reused"] += cache.reused_blocks - reused
        return chain

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if params and params.get(RETAIN_KEY) and self.is_bidirectional_kv_xfer_enabled:
            # Decode-local turns never pass through P, so vLLM would not track them for sending; without
            # this the worker ignores their deadline and the retained blocks would never be freed.
            self._reqs_in_batch.add(request.request_id)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    # --- decode: lease instead of a fixed TTL -----------------------------------------------------------
    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        with self._kept_if_cut(request):
            delay, params = super().request_finished(request, block_ids)
        pulled = self._pulled.pop(request.request_id, None)
        if params is not None and not self.is_decode:
            # The router's count of what came from decode (vLLM's cached_tokens adds prefill's cache hits).
            params[PULLED_KEY] = pulled or 0
        if delay and params and params.get("do_remote_decode") and self.is_decode:
            n = int(params.get("remote_num_tokens") or 0)
            if not offers_decoded(request.kv_transfer_params, default=self.agentkv.offer_decoded):
                n = prefill_computed_tokens(
                    computed=n,
                    num_prompt_tokens=request.num_prompt_tokens,
                    tail=self._tail(request.kv_transfer_params),
                )
            else:
                n = prefix_cache_tokens(n, self.block_size)
            params.update(cut_offer(params, n, self.block_size))
            ids = request.all_token_ids
            chain = self._chain(request, ids, n)
            params[FINGERPRINTS_KEY] = chain.hex()
            params[TAIL] = tail_fingerprint(ids, self.block_size, n, chain=chain)
            retained = True
            if self.leases is not None:
                svc = self.service
                if svc is not None:
                    params[SERVICE_KEY] = f"http://{self.agentkv.service_host}:{svc.port}"
                keys = _block_keys(block_ids)
                deadline = self.leases.add(request.request_id, params, n, block_ids=keys)
                if (
                    not deadline
                    and svc is not None
                    and self.agentkv.demote_on_pressure
                    and svc.make_room(keys)
                ):
                    # Longer-held leases whose blocks the host tier holds made way (their next turns restore).
                    deadline = self.leases.add(request.request_id, params, n, block_ids=keys)
                retained = bool(deadline)
                if not retained:
                    # No room under the retention cap: offer nothing (no block list, so neither the router
                    # nor a prefill takes it for an offer) and let the worker free the blocks at its next
                    # step (vLLM already tracks them for sending, so they cannot be freed here).
                    params.update(remote_num_tokens=0, remote_block_ids=[])
                    deadline = time.perf_counter()
                self._reqs_need_send[request.request_id] = deadline
                params["remote_blocks_expiry_time"] = deadline
            self.stats["retained" if retained else "not_retained"] += 1
        if self.cached is not None:
            self._keep_hashes(request)
        if self.service is not None:
            self.service.finished(request.request_id)
        return delay, params

    @contextlib.contextmanager
    def _kept_if_cut(self, request: Request) -> Iterator[None]:
        """On decode, a request aborted after it generated is retained as one that stopped.

        vLLM aborts a request in the engine core when its API server finds a client's stop string, or when
        the client leaves; NixlConnector retains only requests finished by length or a stop token, so such a
        turn (every turn of a harness that sends stop sequences) left nothing for the next. Its KV is as
        complete as a stopped request's up to the tokens it computed, and what is offered from it is checked
        block by block on the next prompt's ids like any offer (`FINGERPRINTS_KEY`)."""
        from vllm.v1.request import RequestStatus

        if not (
            self.is_decode
            and self.leases is not None
            and request.status == RequestStatus.FINISHED_ABORTED
            and request.num_output_tokens > 0
        ):
            yield
            return
        request.status = RequestStatus.FINISHED_STOPPED
        try:
            yield
        finally:
            request.status = RequestStatus.FINISHED_ABORTED

    def _keep_hashes(self, request: Request) -> None:
        """Remember a finished request's vLLM block hashes (see `CachedPrompts`)."""
        assert self.cached is not None
        if not self._pool_searched:
            # The pool is vLLM's scheduler's, which builds it after this connector: found on the first call
            # from it (request_finished is one).
            self._pool_searched = True
            scheduler = calling_scheduler()
            self.cached.lookup = pool_lookup(scheduler)
            if self.cached.lookup is None:
                logger.info("agentkv: vLLM's block pool not found; decode cannot say what it still caches")
            host = host_lookup(scheduler)
            if host is not None:
                self.cached.host_lookup, self.cached.blocks_per_chunk = host.lookup, host.blocks_per_chunk
                self.cached.host_key = host.key
                if self.service is not None and self.leases is not None:
                    # The tier's evictions spare kept conversations (`_host_policy`, where the launcher
                    # named it as the tier's policy; vLLM's plain LRU never asks).
                    per_token = self.cost.bytes_per_token
                    chunk_bytes = per_token * self.block_size * host.blocks_per_chunk if per_token else None
                    keep_with(self.service.kept_host_keys, counts=self.stats, chunk_bytes=chunk_bytes)
                    self.cached.pinned = self.service.kept_ids
                # Remember as many finished requests' blocks as both tiers can hold, not the pool's alone.
                self.cached.max_blocks += host.capacity_blocks
        keys: Any = getattr(request, "block_hashes", None)
        # At our block size only (one hash per block of the request's tokens so far, or fewer).
        if keys and len(keys) <= request.num_tokens // self.block_size:
            self.cached.keep(request.request_id, keys)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        if self.leases is not None:
            self._reqs_need_send.update(self.leases.drain())
        # Timed from here (scheduling) to update_connector_output (the step's results): the step's own
        # execution time, never an idle gap between requests.
        self._last_step = (
            time.perf_counter(),
            scheduler_output.total_num_scheduled_tokens,
            _mean_position(scheduler_output),
        )
        meta = super().build_connector_meta(scheduler_output)
        self._maybe_idle(scheduler_output)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        if self._last_step is not None:
            started, tokens, context = self._last_step
            self.cost.observe_step(tokens=tokens, seconds=time.perf_counter() - started, context=context)
            self._last_step = None
        for rid in connector_output.finished_recving or ():
            self._awaiting.discard(rid)
        for rid in getattr(connector_output, "failed_recving", None) or ():  # vLLM >= 0.30
            self._awaiting.discard(rid)
            if rid in self._pulled:
                self._pulled[rid] = 0  # recomputed (kv_load_failure_policy "recompute")
        if self.leases is not None:
            for rid in connector_output.finished_sending or ():
                self.leases.forget(rid)
        stats = connector_output.kv_connector_stats
        if stats is not None and not stats.is_empty():
            self.cost.observe_transfer(stats.data)

    def _maybe_idle(self, scheduler_output: SchedulerOutput) -> None:
        """Back off while nothing is scheduled and no load is in flight.

        vLLM keeps stepping empty batches while a finished request's blocks are retained (hundreds of steps
        a second), and every step wakes the worker, which then spins on its queue for a second: two busy
        cores per engine for the whole retention time, on a 2-core machine enough to starve the other
        engines' NIXL handshakes for minutes. The wait grows from 0.5 ms to ``idle_sleep_max_ms`` and ends
        the moment a request reaches the engine's input queue, so a long wait costs a new turn nothing;
        what waits is only the bookkeeping of retained blocks (a finished read or an expired lease is
        noticed up to one wait later).
        """
        cap = self.agentkv.idle_sleep_max_ms / 1000.0
        if cap <= 0 or scheduler_output.total_num_scheduled_tokens > 0 or self._awaiting:
            self._idle_sleep = 0.0
            return
        if self._input_queue is None:
            self._input_queue = _engine_input_queue()
        if self._input_queue is False:
            # No queue to wake us: bounded like a plain sleep, because a request would wait it out.
            cap = min(cap, _BLIND_SLEEP_MAX_S)
        self._idle_sleep = min(cap, max(0.0005, self._idle_sleep * 2))
        _wait_for_input(self._input_queue, self._idle_sleep)

    def shutdown(self) -> None:
        if self.service is not None:
            self.service.stop()
        super().shutdown()


def _mean_position(scheduler_output: Any) -> float:
    """Mean position of the tokens a step computes (what their attention spans), weighted by token count.

    Built from vLLM's SchedulerOutput (new requests and cached ones carry ``num_computed_tokens``); 0 where a
    layout differs, which leaves the prefill rate flat instead of failing the step.
    """
    try:
        scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        total = sum(scheduled.values())
        if not total:
            return 0.0
        return sum(n * (computed.get(rid, 0) + n / 2) for rid, n in scheduled.items()) / total
    except (AttributeError, TypeError):
        return 0.0


def _block_keys(block_ids: Any) -> list[int]:
    """The ids of the blocks a finished request holds: vLLM passes one list per KV cache group (the groups
    allocate from one shared pool, so an id names one block whatever its group), older versions a flat
    list."""
    try:
        if block_ids and isinstance(block_ids[0], int):
            return list(block_ids)
        return [b for group in block_ids for b in group]
    except TypeError:
        return []


def _kv_bytes_per_token(kv_cache_config: Any, block_size: int) -> float | None:
    """KV bytes one token occupies across all layers (what a pull moves per token)."""
    try:
        total = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors)
        return total / kv_cache_config.num_blocks / block_size
    except (AttributeError, ZeroDivisionError, TypeError):
        return None
