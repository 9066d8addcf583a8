from __future__ import annotations

from collections.abc import Iterator

import pytest
import respx

BASE = "http://router.test/v1"


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def control() -> Iterator[respx.MockRouter]:
    """The router's control plane; DELETE answers 200 unless a test overrides it."""
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        mock.delete(path__regex=r"/conversations/.+").respond(200, json={"released": True})
        yield mock
