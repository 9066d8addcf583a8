"""Background health checks: dead backends leave the rotation, recovered ones come back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import httpx

from ._backend import BackendPool, BackendState
from ._lease import LeaseClient
from ._metrics import RouterMetrics

__all__ = ["HealthChecker"]

logger = logging.getLogger("agentkv.router")
MISSES_TO_DOWN = 3


class HealthChecker:
    def __init__(
        self,
        *,
        client: httpx.AsyncClient,
        prefill: BackendPool,
        decode: BackendPool,
        leases: LeaseClient,
        metrics: RouterMetrics,
        timeout_s: float,
    ) -> None:
        self._client = client
        self._prefill = prefill
        self._decode = decode
        self._leases = leases
        self._metrics = metrics
        self._timeout = httpx.Timeout(timeout_s)
        self.models: list[dict[str, Any]] | None = None
        self._misses: dict[str, int] = {}

    async def check_once(self) -> None:
        await self.check((*self._prefill, *self._decode))
        for state in self._decode:
            if state.healthy:
                await self.refresh_models(state)
                break
        self.publish()

    async def check(self, states: Iterable[BackendState]) -> None:
        """One health check of each of ``states`` (a round, or discovery's new backends), draining ones
        left out."""
        await asyncio.gather(*(self._check(s) for s in states if not s.draining))
        self.publish()

    def forget(self, name: str) -> None:
        """A backend left the pool: a later one under the same name starts with no misses."""
        self._misses.pop(name, None)

    def publish(self) -> None:
        self._metrics.healthy_backends.labels(role="prefill").set(len(self._prefill.healthy()))
        self._metrics.healthy_backends.labels(role="decode").set(len(self._decode.healthy()))

    async def _check(self, state: BackendState) -> None:
        refused = False
        try:
            resp = await self._client.get(f"{state.backend.url}/health", timeout=self._timeout)
            ok = resp.status_code == 200
        except httpx.ConnectError:
            ok, refused = False, True
        except httpx.HTTPError:
            ok = False
        # A refused connection means the process is gone: out at once. A slow or failing probe (an engine
        # busy with a long prefill on a loaded host) must fail MISSES_TO_DOWN times in a row first.
        if state.draining:  # drained by discovery while the probe ran: out of rotation, whatever it said
            return
        misses = 0 if ok else self._misses.get(state.name, 0) + 1
        self._misses[state.name] = misses
        if not ok and not refused and state.healthy and misses < MISSES_TO_DOWN:
            return
        if ok != state.healthy:
            logger.warning(
                "backend %s (%s) is now %s", state.name, state.backend.role, "up" if ok else "down"
            )
            if not ok:
                self._metrics.backend_errors.labels(role=state.backend.role, kind="health").inc()
        if ok and state.backend.role == "decode":
            # Re-probe every round: a restarted decode has a new engine id, which voids old blocks. Before it
            # counts as healthy again, so no turn that runs meanwhile sees it with the old engine's id.
            await self._leases.probe(state)
        # Discovery may have drained it while the probes ran: it stays out of rotation.
        state.healthy = ok and not state.draining
        if not ok:
            state.block_size = None  # a restarted engine may come back with another configuration
            state.renders = {}
            state.release = state.generates = None

    async def refresh_models(self, state: BackendState) -> list[dict[str, Any]] | None:
        try:
            resp = await self._client.get(f"{state.backend.url}/v1/models", timeout=self._timeout)
            data = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            data = None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            self.models = [m for m in data["data"] if isinstance(m, dict)]
        return self.models

    def model_ids(self) -> set[str] | None:
        if self.models is None:
            return None
        return {m["id"] for m in self.models if isinstance(m.get("id"), str)}

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.check_once()
            except Exception:  # a bug in one round must not stop health checking for good
                logger.exception("health check round failed")
            await asyncio.sleep(interval_s)
