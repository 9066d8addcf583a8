import pytest

from agentkv.server._connector._config import ConnectorSettings
from agentkv.server._connector._cost import PullCostModel
from agentkv.server._connector._leases import LeaseTable
from agentkv.server._connector._service import RetentionService


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
    assert m.last_estimate == {"pull_ms": 21.0, "recompute_ms": 10.0}
    assert m.should_pull(pull_tokens=10_000, new_tokens=0, context=10_000) is True  # 30 ms < 100 ms
    m.enabled = False
    assert m.should_pull(pull_tokens=1000, new_tokens=0, context=1000) is True


def test_settings_coerce_strings_and_reject_nonsense() -> None:
    s = ConnectorSettings.from_extra({"agentkv_prefix_check": "false", "agentkv_service_port": "9200"})
    assert s.prefix_check is False and s.service_port == 9200
    assert ConnectorSettings.from_extra(None).service_port is None
    with pytest.raises(ValueError):
        ConnectorSettings.from_extra({"agentkv_prefix_check": "maybe"})
    with pytest.raises(ValueError):
        ConnectorSettings.from_extra({"agentkv_lease_s": 100, "agentkv_max_lease_s": 10})


def test_service_routes() -> None:
    t = LeaseTable(lease_s=10, max_lease_s=60, clock=lambda: 0.0)
    t.add("chatcmpl-x-1", {"a": 1}, 5)
    svc = RetentionService.__new__(RetentionService)  # routing only: no socket
    svc.table = t
    svc._info = lambda: {"engine_id": "e"}
    assert svc.handle("GET", "/agentkv/v1/info", {}) == (200, {"engine_id": "e", "retained": 1})
    status, body = svc.handle("GET", "/agentkv/v1/retained/x", {})
    assert status == 200 and body["num_tokens"] == 5
    assert svc.handle("POST", "/agentkv/v1/leases/x/renew", {"duration_s": "long"})[0] == 400
    assert svc.handle("POST", "/agentkv/v1/leases/x/renew", {"duration_s": 30})[0] == 200
    assert svc.handle("DELETE", "/agentkv/v1/leases/x", {}) == (200, {"released": True})
    assert svc.handle("GET", "/agentkv/v1/retained/x", {})[0] == 404
    assert svc.handle("GET", "/elsewhere", {})[0] == 404
