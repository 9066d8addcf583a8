"""The warm-up's wire sequence against a fake pair (httpx MockTransport); the real engines run it in
tests/integration (every cluster fixture starts through ``Cluster.up``)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from agentkv import EngineVersionError, WarmUpError
from agentkv.server.launch._warmup import warm_up_pair

P, D, SVC = "http://p:8100", "http://d:8200", "http://d:9200"


class FakePair:
    def __init__(
        self, *, decode_status: int = 200, cached: int = 300, versions: tuple[str, str] = ("0.32.0", "0.32.0")
    ) -> None:
        self.versions = dict(zip((P, D), versions, strict=True))
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.decode_status = decode_status
        self.cached = cached
        self.turn = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.calls.append((request.method, str(request.url), body))
        url = str(request.url)
        if url.endswith("/version"):  # vLLM's API server: {"version": "0.32.0"}
            return httpx.Response(200, json={"version": self.versions[url.removesuffix("/version")]})
        if url == f"{P}/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if url.startswith(P):
            cached = self.cached if self.turn == 1 else 0
            return httpx.Response(
                200,
                json={
                    "kv_transfer_params": {"remote_engine_id": "p", "do_remote_prefill": True},
                    "usage": {"prompt_tokens_details": {"cached_tokens": cached}},
                },
            )
        if url.startswith(D):
            self.turn += 1
            if self.decode_status != 200:
                return httpx.Response(self.decode_status, json={"error": "boom"})
            params = {"remote_request_id": f"d{self.turn}", "remote_num_tokens": 300, "agentkv_service": SVC}
            return httpx.Response(
                200, json={"choices": [{"message": {"content": "ok"}}], "kv_transfer_params": params}
            )
        if request.method == "DELETE":  # turn 1's lease was read by prefill: only turn 2's is still there
            return httpx.Response(200 if url.endswith("/d2") else 404, json={})
        return httpx.Response(404)


def run(fake: FakePair) -> Any:
    with httpx.Client(transport=httpx.MockTransport(fake)) as client:
        return warm_up_pair(prefill_url=P, decode_url=D, client=client)


def test_two_turns_then_prefill_pulls_what_decode_retained_and_the_lease_is_released() -> None:
    fake = FakePair()
    report = run(fake)
    posts = [(url, body) for method, url, body in fake.calls if method == "POST"]
    assert [url.split("/v1")[0] for url, _ in posts] == [P, D, P, D]
    (_, p1), (_, d1), (_, p2), (_, d2) = posts
    assert p1["kv_transfer_params"]["do_remote_decode"] is True and p1["max_tokens"] == 1
    assert d1["kv_transfer_params"] == {"remote_engine_id": "p", "do_remote_prefill": True}  # P's params
    # Turn 2 extends turn 1 and hands P decode's retained params: P pulls them.
    assert p2["messages"][: len(p1["messages"])] == p1["messages"]
    assert p2["kv_transfer_params"]["remote_request_id"] == "d1"
    assert p2["kv_transfer_params"]["do_remote_decode"] is True
    # Every hop salted, each turn with its own salt: the warm-up's KV is never another request's prefix.
    assert p1["cache_salt"] == d1["cache_salt"] != p2["cache_salt"] == d2["cache_salt"]
    deletes = [url for method, url, _ in fake.calls if method == "DELETE"]
    assert deletes == [f"{SVC}/agentkv/v1/leases/d1", f"{SVC}/agentkv/v1/leases/d2"]
    assert report.pulled_tokens == 300 and report.released == 1


def test_a_failing_hop_raises_a_warm_up_error_naming_it() -> None:
    with pytest.raises(WarmUpError, match=r"decode hop.*answered 500"):
        run(FakePair(decode_status=500))


def test_a_declined_pull_is_reported_not_raised() -> None:
    report = run(FakePair(cached=0))
    assert report.pulled_tokens == 0


@pytest.mark.parametrize(
    ("versions", "message"),
    [
        (
            ("0.32.0", "0.33.0"),
            r"same vLLM release.*prefill http://p:8100 0\.32\.0, decode http://d:8200 0\.33\.0",
        ),
        (("0.25.1", "0.25.1"), r"prefill http://p:8100 runs vLLM 0\.25\.1.*supports vLLM >=0\.26,<0\.35"),
        (("0.35.0", "0.35.0"), r"runs vLLM 0\.35\.0"),
    ],
)
def test_a_pair_on_different_or_unsupported_vllm_releases_is_refused_before_any_turn(
    versions: tuple[str, str], message: str
) -> None:
    fake = FakePair(versions=versions)
    with pytest.raises(EngineVersionError, match=message):
        run(fake)
    assert not [c for c in fake.calls if c[0] == "POST"]  # no turn ran: nothing retained on decode


def test_a_pair_on_one_supported_release_passes_the_version_check() -> None:
    assert run(FakePair(versions=("0.34.0+cu130", "0.34.0+cu130"))).pulled_tokens == 300
