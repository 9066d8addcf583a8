"""Engines that come and go: a discovery source says which engines serve each role now, and the router's
backend pools follow it.

`reconcile` is the decision, pure and I/O-free: engines new to the view join (out of rotation until their
health check passes), engines gone from it drain (no new turn is routed to them; the turns already there
finish), and drained engines leave the pool once idle. A conversation whose decode left is routed as one
whose decode died: its next turn recomputes on another decode (a reuse miss, never a failed turn).

Sources (`DiscoverySource`): `DnsSource` re-resolves headless Services' names every interval;
`KubernetesSource` lists the Services' EndpointSlices and watches them, so that a change is seen at once.
`Discovery` runs a source and applies what `reconcile` decides. Each router replica runs its own: the
conversation store holds no view of the engines, only the decode each conversation last ran on, by a name
every replica derives from the engine's address alone."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx

from agentkv._exceptions import ConfigError

from ._backend import Backend, BackendPool, BackendState, Role
from ._health import HealthChecker
from ._settings import RouterSettings, control_url, split_host_port

__all__ = [
    "Changes",
    "Discovered",
    "Discovery",
    "DiscoverySource",
    "DnsSource",
    "KubernetesSource",
    "Member",
    "Resolver",
    "backend_name",
    "reconcile",
    "resolve_addresses",
    "slice_urls",
    "source_from_settings",
]

logger = logging.getLogger("agentkv.router")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Discovered:
    """The engine URLs serving each role now; None where the source could not tell this round (its last
    view stands: a DNS or API server hiccup must not drain every engine)."""

    prefill: frozenset[str] | None
    decode: frozenset[str] | None


class DiscoverySource(Protocol):
    async def discover(self) -> Discovered: ...

    async def wait(self, interval_s: float) -> None:
        """Return when the next `discover` is due: after ``interval_s``, or earlier where the source
        learns of a change."""
        ...

    async def aclose(self) -> None: ...


# --- the decision -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Member:
    """One backend of a pool as `reconcile` sees it."""

    url: str
    draining_since: float | None = None  # monotonic seconds; None: in the view (serving or joining)
    busy: bool = False  # requests in flight on it


@dataclasses.dataclass(frozen=True, kw_only=True)
class Changes:
    """What a pool does after a discovery round, by engine URL."""

    join: frozenset[str] = frozenset()  # new to the pool
    drain: frozenset[str] = frozenset()  # gone from the view: no new turns
    rejoin: frozenset[str] = frozenset()  # draining, but back in the view
    remove: frozenset[str] = frozenset()  # drained: out of the pool

    def __bool__(self) -> bool:
        return bool(self.join or self.drain or self.rejoin or self.remove)


def reconcile(
    members: Iterable[Member], found: frozenset[str] | None, *, now: float, drain_s: float
) -> Changes:
    """How a pool of ``members`` follows the view ``found`` (None: unknown this round).

    A drained member leaves once nothing runs on it any more, or ``drain_s`` after it started draining
    whatever still runs there (those turns keep their backend and finish; only the pool forgets it). It
    leaves a round after it started draining at the earliest: a turn that ended just before still releases
    the blocks its conversation held there. A member that returns to the view while draining rejoins, health
    check first, as a new one would."""
    by_url = {m.url: m for m in members}
    remove = frozenset(
        url
        for url, m in by_url.items()
        if m.draining_since is not None
        and (found is None or url not in found)
        and (not m.busy or now - m.draining_since >= drain_s)
    )
    if found is None:
        return Changes(remove=remove)
    return Changes(
        join=found - by_url.keys(),
        drain=frozenset(url for url, m in by_url.items() if m.draining_since is None and url not in found),
        rejoin=frozenset(url for url, m in by_url.items() if m.draining_since is not None and url in found),
        remove=remove,
    )


def backend_name(url: str) -> str:
    """A discovered backend's name: its address (``host:port``), the same in every router replica, so that
    a conversation record written by one names the same engine for all (never a configured ``d0``)."""
    return urlsplit(url).netloc


# --- the runner ---------------------------------------------------------------------------------------


class Discovery:
    """Runs a source and makes the two pools follow it. New backends are probed in the round that found
    them, so an engine is in rotation one health check after it appears, not a health interval later."""

    def __init__(
        self,
        *,
        source: DiscoverySource,
        prefill: BackendPool,
        decode: BackendPool,
        health: HealthChecker,
        interval_s: float,
        drain_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self._pools: dict[Role, BackendPool] = {"prefill": prefill, "decode": decode}
        self._health = health
        self._interval = interval_s
        self._drain_s = drain_s
        self._clock = clock
        self._since: dict[str, float] = {}  # draining backends: since when
        self._joining: set[str] = set()  # in the pool, not yet through a health check

    async def step(self) -> dict[Role, Changes]:
        """One round: ask the source, apply the changes, probe the backends still joining."""
        found = await self.source.discover()
        now = self._clock()
        done: dict[Role, Changes] = {}
        for role, pool in self._pools.items():
            view = found.prefill if role == "prefill" else found.decode
            members = [
                Member(
                    url=s.backend.url,
                    draining_since=self._since.get(s.name) if s.draining else None,
                    busy=s.outstanding > 0 or s.prefilling > 0,
                )
                for s in pool
            ]
            changes = reconcile(members, view, now=now, drain_s=self._drain_s)
            if changes:
                self._apply(role, pool, changes, now)
            done[role] = changes
        joining = [s for pool in self._pools.values() for s in pool if s.name in self._joining]
        if joining:
            await self._health.check(joining)
            self._joining.difference_update(s.name for s in joining if s.healthy)
        return done

    def _apply(self, role: Role, pool: BackendPool, changes: Changes, now: float) -> None:
        by_url: dict[str, list[BackendState]] = {}
        for state in pool:
            by_url.setdefault(state.backend.url, []).append(state)
        for url in sorted(changes.remove):
            for state in by_url.get(url, ()):
                pool.remove(state.name)
                self._health.forget(state.name)
                self._since.pop(state.name, None)
                self._joining.discard(state.name)
                logger.warning("%s %s left the pool", role, state.name)
        for url in sorted(changes.drain):
            for state in by_url.get(url, ()):
                state.draining, state.healthy = True, False
                self._since[state.name] = now
                self._joining.discard(state.name)
                logger.warning("%s %s is gone from discovery: draining", role, state.name)
        for url in sorted(changes.rejoin):
            for state in by_url.get(url, ()):
                # Whatever ran there may have restarted meanwhile: a health check (and, for a decode, the
                # retention service's probe) before it takes turns again.
                state.draining = False
                self._since.pop(state.name, None)
                self._joining.add(state.name)
                logger.warning("%s %s is back in discovery", role, state.name)
        for url in sorted(changes.join):
            backend = Backend(
                name=backend_name(url),
                role=role,
                url=url,
                control_url=control_url(url) if role == "decode" else None,
            )
            pool.add(backend)
            self._joining.add(backend.name)
            logger.warning("%s %s found: joining after its health check", role, backend.name)
        self._health.publish()

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:  # a bug in one round must not stop discovery for good
                logger.exception("discovery round failed")
            try:
                await self.source.wait(self._interval)
            except Exception:
                logger.exception("discovery wait failed")
                await asyncio.sleep(self._interval)


# --- DNS ----------------------------------------------------------------------------------------------

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
# getaddrinfo's "no such name" and "no address for it": an answer (the Service has no ready endpoint), not a
# failure to get one.
_NO_RECORDS = frozenset(
    code for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if code is not None
)


async def resolve_addresses(host: str, port: int) -> list[str]:
    """`host`'s A and AAAA records through the system resolver, asked again on every call; [] when it has
    none. Other resolver errors raise OSError."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_RECORDS:
            return []
        raise
    return [str(info[4][0]) for info in infos]


class DnsSource:
    """A headless Service per role (``"host:port"``): every address its name resolves to is an engine at
    ``http://address:port``. `resolve` is the resolver (the system's by default; tests pass a fake one)."""

    def __init__(self, *, prefill: str, decode: str, resolve: Resolver = resolve_addresses) -> None:
        self._names = {"prefill": split_host_port(prefill), "decode": split_host_port(decode)}
        self._resolve = resolve
        self._failing: set[str] = set()

    async def discover(self) -> Discovered:
        prefill, decode = await asyncio.gather(self._urls("prefill"), self._urls("decode"))
        return Discovered(prefill=prefill, decode=decode)

    async def _urls(self, role: str) -> frozenset[str] | None:
        host, port = self._names[role]
        try:
            addresses = await self._resolve(host, port)
        except OSError as exc:
            if role not in self._failing:  # once per failure streak, not every round
                logger.warning("cannot resolve %s engines %s: %s (keeping the last view)", role, host, exc)
            self._failing.add(role)
            return None
        self._failing.discard(role)
        return frozenset(f"http://{_url_host(a)}:{port}" for a in addresses)

    async def wait(self, interval_s: float) -> None:
        await asyncio.sleep(interval_s)

    async def aclose(self) -> None:
        return None


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


# --- Kubernetes ---------------------------------------------------------------------------------------

_SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_SERVICE_LABEL = "kubernetes.io/service-name"
# A watch's own timeout is the discovery interval; the HTTP read waits this much longer before it gives up.
_WATCH_SLACK_S = 5.0


def slice_urls(item: Mapping[str, Any]) -> tuple[str | None, frozenset[str]]:
    """(Service name, URLs of its ready endpoints) of one EndpointSlice (discovery.k8s.io/v1).

    The port is the one named ``http``, else the slice's first; a slice without a port has no URL. An
    endpoint counts unless its `ready` condition is false (the API reads an unset one as ready; a terminating
    pod is not ready); of its addresses, the first (the API says they are fungible)."""
    labels = (item.get("metadata") or {}).get("labels") or {}
    service = labels.get(_SERVICE_LABEL)
    ports = [p for p in item.get("ports") or [] if isinstance(p, dict) and isinstance(p.get("port"), int)]
    port = next((p["port"] for p in ports if p.get("name") == "http"), ports[0]["port"] if ports else None)
    if port is None:
        return service, frozenset()
    urls = set()
    for endpoint in item.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        addresses = endpoint.get("addresses") or []
        if addresses and isinstance(addresses[0], str):
            urls.add(f"http://{_url_host(addresses[0])}:{port}")
    return service, frozenset(urls)


class KubernetesSource:
    """The engines behind two Services, from their EndpointSlices through the Kubernetes API (RBAC: get,
    list and watch `endpointslices` of `discovery.k8s.io` in the namespace).

    Each round lists the slices of both Services; `wait` then watches them from the list's version until
    the first change (or the interval's end), so an engine's coming or going is seen within a round trip.
    The service account token is read again for every request: the kubelet rotates it."""

    def __init__(
        self,
        *,
        api_url: str,
        namespace: str,
        prefill_service: str,
        decode_service: str,
        client: httpx.AsyncClient,
        token: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._url = f"{api_url.rstrip('/')}/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self._services = {prefill_service: "prefill", decode_service: "decode"}
        self._selector = f"{_SERVICE_LABEL} in ({prefill_service},{decode_service})"
        self._client = client
        self._token = token
        self._version: str | None = None  # the last list's resourceVersion, where the watch starts
        self._failing = False

    @classmethod
    def in_cluster(
        cls,
        *,
        prefill_service: str,
        decode_service: str,
        namespace: str | None = None,
        account: Path = _SERVICE_ACCOUNT,
        environ: Mapping[str, str] = os.environ,
    ) -> KubernetesSource:
        """The API server, CA, token and (unless given) namespace of the pod this router runs in."""
        host = environ.get("KUBERNETES_SERVICE_HOST")
        if not host:
            raise ConfigError("discovery=kubernetes runs in a pod: KUBERNETES_SERVICE_HOST is not set")
        port = environ.get("KUBERNETES_SERVICE_PORT", "443")
        try:
            context = ssl.create_default_context(cafile=str(account / "ca.crt"))
            if namespace is None:
                namespace = (account / "namespace").read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"discovery=kubernetes needs the pod's service account at {account} "
                f"(automountServiceAccountToken): {exc}"
            ) from exc
        token_file = account / "token"

        def token() -> str | None:
            try:
                return token_file.read_text().strip() or None
            except OSError:
                return None

        return cls(
            api_url=f"https://{_url_host(host)}:{port}",
            namespace=namespace,
            prefill_service=prefill_service,
            decode_service=decode_service,
            client=httpx.AsyncClient(verify=context, timeout=httpx.Timeout(10.0)),
            token=token,
        )

    def _headers(self) -> dict[str, str]:
        token = self._token()
        return {"authorization": f"Bearer {token}"} if token else {}

    async def discover(self) -> Discovered:
        try:
            items, self._version = await self._list()
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self._version = None
            if not self._failing:
                logger.warning("cannot list EndpointSlices: %s (keeping the last view)", exc)
            self._failing = True
            return Discovered(prefill=None, decode=None)
        self._failing = False
        found: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        for item in items:
            service, urls = slice_urls(item)
            role = self._services.get(service or "")
            if role is not None:
                found[role] |= urls
        return Discovered(prefill=frozenset(found["prefill"]), decode=frozenset(found["decode"]))

    async def _list(self) -> tuple[list[dict[str, Any]], str | None]:
        items: list[dict[str, Any]] = []
        params = {"labelSelector": self._selector, "limit": "500"}
        while True:
            resp = await self._client.get(self._url, params=params, headers=self._headers())
            resp.raise_for_status()
            data = resp.json()
            items.extend(i for i in data.get("items") or [] if isinstance(i, dict))
            meta = data.get("metadata") or {}
            if not meta.get("continue"):
                return items, meta.get("resourceVersion")
            params = {**params, "continue": meta["continue"]}

    async def wait(self, interval_s: float) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self._version is not None:
            with contextlib.suppress(httpx.HTTPError, TimeoutError, ValueError, KeyError, TypeError):
                async with asyncio.timeout(interval_s + _WATCH_SLACK_S):
                    if await self._watch(interval_s):
                        return
        # No change seen (the watch timed out, failed or is not allowed): list again at the interval.
        await asyncio.sleep(max(interval_s - (loop.time() - started), 0.0))

    async def _watch(self, interval_s: float) -> bool:
        """Whether a change to the slices arrived before the watch ended."""
        params = {
            "labelSelector": self._selector,
            "watch": "true",
            "resourceVersion": self._version or "",
            "timeoutSeconds": str(max(math.ceil(interval_s), 1)),
            "allowWatchBookmarks": "true",
        }
        timeout = httpx.Timeout(10.0, read=interval_s + _WATCH_SLACK_S)
        async with self._client.stream(
            "GET", self._url, params=params, headers=self._headers(), timeout=timeout
        ) as resp:
            if resp.status_code != 200:
                return False
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "BOOKMARK":
                    self._version = event["object"]["metadata"]["resourceVersion"]
                    continue
                # ADDED, MODIFIED, DELETED, or ERROR (the version expired): the next list sees what changed.
                return True
        return False

    async def aclose(self) -> None:
        await self._client.aclose()


def source_from_settings(settings: RouterSettings) -> DiscoverySource | None:
    """The source `settings.discovery` names; None for "static" (the configured engines, for good)."""
    if settings.discovery == "dns":
        assert settings.prefill_dns and settings.decode_dns  # checked by RouterSettings
        return DnsSource(prefill=settings.prefill_dns, decode=settings.decode_dns)
    if settings.discovery == "kubernetes":
        assert settings.prefill_service and settings.decode_service
        return KubernetesSource.in_cluster(
            prefill_service=settings.prefill_service,
            decode_service=settings.decode_service,
            namespace=settings.discovery_namespace,
        )
    return None
