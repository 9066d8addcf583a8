"""The bench package lives at the repository root, outside the installed ``agentkv`` distribution."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


class Dispatch(httpx.AsyncBaseTransport):
    """Routes HTTP calls to in-process ASGI apps by ``host:port`` (the stubs stand in for real servers)."""

    def __init__(self, routes: dict[str, httpx.ASGITransport]) -> None:
        self.routes = routes

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.routes[f"{request.url.host}:{request.url.port or 80}"].handle_async_request(request)


@pytest.fixture
def dispatch() -> type[Dispatch]:
    return Dispatch
