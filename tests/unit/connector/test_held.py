import io
import json
import urllib.error
from typing import Any

from agentkv.server.engine._connector._held import HeldCheck

SERVICE = "http://d0:9200"


class Decode:
    """What the retention service answers, and what prefill asked it."""

    def __init__(self) -> None:
        self.answer: Any = {"kv_transfer_params": {"remote_blocks_expiry_time": 77.0}}
        self.calls: list[tuple[str, dict[str, str], float]] = []

    def fetch(self, url: str, headers: dict[str, str], timeout_s: float) -> bytes:
        self.calls.append((url, headers, timeout_s))
        if isinstance(self.answer, int):
            raise urllib.error.HTTPError(url, self.answer, "no", {}, io.BytesIO(b"{}"))  # type: ignore[arg-type]
        if isinstance(self.answer, BaseException):
            raise self.answer
        return json.dumps(self.answer).encode()


def params() -> dict[str, Any]:
    return {"agentkv_service": SERVICE, "remote_request_id": "chatcmpl-r1", "remote_blocks_expiry_time": 1.0}


def make(decode: Decode, now: list[float], token: str | None = "s3cret") -> HeldCheck:
    return HeldCheck(token=token, timeout_s=1.0, cooldown_s=5.0, clock=lambda: now[0], fetch=decode.fetch)


def test_held_refreshes_the_deadline_and_sends_the_token() -> None:
    d, now = Decode(), [0.0]
    p = params()
    assert make(d, now)(p) is True
    assert p["remote_blocks_expiry_time"] == 77.0
    assert d.calls == [
        (f"{SERVICE}/agentkv/v1/retained/chatcmpl-r1?reading=1", {"authorization": "Bearer s3cret"}, 1.0)
    ]


def test_a_stock_decode_is_not_asked() -> None:
    d, now = Decode(), [0.0]
    assert make(d, now)({"remote_request_id": "x"}) is True
    assert d.calls == []


def test_an_answer_that_is_no_keeps_asking() -> None:
    d, now = Decode(), [0.0]
    check = make(d, now)
    for status in (404, 401):
        d.answer = status
        assert check(params()) is False
    d.answer = {"kv_transfer_params": {}}
    assert check(params()) is True  # 404 and 401 are answers: the service is up, so it is asked again
    assert len(d.calls) == 3


def test_a_service_that_does_not_answer_is_left_alone_for_the_cooldown() -> None:
    d, now = Decode(), [0.0]
    check = make(d, now)
    d.answer = TimeoutError("timed out")  # what a frozen or unreachable decode costs: the whole timeout
    assert check(params()) is False
    d.answer = {"kv_transfer_params": {}}
    now[0] = 4.9
    assert check(params()) is False  # refused without a call: no second stall of prefill's step
    assert len(d.calls) == 1
    now[0] = 5.1
    assert check(params()) is True
    assert len(d.calls) == 2


def test_malformed_answers_are_a_no() -> None:
    d, now = Decode(), [0.0]
    check = make(d, now, token=None)
    for answer in ([], {"kv_transfer_params": []}, {"other": 1}):
        d.answer = answer
        assert check(params()) is False
    assert all(headers == {} for _u, headers, _t in d.calls)
