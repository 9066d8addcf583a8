import threading

import pytest

from agentkv._wire import DECODE_TAIL_KEY, OFFER_DECODED_KEY
from agentkv.server.engine._connector._config import ConnectorSettings, decode_tail, offers_decoded
from agentkv.server.engine._connector._cost import PullCostModel, _DecayedLine
from agentkv.server.engine._connector._leases import LeaseTable
from agentkv.server.engine._connector._service import (
    _FINISHED_KEPT,
    RetentionService,
    _RecentIds,
    render_metrics,
)


def test_static_threshold_is_a_floor_and_model_defers_until_it_has_data() -> None:
    m = PullCostModel(static_threshold=64)
    assert m.should_pull(pull_tokens=10, new_tokens=5, context=100) is False
    assert m.should_pull(pull_tokens=1000, new_tokens=5, context=1000) is True  # no data yet: vLLM's rule
    assert m.last_estimate is None


def test_learned_rates_decide_pull_vs_recompute() -> None:
    m = PullCostModel(static_threshold=0)
    m.bytes_per_token = 1000.0
    for _ in range(5):
        # 20 ms fixed posting cost, 1 GB/s, prefill 10 us/token
        m.observe_transfer(
            {"transfer_duration": [0.021], "post_duration": [0.020], "bytes_transferred": [1_000_000]}
        )
        m.observe_step(tokens=1000, seconds=0.01)
    assert m.should_pull(pull_tokens=1000, new_tokens=0, context=1000) is False  # 21 ms pull > 10 ms compute
    assert m.last_estimate == {"pull_ms": 21.0, "post_ms": 20.0, "descriptors": 0, "recompute_ms": 10.0}
    assert m.should_pull(pull_tokens=10_000, new_tokens=0, context=10_000) is True  # 30 ms < 100 ms
    m.enabled = False
    assert m.should_pull(pull_tokens=1000, new_tokens=0, context=1000) is True


def test_settings_coerce_strings_and_reject_nonsense() -> None:
    s = ConnectorSettings.from_extra({"agentkv_prefix_check": "false", "agentkv_service_port": "9200"})
    assert s.prefix_check is False and s.service_port == 9200
    assert ConnectorSettings.from_extra(None).service_port is None
    assert ConnectorSettings.from_extra(None).offer_decoded is False  # exact offers unless asked
    assert ConnectorSettings.from_extra({"agentkv_offer_decoded": "true"}).offer_decoded is True
    assert ConnectorSettings.from_extra(None).decode_tail_tokens == 1  # vLLM's own
    assert ConnectorSettings.from_extra({"agentkv_decode_tail_tokens": "2"}).decode_tail_tokens == 2
    with pytest.raises(ValueError, match="decode_tail_tokens"):
        ConnectorSettings.from_extra({"agentkv_decode_tail_tokens": 0})
    assert ConnectorSettings.from_extra(None).block_hash_reuse_tokens == 1 << 20
    assert ConnectorSettings.from_extra({"agentkv_block_hash_reuse_tokens": "0"}).block_hash_reuse_tokens == 0
    with pytest.raises(ValueError, match="block_hash_reuse_tokens"):
        ConnectorSettings.from_extra({"agentkv_block_hash_reuse_tokens": -1})
    assert ConnectorSettings.from_extra(None).demote_on_pressure is True
    assert ConnectorSettings.from_extra({"agentkv_demote_on_pressure": "off"}).demote_on_pressure is False
    with pytest.raises(ValueError, match="demote_on_pressure"):
        ConnectorSettings.from_extra({"agentkv_demote_on_pressure": "sometimes"})


def test_a_requests_word_decides_what_decode_offers_and_computes() -> None:
    for default in (False, True):
        assert offers_decoded({OFFER_DECODED_KEY: True}, default=default) is True
        assert offers_decoded({OFFER_DECODED_KEY: False}, default=default) is False
        # Nothing said (a proxy of someone else's), or not a bool: the configured default.
        assert offers_decoded({"do_remote_decode": True}, default=default) is default
        assert offers_decoded(None, default=default) is default
        assert offers_decoded({OFFER_DECODED_KEY: "yes"}, default=default) is default
    for default in (1, 2):
        assert decode_tail({DECODE_TAIL_KEY: 2}, default=default) == 2
        assert decode_tail({DECODE_TAIL_KEY: 1}, default=default) == 1
        # Nothing said, or not a positive int (a bool is not one): the configured default.
        for bad in ({}, None, {DECODE_TAIL_KEY: 0}, {DECODE_TAIL_KEY: True}, {DECODE_TAIL_KEY: "2"}):
            assert decode_tail(bad, default=default) == default
    with pytest.raises(ValueError):
        ConnectorSettings.from_extra({"agentkv_prefix_check": "maybe"})
    with pytest.raises(ValueError):
        ConnectorSettings.from_extra({"agentkv_lease_s": 100, "agentkv_max_lease_s": 10})


def test_retention_cap_settings() -> None:
    default = ConnectorSettings.from_extra(None)
    assert default.max_retained_fraction == 0.5 and default.retention_capacity(1000) == 500
    both = ConnectorSettings.from_extra(
        {"agentkv_max_retained_fraction": "0.8", "agentkv_max_retained_blocks": "64"}
    )
    assert both.retention_capacity(1000) == 64  # the smaller of the two caps
    assert both.retention_capacity(50) == 40
    for bad in ({"agentkv_max_retained_fraction": 0}, {"agentkv_max_retained_fraction": 1.5}):
        with pytest.raises(ValueError):
            ConnectorSettings.from_extra(bad)
    with pytest.raises(ValueError):
        ConnectorSettings.from_extra({"agentkv_max_retained_blocks": -1})


def _routing_only(table: LeaseTable) -> RetentionService:
    svc = RetentionService.__new__(RetentionService)  # routing only: no socket
    svc.table = table
    svc._info = lambda: {"engine_id": "e"}
    svc.cached = None
    svc._finished = _RecentIds(_FINISHED_KEPT)
    svc._demoted = _RecentIds(_FINISHED_KEPT)
    svc._kept_until = {}
    svc._demote_lock = threading.Lock()
    svc.stats = {}
    return svc


def test_a_lookup_waits_for_its_request_to_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer to a stop-string turn reaches the router before vLLM's abort reaches decode's scheduler: a
    lookup with `wait_ms` answers once the request has finished, leased or not."""
    from agentkv.server.engine._connector import _service

    t = LeaseTable(lease_s=10, max_lease_s=60, clock=lambda: 0.0)
    svc = _routing_only(t)
    finishing = iter([lambda: (t.add("chatcmpl-late-1", {"a": 1}, 7), svc.finished("chatcmpl-late-1"))])
    # The scheduler finishes the request while the lookup waits (at its first pause), never by the clock.
    monkeypatch.setattr(_service.time, "sleep", lambda _s: next(finishing, lambda: None)())
    status, body = svc.handle("GET", "/agentkv/v1/retained/late?wait_ms=2000", {})
    assert status == 200 and body["num_tokens"] == 7
    # Finished without a lease (declined at the cap): answered at once, not after the wait, found under
    # the router's id as vLLM spells it (chatcmpl-<id>-<suffix>).
    svc.finished("chatcmpl-declined-1f2e3d")
    monkeypatch.setattr(_service.time, "sleep", lambda _s: pytest.fail("waited for a finished request"))
    assert svc.handle("GET", "/agentkv/v1/retained/declined?wait_ms=2000", {})[0] == 404
    assert svc.handle("GET", "/agentkv/v1/retained/unknown?wait_ms=0", {})[0] == 404
    for bad in ("nan", "1e9x", "-"):
        assert svc.handle("GET", f"/agentkv/v1/retained/x?wait_ms={bad}", {})[0] == 400


def test_finished_requests_are_bounded() -> None:
    svc = _routing_only(LeaseTable(lease_s=10, max_lease_s=60, clock=lambda: 0.0))
    for i in range(_FINISHED_KEPT + 10):
        svc.finished(f"r{i}")
    assert len(svc._finished) == _FINISHED_KEPT
    assert f"r{_FINISHED_KEPT + 9}" in svc._finished and "r0" not in svc._finished


def test_service_routes() -> None:
    t = LeaseTable(lease_s=10, max_lease_s=60, clock=lambda: 0.0)
    t.add("chatcmpl-x-1", {"a": 1}, 5)
    svc = _routing_only(t)
    info = (200, {"engine_id": "e", "host_tier": False, "retained": 1, "retained_blocks": 0})  # num_blocks=0
    assert svc.handle("GET", "/agentkv/v1/info", {}) == info
    status, body = svc.handle("GET", "/agentkv/v1/retained/x", {})
    assert status == 200 and body["num_tokens"] == 5
    assert svc.handle("POST", "/agentkv/v1/leases/x/renew", {"duration_s": "long"})[0] == 400
    assert svc.handle("POST", "/agentkv/v1/leases/x/renew", {"duration_s": 30})[0] == 200
    assert svc.handle("DELETE", "/agentkv/v1/leases/x", {}) == (200, {"released": True})
    assert svc.handle("GET", "/agentkv/v1/retained/x", {})[0] == 404
    assert svc.handle("GET", "/elsewhere", {})[0] == 404


def test_line_separates_fixed_post_cost_from_per_descriptor_cost() -> None:
    line = _DecayedLine(decay=0.9)
    assert line.fit() is None
    for n in (100, 5000, 20_000, 300):
        line.add(n, 0.002 + 5e-6 * n)  # 2 ms fixed + 5 us per descriptor
    fixed, slope = line.fit()  # type: ignore[misc]
    assert abs(fixed - 0.002) < 1e-9 and abs(slope - 5e-6) < 1e-12
    flat = _DecayedLine(decay=0.9)
    for _ in range(3):
        flat.add(64, 0.004)
    assert flat.fit() == (0.004, 0.0)  # one size only: no slope to learn, the mean is the cost


def _learned(descriptors_per_mb: int) -> PullCostModel:
    m = PullCostModel(static_threshold=0)
    m.bytes_per_token = 100_000.0  # 100 kB of KV per token (an 8B-class model)
    for mb in (10, 100, 400):
        n = descriptors_per_mb * mb
        m.observe_transfer(
            {
                "transfer_duration": [0.001 + 5e-6 * n + mb / 100_000],  # 100 GB/s
                "post_duration": [0.001 + 5e-6 * n],
                "bytes_transferred": [mb * 1_000_000],
                "num_descriptors": [n],
            }
        )
        m.observe_step(tokens=2048, seconds=2048 * 20e-6)  # 20 us per token
    return m


def test_descriptor_count_decides_pull_vs_recompute() -> None:
    # 4,000 tokens = 400 MB. Per-layer blocks (~85 descriptors/MB, the GPU defaults' ~20k for a 24k pull)
    # post for ~170 ms, more than recomputing (80 ms); cross-layer blocks (~0.4/MB) post for ~2 ms.
    per_layer, cross_layer = _learned(85), _learned(0)
    assert per_layer.should_pull(pull_tokens=4000, new_tokens=0, context=4000) is False
    est = per_layer.last_estimate
    assert est is not None and est["descriptors"] == 34_000 and est["post_ms"] > est["recompute_ms"]
    assert cross_layer.should_pull(pull_tokens=4000, new_tokens=0, context=4000) is True
    snap = per_layer.snapshot()
    assert snap["post_fixed_ms"] == 1.0 and snap["post_us_per_descriptor"] == 5.0


def test_connector_counters_render_as_prometheus_text() -> None:
    text = render_metrics(
        {"role": "prefill", "stats": {"tokens_trimmed": 128, "pulls": 3}}, retained_now=2, retained_blocks=7
    )
    assert 'agentkv_connector_tokens_trimmed_total{role="prefill"} 128.0' in text
    assert 'agentkv_connector_pulls_total{role="prefill"} 3.0' in text
    assert 'agentkv_connector_recomputes_total{role="prefill"} 0.0' in text
    assert 'agentkv_connector_retained_requests{role="prefill"} 2.0' in text
    assert 'agentkv_connector_retained_blocks{role="prefill"} 7.0' in text
    assert "# TYPE agentkv_connector_tokens_refused_total counter" in text


def test_service_serves_metrics_over_http() -> None:
    import httpx

    t = LeaseTable(lease_s=10, max_lease_s=60, clock=lambda: 0.0)
    svc = RetentionService(
        table=t, host="127.0.0.1", port=0, info=lambda: {"role": "decode", "stats": {"retained": 4}}
    )
    svc.start()
    try:
        r = httpx.get(f"http://127.0.0.1:{svc.port}/metrics", timeout=5)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert 'agentkv_connector_retained_total{role="decode"} 4.0' in r.text
        assert httpx.get(f"http://127.0.0.1:{svc.port}/agentkv/v1/info", timeout=5).json()["retained"] == 0
    finally:
        svc.stop()


def test_prefill_rate_grows_with_context_and_prices_the_pulled_span_at_its_middle() -> None:
    m = PullCostModel(static_threshold=0)
    m.bytes_per_token = 1000.0
    for _ in range(3):
        m.observe_transfer(
            {"transfer_duration": [0.012], "post_duration": [0.010], "bytes_transferred": [2_000_000]}
        )  # 10 ms to post, 1 GB/s
        m.observe_step(tokens=512, seconds=512 * 10e-6, context=1000)  # 10 us/token near the start
        m.observe_step(tokens=512, seconds=512 * 30e-6, context=21_000)  # 30 us/token 21k tokens in
    rate = m.prefill_s_per_token(11_000)
    assert rate is not None and abs(rate - 20e-6) < 1e-9
    # 2,000 tokens: pull 10 + 2 = 12 ms; recompute at the rate of position 1,000: 2,000 x 10 us = 20 ms.
    assert m.should_pull(pull_tokens=2000, new_tokens=100, context=2100) is True
    assert m.last_estimate is not None and m.last_estimate["recompute_ms"] == 20.0
    # With a much slower link the pull of the same span loses, and a longer span (dearer per token) wins.
    m._bytes_per_s.value = 50e6  # 50 MB/s: 2,000 tokens = 2 MB = 40 ms
    assert m.should_pull(pull_tokens=2000, new_tokens=100, context=2100) is False
    assert m.should_pull(pull_tokens=40_000, new_tokens=100, context=40_100) is True  # 810 ms < 1.2 s
    assert m.snapshot()["prefill_us_per_token_per_1k_context"] == 1.0


def test_mean_position_of_a_step_weights_requests_by_their_tokens() -> None:
    from types import SimpleNamespace

    from agentkv.server.engine._connector._scheduler import _mean_position

    out = SimpleNamespace(
        num_scheduled_tokens={"new": 100, "old": 1},
        scheduled_new_reqs=[SimpleNamespace(req_id="new", num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["old"], num_computed_tokens=[5000]),
    )
    # new: 100 tokens around position 50; old (a decode step): 1 token at 5000.5
    assert abs(_mean_position(out) - (100 * 50 + 5000.5) / 101) < 1e-9
    assert _mean_position(SimpleNamespace()) == 0.0  # an unknown layout: flat rate, no failure
    assert (
        _mean_position(
            SimpleNamespace(
                num_scheduled_tokens={},
                scheduled_new_reqs=[],
                scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            )
        )
        == 0.0
    )


def test_blocks_a_finished_request_holds_are_counted_per_group_or_flat() -> None:
    from agentkv.server.engine._connector._scheduler import _block_keys

    assert _block_keys(([1, 2, 3],)) == [1, 2, 3]  # one KV cache group
    assert _block_keys(([1, 2], [7, 8, 9])) == [1, 2, 7, 8, 9]  # groups share one pool: every block counts
    assert _block_keys([4, 5]) == [4, 5]  # older vLLM: a flat list
    assert _block_keys(()) == [] and _block_keys(None) == []


def test_a_token_guards_every_lease_route_but_not_metrics() -> None:
    import httpx

    t = LeaseTable(lease_s=10, max_lease_s=60, clock=lambda: 0.0)
    svc = RetentionService(table=t, host="127.0.0.1", port=0, info=lambda: {"role": "decode"}, token="s3cret")
    svc.start()
    base = f"http://127.0.0.1:{svc.port}"
    good = {"authorization": "Bearer s3cret"}
    try:
        assert httpx.get(f"{base}/metrics", timeout=5).status_code == 200
        for method, path in [
            ("GET", "/agentkv/v1/info"),
            ("GET", "/agentkv/v1/retained/r1"),
            ("POST", "/agentkv/v1/leases/r1/renew"),
            ("DELETE", "/agentkv/v1/leases/r1"),
        ]:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
                r = httpx.request(method, base + path, headers=headers, timeout=5)
                assert (r.status_code, r.json()) == (401, {"error": "unauthorized"}), (method, path, headers)
        assert httpx.get(f"{base}/agentkv/v1/info", headers=good, timeout=5).status_code == 200
        # With the token, routes answer as they do without one: an unknown lease is a 404, not a 401.
        assert httpx.delete(f"{base}/agentkv/v1/leases/r1", headers=good, timeout=5).status_code == 404
    finally:
        svc.stop()
