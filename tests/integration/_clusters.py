"""The suite's clusters and routers: one factory (``Clusters``) that keeps at most one cluster running.

Two cores cannot run two clusters at once without starving both (a 2P2D cluster on top of the 1P1D one is six
engines), so asking for a cluster stops the one running before, with its routers. conftest orders the modules
so that everything on the default 1P1D cluster runs before the modules that need a cluster of their own: the
default cluster starts once, and each other cluster once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentkv.server.launch._cluster import Cluster, ClusterConfig

from ._helpers import RouterProc, free_port, start_router

LOG_DIR = Path(os.environ.get("AGENTKV_IT_LOGS", ".agentkv/it-logs"))
# The default cluster's decode lease. Short enough that tests can outlast it; long enough for prefill's 5 s
# expiry margin and the router's 6 s.
LEASE_S = 14
# Routers take the first free port from here: below Linux's ephemeral range (32768-60999), where an engine's
# own listeners (vLLM's ZMQ sockets, UCX) or an outgoing connection can take a port at any moment.
ROUTER_PORT_FROM = 18000


def cluster_config(model_dir: Path, name: str, **fields: Any) -> ClusterConfig:
    """A suite cluster: no router of its own (tests start theirs), prefill without prefix caching (the
    published cache-eviction setup, so every reused token comes from decode), and prefill pulling every
    verified offer (on 2 cores a pull and a recompute of a few hundred tiny-model tokens cost about the same,
    so prefill's cost model declines some pulls as it should, and tests that require a hit would fail; these
    tests are about answers, reuse, routing and faults, and the cost model has its unit tests), and the
    tokenizer cache in verify mode. ``fields`` override any of these."""
    defaults: dict[str, Any] = {
        "router_port": None,
        "prefill_prefix_caching": False,
        "max_model_len": 4096,
        "cost_model": False,
        "log_dir": LOG_DIR / name,
        # Every turn of the suite checks the tokenizer cache against a whole tokenization.
        "tokenizer_cache": "verify",
    }
    return ClusterConfig(model=str(model_dir), **{**defaults, **fields})


@dataclass
class _Live:
    name: str
    cluster: Cluster
    started: bool  # False: an external cluster (AGENTKV_IT_EXTERNAL=1), left running
    routers: dict[str, RouterProc] = field(default_factory=dict)


class Clusters:
    """Session-wide: the one running cluster and the routers in front of it, started on first request."""

    def __init__(self, *, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._live: _Live | None = None

    def get(self, name: str, *, external: bool = False, **fields: Any) -> Cluster:
        """The cluster ``name`` (configured by ``fields`` over ``cluster_config``'s defaults), started if it
        is not the one running; the one running before is stopped first. ``external``: the cluster is
        already running on its ports (development); it is used, never started or stopped."""
        if self._live is not None and self._live.name == name:
            return self._live.cluster
        self.stop()
        cluster = Cluster(config=cluster_config(self.model_dir, name, **fields))
        if not external:
            cluster.up()  # warms every P/D pair in both NIXL directions; stops what it started on failure
        self._live = _Live(name, cluster, started=not external)
        return cluster

    def router(
        self,
        name: str,
        *args: str,
        env: dict[str, str] | None = None,
        ready_s: float = 60,
        shared: bool = True,
    ) -> RouterProc:
        """A router (CLI ``args``, ``env`` added to its environment) in front of every engine of the running
        cluster. ``shared``: one per name for as long as the cluster runs; otherwise a new one each call,
        still stopped with the cluster."""
        live = self._live
        assert live is not None, "ask for a cluster before its routers"
        if shared and name in live.routers and live.routers[name].proc.poll() is None:
            return live.routers[name]
        r = start_router(
            port=free_port(ROUTER_PORT_FROM),
            prefill=[e.spec.url for e in live.cluster.prefills],
            decode=[e.spec.url for e in live.cluster.decodes],
            log=LOG_DIR / f"router-{live.name}-{name}.log",
            args=list(args),
            ready_s=ready_s,
            env=env,
        )
        live.routers[name if shared else f"{name}-{len(live.routers)}"] = r
        return r

    def stop(self) -> None:
        """Stop the running cluster's routers, then the cluster (unless it was external)."""
        live, self._live = self._live, None
        if live is None:
            return
        try:
            for r in live.routers.values():
                r.stop()
        finally:
            if live.started:
                live.cluster.down()
