import email.utils

import httpx
import pytest

from agentkv import APIStatusError, ConnectError, RateLimitError, TimeoutError_, TransportError
from agentkv.client import RetryPolicy, ScriptedReply, ScriptedRouter, Transport
from agentkv.client._retry import retry_after

BASE = "http://router.test/v1"
PARAMS = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "extra_headers": {"x-session-id": "c1"},
}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def make(router: ScriptedRouter, clock: FakeClock, **options: object) -> Transport:
    return Transport(
        base_url=BASE,
        api_key="k",
        http_client=router.client(),
        clock=clock,
        sleep=clock.sleep,
        **options,  # type: ignore[arg-type]
    )


def test_retry_after_forms() -> None:
    assert retry_after({"retry-after": "2"}) == 2.0
    assert retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert retry_after({"retry-after": "soon"}) is None
    assert retry_after({}) is None
    date = email.utils.formatdate(1_000_010.0, usegmt=True)
    assert retry_after({"retry-after": date}, now=1_000_000.0) == pytest.approx(10.0)


def test_connect_error_is_retried_with_identical_request() -> None:
    router = ScriptedRouter([httpx.ConnectError("refused"), ScriptedReply.completion("fine")])
    clock = FakeClock()
    reply = make(router, clock).complete(PARAMS)
    assert reply.value.choices[0].message.content == "fine"
    assert len(router.requests) == 2
    assert router.requests[0].headers["x-session-id"] == router.requests[1].headers["x-session-id"] == "c1"
    assert router.requests[0].content == router.requests[1].content


@pytest.mark.parametrize("status", [429, 502, 503, 504])
def test_retryable_status_honours_retry_after(status: int) -> None:
    router = ScriptedRouter(
        [ScriptedReply.error(status, headers={"retry-after": "2"}), ScriptedReply.completion()]
    )
    clock = FakeClock()
    make(router, clock).complete(PARAMS)
    assert clock.slept == [2.0]


def test_retry_after_is_capped() -> None:
    router = ScriptedRouter(
        [ScriptedReply.error(503, headers={"retry-after": "3600"}), ScriptedReply.completion()]
    )
    clock = FakeClock()
    make(router, clock, retry=RetryPolicy(max_retry_after_s=5.0)).complete(PARAMS)
    assert clock.slept == [5.0]


@pytest.mark.parametrize("status", [400, 401, 404, 500])
def test_other_statuses_are_not_retried(status: int) -> None:
    router = ScriptedRouter([ScriptedReply.error(status, "nope"), ScriptedReply.completion()])
    with pytest.raises(APIStatusError) as info:
        make(router, FakeClock()).complete(PARAMS)
    assert info.value.status_code == status
    assert info.value.error_type == "upstream_error"
    assert "nope" in str(info.value)
    assert len(router.requests) == 1


def test_attempts_exhausted_raises_last_error() -> None:
    router = ScriptedRouter([ScriptedReply.error(429)] * 3)
    with pytest.raises(RateLimitError):
        make(router, FakeClock(), retry=RetryPolicy(max_attempts=3)).complete(PARAMS)
    assert len(router.requests) == 3


def test_read_timeout_is_not_retried() -> None:
    router = ScriptedRouter([httpx.ReadTimeout("slow"), ScriptedReply.completion()])
    with pytest.raises(TimeoutError_):
        make(router, FakeClock()).complete(PARAMS)
    assert len(router.requests) == 1


def test_pool_timeout_is_retried() -> None:
    router = ScriptedRouter([httpx.PoolTimeout("busy"), ScriptedReply.completion("ok")])
    assert make(router, FakeClock()).complete(PARAMS).value.choices[0].message.content == "ok"


def test_persistent_connect_error_maps_to_connect_error() -> None:
    router = ScriptedRouter([httpx.ConnectError("refused")] * 3)
    with pytest.raises(ConnectError):
        make(router, FakeClock()).complete(PARAMS)


def test_retry_that_cannot_finish_before_the_deadline_is_skipped() -> None:
    router = ScriptedRouter(
        [ScriptedReply.error(503, headers={"retry-after": "20"}), ScriptedReply.completion()]
    )
    clock = FakeClock()
    with pytest.raises(APIStatusError):
        make(router, clock, timeout=10.0).complete(PARAMS)
    assert clock.slept == []
    assert len(router.requests) == 1


def test_stream_open_is_retried_before_the_first_byte() -> None:
    router = ScriptedRouter([ScriptedReply.error(503), ScriptedReply.stream(["a", "b"])])
    transport = make(router, FakeClock())
    reply = transport.open_stream(PARAMS)
    pieces = [c.choices[0].delta.content for c in transport.chunks(reply) if c.choices]
    assert "".join(p or "" for p in pieces) == "ab"
    assert len(router.requests) == 2


def test_broken_stream_is_never_replayed() -> None:
    router = ScriptedRouter([ScriptedReply.stream(["a", "b", "c"], break_after=2), ScriptedReply.stream()])
    transport = make(router, FakeClock())
    reply = transport.open_stream(PARAMS)
    # The message is the SDK's (openai 2: "ReadError: connection reset by peer", 3: "Connection error."):
    # what matters is one typed error and no second request.
    with pytest.raises(TransportError):
        list(transport.chunks(reply))
    assert len(router.requests) == 1
