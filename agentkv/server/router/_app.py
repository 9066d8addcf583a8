"""The ASGI app: routes, auth, bounded bodies, and the guarantee that every error is an OpenAI body."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkv._exceptions import APIStatusError
from agentkv._wire import CHAT_PATH, COMPLETIONS_PATH, COUNT_TOKENS_PATH, MESSAGES_PATH, RESPONSES_PATH

from ._backend import BackendPool, BackendState
from ._book import TurnBook
from ._conversations import Conversations
from ._discovery import Discovery, DiscoverySource, source_from_settings
from ._errors import client_error, error_body, error_response
from ._health import HealthChecker
from ._hops import Hops, with_failover
from ._ids import (
    Endpoint,
    conversation_key,
    extract_conversation_id,
    final_turn,
    new_request_id,
    parse_body,
    tenant_of,
    validate_conversation_id,
)
from ._lease import LeaseClient
from ._metrics import RouterMetrics
from ._params import strip_client_fields
from ._policy import choose_prefill
from ._proxy import TurnRunner
from ._services import RouterServices
from ._settings import RouterSettings
from ._store import ConversationStore, MemoryStore, StoreUnavailableError
from ._transport import PooledTransport
from ._turn import Turn

__all__ = ["create_app", "run_router"]

logger = logging.getLogger("agentkv.router")

Handler = Callable[[Request], Awaitable[Response]]


def _guarded(handler: Handler) -> Handler:
    """Every route answers an OpenAI error body; a bug is logged with its traceback, never shown."""

    @functools.wraps(handler)
    async def wrapper(request: Request) -> Response:
        try:
            return await handler(request)
        except APIStatusError as exc:
            return error_response(exc)
        except StoreUnavailableError:
            logger.warning("conversation store unavailable for %s %s", request.method, request.url.path)
            return JSONResponse(error_body(503, "conversation store unavailable, retry"), status_code=503)
        except Exception:
            logger.exception("unhandled error serving %s %s", request.method, request.url.path)
            return JSONResponse(error_body(500, "internal router error"), status_code=500)

    return wrapper


class _Router:
    """Everything one app owns; built by `create_app`, reachable as `app.state.router`."""

    def __init__(
        self,
        *,
        settings: RouterSettings,
        transport: httpx.AsyncBaseTransport | None,
        store: ConversationStore | None,
        discovery: DiscoverySource | None,
    ) -> None:
        self.settings = settings
        self.api_keys = settings.all_api_keys()
        prefill, decode = settings.backends()
        self.prefill = BackendPool(backends=prefill)
        self.decode = BackendPool(backends=decode)
        # One transport (one pool per engine origin) for the hops and the client the control calls use.
        self.transport = transport if transport is not None else PooledTransport()
        self.client = httpx.AsyncClient(
            transport=self.transport,
            timeout=httpx.Timeout(settings.timeouts.prefill_s, connect=settings.timeouts.connect_s),
        )
        self.metrics = RouterMetrics()
        token = settings.service_token.get_secret_value() if settings.service_token else None
        self.leases = LeaseClient(client=self.client, timeout_s=settings.timeouts.control_s, token=token)
        if store is None:
            store = _make_store(settings)
        self.services = RouterServices(
            settings=settings,
            store=store,
            metrics=self.metrics,
            prefill=self.prefill,
            decode=self.decode,
            leases=self.leases,
            hops=Hops(transport=self.transport, metrics=self.metrics, connect_s=settings.timeouts.connect_s),
        )
        self.book = TurnBook(services=self.services)
        if isinstance(store, MemoryStore) and store.on_evict is None:
            store.on_evict = self.book.release_soon
        self.store = store
        self.runner = TurnRunner(services=self.services, book=self.book)
        self.conversations = Conversations(services=self.services, book=self.book)
        self.health = HealthChecker(
            client=self.client,
            prefill=self.prefill,
            decode=self.decode,
            leases=self.leases,
            metrics=self.metrics,
            timeout_s=settings.timeouts.control_s,
        )
        self.health.publish()
        source = discovery if discovery is not None else source_from_settings(settings)
        self.discovery = (
            Discovery(
                source=source,
                prefill=self.prefill,
                decode=self.decode,
                health=self.health,
                interval_s=settings.discovery_interval_s,
                # A drained engine leaves the pool once idle, or after the longest a whole answer may take.
                drain_s=settings.timeouts.decode_total_s,
            )
            if source is not None
            else None
        )

    def tenant(self, request: Request) -> str:
        return tenant_of(request.headers.get("authorization"), self.api_keys)

    async def read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise client_error(413, f"request body exceeds {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise client_error(413, f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def known_models(self) -> set[str] | None:
        if self.health.models is None:
            for state in self.decode.healthy():
                if await self.health.refresh_models(state) is not None:
                    break
        return self.health.model_ids()

    def conversation(self, request: Request) -> tuple[str, str]:
        tenant = self.tenant(request)
        cid = validate_conversation_id(request.path_params["conversation_id"], "path")
        return conversation_key(tenant, cid), cid


def _make_store(settings: RouterSettings) -> ConversationStore:
    if settings.store_url:
        from ._redis_store import RedisStore

        return RedisStore(url=settings.store_url)
    return MemoryStore(max_conversations=settings.max_conversations)


def _completion_route(endpoint: Endpoint, api_path: str) -> Handler:
    async def handler(request: Request) -> Response:
        router: _Router = request.app.state.router
        tenant = router.tenant(request)
        body = parse_body(await router.read_body(request), endpoint)
        conversation_id = extract_conversation_id(
            request.headers, body, session_header=router.settings.session_header
        )
        body, dropped = strip_client_fields(body)
        if dropped:
            router.metrics.kv_params_dropped.inc()
            logger.warning("dropped client-supplied kv_transfer_params (conversation_id=%s)", conversation_id)
        model = body.get("model")
        if model is not None:
            models = await router.known_models()
            if models is not None and model not in models:
                raise client_error(404, f"The model `{model}` does not exist.", param="model", code=404)
        request_id = new_request_id()
        if endpoint == "responses":
            # vLLM names a response's engine request after the body's `request_id` (not X-Request-Id), and
            # the retention service finds decode's blocks by the router's id; `store` would keep every
            # response in one engine's memory for good.
            body = {**body, "request_id": f"resp_{request_id}", "store": False}
        turn = Turn(
            api_path=api_path,
            body=body,
            conversation_id=conversation_id,
            key=conversation_key(tenant, conversation_id) if conversation_id else None,
            request_id=request_id,
            final=final_turn(request.headers),
        )
        return await router.runner.run(turn)

    return _guarded(handler)


@_guarded
async def _count_tokens(request: Request) -> Response:
    """Anthropic's token count (clients size their context with it): answered by any prefill, which renders
    the same body with the same template; nothing is kept."""
    router: _Router = request.app.state.router
    router.tenant(request)
    body, _ = strip_client_fields(parse_body(await router.read_body(request), "count"))
    sv, timeout_s = router.services, router.settings.timeouts.prefill_s

    async def attempt(p: BackendState) -> Any:
        return await sv.hops.post(p, COUNT_TOKENS_PATH, body, new_request_id(), total_s=timeout_s)

    _, answer = await with_failover(
        lambda tried: choose_prefill(sv.prefill, exclude=tried),
        attempt,
        role="prefill",
        mark_down=router.settings.health_interval_s > 0,
    )
    if not isinstance(answer, dict):
        raise client_error(502, "prefill engine returned a malformed response", code="upstream_error")
    return JSONResponse(answer)


@_guarded
async def _models(request: Request) -> Response:
    router: _Router = request.app.state.router
    router.tenant(request)
    if await router.known_models() is None:
        raise client_error(503, "no healthy decode engine available", code="no_backend")
    return JSONResponse({"object": "list", "data": router.health.models})


@_guarded
async def _health(request: Request) -> Response:
    router: _Router = request.app.state.router
    p, d = len(router.prefill.healthy()), len(router.decode.healthy())
    return JSONResponse(
        {"status": "ok" if p and d else "unavailable", "prefill": p, "decode": d},
        status_code=200 if p and d else 503,
    )


@_guarded
async def _metrics(request: Request) -> Response:
    router: _Router = request.app.state.router
    router.metrics.conversations.set(await router.store.count())
    router.health.publish()
    return Response(router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@_guarded
async def _conversation(request: Request) -> Response:
    router: _Router = request.app.state.router
    key, cid = router.conversation(request)
    if request.method == "DELETE":
        return JSONResponse(await router.conversations.forget(key, cid))
    return JSONResponse(await router.conversations.lookup(key, cid))


@_guarded
async def _heartbeat(request: Request) -> Response:
    router: _Router = request.app.state.router
    key, cid = router.conversation(request)
    raw = await router.read_body(request)
    return JSONResponse(await router.conversations.heartbeat(key, cid, raw))


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = {404: "no such endpoint", 405: "method not allowed"}.get(status, "request failed")
    return JSONResponse(error_body(status, message), status_code=status)


def create_app(
    settings: RouterSettings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    store: ConversationStore | None = None,
    discovery: DiscoverySource | None = None,
) -> Starlette:
    """The router as an ASGI app. `transport`, `store` and `discovery` (a source of engines, in place of the
    one `settings.discovery` names) exist for tests and embedding."""
    router = _Router(settings=settings, transport=transport, store=store, discovery=discovery)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        tasks = []
        if settings.health_interval_s > 0:
            tasks.append(asyncio.create_task(router.health.run(settings.health_interval_s)))
        if router.discovery is not None:
            tasks.append(asyncio.create_task(router.discovery.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if router.discovery is not None:
                await router.discovery.source.aclose()
            await router.book.drain()
            await router.client.aclose()
            await router.store.aclose()

    routes = [
        Route(CHAT_PATH, _completion_route("chat", CHAT_PATH), methods=["POST"]),
        Route(COMPLETIONS_PATH, _completion_route("completions", COMPLETIONS_PATH), methods=["POST"]),
        Route(MESSAGES_PATH, _completion_route("messages", MESSAGES_PATH), methods=["POST"]),
        Route(COUNT_TOKENS_PATH, _count_tokens, methods=["POST"]),
        Route(RESPONSES_PATH, _completion_route("responses", RESPONSES_PATH), methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}", _conversation, methods=["GET", "DELETE"]),
        Route("/v1/conversations/{conversation_id}/heartbeat", _heartbeat, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.state.router = router
    return app


def run_router(settings: RouterSettings) -> None:
    """Serve until interrupted (blocking)."""
    import uvicorn

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    # httpx logs every upstream request at INFO: three lines per turn that cost more than the turn's own
    # log line. Our per-turn line says what happened; their DEBUG detail is still there at debug level.
    quiet = logging.DEBUG if settings.log_level == "debug" else logging.WARNING
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(quiet)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        # uvloop and httptools when installed (the `bench` extra brings them), else asyncio and h11.
        loop="auto",
        http="auto",
    )
