"""Orchestration of one turn: choose P and D, pick the path, run the hops, stream D back, remember."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.responses import Response

from agentkv._constants import H_LEASE_EXPIRES_IN, PULLED_KEY
from agentkv._exceptions import APIStatusError
from agentkv._wire import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    KV_KEY,
    asked_logprobs,
    cut_messages,
    cut_offer,
    decode_body,
    decode_local_body,
    prefill_body,
    prefill_logprobs,
    prefill_params,
    prefill_token,
    rendered_request,
    reusable_tokens,
    token_prefill,
)

from ._backend import BackendState
from ._book import TurnBook
from ._errors import client_error
from ._hops import close_quietly, with_failover
from ._params import strip_kv_json
from ._policy import PathDecision, assess_reuse, choose_decode, choose_path, choose_prefill, partial_offer
from ._prefix import prompt_chars
from ._relay import AfterwardsResponse, Relay, RelayResponse
from ._services import RouterServices
from ._sse import ABORTED, TurnOutput
from ._store import ConversationRecord, StoreUnavailableError
from ._turn import Turn

__all__ = ["TurnRunner"]

logger = logging.getLogger("agentkv.router")


class TurnRunner:
    def __init__(self, *, services: RouterServices, book: TurnBook) -> None:
        self._sv, self._book = services, book
        self._s = services.settings
        self._ending: set[asyncio.Future[None]] = set()

    def _ended(self, ended: asyncio.Future[None]) -> None:
        self._ending.discard(ended)
        if not ended.cancelled() and (exc := ended.exception()) is not None:
            # The entry then counts until its deadline; only the shared load reads high meanwhile.
            logger.debug("prefill hop not cleared from the store: %s", exc)

    async def run(self, turn: Turn) -> Response:
        stack = contextlib.AsyncExitStack()
        try:
            locked = True
            record = None
            if turn.key is not None:
                try:
                    locked = await stack.enter_async_context(
                        self._sv.store.lock(turn.key, timeout=self._s.conversation_lock_timeout_s)
                    )
                    record = await self._sv.store.get(turn.key)
                except StoreUnavailableError as exc:
                    # No shared state: serve the turn without reuse (a recompute) rather than fail it.
                    logger.warning("serving %s without reuse: %s", turn.conversation_id, exc)
                    self._sv.metrics.backend_errors.labels(role="store", kind="unavailable").inc()
                    await stack.aclose()
                    stack = contextlib.AsyncExitStack()
                    turn.key = None
            await self._render(turn, record)
            decode, decision = await self._plan(turn, record, locked)
            try:
                if decision.path == "decode-local":
                    resp, decode = await self._decode_local(turn, record, decode)
                else:
                    resp, decode = await self._prefill_then_decode(turn, record, decode)
            except BaseException:
                await self._book.failed(turn, record)
                raise
            response: Response
            if turn.stream:
                relay = Relay(
                    services=self._sv,
                    book=self._book,
                    turn=turn,
                    record=record,
                    decode=decode,
                    resp=resp,
                    stack=stack,
                )
                response = RelayResponse(relay, headers=turn.headers())
            else:
                response = await self._finish_json(turn, record, decode, resp, stack)
            # The response owns the lock now; it lets go once the bookkeeping after the last byte is done.
            stack = contextlib.AsyncExitStack()
            return response
        finally:
            await stack.aclose()

    async def _render(self, turn: Turn, record: ConversationRecord | None) -> None:
        """The token path's one render of this turn, on a prefill that serves vLLM's render API. Engines
        that do not (403 without `--enable-scale-out`, 404 before it existed) are remembered and served
        text; a render the client's body fails (400) is the client's error, as the chat route's would be."""
        path = turn.render_path
        if not self._s.tokens or path is None:
            return
        sv = self._sv
        refused: list[BackendState] = []

        # The prefill that rendered is the one the token path's P hop goes to.
        prefer = record.prefill if record is not None else None

        def choose(tried: frozenset[str]) -> BackendState | None:
            pool = (p for p in sv.prefill if p.renders.get(path) is not False)
            return choose_prefill(pool, exclude=tried, prefer=prefer)

        async def attempt(p: BackendState) -> Any:
            try:
                return await sv.hops.post(
                    p, path, turn.body, turn.request_id, total_s=self._s.timeouts.prefill_s
                )
            except APIStatusError as exc:
                if exc.status_code in (403, 404, 405):
                    refused.append(p)
                raise

        t0 = time.perf_counter()
        try:
            prefill, answer = await with_failover(
                choose, attempt, role="prefill", mark_down=self._s.health_interval_s > 0
            )
        except APIStatusError as exc:
            if exc.status_code == 503 and not refused:
                return  # no prefill left that renders: the text path has its own choice (and its own 503)
            if not refused:
                raise
            logger.warning("%s serves no %s (HTTP %d): text to it", refused[0].name, path, exc.status_code)
            refused[0].renders[path] = False
            return
        rendered = rendered_request(answer)
        if rendered is None:
            return  # several prompts or multimodal input: the text path handles those
        prefill.renders[path] = True
        (turn.rendered, turn.prompt_ids), turn.render_prefill = rendered, prefill
        turn.render_ms = (time.perf_counter() - t0) * 1000
        self._sv.metrics.render_seconds.observe(turn.render_ms / 1000)

    async def _plan(
        self, turn: Turn, record: ConversationRecord | None, locked: bool
    ) -> tuple[BackendState, PathDecision]:
        book = self._book
        sv = self._sv
        sticky = record.decode if record else None
        decode = choose_decode(sv.decode, sticky=sticky, load_cap=self._s.decode_load_cap)
        if decode is None:
            # Checked before prefill: a P hop whose blocks no decode will read only wastes P.
            raise client_error(503, "no healthy decode engine available", code="no_backend")
        verdict = "miss"
        if turn.conversation_id is None:
            turn.reuse = "none"
        if record is not None and decode.name == record.decode:
            if decode.retention is None:
                await sv.leases.probe(decode)
            ids = turn.prompt_ids
            match = (
                record.tokens.match(ids)
                if record.tokens and ids is not None and self._s.prefix_guard
                else None
            )
            verdict = assess_reuse(
                retained=record.retained,
                expires_at=record.expires_at,
                prefix=record.prefix,
                body=turn.body,
                decode=decode,
                now=time.time(),
                margin_s=self._s.expiry_margin_s,
                check_prefix=self._s.prefix_guard,
                exact=self._s.exact,
                tokens=record.tokens,
                prompt_ids=ids,
                match=match,
            )
            if verdict == "partial" and match is not None and record.retained is not None:
                turn.offer_tokens = partial_offer(match, record.retained)
        if not (self._s.reuse and locked):
            verdict, turn.offer_tokens = "miss", None
        if turn.conversation_id is not None:
            # A partial match reuses decode's blocks as a whole one does (its count says how many).
            turn.reuse = "hit" if verdict in ("ok", "partial") else verdict
        cached, beyond, host = await self._decode_cached(turn, record, decode, verdict)
        decision = choose_path(
            policy=self._s.path_policy,
            reuse_ok=verdict in ("ok", "partial"),
            new_tokens=beyond if cached else self._new_tokens(turn, record),
            decode_outstanding=decode.outstanding,
            local_max_tokens=self._s.decode_local_max_tokens,
            model=sv.cost,
            exact=self._s.exact,
            prefill_outstanding=await self._prefill_load(),
            prefill_queue_cap=self._s.prefill_queue_cap,
            cached_tokens=cached,
            context_tokens=self._held_tokens(turn, record) if verdict in ("ok", "partial") else 0,
            restore_ms=host * (decode.kv_bytes_per_token or 0.0) / (self._s.host_restore_gbps * 1e6),
        )
        book.decided(turn, decision)
        turn.path = decision.path
        if cached and decision.path == "decode-local":
            # Decode's prefix cache serves the prompt's start: counted apart from a lease's reuse. `assess`
            # corrects the count where decode's answer reports its cached tokens.
            turn.reuse, turn.reused_tokens, turn.host_tokens = "cached", cached, host
        if turn.rendered is not None:
            turn.forward_ids = await sv.leases.learn_takes_ids(decode)
            turn.pack_ids = turn.forward_ids and decode.packed_ids
            turn.cut_messages = (
                self._s.cut_messages and turn.pack_ids and decode.messages_cut and turn.api_path == CHAT_PATH
            )
        return decode, decision

    @property
    def _reads_prefill_load(self) -> bool:
        """Whether `choose_path` can act on the prefills' load (conditional disaggregation)."""
        s = self._s
        return s.prefill_queue_cap > 0 and not s.exact and s.path_policy == "auto"

    async def _prefill_load(self) -> int:
        """P hops in flight on the least busy healthy prefill, counting every router replica's where the
        store is shared: replicas that counted only their own would each send up to the cap, and together
        queue several times the cap on one prefill. A store that cannot answer leaves this replica's own
        count, which the shared one includes and so never exceeds."""
        counts = {p.name: p.prefilling for p in self._sv.prefill if p.healthy}
        if not counts or not self._reads_prefill_load or min(counts.values()) >= self._s.prefill_queue_cap:
            return min(counts.values(), default=0)
        try:
            shared = await self._sv.store.prefilling(list(counts))
        except StoreUnavailableError as exc:
            logger.debug("prefill load from this replica alone: %s", exc)
            shared = None
        if shared:
            counts = {name: max(n, shared.get(name, 0)) for name, n in counts.items()}
        return min(counts.values())

    @contextlib.asynccontextmanager
    async def _computing(self, prefill: BackendState, turn: Turn) -> AsyncIterator[None]:
        """One P hop counted on `prefill` for as long as it runs: here, and in the shared store for the
        other replicas when they read it."""
        store, hop = self._sv.store, f"{turn.request_id}@{prefill.name}"
        shared = self._reads_prefill_load
        with prefill.computing():
            if shared:
                try:
                    until = time.time() + self._s.timeouts.prefill_s + self._s.timeouts.connect_s
                    await store.prefill_started(prefill.name, hop, until=until)
                except StoreUnavailableError:
                    shared = False
            try:
                yield
            finally:
                if shared:
                    # Its own task: a client that goes away cancels the turn, and the entry would then
                    # count until its deadline; the cancellation itself still reaches the turn.
                    ended = asyncio.ensure_future(store.prefill_ended(prefill.name, hop))
                    self._ending.add(ended)
                    ended.add_done_callback(self._ended)
                    with contextlib.suppress(StoreUnavailableError):
                        await asyncio.shield(ended)

    @staticmethod
    def _held_tokens(turn: Turn, record: ConversationRecord | None) -> int:
        """Tokens of the conversation decode holds that this turn may reuse: those a partial match leaves,
        those the token path checked, else decode's count."""
        if record is None:
            return 0
        if turn.offer_tokens is not None:
            return turn.offer_tokens
        return record.tokens.held if record.tokens else record.retained_tokens

    async def _decode_cached(
        self, turn: Turn, record: ConversationRecord | None, decode: BackendState, verdict: str
    ) -> tuple[int, int, int]:
        """(tokens of this prompt decode still has cached, tokens beyond them, of the cached those in its host
        tier) for a turn of a conversation whose decode retains nothing it may reuse (its retention cap
        declined the last turn, the lease ran out, or the conversation was demoted); zeros where decode cannot
        say, or the prompt shares no whole block with what decode had (on ids: counted up to the last whole
        block the router proves equal)."""
        s = self._s
        if (
            record is None
            or verdict not in ("miss", "expired")
            or decode.name != record.decode
            or not decode.retention
            or s.exact
            or s.path_policy == "always-pd"
            or not s.reuse
            or turn.key is None
        ):
            return 0, 0, 0
        ids = turn.prompt_ids
        limit: int | None = None  # tokens of the prompt proven equal to what decode had (None: all of it)
        if record.tokens is not None and ids is not None:
            match = record.tokens.match(ids)
            # A prompt that extends only some of the held ids' whole blocks (an answer that re-renders to
            # other ids, an edited history) still finds those in decode's prefix cache: vLLM matches blocks
            # by their tokens' hashes, as for any prompt.
            extends, limit = match.extends or match.verified > 0, None if match.extends else match.verified
        else:
            extends = record.prefix is not None and record.prefix.matches(turn.body)
        if not extends:
            return 0, 0, 0
        held, host = await self._sv.leases.cached(decode, record.request_id)
        if ids is None:
            turn.decode_had = (held, host)
            return held, self._new_tokens(turn, record), host
        # vLLM computes at least a prompt's last token.
        cached = min(held, max(len(ids) - 1, 0), len(ids) if limit is None else limit)
        # The host tier's part is the count's tail (decode counts its KV cache's leading blocks first).
        host = max(0, min(host, cached - (held - host)))
        turn.decode_had = (cached, host)
        return cached, len(ids) - cached, host

    def _new_tokens(self, turn: Turn, record: ConversationRecord | None) -> int:
        """Tokens this turn adds beyond what decode holds: counted on the token path, else estimated."""
        ids = turn.prompt_ids
        if ids is not None:
            if turn.offer_tokens is not None:
                return len(ids) - turn.offer_tokens
            return len(ids) - (record.tokens.held if record and record.tokens else 0)
        if record and record.prefix:
            return self._sv.cost.estimate_tokens(record.prefix.new_chars(turn.body))
        return self._sv.cost.estimate_tokens(prompt_chars(turn.body))

    async def _decode_local(
        self, turn: Turn, record: ConversationRecord | None, decode: BackendState
    ) -> tuple[httpx.Response, BackendState]:
        if turn.reuse == "hit":
            turn.reuse = "local"
            if record is not None:
                # A stream's headers go out before decode's usage says what its cache served: what decode
                # holds of this prompt (its prefix cache reads whole blocks of it). `assess` corrects it
                # where the answer reports cached tokens.
                ids = turn.prompt_ids
                held = record.retained_tokens if turn.offer_tokens is None else turn.offer_tokens
                turn.reused_tokens = min(held, len(ids)) if ids is not None else held
        try:
            body = decode_local_body(
                turn.body,
                prompt_ids=turn.forwarded_ids(),
                pack=turn.pack_ids,
                offer_decoded=not self._s.exact,
            )
            if turn.cut_messages:  # no failover on this path: the one decode said it takes a cut body
                body = cut_messages(body)
            return await self._open_decode(turn, body, first=decode, failover=False)
        except APIStatusError as exc:
            if exc.status_code != 503:
                raise
            # The sticky decode is gone, and its blocks with it: recompute through P on another decode.
            turn.path, turn.reuse = "recompute", "miss"
            return await self._prefill_then_decode(turn, None, None)

    async def _prefill_then_decode(
        self, turn: Turn, record: ConversationRecord | None, decode: BackendState | None
    ) -> tuple[httpx.Response, BackendState]:
        sv = self._sv
        retained = record.retained if record is not None and turn.path == "pull" else None
        if retained is not None and turn.offer_tokens is not None and record is not None and record.tokens:
            # A partial match: only the leading whole blocks it may read (cut at decode's block size).
            retained = cut_offer(retained, turn.offer_tokens, record.tokens.block_size)
        rendered = turn.rendered
        if rendered is not None:
            # Tokens in: prefill renders nothing again. Any prefill with the render API takes the ids.
            first = turn.render_prefill
            path = turn.render_path
            pool = [p for p in sv.prefill if path is not None and p.renders.get(path)]
        else:
            first, pool = None, list(sv.prefill)

        prefer = record.prefill if record is not None else None

        def choose(tried: frozenset[str]) -> BackendState | None:
            if first is not None and first.name not in tried and first.healthy:
                return first
            return choose_prefill(pool, exclude=tried, prefer=prefer)

        # Set before the hop: once P has the params it may have read (and so freed) decode's blocks.
        turn.used_retained = retained is not None
        # The client's top logprobs, asked of prefill for the token decode starts from and forwarded with it.
        logprobs = self._asked_logprobs(turn) if rendered is not None else None
        t0 = time.perf_counter()

        async def attempt(p: BackendState) -> dict[str, Any]:
            async with self._computing(p, turn):
                if rendered is not None:
                    return await self._token_prefill(p, turn, rendered, prefill_params(retained), logprobs)
                body = prefill_body(turn.body, retained, responses=turn.dialect == "responses")
                return await sv.hops.post_json(
                    p, turn.api_path, body, turn.request_id, total_s=self._s.timeouts.prefill_s
                )

        prefill, answer = await with_failover(
            choose, attempt, role="prefill", mark_down=self._s.health_interval_s > 0
        )
        turn.prefill_ms = (time.perf_counter() - t0) * 1000
        sv.metrics.prefill_seconds.observe(turn.prefill_ms / 1000)
        turn.prefill = prefill.name
        usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        prompt_tokens = usage.get("prompt_tokens")
        turn.prompt_tokens = prompt_tokens if isinstance(prompt_tokens, int) else None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if retained is not None:
            if isinstance(cached, int):
                turn.reuse, turn.reused_tokens = ("hit", cached) if cached > 0 else ("declined", 0)
            else:
                # P does not say whether it pulled; count the attempt as a hit of what decode held.
                turn.reused_tokens = reusable_tokens(retained, turn.prompt_tokens)
        elif isinstance(cached, int) and cached > 0:
            # Nothing offered from decode, but prefill's own prefix cache held the start of the prompt (a
            # conversation whose retention was declined or expired, a shared system prompt): not recomputed
            # either. The verdict stays what the router decided about decode's KV.
            turn.reused_tokens = cached
        kv = answer.get(KV_KEY) if isinstance(answer.get(KV_KEY), dict) else None
        pulled = kv.pop(PULLED_KEY, None) if kv is not None else None
        if retained is not None and isinstance(pulled, int) and not isinstance(pulled, bool):
            turn.pulled_tokens = pulled
        salt = f"agentkv-{turn.request_id}" if self._s.exact else None
        body = decode_body(
            turn.body,
            kv,
            cache_salt=salt,
            prompt_ids=turn.forwarded_ids(),
            pack=turn.pack_ids,
            offer_decoded=not self._s.exact,
            # Token ids in both hops: prefill sampled greedily what decode may start from.
            prefill_token=prefill_token(answer) if self._s.prefill_token and rendered is not None else None,
            prefill_logprobs=None if logprobs is None else prefill_logprobs(answer, logprobs),
        )
        # The whole body stays for a decode the hop fails over to: only `decode` said it takes a cut one.
        cut = cut_messages(body) if turn.cut_messages else body
        return await self._open_decode(turn, cut, first=decode, whole=body)

    def _asked_logprobs(self, turn: Turn) -> int | None:
        """The top logprobs the client asked of its answer, where prefill computes them for the token decode
        starts from (`agentkv._wire.asked_logprobs`)."""
        if not self._s.prefill_token or turn.api_path not in (CHAT_PATH, COMPLETIONS_PATH):
            return None
        return asked_logprobs(turn.body, chat=turn.api_path == CHAT_PATH)

    async def _token_prefill(
        self,
        p: BackendState,
        turn: Turn,
        rendered: dict[str, Any],
        kv_params: dict[str, Any],
        logprobs: int | None,
    ) -> dict[str, Any]:
        """The token path's prefill hop on prefill ``p``: the generate route where ``p`` takes it, else an id
        prompt (`agentkv._wire.token_prefill`), asking ``logprobs`` top logprobs of its token."""
        sv = self._sv

        async def post(generate: bool) -> dict[str, Any]:
            path, body = token_prefill(
                rendered,
                model=turn.body.get("model"),
                kv_params=kv_params,
                generate=generate,
                logprobs=logprobs,
            )
            return await sv.hops.post_json(p, path, body, turn.request_id, total_s=self._s.timeouts.prefill_s)

        generate = await sv.leases.learn_generates(p)
        try:
            answer = await post(generate)
        except APIStatusError as exc:
            # A release whose generate route takes other fields than 0.32's: the route every release has.
            # Remembered only if that one takes the request (a prompt too long fails on both).
            if not generate or exc.status_code not in (400, 404, 405, 422):
                raise
            answer = await post(False)
            logger.warning("%s refused the generate route (HTTP %d): id prompts", p.name, exc.status_code)
            p.generates = False
            return answer
        if generate and not isinstance(answer.get("kv_transfer_params"), dict):
            # Decode recomputes this turn (no blocks to read); later turns take the completions route.
            logger.warning("%s answered the generate route without kv_transfer_params: id prompts", p.name)
            p.generates = False
        return answer

    async def _open_decode(
        self,
        turn: Turn,
        body: dict[str, Any],
        *,
        first: BackendState | None,
        failover: bool = True,
        whole: dict[str, Any] | None = None,
    ) -> tuple[httpx.Response, BackendState]:
        """Decode's hop to ``first``, else (``failover``) another decode, which gets ``whole`` (the body
        before `cut_messages`) where given."""
        sv = self._sv
        s = self._s

        def choose(tried: frozenset[str]) -> BackendState | None:
            if first is not None and first.name not in tried and first.healthy:
                return first
            if not failover:
                return None
            return choose_decode(sv.decode, sticky=None, load_cap=s.decode_load_cap, exclude=tried)

        async def attempt(d: BackendState) -> httpx.Response:
            with contextlib.ExitStack() as inflight:
                inflight.enter_context(d.inflight())
                first_byte = s.timeouts.decode_first_byte_s if turn.stream else s.timeouts.decode_total_s
                sent = body if whole is None or d is first else whole
                resp = await sv.hops.open_stream(
                    d, turn.api_path, sent, turn.request_id, first_byte_s=first_byte
                )
                turn.inflight = inflight.pop_all()  # until the answer's last byte
                return resp

        t0 = time.perf_counter()
        decode, resp = await with_failover(choose, attempt, role="decode", mark_down=s.health_interval_s > 0)
        turn.decode = decode.name
        turn.decode_started = t0
        return resp, decode

    async def _finish_json(
        self,
        turn: Turn,
        record: ConversationRecord | None,
        decode: BackendState,
        resp: httpx.Response,
        stack: contextlib.AsyncExitStack,
    ) -> Response:
        output = TurnOutput(dialect=turn.dialect)
        try:
            try:
                content = await resp.aread()
            except httpx.HTTPError:
                self._sv.metrics.backend_errors.labels(role="decode", kind="protocol").inc()
                raise client_error(502, "decode engine connection failed", code="upstream_error") from None
        finally:
            turn.inflight.close()
            await close_quietly(resp)
        content, params, obj = strip_kv_json(content)
        if obj is None:
            try:
                obj = json.loads(content)
            except ValueError:
                raise client_error(502, "decode engine returned a malformed response") from None
        output.add_response(obj)
        output.kv_params = params
        if output.finish_reason == ABORTED:
            # Decode dropped the request (shutting down): a cut-short answer is an error, never an answer.
            self._sv.metrics.backend_errors.labels(role="decode", kind="aborted").inc()
            await self._book.failed(turn, record)
            raise client_error(502, "decode engine aborted the request", code="upstream_error")
        # What decode retained is needed for the lease header; storing it waits until the client has the
        # answer (the lock, moved into `stack`, keeps the next turn of this conversation out until then).
        new = await self._book.assess(turn, record, decode, output)
        headers = turn.headers()
        if self._book.keeps(turn) and new.lease_state != "none" and new.expires_at is not None:
            headers[H_LEASE_EXPIRES_IN] = f"{max(new.expires_at - time.time(), 0.0):.1f}"
        book = self._book

        async def after() -> None:
            async with stack:
                await book.remember(turn, record, new)

        return AfterwardsResponse(content, headers=headers, after=after)
